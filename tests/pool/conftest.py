"""Fixtures for the pool's tests: real ``gpuwire pool`` and ``gpuwire serve --pool`` processes.

Every process listens on loopback on an ephemeral port, keeps its state in the test's temp
folder, and is killed by pid when the test (or module) is done. Tenants are made fresh per
test, and their leases are released at teardown so the shared pool's queue stays empty.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from gpuwire.pool.client import PoolClient, PoolError

STARTUP_TIMEOUT = 90.0
_counter = itertools.count(1)


def new_admin_key() -> str:
    return f"gpw_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"


class Proc:
    """A ``python -m gpuwire ...`` child with stdout/stderr in files."""

    def __init__(self, name: str, args: list[str], folder: str, env: dict | None = None):
        self.name, self.args, self.folder, self.env = name, args, folder, env or {}
        self.out_path = os.path.join(folder, f"{name}.out")
        self.err_path = os.path.join(folder, f"{name}.err")
        self.start()

    def start(self) -> None:
        env = {**os.environ, "GPUWIRE_POOL": "", "GPUWIRE_API_KEY": "", **self.env}
        with open(self.out_path, "ab") as out, open(self.err_path, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpuwire", *self.args], stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=env)
        self._out_offset = os.path.getsize(self.out_path) if os.path.exists(self.out_path) else 0

    def wait_for(self, pattern: str, timeout: float = STARTUP_TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            with open(self.out_path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            match = None
            for match in re.finditer(pattern, text):
                pass  # the last one: a restarted process prints again
            if match:
                return match
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not print {pattern!r} (exit {self.proc.poll()}):\n"
                                   f"{text[-2000:]}\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


class PoolProcess(Proc):
    def __init__(self, folder: str, *extra: str, admin_key: str | None = None, name: str = "pool"):
        self.admin_key = admin_key or new_admin_key()
        self.db = os.path.join(folder, f"{name}.db")
        self.extra = list(extra)
        super().__init__(name, ["pool", "--host", "127.0.0.1", "--port", "0", "--db", self.db,
                                "--admin-key", self.admin_key, "--log-level", "warning", *extra], folder)
        self._await_start()

    def _await_start(self) -> None:
        try:
            self.url = self.wait_for(r"gpuwire pool listening on (https?://\S+)").group(1)
            self.port = int(self.url.rsplit(":", 1)[1])
            PoolClient(self.url, self.admin_key).wait_ready()
        except BaseException:  # a timeout included: leave no process behind
            self.kill()
            raise

    def restart(self) -> None:
        """Start again on the same port and database (after a kill)."""
        self.args[self.args.index("--port") + 1] = str(self.port)
        self.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            try:
                PoolClient(self.url, self.admin_key).health()
                return
            except PoolError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pool did not restart:\n{self.log()[-3000:]}")
                time.sleep(0.05)

    def admin(self) -> PoolClient:
        return PoolClient(self.url, self.admin_key)


class NodeProcess(Proc):
    def __init__(self, folder: str, pool_url: str, api_key: str, node_id: str, *extra: str,
                 memory: str = "4GiB", wait: bool = True):
        self.node_id = node_id
        self.address = None
        super().__init__(node_id, ["serve", "--backend", "cpu", "--host", "127.0.0.1", "--port", "0",
                                   "--pool", pool_url, "--node-id", node_id, "--pool-memory", memory,
                                   "--log-level", "info", *extra], folder, {"GPUWIRE_API_KEY": api_key})
        if wait:
            self.await_start()

    def await_start(self) -> "NodeProcess":
        try:
            match = self.wait_for(r"listening on (\S+):(\d+)")
        except BaseException:  # a timeout included: leave no process behind
            self.kill()
            raise
        self.address = f"{match.group(1)}:{match.group(2)}"
        return self


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def unique(prefix: str) -> str:
    return f"{prefix}{next(_counter)}-{secrets.token_hex(2)}"


def fake_gpu(index: int = 0, memory: int = 16 << 30, name: str = "NVIDIA A100-SXM4-80GB", **extra) -> dict:
    return {"index": index, "name": name, "memory": memory, "backend": "cuda", **extra}


@pytest.fixture(scope="module")
def pool_proc(tmp_path_factory):
    """A pool shared by a test module; nodes registered over HTTP need no heartbeats for 5 minutes."""
    proc = PoolProcess(str(tmp_path_factory.mktemp("pool")), "--heartbeat-interval", "100")
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def admin(pool_proc):
    client = pool_proc.admin()
    yield client
    client.close()


@pytest.fixture
def make_tenant(admin):
    """make_tenant(max_gpus=..., max_memory=...) -> a PoolClient acting for a fresh tenant."""
    made: list[PoolClient] = []

    def make(**quota) -> PoolClient:
        name = unique("t")
        admin.create_tenant(name, **quota)
        client = PoolClient(admin.url, admin.create_key(tenant=name)["key"])
        client.tenant = name
        made.append(client)
        return client

    yield make
    names = {client.tenant for client in made}
    for lease in admin.leases():
        if lease["tenant"] in names:
            admin.release(lease["id"])
    for client in made:
        client.close()


@pytest.fixture
def fake_node(pool_proc):
    """fake_node(gpus=[...], labels=...) -> node id: a node registered over HTTP (no process behind it)."""
    node_client = PoolClient(pool_proc.url, pool_proc.admin().create_key(role="node")["key"])
    made: list[str] = []

    def make(gpus: list[dict] | None = None, labels: dict | None = None, node_id: str | None = None) -> str:
        node_id = node_id or unique("n")
        node_client.register_node(node_id, f"127.0.0.1:{10000 + len(made)}", gpus or [fake_gpu()],
                                  labels=labels or {})
        made.append(node_id)
        return node_id

    make.client = node_client
    yield make
    for node_id in made:
        try:
            node_client.deregister_node(node_id)
        except PoolError:
            pass
    node_client.close()
