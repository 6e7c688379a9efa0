"""Load: 64 concurrent sessions on one node, slow-loris connections alongside.

Each session is a thread with its own ``Runtime`` connection (16 threads in each of 4 worker
processes) running random ops whose answers are known: every result is compared with the
same op run by CPU torch (``torch.equal``). Asserted: no wrong result, no error, every session
served throughout (no op waits longer than ``MAX_LATENCY``) while three slow-loris connections
are open (one silent, one dribbling a Hello a byte at a time, one trickling a partial frame after
its handshake); the node holds all 64 sessions at once; afterwards its memory and session
table are back to the baseline. Slow lorises that never finish a handshake are closed by the
node within its handshake timeout (``gpuwire serve --handshake-timeout``).

CI: 64 sessions for 10 s. ``-m slow``: 64 sessions for 60 s. By hand:
``python -m tests.node.test_load --node HOST:PORT --seconds 60`` runs the workers against any node.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from gpuwire.client.runtime import Runtime
from gpuwire.protocol import Connection, Role
from gpuwire.protocol.codec import DTYPE_CODES, pack_tensor_ref
from gpuwire.protocol.events import Free, Hello, Welcome

SESSIONS = 64
PROCESSES = 4
FRAME_TIMEOUT = 60.0  # NodeServer.frame_timeout: a started frame must complete within it
MAX_LATENCY = 15.0  # seconds: no session's op may wait longer than this, slow lorises or not
HANDSHAKE_TIMEOUT = 2.0


def _serve_has_handshake_flag() -> bool:
    from gpuwire import cli
    return "handshake_timeout" in inspect.signature(cli.serve).parameters


HANDSHAKE_FLAG = _serve_has_handshake_flag()
NO_FLAG_REASON = ("`gpuwire serve` has no --handshake-timeout yet (the node's overall handshake deadline is "
                  "the NodeServer default of 10 s, not settable from the command line)")


# ---------------------------------------------------------------- one session's workload

CODE = {torch.float32: DTYPE_CODES["float32"], torch.int64: DTYPE_CODES["int64"], torch.bool: DTYPE_CODES["bool"]}
aten = torch.ops.aten


def _strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return tuple(strides)


class Session:
    """One client session: random ops on the node, each checked against CPU torch."""

    def __init__(self, address: str, seed: int):
        self.rt = Runtime(address, reply_timeout=60)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.ops = self.wrong = 0
        self.wrong_kinds: list[str] = []
        self.latencies: list[float] = []

    def upload(self, t: torch.Tensor):
        t = t.contiguous()
        sid = self.rt.allocate(max(t.numel() * t.element_size(), 1))
        if t.numel():
            self.rt.write(sid, 0, memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.dtype is torch.bool
                          else memoryview(t.numpy()).cast("B"))
        return sid, pack_tensor_ref(sid, 0, tuple(t.shape), _strides(t.shape), CODE[t.dtype])

    def run_one(self) -> None:
        r, g = self.rng, self.gen
        n, m, k = r.randint(1, 24), r.randint(1, 24), r.randint(1, 24)
        a, b = torch.randn(n, m, generator=g), torch.randn(n, m, generator=g)
        kind = r.choice(["add", "mul.out", "mm", "sum", "cat", "repeat", "neg_", "relu", "softmax",
                         "index_select", "where"])
        if kind == "add":
            name, args, kwargs, expected = "aten::add.Tensor", [a, b], {"alpha": 2}, aten.add.Tensor(a, b, alpha=2)
        elif kind == "mul.out":
            name, args, kwargs, expected = "aten::mul.out", [a, b], {"out": torch.zeros(n, m)}, a * b
        elif kind == "mm":
            c = torch.randn(m, k, generator=g)
            name, args, kwargs, expected = "aten::mm", [a, c], {}, aten.mm(a, c)
        elif kind == "sum":
            name, args, kwargs, expected = "aten::sum.dim_IntList", [a, [1], False], {}, aten.sum.dim_IntList(a, [1])
        elif kind == "cat":
            name, args, kwargs, expected = "aten::cat", [[a, b], 0], {}, aten.cat([a, b], 0)
        elif kind == "repeat":
            reps = [r.randint(1, 3), r.randint(1, 3)]
            name, args, kwargs, expected = "aten::repeat", [a, reps], {}, aten.repeat(a, reps)
        elif kind == "neg_":
            name, args, kwargs, expected = "aten::neg_", [a], {}, -a
        elif kind == "relu":
            name, args, kwargs, expected = "aten::relu", [a], {}, aten.relu(a)
        elif kind == "softmax":
            name, args, kwargs, expected = "aten::_softmax", [a, 1, False], {}, aten._softmax(a, 1, False)
        elif kind == "index_select":
            idx = torch.randint(0, n, (r.randint(1, 16),), generator=g)
            name, args, kwargs, expected = "aten::index_select", [a, 0, idx], {}, aten.index_select(a, 0, idx)
        else:
            cond = torch.rand(n, m, generator=g) > 0.5
            name, args, kwargs, expected = "aten::where.self", [cond, a, b], {}, aten.where.self(cond, a, b)
        rt = self.rt
        storages, wire_args, wire_kwargs, result_sid = [], [], {}, None

        def wire(value):
            if isinstance(value, torch.Tensor):
                sid, ref = self.upload(value)
                storages.append(sid)
                return ref, sid
            if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                return [wire(v)[0] for v in value], None
            return value, None

        for value in args:
            ref, sid = wire(value)
            wire_args.append(ref)
            if kind == "neg_" and sid is not None and result_sid is None:
                result_sid = sid  # in place: the result is the first argument
        for key, value in kwargs.items():
            ref, sid = wire(value)
            wire_kwargs[key] = ref
            if key == "out":
                result_sid = sid
        outs = []
        if result_sid is None:  # a functional op: declare its result, as a client does
            result_sid = rt.reserve(expected.numel() * 4)
            outs = [[result_sid, expected.numel() * 4, list(expected.shape), list(_strides(expected.shape)),
                     CODE[expected.dtype]]]
            storages.append(result_sid)
        started = time.perf_counter()
        with rt.lock:
            rt.enqueue(rt.conn.encode_op(rt.next_seq(), name, wire_args, wire_kwargs, outs))
        data = rt.read(result_sid, 0, expected.numel() * 4)
        self.latencies.append(time.perf_counter() - started)
        got = torch.frombuffer(bytearray(data), dtype=expected.dtype).reshape(expected.shape) if expected.numel() \
            else torch.empty(expected.shape)
        if not torch.equal(got, expected):
            self.wrong += 1
            self.wrong_kinds.append(kind)
        with rt.lock:
            rt.enqueue(rt.conn.send(Free(seq=rt.next_seq(), storage_ids=storages)))
        self.ops += 1


def run_workers(address: str, threads: int, seconds: float, seed: int) -> dict:
    """``threads`` sessions in this process, each running ops for ``seconds``."""
    results, lock = [], threading.Lock()
    ready = threading.Barrier(threads)

    def one(i: int) -> None:
        summary = {"ops": 0, "wrong": 0, "errors": [], "latencies": []}
        session = None
        try:
            session = Session(address, seed * 1000 + i)
            ready.wait(timeout=60)  # every session connected before the clock starts
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                session.run_one()
        except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
            summary["errors"].append(f"{type(exc).__name__}: {exc}"[:500])
        finally:
            if session is not None:
                summary.update(ops=session.ops, wrong=session.wrong, latencies=session.latencies,
                               wrong_kinds=session.wrong_kinds)
                session.rt.close()
            with lock:
                results.append(summary)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    return {"sessions": len(results), "ops": sum(r["ops"] for r in results),
            "wrong": sum(r["wrong"] for r in results), "errors": [e for r in results for e in r["errors"]],
            "wrong_kinds": sorted({k for r in results for k in r.get("wrong_kinds", ())}),
            "ops_per_session": [r["ops"] for r in results],
            "max_latency": latencies[-1] if latencies else None,
            "p99_latency": latencies[int(len(latencies) * 0.99)] if latencies else None}


# ---------------------------------------------------------------- slow lorises


class Loris:
    """A connection that hogs a slot slowly. ``closed_after``: seconds until the node closed it."""

    def __init__(self, address: str, kind: str):
        host, port = address.rsplit(":", 1)
        self.kind = kind
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.opened = time.monotonic()
        self.closed_after: float | None = None
        self.stop = threading.Event()
        if kind == "trickle":  # a real session, then a frame that never completes
            conn = Connection(Role.CLIENT)
            self.sock.sendall(conn.send(Hello(client_version="loris")))
            while True:
                event = conn.next_event()
                if isinstance(event, Welcome):
                    break
                conn.receive_data(self.sock.recv(65536))
            self.opened = time.monotonic()
            self.data = struct.pack("!IQ", 1024, 0) + b"\x96" + b"\x00" * 1023
        elif kind == "dribble":  # a valid Hello, one byte at a time
            self.data = Connection(Role.CLIENT).send(Hello(client_version="loris"))
        else:  # silent
            self.data = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        position = 0
        self.sock.settimeout(1.0)
        while not self.stop.is_set():
            if position < len(self.data):
                try:
                    self.sock.send(self.data[position:position + 1])
                    position += 1
                except OSError:
                    self._closed()
                    return
            try:
                if self.sock.recv(4096) == b"":
                    self._closed()
                    return
            except socket.timeout:
                continue
            except OSError:
                self._closed()
                return

    def _closed(self) -> None:
        if self.closed_after is None:
            self.closed_after = time.monotonic() - self.opened

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------- the tests


def node_args() -> list[str]:
    extra = ["--max-sessions", str(SESSIONS + 16), "--log-level", "warning"]
    if HANDSHAKE_FLAG:
        extra += ["--handshake-timeout", str(HANDSHAKE_TIMEOUT)]
    return extra


@pytest.fixture(scope="module")
def load_node():
    from tests.conftest import NodeProcess
    node = NodeProcess(*node_args())
    yield node
    node.kill()


def node_state(monitor: Runtime) -> tuple[int, list]:
    info = monitor.query("node")
    return info["bytes_in_use"], sorted(s["id"] for s in info["sessions"])


def run_load(node, seconds: float) -> dict:
    monitor = Runtime(node.address, reply_timeout=60)
    baseline = node_state(monitor)
    lorises = [Loris(node.address, kind) for kind in ("silent", "dribble", "trickle")]
    peak = [0]
    done = threading.Event()

    def watch() -> None:  # how many sessions the node holds at once
        while not done.wait(0.5):
            try:
                peak[0] = max(peak[0], len(monitor.query("node")["sessions"]))
            except Exception:  # noqa: BLE001
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.node.test_load", "--node", node.address,
                               "--threads", str(SESSIONS // PROCESSES), "--seconds", str(seconds), "--seed", str(p)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
             for p in range(PROCESSES)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + 120)
            assert proc.returncode == 0, f"a worker process failed:\n{err[-3000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, 9)
                proc.wait()
        done.set()
        watcher.join(timeout=5)
    elapsed = time.monotonic() - started
    # open while the load ran, or until the node's frame timeout (a frame that started must
    # finish within it) ended it, whichever came first: a session is not closed as a handshake
    open_during_load = {l.kind: l.closed_after is None or l.closed_after > min(elapsed, FRAME_TIMEOUT - 1)
                        for l in lorises}
    for loris in lorises:
        loris.close()
    deadline = time.monotonic() + 20  # sessions end as their Goodbyes arrive
    while node_state(monitor) != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    after = node_state(monitor)
    monitor.close()
    ops = sum(r["ops"] for r in reports)
    return {"reports": reports, "ops": ops, "ops_per_s": ops / seconds, "seconds": seconds, "peak_sessions": peak[0],
            "baseline": baseline, "after": after, "lorises": {l.kind: l.closed_after for l in lorises},
            "trickle_open_during_load": open_during_load["trickle"]}


def check_load(result: dict) -> None:
    reports = result["reports"]
    errors = [e for r in reports for e in r["errors"]]
    assert not errors, f"{len(errors)} sessions failed: {errors[:5]}"
    assert sum(r["sessions"] for r in reports) == SESSIONS
    assert sum(r["wrong"] for r in reports) == 0, \
        f"wrong results from {sorted({k for r in reports for k in r['wrong_kinds']})}"
    per_session = [n for r in reports for n in r["ops_per_session"]]
    assert min(per_session) >= 5, f"a session was starved: ops per session {sorted(per_session)[:8]}..."
    worst = max(r["max_latency"] for r in reports)
    assert worst < MAX_LATENCY, f"an op waited {worst:.1f} s"
    assert result["peak_sessions"] >= SESSIONS, f"the node held at most {result['peak_sessions']} sessions at once"
    assert result["trickle_open_during_load"], "the trickling loris was open throughout (it is a session)"
    assert result["after"] == result["baseline"], \
        f"node memory/sessions not back to baseline: {result['after']} != {result['baseline']}"
    print(f"\nload: {SESSIONS} sessions, {result['ops']} ops in {result['seconds']:g} s "
          f"({result['ops_per_s']:.0f} ops/s), p99 {max(r['p99_latency'] for r in reports) * 1e3:.0f} ms, "
          f"max {worst * 1e3:.0f} ms, 0 wrong, 0 errors; lorises closed after {result['lorises']}")


@pytest.mark.timeout(240)
def test_64_sessions_with_slow_loris_ci(load_node):
    check_load(run_load(load_node, seconds=10))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_64_sessions_with_slow_loris_full(load_node):
    check_load(run_load(load_node, seconds=60))


@pytest.mark.timeout(120)
@pytest.mark.xfail(not HANDSHAKE_FLAG, reason=NO_FLAG_REASON, strict=False)
def test_slow_lorises_without_a_handshake_are_closed_within_the_handshake_timeout(load_node):
    limit = HANDSHAKE_TIMEOUT if HANDSHAKE_FLAG else 10.0
    lorises = [Loris(load_node.address, kind) for kind in ("silent", "dribble")]
    try:
        rt = Runtime(load_node.address, connect_timeout=5)  # a real client is served meanwhile
        started = time.monotonic()
        rt.synchronize()
        assert time.monotonic() - started < 2.0
        rt.close()
        deadline = time.monotonic() + limit + 5
        while any(l.closed_after is None for l in lorises) and time.monotonic() < deadline:
            time.sleep(0.1)
        for loris in lorises:
            assert loris.closed_after is not None, f"the {loris.kind} loris was still open after {limit + 5:g} s"
            assert loris.closed_after <= limit + 1.5, \
                f"the {loris.kind} loris was closed after {loris.closed_after:.1f} s (handshake timeout {limit:g} s)"
    finally:
        for loris in lorises:
            loris.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.node.test_load")
    parser.add_argument("--node", required=True, help="HOST:PORT of the node")
    parser.add_argument("--threads", type=int, default=16, help="sessions in this process")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(run_workers(args.node, args.threads, args.seconds, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
