"""Real processes: a pool and ``gpuwire serve --pool`` nodes on loopback. Registration and
heartbeats, node death (SIGKILL) and rejoin, clean shutdown, and a pool SIGKILL + restart in
the middle of a job."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gpuwire.pool.agent import make_token_verifier
from gpuwire.pool.client import PoolClient, PoolError

from .conftest import NodeProcess, PoolProcess, unique, wait_until

GIB = 1 << 30
pytestmark = pytest.mark.timeout(120)

HEARTBEAT = 0.5  # seconds; dead after 3 missed = 1.5 s


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("procs"))


@pytest.fixture(scope="module")
def pool_proc(folder):
    proc = PoolProcess(folder, "--heartbeat-interval", str(HEARTBEAT), "--heartbeat-misses", "3",
                       "--restart-grace", "20")
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def node_key(admin):
    return admin.create_key(role="node", name="test nodes")["key"]


@pytest.fixture(scope="module")
def nodes(folder, pool_proc, node_key, admin):
    started = []
    try:
        for name in ("node-a", "node-b"):  # started together, then waited for
            started.append(NodeProcess(folder, pool_proc.url, node_key, name, wait=False))
        for n in started:
            n.await_start()
        # registered before any test sees them (tests of this module may run on different
        # workers, each with its own pool and nodes: none may count on an earlier test's waiting)
        for n in started:
            wait_until(lambda n=n: n.node_id in [node["id"] for node in admin.nodes()], what=f"{n.node_id} to register")
        yield {n.node_id: n for n in started}
    finally:
        for n in started:
            n.kill()


def alive(admin, node_id) -> bool:
    return admin.node(node_id)["state"] == "alive"


def test_nodes_register_their_gpu_and_heartbeat(admin, nodes):
    for node_id, proc in nodes.items():
        wait_until(lambda node_id=node_id: node_id in [n["id"] for n in admin.nodes()], what=f"{node_id} to register")
        node = admin.node(node_id)
        assert node["state"] == "alive" and node["address"] == proc.address
        assert node["labels"] == {} and node["version"]
        [gpu] = node["gpus"]
        assert gpu["backend"] == "cpu" and "software GPU" in gpu["name"] and gpu["memory"] == 4 * GIB
    first = {n: admin.node(n)["last_heartbeat"] for n in nodes}
    time.sleep(4 * HEARTBEAT)  # longer than the dead-after time: heartbeats keep them alive
    for node_id in nodes:
        node = admin.node(node_id)
        assert node["state"] == "alive" and node["last_heartbeat"] > first[node_id]
        assert node["usage"] == {"sessions": 0, "bytes_in_use": 0}


def test_heartbeats_report_sessions(admin, nodes, make_tenant):
    from gpuwire.client.runtime import Runtime
    lease = make_tenant().request_lease(share=0.1, memory=GIB // 16)
    rt = Runtime(lease.address, token=lease.token)  # pool-mode nodes admit lease holders only
    try:
        node = lease.node_id
        wait_until(lambda: admin.node(node)["usage"].get("sessions") == 1, what="the session in a heartbeat")
    finally:
        rt.close()
        lease.release()
    wait_until(lambda: admin.node(node)["usage"].get("sessions") == 0, what="the session to go")


def test_node_killed_is_declared_dead_and_its_leases_fail(folder, pool_proc, admin, node_key, make_tenant, nodes):
    tag = unique("doomed")
    doomed = NodeProcess(folder, pool_proc.url, node_key, tag, "--max-sessions", "4")
    try:
        wait_until(lambda: tag in [n["id"] for n in admin.nodes()], what="registration")
        assert admin.node(tag)["gpus"][0]["max_sessions"] == 4
        tenant = make_tenant()
        leases = []
        for _ in range(3):  # fill the doomed node: fractional leases pack onto one GPU
            lease = tenant.request_lease(share=0.25, memory=GIB)
            leases.append(lease)
        on_doomed = [l for l in leases if l.node_id == tag]
        assert on_doomed, [l.node_id for l in leases]
        killed_at = time.monotonic()
        doomed.kill(signal.SIGKILL)
        wait_until(lambda: not alive(admin, tag), timeout=15, what="the node to be declared dead")
        detected = time.monotonic() - killed_at
        assert detected < 3 * HEARTBEAT + 5, detected
        node = admin.node(tag)
        assert "missed heartbeats" in node["reason"]
        for lease in on_doomed:
            view = tenant.get_lease(lease.id)
            assert view["state"] == "failed" and tag in view["reason"] and "missed heartbeats" in view["reason"]
            with pytest.raises(PoolError) as err:
                lease.renew()
            assert err.value.status == 409 and "failed" in err.value.message
        assert alive(admin, "node-a") and alive(admin, "node-b")
        assert admin.status()["free"]["total_gpus"] == 2  # the dead node's GPU is no longer offered
    finally:
        doomed.kill()


def test_a_paused_node_is_buried_then_rejoins_by_itself(admin, nodes):
    proc = nodes["node-b"]
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not alive(admin, "node-b"), timeout=15, what="node-b to be declared dead")
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    wait_until(lambda: alive(admin, "node-b"), timeout=15, what="node-b to register again")
    assert "registering again" in wait_until(lambda: "registering again" in proc.log() and proc.log(), timeout=5,
                                             what="the agent's log line")


def test_sigterm_deregisters_the_node(folder, pool_proc, admin, node_key):
    tag = unique("leaving")
    proc = NodeProcess(folder, pool_proc.url, node_key, tag)
    try:
        wait_until(lambda: tag in [n["id"] for n in admin.nodes()], what="registration")
        proc.kill(signal.SIGTERM)
        assert proc.proc.returncode == 0
        node = admin.node(tag)
        assert node["state"] == "dead" and "deregistered" in node["reason"]
    finally:
        proc.kill()


def test_serve_with_a_bad_or_missing_key_refuses_to_start(folder, pool_proc):
    cmd = [sys.executable, "-m", "gpuwire", "serve", "--backend", "cpu", "--port", "0", "--pool", pool_proc.url]
    wrong = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "GPUWIRE_API_KEY": "gpw_12345678_" + "x" * 40})
    missing = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "GPUWIRE_API_KEY": ""})
    try:
        _, err = wrong.communicate(timeout=60)
        assert wrong.returncode == 2 and "refused to register" in err and "invalid or revoked API key" in err
        _, err = missing.communicate(timeout=60)
        assert missing.returncode == 2 and "GPUWIRE_API_KEY" in err
    finally:
        for proc in (wrong, missing):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


JOB = textwrap.dedent("""
    import sys, time, torch, gpuwire
    print("ready", flush=True)  # (the token comes after the imports: it lives 2 s, an import on a busy machine more)
    gpuwire.attach(sys.argv[1], token=sys.stdin.readline().strip())
    x = torch.ones(64, 64, device="gpuwire")
    total = 0.0
    for step in range(40):
        x = (x @ torch.ones(64, 64, device="gpuwire")) / 64.0
        total += x.sum().item()
        if step == 0:
            print("started", flush=True)
        time.sleep(0.1)
    print(f"done {total}", flush=True)
