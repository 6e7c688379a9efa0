"""``gpuwire demo``: the whole control plane on one machine, in one command.

Starts a pool and two CPU nodes (``gpuwire serve --backend cpu --pool ...``) as child
processes on loopback, with a throw-away SQLite file; creates a tenant and its API key; asks
for three fractional leases (shares 0.25, 0.25 and 0.5 with 1 GiB each: best fit packs them
onto one GPU) and a whole GPU (which goes to the other node, kept whole for it); shows a
fourth slice waiting in the queue until one is released; runs a tiny torch job on each
lease's node; prints ``gpuwire smi --pool``; then stops every process it started, by pid.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .sizes import format_size

STARTUP_TIMEOUT = 90.0
JOBS = r"""
import sys, torch, gpuwire

def job(address, token, lease):
    gpuwire.attach(address, token=token)  # the lease's node, with the lease's token
    torch.manual_seed(0)
    x = torch.randn(128, 128, device="gpuwire")
    w = torch.randn(128, 128, device="gpuwire", requires_grad=True)
    loss = torch.tanh(x @ w).square().mean()
    loss.backward()
    print(f"job on lease {lease}: node {address}, loss {loss.item():.6f}, grad norm {w.grad.norm().item():.4f}",
          flush=True)

args = sys.argv[1:]
for i in range(0, len(args), 3):
    job(*args[i:i + 3])
