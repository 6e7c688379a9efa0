"""Replacement leases and drains through the real pool HTTP API (nodes registered over HTTP)."""

from __future__ import annotations

import pytest

from gpuwire.pool.client import PoolError

from .conftest import fake_gpu


def test_replace_moves_a_lost_lease_to_another_node_and_buries_the_dead_one(admin, make_tenant, fake_node):
    a = fake_node([fake_gpu(memory=8 << 30)])
    b = fake_node([fake_gpu(memory=8 << 30)])
    tenant = make_tenant()
    lease = tenant.request_lease(memory="6GiB", share=1.0)
    first = lease.node_id
    moved = tenant.replace_lease(lease.id, reason="lost", lost_address=lease.address)
    assert moved["state"] == "active" and moved["id"] == lease.id
    assert moved["node_id"] in {a, b} - {first}
    assert moved["token"] and moved["token"] != lease.token
    # nothing listens at a fake node's address: the pool's probe buried it at once
    assert admin.node(first)["state"] == "dead"
    assert tenant.renew(lease.id)["node_id"] == moved["node_id"]


def test_replace_with_no_room_waits_in_the_queue(admin, make_tenant, fake_node):
    node = fake_node([fake_gpu(memory=8 << 30)])
    tenant = make_tenant()
    lease = tenant.request_lease(memory="6GiB", share=1.0)
    assert lease.node_id == node
    queued = tenant.replace_lease(lease.id, reason="drain")
    assert queued["state"] == "queued" and queued["position"] >= 1
    assert "draining" in queued["reason"]
    replacement = fake_node([fake_gpu(memory=8 << 30)])
    placed = tenant.get_lease(lease.id)
    assert placed["state"] == "active" and placed["node_id"] == replacement


def test_drain_is_for_admins_and_stops_placement(admin, make_tenant, fake_node):
    node = fake_node([fake_gpu(memory=8 << 30)])
    tenant = make_tenant()
    with pytest.raises(PoolError) as refused:
        tenant.drain_node(node)
    assert refused.value.status == 403
    assert admin.drain_node(node)["state"] == "draining"
    with pytest.raises(PoolError, match="no room|cannot fit"):
        tenant.request_lease(memory="1GiB", share=0.5, gpus=1, labels=None)
    assert admin.undrain_node(node)["state"] == "alive"
    assert tenant.request_lease(memory="1GiB", share=0.5).node_id == node


def test_replacing_an_ended_lease_is_refused_with_what_to_do(make_tenant, fake_node):
    fake_node([fake_gpu(memory=8 << 30)])
    tenant = make_tenant()
    lease = tenant.request_lease(memory="1GiB", share=0.5)
    tenant.release(lease.id)
    with pytest.raises(PoolError, match="ask for a new lease") as ended:
        tenant.replace_lease(lease.id)
    assert ended.value.status == 409
