"""Waiting for a GPU: FIFO within priority, queue positions, timeouts, leaving the queue."""

import threading

import pytest

from gpuwire.pool.client import PoolError

from .conftest import fake_gpu, unique, wait_until

GIB = 1 << 30
pytestmark = pytest.mark.timeout(60)


def queued(tenant, share=0.5, wait=30, priority=0, **kw):
    """POST a request that will wait; returns the pool's view of it (202: queued)."""
    status, view = tenant.call("POST", "/v1/leases", json={"share": share, "wait": wait, "priority": priority, **kw})
    return status, view


def state(tenant, lease_id):
    return tenant.get_lease(lease_id)


def test_fifo_positions_and_placement_as_room_frees_up(make_tenant, fake_node):
    tag = unique("fifo")
    fake_node(gpus=[fake_gpu(0, memory=8 * GIB)], labels={"t": tag})
    holder, a, b, c = make_tenant(), make_tenant(), make_tenant(), make_tenant()
    whole = holder.request_lease(labels={"t": tag})
    ids = []
    for tenant, share in ((a, 0.5), (b, 0.5), (c, 1.0)):
        status, view = queued(tenant, share=share, labels={"t": tag})
        assert status == 202 and view["state"] == "queued"
        ids.append(view["id"])
    views = [state(t, i) for t, i in zip((a, b, c), ids)]
    assert [v["position"] for v in views] == [1, 2, 3]
    assert [v["position_text"] for v in views] == ["1st in queue", "2nd in queue", "3rd in queue"]
    assert views[0]["token"] is None and views[0]["allocations"] == []

    with pytest.raises(PoolError) as err:  # no waiting: refused, and told about the queue
        a.request_lease(share=0.25, labels={"t": tag})
    assert err.value.status == 409 and "queued ahead" in err.value.message and err.value.body["queued"] == 3

    whole.release()  # room for both halves; the whole-GPU request stays first in line
    assert state(a, ids[0])["state"] == "active" and state(b, ids[1])["state"] == "active"
    assert state(a, ids[0])["token"]
    view = state(c, ids[2])
    assert view["state"] == "queued" and view["position"] == 1
    a.release(ids[0])
    assert state(c, ids[2])["state"] == "queued"  # half a GPU is not a whole one
    b.release(ids[1])
    assert state(c, ids[2])["state"] == "active"


def test_higher_priority_goes_first_fifo_within_a_priority(make_tenant, fake_node):
    tag = unique("prio")
    fake_node(gpus=[fake_gpu(0)], labels={"t": tag})
    holder, t = make_tenant(), make_tenant()
    whole = holder.request_lease(labels={"t": tag})
    low1 = queued(t, share=1.0, labels={"t": tag})[1]["id"]
    low2 = queued(t, share=1.0, labels={"t": tag})[1]["id"]
    high = queued(t, share=1.0, priority=10, labels={"t": tag})[1]["id"]
    assert [state(t, i)["position"] for i in (high, low1, low2)] == [1, 2, 3]
    whole.release()
    assert state(t, high)["state"] == "active"
    assert state(t, low1)["position"] == 1 and state(t, low2)["position"] == 2
    t.release(high)
    assert state(t, low1)["state"] == "active" and state(t, low2)["position"] == 1


def test_waiting_too_long_expires_and_leaving_the_queue_moves_others_up(make_tenant, fake_node):
    tag = unique("wait")
    fake_node(gpus=[fake_gpu(0)], labels={"t": tag})
    holder, t = make_tenant(), make_tenant()
    holder.request_lease(labels={"t": tag})
    short = queued(t, share=1.0, wait=1, labels={"t": tag})[1]["id"]
    leaving = queued(t, share=1.0, wait=30, labels={"t": tag})[1]["id"]
    last = queued(t, share=1.0, wait=30, labels={"t": tag})[1]["id"]
    assert state(t, last)["position"] == 3
    assert t.release(leaving)["state"] == "cancelled"
    assert state(t, last)["position"] == 2
    view = wait_until(lambda: (v := state(t, short))["state"] == "expired" and v, timeout=10, what="the wait to end")
    assert "waited" in view["reason"]
    assert state(t, last)["position"] == 1


def test_client_waits_reporting_its_position(make_tenant, fake_node):
    tag = unique("client")
    fake_node(gpus=[fake_gpu(0)], labels={"t": tag})
    holder, first, t = make_tenant(), make_tenant(), make_tenant()
    whole = holder.request_lease(labels={"t": tag})
    ahead = queued(first, share=1.0, labels={"t": tag})[1]["id"]
    positions, result = [], {}

    def wait_for_gpu():
        result["lease"] = t.clone().request_lease(
            share=1.0, labels={"t": tag}, wait=30, poll=0.05,
            on_position=lambda n, view: positions.append(view["position_text"]))
    waiter = threading.Thread(target=wait_for_gpu)
    waiter.start()
    wait_until(lambda: positions, what="a queue position")
    assert positions == ["2nd in queue"]
    whole.release()   # `ahead` gets the GPU; the waiter moves up
    wait_until(lambda: len(positions) == 2, what="moving up")
    assert positions[-1] == "1st in queue"
    first.release(ahead)
    waiter.join(timeout=20)
    assert result["lease"].state == "active" and result["lease"].token


def test_a_request_nothing_can_hold_does_not_block_the_queue(make_tenant, fake_node):
    tag = unique("never")
    fake_node(gpus=[fake_gpu(0, name="NVIDIA L4")], labels={"t": tag})
    holder, t = make_tenant(), make_tenant()
    whole = holder.request_lease(labels={"t": tag})
    h100 = queued(t, share=1.0, model="H100", labels={"t": tag})[1]["id"]  # waits for a node that has one
    l4 = queued(t, share=1.0, labels={"t": tag})[1]["id"]
    whole.release()
    assert state(t, l4)["state"] == "active"
    assert state(t, h100)["state"] == "queued"


def test_queued_requests_count_against_the_quota(make_tenant, fake_node):
    tag = unique("qq")
    fake_node(gpus=[fake_gpu(0)], labels={"t": tag})
    holder = make_tenant()
    holder.request_lease(labels={"t": tag})
    t = make_tenant(max_gpus=1)
    assert queued(t, share=0.75, labels={"t": tag})[0] == 202
    with pytest.raises(PoolError) as err:
        queued(t, share=0.5, labels={"t": tag})
    assert err.value.code == "quota_exceeded"


def test_requests_for_other_gpus_are_not_held_up(make_tenant, fake_node):
    busy, free = unique("busy"), unique("free")
    fake_node(gpus=[fake_gpu(0)], labels={"t": busy})
    fake_node(gpus=[fake_gpu(0)], labels={"t": free})
    holder, t = make_tenant(), make_tenant()
    holder.request_lease(labels={"t": busy})
    waiting = queued(t, share=1.0, labels={"t": busy})[1]["id"]
    elsewhere = t.request_lease(share=0.5, labels={"t": free})  # no waiting needed: other GPUs
    assert elsewhere.state == "active"
    with pytest.raises(PoolError) as err:  # the same GPUs: behind the queued one
        t.request_lease(share=0.5, labels={"t": busy})
    assert "queued ahead" in err.value.message
    assert state(t, waiting)["position"] == 1