""")


def test_pool_sigkill_and_restart_during_a_job(pool_proc, admin, nodes, make_tenant):
    wait_until(lambda: alive(admin, "node-a") and alive(admin, "node-b"), timeout=15, what="both nodes")
    tenant = make_tenant(max_gpus=2)
    lease = tenant.request_lease(share=0.5, memory=GIB, ttl=2)
    keeper = lease.keep_alive()
    token = lease.token
    node_id = lease.node_id
    kid = admin.signing_key()["kid"]
    job = subprocess.Popen([sys.executable, "-c", JOB, lease.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "GPUWIRE_NODE": ""})
    try:
        assert job.stdout.readline().strip() == "ready", job.communicate(timeout=30)[1]
        token = lease.token  # (renewed by the keeper meanwhile)
        job.stdin.write(token + "\n")
        job.stdin.flush()
        assert job.stdout.readline().strip() == "started", job.communicate(timeout=30)[1]
        pool_proc.kill(signal.SIGKILL)           # the control plane dies mid-job
        time.sleep(3)                            # longer than the lease's ttl and the nodes' dead-after time
        pool_proc.restart()
        out, err = job.communicate(timeout=60)   # the data plane never noticed
        assert job.returncode == 0, err
        assert out.strip() == f"done {40 * 64 * 64.0}"  # ones @ ones / 64 stays ones
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    # the lease came back from the store, still valid; renewals resumed; the nodes kept their place
    renewals = keeper.renewals
    wait_until(lambda: keeper.renewals > renewals + 1, timeout=10, what="renewals after the restart")
    view = tenant.get_lease(lease.id)
    assert view["state"] == "active" and view["expires_at"] > time.time()
    assert admin.signing_key()["kid"] == kid  # the signing key came back from the store too
    verify = make_token_verifier(pool_proc.url, node_id, api_key=pool_proc.admin_key)
    assert verify(lease.token)["lease"] == lease.id  # a token renewed after the restart
    # the token issued before the crash (expired by now: ttl 2 s) still carries a valid signature
    old = make_token_verifier(pool_proc.url, node_id, api_key=pool_proc.admin_key, leeway=120)(token)
    assert old["lease"] == lease.id and old["exp"] < time.time()
    time.sleep(4 * HEARTBEAT)
    assert alive(admin, "node-a") and alive(admin, "node-b")
    assert tenant.get_lease(lease.id)["state"] == "active"
    second = tenant.request_lease(share=0.5, memory=GIB)
    assert second.state == "active"
    lease.release()
    second.release()
    assert not keeper.is_alive() and keeper.lost is None


def test_restart_keeps_tenants_keys_and_nodes(pool_proc, admin):
    client = PoolClient(pool_proc.url, pool_proc.admin_key)
    names = {t["name"] for t in client.tenants()}
    assert names  # made by earlier tests, before the restart
    assert {"node-a", "node-b"} <= {n["id"] for n in client.nodes()}


RANK_JOB = textwrap.dedent("""
    import os, sys, torch, gpuwire
    x = torch.ones(64, device="cuda") * (int(os.environ["LOCAL_RANK"]) + 1)
    line = f"RANK {os.environ['LOCAL_RANK']} {gpuwire.client.device.runtime().address} {x.sum().item()}"
    sys.stdout.write(line + chr(10))  # one write: the ranks share an unbuffered pipe
    sys.stdout.flush()
