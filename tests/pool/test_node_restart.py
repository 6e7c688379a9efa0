"""A pool node run with ``gpuwire serve --restart-on-crash`` dies under a job, and the job goes on.

The node process is killed with SIGSEGV (what a kernel crash does) in the middle of a training
run under ``gpuwire run --pool`` (durability ``checkpoint``, the default there). The supervisor
starts the node again on its address; the client finds it there, rebuilds its session from its
checkpoint and replay log, and the run ends with the same losses as a run without the crash.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import child_process

from .conftest import PoolProcess, Proc, unique

JOB = textwrap.dedent("""
    import os, signal, time, torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).cuda()
    for step in range(6):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step", step, loss.item(), flush=True)
        if step == 2 and os.environ.get("CRASH_NODE"):
            os.kill(int(os.environ["CRASH_NODE"]), signal.SIGSEGV)
            time.sleep(0.5)
""")


def test_a_job_survives_its_pool_node_crashing_and_restarting(pool_proc, admin, tmp_path):
    node_key = admin.create_key(role="node")["key"]
    tenant = unique("t")
    admin.create_tenant(tenant)
    tenant_key = admin.create_key(tenant=tenant)["key"]
    node = Proc("restarting-node", ["serve", "--restart-on-crash", "--port", "0", "--backend", "cpu",
                                    "--pool", pool_proc.url, "--node-id", unique("n"), "--pool-memory", "4GiB",
                                    "--log-level", "warning"], str(tmp_path), {"GPUWIRE_API_KEY": node_key})
    try:
        node.wait_for(r"listening on (\S+):(\d+)")
        script = tmp_path / "job.py"
        script.write_text(JOB)

        def job(**env):
            return subprocess.run([sys.executable, "-m", "gpuwire", "run", "--pool", pool_proc.url, "--", sys.executable,
                                   str(script)], capture_output=True, text=True, timeout=240,
                                  env={**os.environ, "GPUWIRE_API_KEY": tenant_key, **env})

        crashed = job(CRASH_NODE=str(child_process(node.proc.pid)))
        assert crashed.returncode == 0, crashed.stdout + crashed.stderr[-3000:]
        assert re.search(r"node \S+ lost at op [\d,]+; resumed on \S+", crashed.stderr), crashed.stderr[-3000:]
        assert "killed by SIGSEGV" in node.log(), node.log()[-3000:]
        steady = job()
        assert steady.returncode == 0, steady.stderr[-3000:]
        losses = re.findall(r"step \d+ \S+", crashed.stdout)
        assert len(losses) == 6 and losses == re.findall(r"step \d+ \S+", steady.stdout), (crashed.stdout, steady.stdout)
    finally:
        node.kill(signal.SIGTERM)  # (the supervisor passes it on: both end)


def test_a_supervised_pool_node_signalled_as_a_group_stops(tmp_path):
    """systemd stops a service by signalling its whole process group: the supervisor and the node
    both get SIGTERM (here three times, with the pool down, so leaving it takes a while), and
    both must end. (Seen by hand once: the node's handler ran again inside the first, in its
    agent's Event.set, and waited on that lock for ever; the handler now runs once and the
    supervisor passes a signal on once. This test does not hit that timing every time.)"""
    pool = PoolProcess(str(tmp_path), "--heartbeat-interval", "1")
    node = Proc("group-stopped-node", ["serve", "--restart-on-crash", "--port", "0", "--backend", "cpu",
                                       "--pool", pool.url, "--node-id", unique("n"), "--pool-memory", "1GiB",
                                       "--log-level", "warning"], str(tmp_path),
                {"GPUWIRE_API_KEY": pool.admin().create_key(role="node")["key"]})
    try:
        node.wait_for(r"listening on (\S+):(\d+)")
        worker = child_process(node.proc.pid)
        assert worker is not None
        pool.kill()
        for _ in range(3):
            for pid in (worker, node.proc.pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass  # (it ended already)
            time.sleep(0.3)
        assert node.proc.wait(timeout=60) in (0, -signal.SIGTERM), node.log()[-3000:]  # (a later one may end it)
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker}"), "the node outlived its supervisor"
    finally:
        node.kill()
        pool.kill()
