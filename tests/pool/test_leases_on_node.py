"""Leases on the data plane: a pool-mode node admits only valid lease tokens, takes the budget
and share from them, ends sessions whose lease expired; `gpuwire run --pool` end to end."""

import os
import subprocess
import sys
import time

import pytest
import torch

from gpuwire.client.errors import NodeUnreachable
from gpuwire.client.runtime import Runtime
from tests.pool.conftest import NodeProcess, PoolProcess, unique, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("leases"))
    pool = PoolProcess(folder)
    admin = pool.admin()
    node_key = admin.create_key(role="node")["key"]
    node = NodeProcess(folder, pool.url, node_key, unique("node"), "--lease-grace", "0", memory="2GiB")
    tenant = unique("team")
    admin.create_tenant(tenant, max_gpus=4, max_memory="8GiB")
    key = admin.create_key(tenant=tenant)["key"]
    yield pool, node, key
    node.kill()
    pool.kill()


def _tenant(pool, key):
    from gpuwire.pool.client import PoolClient
    return PoolClient(pool.url, key)


def test_node_refuses_sessions_without_a_valid_lease_token(cluster):
    pool, node, key = cluster
    with pytest.raises(NodeUnreachable, match="lease token refused"):
        Runtime(node.address)
    lease = _tenant(pool, key).request_lease(memory="64MiB", share=0.5)
    try:
        tampered = lease.token[:-4] + ("AAAA" if not lease.token.endswith("AAAA") else "BBBB")
        with pytest.raises(NodeUnreachable, match="lease token refused"):
            Runtime(node.address, token=tampered)
        rt = Runtime(node.address, token=lease.token)
        assert rt.memory_budget == 64 << 20  # the budget comes from the token's claims
        with pytest.raises(torch.OutOfMemoryError):
            rt.reserve(65 << 20)
        rt.close()
    finally:
        lease.release()


def test_a_session_moves_only_to_the_node_its_own_lease_token_names(cluster):
    """A drain's ``migrate:`` makes the node push the session's memory to another node: the
    target must be the address a pool-signed token for the session's own lease names."""
    import json
    import socket

    from gpuwire.client.errors import RemoteError
    from gpuwire.protocol.events import Query

    pool, node, key = cluster
    tenant = _tenant(pool, key)
    lease = tenant.request_lease(memory="16MiB", share=0.25)
    other = tenant.request_lease(memory="16MiB", share=0.25)
    bait = socket.create_server(("127.0.0.1", 0))
    bait.settimeout(0.5)
    bait_address = f"127.0.0.1:{bait.getsockname()[1]}"
    try:
        rt = Runtime(node.address, token=lease.token)
        data = torch.arange(1000, dtype=torch.float32)
        storage = rt.allocate(data.nbytes)
        rt.write(storage, 0, memoryview(data.numpy().tobytes()))

        def move(address, token):
            query = Query(seq=rt.next_seq(), what="migrate:" + json.dumps({"address": address, "token": token}))
            return rt.request(query)

        with pytest.raises(RemoteError, match="not the node the lease token names"):
            move(bait_address, lease.token)
        with pytest.raises(RemoteError, match="another lease than this session's"):
            move(node.address, other.token)
        with pytest.raises(RemoteError, match="lease token is refused"):
            move(bait_address, lease.token[:-4] + ("AAAA" if not lease.token.endswith("AAAA") else "BBBB"))
        with pytest.raises(socket.timeout):
            bait.accept()  # the node never dialled the address it was given
        out = bytearray(data.nbytes)
        rt.read(storage, 0, data.nbytes, into=memoryview(out))
        assert bytes(out) == data.numpy().tobytes()  # the session is intact where it was
        rt.close()
    finally:
        bait.close()
        lease.release()
        other.release()


def test_expired_lease_ends_the_session_and_frees_memory(cluster):
    pool, node, key = cluster
    lease = _tenant(pool, key).request_lease(memory="32MiB", share=0.25, ttl=2)
    rt = Runtime(node.address, token=lease.token)
    rt.allocate(8 << 20)
    rt.synchronize()
    from gpuwire.smi import fetch
    info, _ = fetch(node.address, _tenant(pool, key).request_lease(memory="1MiB", share=0.1).token)
    assert any(s["share"] == 0.25 and s["bytes_in_use"] >= 8 << 20 for s in info["sessions"])
    time.sleep(3.5)  # past the lease's expiry (not renewed)
    with pytest.raises(Exception):
        rt.synchronize()  # the node ended the session
    fresh = _tenant(pool, key).request_lease(memory="1MiB", share=0.1)
    info, _ = fetch(node.address, fresh.token)
    assert not any(s["share"] == 0.25 for s in info["sessions"])


def test_gpuwire_run_with_a_pool_lease(cluster):
    pool, node, key = cluster
    code = ("import torch; x = torch.ones(1000, device='cuda'); "
            "print('sum', x.sum().item(), torch.cuda.get_device_name())")
    result = subprocess.run([sys.executable, "-m", "gpuwire", "run", "--pool", pool.url, "--memory", "256MiB",
                             "--share", "0.5", "--", sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "GPUWIRE_API_KEY": key, "GPUWIRE_NODE": ""})
    assert result.returncode == 0, result.stderr
    assert "sum 1000.0" in result.stdout
    assert "lease" in result.stderr and "share 0.5" in result.stderr
    leases = _tenant(pool, key).leases()
    wait_until(lambda: all(l["state"] != "active" or l["share"] != 0.5 for l in _tenant(pool, key).leases()),
               what="the run's lease to be released")


SHARED_JOB = """
import sys, torch, gpuwire
gpuwire.attach(sys.argv[1], token=sys.argv[2])
x = torch.ones(256, 256, device="gpuwire")
for _ in range(20):
    x = (x @ x) / 256.0
print("result", x.sum().item(), flush=True)
try:
    hog = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device="gpuwire")
    print("hog allocated")
except torch.OutOfMemoryError as e:
    print("oom", "budget" in str(e))
"""


def test_three_jobs_share_one_gpu_with_their_own_budgets(cluster):
    pool, node, key = cluster
    tenant = _tenant(pool, key)
    for earlier in tenant.leases():  # leftovers of earlier tests in this module
        if earlier["state"] in ("active", "queued"):
            tenant.release(earlier["id"])
    leases = [tenant.request_lease(memory="16MiB", share=s) for s in (0.25, 0.25, 0.5)]
    try:
        assert len({(l.node_id, l.device) for l in leases}) == 1  # packed onto one GPU
        jobs = [subprocess.Popen([sys.executable, "-c", SHARED_JOB, l.address, l.token, str(64 << 20)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for l in leases]
        outputs = [j.communicate(timeout=120)[0] for j in jobs]
    finally:
        for lease in leases:
            lease.release()
    for out in outputs:
        assert "result 65536.0" in out          # each job's own result, correct
        assert "oom True" in out                 # a 64 MiB allocation past its 16 MiB budget fails alone