""")


def test_a_lease_of_two_gpus_gives_each_torchrun_rank_its_own_gpu(folder, admin, nodes, make_tenant):
    # gpuwire run --pool --gpus 2 -- torchrun --nproc_per_node=2: rank i on GPU i of the lease (its
    # own node here), each with that GPU's token; before, both ranks used the lease's first GPU
    def both_alive():
        try:
            return alive(admin, "node-a") and alive(admin, "node-b")
        except PoolError:  # (not registered yet)
            return False

    wait_until(both_alive, timeout=30, what="both nodes")
    tenant = make_tenant(max_gpus=2)
    script = os.path.join(folder, "rank_job.py")
    with open(script, "w") as f:
        f.write(RANK_JOB)
    done = subprocess.run(
        [sys.executable, "-m", "gpuwire", "run", "--pool", admin.url, "--gpus", "2", "--memory", "256MiB",
         "--", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_port=0", script],
        capture_output=True, text=True, timeout=110,
        env={**os.environ, "GPUWIRE_API_KEY": tenant.api_key, "GPUWIRE_NODE": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert [(rank, total) for rank, _, total in ranks] == [("0", "64.0"), ("1", "128.0")]
    assert {address for _, address, _ in ranks} == {node.address for node in nodes.values()}
    assert "LOCAL_RANK i) use GPU i" in done.stderr
