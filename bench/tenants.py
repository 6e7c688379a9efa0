"""Node throughput with many tenants: ops/s, op-batch latency and fairness at 1, 8 and 64 sessions.

Each session is its own TCP connection to a fresh ``gpuwire serve`` node, driven by load
generator processes (``python -m bench.tenants --worker``, one thread per session, at most
four processes). The generators speak the protocol directly (``gpuwire.protocol``, no torch,
so 64 sessions fit in a few small processes next to the node on a 2-core machine): after the
handshake a session allocates one tensor of 1,000 float32 on the node, then keeps two batches
in flight, each 32 ``aten::add_.Tensor(x, 1)`` commands followed by a ``Sync``; when a batch's
``SyncDone`` arrives it sends the next one. Every session runs in the same measurement window
(monotonic clock, shared by the processes); afterwards it reads ``x`` back and checks that it
equals the number of ``add_`` commands it sent (so no command was skipped).

Reported per session count N:

* ``ops/s``: ``add_`` commands completed by all sessions in the window / its length;
  baseline: for N = 1 the same ``add_`` run locally in a loop (what the kernel alone costs),
  for N > 1 the one-session figure of this run (ratio 1.0 = no loss from sharing);
* ``op-batch latency p50 / p99`` (ms): from sending a batch to receiving its ``SyncDone``,
  for batches sent and answered inside the window (two in flight, so one batch's own latency
  includes waiting behind the other);
* ``fairness``: each session's completed ops / the mean over sessions; the figure is the
  largest deviation in % (target: within 10 %);
* ``errors``: handshakes refused, ``Error`` replies, connections lost, wrong read-back
  values (target 0).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

NAME = "tenants"
DESCRIPTION = "node ops/s, op-batch latency p50/p99 and fairness with 1, 8 and 64 concurrent sessions"

SESSION_COUNTS = (1, 8, 64)
BATCH = 32  # add_ commands per batch (then one Sync)
IN_FLIGHT = 2  # batches outstanding per session
NUMEL = 1000
MAX_WORKERS = 4


def run(ctx, result) -> None:
    window = 3.0 if ctx.quick else 10.0
    warm = 0.5 if ctx.quick else 1.0
    result.config.update({"sessions": list(SESSION_COUNTS), "window_s": window, "warmup_s": warm,
                          "batch_ops": BATCH, "batches_in_flight": IN_FLIGHT,
                          "op": f"aten::add_.Tensor on {NUMEL} float32", "max_generator_processes": MAX_WORKERS})
    local = _local_ops_per_second(window / 3)
    one = None
    for n in SESSION_COUNTS:
        try:
            stats = _run_sessions(ctx, n, warm, window)
        except Exception as exc:  # noqa: BLE001 - record this count, go on with the next
            result.fail(f"{n} sessions", exc)
            continue
        ops_s = stats["ops"] / window
        who = f"{n} session{'s' if n > 1 else ''}"
        if n == 1:
            one = ops_s
            result.add("1 session: ops/s", ops_s, "ops/s", local, baseline_label="local add_ loop ops/s",
                       note=f"{stats['ops']:,} ops in {window:g} s")
        else:
            result.add(f"{n} sessions: ops/s", ops_s, "ops/s", one, baseline_label="1-session ops/s",
                       note=f"{stats['ops']:,} ops in {window:g} s")
        lat = stats["latencies"]
        if lat:
            result.add(f"{who}: op-batch latency p50", _percentile(lat, 50) * 1e3, "ms",
                       note=f"{len(lat):,} batches of {BATCH} ops + Sync, {IN_FLIGHT} in flight per session")
            result.add(f"{who}: op-batch latency p99", _percentile(lat, 99) * 1e3, "ms")
        per = stats["per_session"]
        mean = statistics.fmean(per) if per else 0.0
        deviation = max(abs(p / mean - 1) for p in per) * 100 if mean else float("inf")
        result.add(f"{who}: fairness, max deviation from mean", deviation, "%", target="<= 10 %",
                   ok=deviation <= 10.0,
                   note=f"ops per session min {min(per):,} / mean {mean:,.0f} / max {max(per):,}" if per else None)
        result.add(f"{who}: errors", stats["errors"], "errors", target="== 0", ok=stats["errors"] == 0,
                   note="; ".join(stats["error_messages"][:3]) or None)


def _local_ops_per_second(seconds: float) -> float:
    import torch

    x = torch.zeros(NUMEL)
    for _ in range(1000):
        x.add_(1)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(1000):
            x.add_(1)
        n += 1000
    return n / (time.perf_counter() - t0)


def _run_sessions(ctx, n: int, warm: float, window: float) -> dict:
    node = ctx.node("cpu", "--max-sessions", str(max(n, 64)), fresh=True)
    workers = []
    try:
        counts = [n // min(n, MAX_WORKERS) + (i < n % min(n, MAX_WORKERS)) for i in range(min(n, MAX_WORKERS))]
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(_src()), os.environ.get("PYTHONPATH")) if p)}
        for count in counts:
            w = ctx.worker([sys.executable, "-m", "bench.tenants", "--worker"], what="tenant load generator",
                           env=env)
            w.send(json.dumps({"address": node.address, "sessions": count}))
            workers.append(w)
        for w in workers:
            line = w.readline(120.0)
            if not line.startswith("ready"):
                raise RuntimeError(f"load generator failed to connect its sessions: {line.strip()}")
        start = time.monotonic() + warm
        for w in workers:
            w.send(json.dumps({"start": start, "end": start + window}))
        results = [json.loads(w.readline(window + warm + 120.0)) for w in workers]
    finally:
        for w in workers:
            ctx.kill(w)
        ctx.kill(node)
    stats = {"ops": 0, "latencies": [], "per_session": [], "errors": 0, "error_messages": []}
    for r in results:
        for s in r["sessions"]:
            stats["ops"] += s["ops"]
            stats["per_session"].append(s["ops"])
            stats["latencies"].extend(s["latencies"])
            stats["errors"] += len(s["errors"])
            stats["error_messages"].extend(s["errors"])
    if len(stats["per_session"]) != n:
        stats["errors"] += n - len(stats["per_session"])
        stats["error_messages"].append(f"{n - len(stats['per_session'])} session(s) reported nothing")
    return stats


def _percentile(xs, p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _src():
    from pathlib import Path
    return Path(__file__).resolve().parent.parent / "src"


# ---------------------------------------------------------------- the load generator process


def _protocol():
    """gpuwire's sans-IO protocol without ``import gpuwire`` (whose package imports torch)."""
    import importlib.util
    import types

    if "gpuwire" not in sys.modules:
        spec = importlib.util.find_spec("gpuwire")
        package = types.ModuleType("gpuwire")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["gpuwire"] = package
    from gpuwire import _version, protocol
    from gpuwire.protocol import codec, events
    return protocol, codec, events, _version.__version__