gpuwire.detach()
"""


def _say(message: str) -> None:
    print(f"gpuwire demo: {message}", flush=True)


class Child:
    """A ``python -m gpuwire ...`` child; stdout and stderr go to files in the demo's folder."""

    def __init__(self, name: str, args: list[str], folder: str, env: dict | None = None):
        self.name = name
        self.out_path = os.path.join(folder, f"{name}.out")
        self.err_path = os.path.join(folder, f"{name}.err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # the children exit when our end of their stdin closes: even a SIGKILLed demo leaves no orphans
            self.proc = subprocess.Popen([sys.executable, "-m", "gpuwire", *args, "--exit-with-stdin"], stdout=out,
                                         stderr=err, stdin=subprocess.PIPE, env={**os.environ, **(env or {})})

    def wait_for(self, pattern: str, timeout: float = STARTUP_TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            with open(self.out_path, encoding="utf-8", errors="replace") as f:
                match = re.search(pattern, f.read())
            if match:
                return match
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.err_path, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()}): {tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # nodes deregister, the pool shuts down cleanly
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc.stdin.close()


def run_demo(*, jobs: bool = True, node_memory: int = 4 << 30) -> int:
    from .cli import render_status
    from .client import PoolClient, PoolError

    folder = tempfile.mkdtemp(prefix="gpuwire-demo-")
    children: list[Child] = []
    jobs_running: list[subprocess.Popen] = []
    admin_key = "gpw_" + secrets.token_hex(4) + "_" + secrets.token_urlsafe(32)
    env = {"GPUWIRE_AUTOLOAD": "1", "GPUWIRE_NODE": "", "GPUWIRE_POOL": "", "GPUWIRE_API_KEY": ""}
    try:
        pool = Child("pool", ["pool", "--host", "127.0.0.1", "--port", "0", "--db", os.path.join(folder, "pool.db"),
                              "--admin-key", admin_key, "--heartbeat-interval", "1", "--log-level", "warning"],
                     folder, env)
        children.append(pool)
        url = pool.wait_for(r"listening on (http://\S+)").group(1)
        _say(f"pool at {url} (state in {folder}/pool.db)")
        admin = PoolClient(url, admin_key)
        admin.wait_ready()
        node_key = admin.create_key(role="node", name="demo nodes")["key"]

        nodes = []
        for i in (1, 2):
            child = Child(f"node-{i}", ["serve", "--backend", "cpu", "--host", "127.0.0.1", "--port", "0",
                                        "--pool", url, "--node-id", f"demo-node-{i}",
                                        "--pool-memory", str(node_memory), "--log-level", "warning"],
                          folder, {**env, "GPUWIRE_API_KEY": node_key})
            children.append(child)
            nodes.append(child)
        for i, child in enumerate(nodes, 1):
            address = child.wait_for(r"listening on (\S+):(\d+)")
            _say(f"node demo-node-{i} at {address.group(1)}:{address.group(2)} (CPU backend: a software GPU "
                 f"offering {format_size(node_memory)})")
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while len([n for n in admin.nodes() if n["state"] == "alive"]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the demo nodes did not register with the pool")
            time.sleep(0.1)

        admin.create_tenant("demo", max_gpus=3, max_memory=12 << 30)
        tenant = PoolClient(url, admin.create_key(tenant="demo", name="demo")["key"])
        _say("tenant 'demo' (quota: 3 GPUs, 12GiB) with its own API key")

        leases = []
        for share in (0.25, 0.25, 0.5):
            lease = tenant.request_lease(share=share, memory=1 << 30)
            leases.append(lease)
            _say(f"lease {lease.id}: share {share:g} with 1GiB -> {lease.node_id} GPU {lease.device} "
                 f"({lease.address})")
        whole = tenant.request_lease(gpus=1)
        leases.append(whole)
        _say(f"lease {whole.id}: a whole GPU -> {whole.node_id} GPU {whole.device} (the GPU kept whole for it)")

        # a fourth slice does not fit anywhere now: it waits in the queue until a slice is released
        positions: list[str] = []
        waiting: dict = {}

        def wait_for_slice():
            try:
                waiting["lease"] = tenant.clone().request_lease(
                    share=0.5, memory=1 << 30, wait=30, poll=0.1,
                    on_position=lambda n, view: positions.append(view.get("position_text", f"{n} in queue")))
            except PoolError as exc:
                waiting["error"] = exc.message
        waiter = threading.Thread(target=wait_for_slice, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while not positions and waiter.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if positions:
            _say(f"another share-0.5 request: waiting for a GPU: {positions[0]}")
        released = leases.pop(2)
        released.release()
        _say(f"released {released.id} (share 0.5)")
        waiter.join(timeout=20)
        if "lease" in waiting:
            leases.append(waiting["lease"])
            _say(f"the queued request got lease {waiting['lease'].id} -> {waiting['lease'].node_id} "
                 f"GPU {waiting['lease'].device}")
        elif "error" in waiting:
            _say(f"the queued request failed: {waiting['error']}")

        if jobs:
            _say(f"running a tiny torch job on each of the {len(leases)} leases' nodes (one client process, "
                 "attaching to each lease's node in turn) ...")
            job_env = {**os.environ, "GPUWIRE_AUTOLOAD": "1"}
            for key in ("GPUWIRE_NODE", "GPUWIRE_POOL", "GPUWIRE_API_KEY", "GPUWIRE_CUDA_COMPAT"):
                job_env.pop(key, None)
            args = [item for lease in leases for item in (lease.address, lease.token or "", lease.id)]
            proc = subprocess.Popen([sys.executable, "-c", JOBS, *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=job_env)
            jobs_running.append(proc)
            out, err = proc.communicate(timeout=180)
            for line in out.splitlines():
                print("  " + line, flush=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the jobs failed (exit {proc.returncode}): {err.strip()[-800:]}")

        print(flush=True)
        render_status(tenant.status(), url)
        print(flush=True)
        for lease in leases:
            lease.release()
        _say(f"released {len(leases)} leases")
        tenant.close()
        admin.close()
        return 0
    except (RuntimeError, PoolError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpuwire demo: failed: {getattr(exc, 'message', exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        for proc in jobs_running:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        for child in reversed(children):
            child.stop()
        _say(f"stopped {len(children)} processes ({', '.join(f'{c.name} pid {c.proc.pid}' for c in children)})")
        shutil.rmtree(folder, ignore_errors=True)
