"""Shared fixtures: a real node process on loopback, and the client attached to it.

Every test that uses the device talks to a real ``gpuwire serve`` subprocess over TCP; the
node is started once per test session and killed (by pid) at the end.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading

import pytest

os.environ.setdefault("GPUWIRE_AUTOLOAD", "1")


def _cap_data_memory() -> None:
    """Each test process (and what it starts) may hold at most ``GPUWIRE_TEST_MEMORY_GIB`` (8) of
    data memory: a test that runs away fails with MemoryError and its own traceback. One CI run
    (session 38) had the OOM killer take an xdist worker at 22 GB instead, and xdist then waited for
    it for ever, naming nothing."""
    limit = int(float(os.environ.get("GPUWIRE_TEST_MEMORY_GIB", "8")) * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard == resource.RLIM_INFINITY or hard > limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


_cap_data_memory()


class NodeProcess:
    """A ``gpuwire serve`` child on an ephemeral loopback port."""

    def __init__(self, *extra: str, env: dict | None = None, backend: str = "cpu", launcher: tuple = ("-m", "gpuwire")):
        cmd = [sys.executable, *launcher, "serve", "--host", "127.0.0.1", "--port", "0",
               "--backend", backend, "--log-level", "info", "--exit-with-stdin", *extra]
        # the node exits when this process dies, even if pytest itself is killed
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.stderr_lines: list[str] = []
        line = _readline_with_timeout(self.proc.stdout, 60)
        match = re.search(r"listening on (\S+):(\d+)", line or "")
        if not match:
            self.kill()
            raise RuntimeError(f"node did not start: {line!r} {self.proc.stderr.read()}")
        self.host, self.port = match.group(1), int(match.group(2))
        self.address = f"{self.host}:{self.port}"
        self._drain = threading.Thread(target=self._collect_stderr, daemon=True)
        self._drain.start()

    def _collect_stderr(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def log_text(self) -> str:
        return "".join(self.stderr_lines)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)


def child_process(parent: int, marker: bytes = b"--listen-fd") -> int | None:
    """The pid of a child of process ``parent`` whose command line holds ``marker`` (the node a
    supervisor started: ``serve ... --listen-fd N``), or None."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if ppid == parent and marker in command:
            return int(entry)
    return None


def _readline_with_timeout(stream, timeout: float) -> str:
    out = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else ""


@pytest.fixture(scope="session", autouse=True)
def native_helpers_built():
    """Build the C++ helpers (client, client autocast, node, node op loop: side by side, ~30 s on
    a clean machine, then cached) once, before any test starts a node or a client: built by the
    first node process instead, the wait landed in whichever test came first, against that
    test's own start-up timeout."""
    from gpuwire import _native
    from gpuwire.client import autocast as client_autocast
    from gpuwire.client import native as client_native
    from gpuwire.node import loop as node_loop
    from gpuwire.node import native as node_native
    if not _native.enabled():
        return
    builds = [_native.build_in_background(helper.SOURCE, helper.MODULE)  # (built only: loading stays each user's)
              for helper in (client_native, client_autocast, node_native, node_loop)]
    for build in builds:
        if build is not None:
            build.join()  # (no compiler: the Python paths run, and the tests that need a build say so)


@pytest.fixture(scope="session")
def node():
    proc = NodeProcess()
    yield proc
    proc.kill()


@pytest.fixture(scope="session")
def device(node):
    """The gpuwire device, attached to the session's node."""
    import torch

    import gpuwire
    gpuwire.attach(node.address)
    yield torch.device("gpuwire")
    gpuwire.detach()


@pytest.fixture
def fresh_node():
    """A node of its own, for tests that kill or break it."""
    proc = NodeProcess()
    yield proc
    proc.kill()


# The files that take longest, longest first (seconds in a clean CI run, session 29). pytest-xdist
# hands whole files to its two workers in collection order (``--no-loadscope-reorder`` in .ci/run;
# by default it orders files by their number of tests, which put these few-test files last, where
# one worker ran the distributed tests for minutes while the other had finished): started first,
# the rest of the suite fills in around them.
SLOWEST_FILES = (
    "tests/cli/test_distributed.py",  # ~260 s
    "tests/cli/test_run.py",  # ~230
    "tests/failover/test_failover.py",  # ~160
    "tests/bench/test_bench_smoke.py",  # ~100
    "tests/client/test_native.py",  # ~75
    "tests/failover/test_reconnect.py",  # ~65
    "tests/conformance/test_error_inputs.py",  # ~65
    "tests/client/test_sharing.py",
    "tests/node/test_request_fuzz.py",
    "tests/cli/test_cuda_api.py",
    "tests/protocol/test_fuzz.py",
    "tests/conformance/test_opinfo.py",
    "tests/client/test_interrupt.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    root = config.rootpath
    def file_rank(item):
        try:
            relative = item.path.relative_to(root).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(relative, len(rank))
    items.sort(key=file_rank)  # (stable: each file's own order, and the other files', as collected)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """``GPUWIRE_CHECK_ACCOUNTING=1``: after every test, the node's count of this session's bytes
    in use must equal the client's (dead storages freed first); a test that makes them differ is
    named on stderr. A developer's check, off in CI: it found the sync out= resize that drifted
    the node's count below zero (session 23)."""
    yield
    if os.environ.get("GPUWIRE_CHECK_ACCOUNTING") != "1":
        return
    from gpuwire.client import device as client_device
    rt = client_device._runtime
    if rt is None or rt._dead is not None:
        return
    import gc
    gc.collect()
    with rt.lock:
        rt._collect_garbage()
    node = rt.query("memory")["bytes_in_use"]
    if node != rt.bytes_in_use:
        sys.stderr.write(f"\naccounting: after {item.nodeid} the node counts {node} bytes in use, the client "
                         f"{rt.bytes_in_use}\n")