class _Session:
    def __init__(self, address: str, index: int):
        import socket

        self.protocol, self.codec, self.events, version = _protocol()
        P, E = self.protocol, self.events
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self.conn = P.Connection(P.Role.CLIENT)
        self.errors: list[str] = []
        self.sock.sendall(self.conn.send(E.Hello(client_version=version, capabilities=["sync-ops"],
                                                 options={"pid": os.getpid()})))
        welcome = self.next_event()
        if not isinstance(welcome, E.Welcome):
            raise RuntimeError(f"session {index} refused: {getattr(welcome, 'reason', welcome)}")
        self.seq = 0
        self.storage_id = 1 << 32
        self.sock.sendall(self.conn.send(E.Alloc(seq=self.next_seq(), storage_id=self.storage_id, nbytes=4 * NUMEL)))
        self.x = self.codec.pack_tensor_ref(self.storage_id, 0, (NUMEL,), (1,), self.codec.DTYPE_CODES["float32"])
        self.sent_ops = 0
        self.ops = 0
        self.latencies: list[float] = []

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def next_event(self):
        P = self.protocol
        while True:
            event = self.conn.next_event()
            if event is P.NEED_DATA:
                data = self.sock.recv(1 << 16)
                self.conn.receive_data(data)
                continue
            if event is P.CLOSED:
                raise ConnectionError("the node closed the connection")
            return event

    def batch(self) -> tuple[bytes, int]:
        encode = self.conn.encode_op
        x = self.x
        frames = [encode(self.next_seq(), "aten::add_.Tensor", [x, 1], {}, []) for _ in range(BATCH)]
        seq = self.next_seq()
        frames.append(self.conn.send(self.events.Sync(seq=seq)))
        self.sent_ops += BATCH
        return b"".join(frames), seq

    def run(self, start: float, end: float) -> None:
        E = self.events
        clock = time.monotonic
        try:
            pending = []  # (sync seq, sent at)
            for _ in range(IN_FLIGHT):
                data, seq = self.batch()
                pending.append((seq, clock()))
                self.sock.sendall(data)
            while pending:
                event = self.next_event()
                now = clock()
                if type(event) is E.Error:
                    self.errors.append(f"{event.op}: {event.exc_type}: {event.message}"[:300])
                elif type(event) is not E.SyncDone:
                    self.errors.append(f"unexpected {type(event).__name__}")
                seq, sent = pending.pop(0)
                if start <= now <= end:
                    self.ops += BATCH
                    if sent >= start:
                        self.latencies.append(now - sent)
                if now < end:
                    data, seq = self.batch()
                    pending.append((seq, clock()))
                    self.sock.sendall(data)
            self._check()
        except Exception as exc:  # noqa: BLE001 - reported as an error of this session
            self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            try:
                self.sock.sendall(self.conn.send(E.Goodbye(reason="bench done")))
                self.sock.close()
            except OSError:
                pass

    def _check(self) -> None:
        """x must hold the number of add_(1) commands sent: none was skipped or repeated."""
        import struct

        E = self.events
        seq = self.next_seq()
        self.sock.sendall(self.conn.send(E.Read(seq=seq, storage_id=self.storage_id, byte_offset=0, nbytes=4 * NUMEL)))
        reply = self.next_event()
        if type(reply) is not E.Data:
            self.errors.append(f"read-back failed: {reply}")
            return
        values = set(struct.unpack(f"<{NUMEL}f", bytes(reply.payload)))
        if values != {float(self.sent_ops)}:
            self.errors.append(f"read back {sorted(values)[:3]}, expected {self.sent_ops} (the ops sent)")


def _worker() -> int:
    config = json.loads(sys.stdin.readline())
    sessions, errors = [], []
    for i in range(config["sessions"]):
        try:
            sessions.append(_Session(config["address"], i))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    print("ready", flush=True)
    window = json.loads(sys.stdin.readline())
    threads = [threading.Thread(target=s.run, args=(window["start"], window["end"]), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = [{"ops": s.ops, "latencies": [round(x, 6) for x in s.latencies], "errors": s.errors} for s in sessions]
    out += [{"ops": 0, "latencies": [], "errors": [e]} for e in errors]
    print(json.dumps({"sessions": out}), flush=True)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(_worker())
    print("run it through the runner: python -m bench --only tenants", file=sys.stderr)
    sys.exit(2)
