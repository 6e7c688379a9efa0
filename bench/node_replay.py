"""Deterministic node-side A/B: record what a client sends, replay it through a real Session.

Not a benchmark of the suite (``python -m bench`` does not run it): a tool for changes to the
node's hot path, whose effect on a live step drowns in the noise of a shared 2-core machine.

    python -m bench.node_replay record gpt2 60 /tmp/gpt2.bin   # a node that records, 60 steps
    python -m bench.node_replay replay /tmp/gpt2.bin 3          # node CPU per event, 3 runs
    python -m bench.node_replay ops /tmp/gpt2.bin 3             # the native loop's ops, by name
    GPUWIRE_REPLAY_PROFILE=30 python -m bench.node_replay ops /tmp/gpt2.bin 2   # + torch.profiler's table

``record`` starts a node whose connections keep every byte they receive, runs the workload
(bench/models.py) against it and saves the session's byte stream (GPUWIRE_REPLAY_BACKEND=cuda:
a CUDA node, for recording and replaying; GPUWIRE_REPLAY_AMP=bf16: the steps under autocast).
``replay`` feeds that stream through ``Connection`` + ``Session`` in this process (no sockets,
no client), as a served connection is bound, and prints the thread CPU time per frame split
into decoding (the frames the native op loop runs included), the kernels of the Python path
and the rest of ``Session.handle``, skipping the first 4,000 frames (model set-up and warm-up;
GPUWIRE_REPLAY_WARM_EVENTS sets another count: an MLP recording of 80 steps has ~2,700).
``ops`` times each frame the native op loop runs (node/loop.py), by op name, the best of the
runs for each name. On a CUDA node the times are the host's: launches, not kernels.

On a shared VM, wall and CPU times of one change swing by 2x between runs; instruction counts
do not. For the loop's own cost (docs/performance.md, session 26):

    valgrind --tool=callgrind --collect-atstart=no '--toggle-collect=*loop_run*' \
        $(python -c 'import sys; print(sys.executable)') -m bench.node_replay replay FILE 1
"""

from __future__ import annotations

import os
import signal
import sys
import time

WARM_EVENTS = int(os.environ.get("GPUWIRE_REPLAY_WARM_EVENTS", "4000"))  # model set-up and warm-up
# the node's backend, for recording and replaying alike (a recording made against a CPU node
# declares CPU layouts: record on the machine and backend you replay on)
BACKEND = os.environ.get("GPUWIRE_REPLAY_BACKEND", "cpu")
# "bf16": the recorded steps run under torch.autocast (a host-bound step on a GPU)
AMP = os.environ.get("GPUWIRE_REPLAY_AMP", "")
# GPUWIRE_REPLAY_PROFILE=N: ``ops`` also prints the N host functions (aten ops, CUDA runtime calls)
# that took the most self time in its last run, under torch.profiler
PROFILE = os.environ.get("GPUWIRE_REPLAY_PROFILE", "")


def _recording_node(out: str) -> None:
    """Run ``gpuwire serve`` (argv) keeping what its connections receive; SIGUSR1 saves it."""
    from gpuwire.cli import app
    from gpuwire.protocol import connection

    chunks: list[bytes] = []
    cls = connection.Connection
    receive_data, buffer_updated, get_buffer = cls.receive_data, cls.buffer_updated, cls.get_buffer

    def keep_data(self, data):
        chunks.append(bytes(data))
        return receive_data(self, data)

    def keep_direct(self, nbytes):
        if nbytes and self._direct:  # received straight into a payload: receive_data never sees it
            chunks.append(bytes(self._last_buffer[:nbytes]))
        return buffer_updated(self, nbytes)

    def remember_buffer(self, sizehint=1 << 20):
        self._last_buffer = get_buffer(self, sizehint)
        return self._last_buffer

    cls.receive_data, cls.buffer_updated, cls.get_buffer = keep_data, keep_direct, remember_buffer
    signal.signal(signal.SIGUSR1, lambda *_: open(out, "wb").write(b"".join(chunks)))
    sys.argv = ["gpuwire", *sys.argv[3:]]
    app()


def record(kind: str, steps: int, out: str) -> None:
    import torch

    import gpuwire
    from bench.common import Child
    from bench.models import Workload

    if AMP not in ("", "bf16"):
        raise SystemExit(f"GPUWIRE_REPLAY_AMP={AMP!r}: bf16, or unset")
    torch.set_num_threads(1)
    node = Child([sys.executable, "-m", "bench.node_replay", "_node", out, "serve", "--host", "127.0.0.1",
                  "--port", "0", "--backend", BACKEND, "--threads", "1", "--log-level", "warning",
                  "--exit-with-stdin"], what="recording node", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    try:
        gpuwire.attach(node.address)
        workload = Workload(kind, torch.device("gpuwire"))
        for _ in range(steps):
            if AMP:
                with torch.autocast("gpuwire", dtype=torch.bfloat16):
                    workload.step()
            else:
                workload.step()
        os.kill(node.pid, signal.SIGUSR1)
        time.sleep(1.0)
        print(f"{os.path.getsize(out)} bytes of {steps} {kind} steps in {out}")
    finally:
        node.kill()


def _replay_node():
    """(backend, generator owner, op table) of a node in this process, its helpers installed and
    its collector settled as a serving node's process does once it listens."""
    import torch

    from gpuwire.node import loop, native
    from gpuwire.node import session as node_session
    from gpuwire.node.backend import Backend
    from gpuwire.node.ops import OpTable

    torch.set_num_threads(1)
    native.install()
    loop.install()
    backend = Backend.select(BACKEND)
    rng, table = node_session.RngOwner(backend), OpTable()
    node_session.settle_garbage_collector()
    return backend, rng, table


def _replay_session(data: bytes, node, wrap=None):
    """A fresh session on ``node`` (``_replay_node``) and the server connection holding the
    recording ``data``, past its Hello, its op runners bound as a served connection binds them;
    ``wrap``: bind ``wrap(session.op_runner)`` alone instead (one frame a call)."""
    from gpuwire.node import session as node_session
    from gpuwire.protocol.connection import Connection, Role
    from gpuwire.protocol.events import Welcome

    backend, rng, table = node
    conn = Connection(Role.SERVER)
    session = node_session.Session(backend, rng, table)
    conn.receive_data(data)
    conn.next_event()  # the Hello
    if wrap is None:
        hooks = {"op_runner": session.op_runner, "op_frames_runner": session.op_frames_runner}
    else:
        hooks = {"op_runner": wrap(session.op_runner)}
    conn.bind(ext_hook=session.decode_hook, payload_sink=session.payload_sink, **hooks)
    conn.send(Welcome(server_version="replay", capabilities=[], session_id=session.id,
                      device=backend.describe(), limits={}, resume={}))
    return conn, session


def replay(path: str, runs: int) -> None:
    from gpuwire.node import loop, native
    from gpuwire.node import session as node_session
    from gpuwire.protocol.connection import CLOSED, NEED_DATA
    from gpuwire.protocol.events import Goodbye

    kernel_seconds = [0.0]
    direct = node_session._direct

    def timed_direct(fn):
        call = direct(fn)

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                kernel_seconds[0] += time.thread_time() - started
        return timed

    node_session._direct = timed_direct
    data = open(path, "rb").read()
    node = _replay_node()
    print(f"node helpers: {native.status()}, op loop: {loop.status()}")
    for _ in range(runs):
        conn, session = _replay_session(data, node)
        frames, decoding, handling, counted, loop_frames, calls = 0, 0.0, 0.0, 0, 0, 0
        warm = True
        clock = time.thread_time
        ran_before = _loop_frames(loop)
        while True:
            t0 = clock()
            event = conn.next_event()
            t1 = clock()
            if event is NEED_DATA or event is CLOSED or type(event) is Goodbye:
                break
            session.handle(event)
            t2 = clock()
            # frames, not events: one RanOp stands for all the Op frames the loop ran in one call
            ran = 1
            if type(event) is node_session.RanOp:
                ran_now = _loop_frames(loop)
                ran, ran_before = ran_now - ran_before, ran_now
            frames += ran
            if warm:
                if frames >= WARM_EVENTS:
                    warm = False
                    kernel_seconds[0] = 0.0
            else:
                decoding += t1 - t0
                handling += t2 - t1
                counted += ran
                if type(event) is node_session.RanOp:
                    loop_frames += ran
                    calls += 1
        session.close()
        node[0].synchronize()  # (on a GPU the kernels queued by the host time above)
        counted = max(counted, 1)
        kernels = kernel_seconds[0]
        print(f"{counted} frames ({loop_frames} run by the op loop, in {calls} calls): decode "
              f"{decoding / counted * 1e6:.1f} us (the loop's frames included), handle {handling / counted * 1e6:.1f} us "
              f"(Python-path kernels {kernels / counted * 1e6:.1f}, the rest {(handling - kernels) / counted * 1e6:.1f}) "
              f"per frame; node CPU {(decoding + handling) * 1e3:.0f} ms")


def _loop_frames(loop) -> int:
    """Op frames the native loop has run in this process (failed ones included)."""
    if loop.module is None:
        return 0
    stats = loop.module.stats()
    return stats["ran"] + stats["failed"]


def ops(path: str, runs: int) -> None:
    import msgpack

    from gpuwire.node import loop
    from gpuwire.protocol.connection import CLOSED, NEED_DATA
    from gpuwire.protocol.events import Goodbye

    data = open(path, "rb").read()
    node = _replay_node()
    if loop.module is None:
        print(f"the native op loop does not run here: {loop.status()}")
        return
    best: dict[str, float] = {}
    calls: dict[str, int] = {}
    profiler = None
    if PROFILE:  # the host's time by aten op and CUDA runtime call, over the last run
        import torch
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    for run in range(runs):
        if profiler is not None and run == runs - 1:
            profiler.__enter__()
        seconds: dict[str, float] = {}
        counts: dict[str, int] = {}
        events = [0]

        def timing(runner, seconds=seconds, counts=counts):
            def timed(raw, names):
                started = time.perf_counter()
                event = runner(raw, names)
                took = time.perf_counter() - started
                if event is not None and events[0] > WARM_EVENTS:
                    header = msgpack.unpackb(bytes(raw), strict_map_key=False, ext_hook=lambda code, data: None)
                    name = names[header[2]]
                    seconds[name] = seconds.get(name, 0.0) + took
                    counts[name] = counts.get(name, 0) + 1
                return event
            return timed

        conn, session = _replay_session(data, node, wrap=timing)
        while True:
            event = conn.next_event()
            events[0] += 1
            if event is NEED_DATA or event is CLOSED or type(event) is Goodbye:
                break
            session.handle(event)
        session.close()
        if profiler is not None and run == runs - 1:
            profiler.__exit__(None, None, None)
        for name, took in seconds.items():
            best[name] = min(best.get(name, float("inf")), took / counts[name])
            calls[name] = counts[name]
    total = sum(best[name] * calls[name] for name in best)
    print(f"{sum(calls.values())} frames the loop ran, {total * 1e3:.1f} ms (best of {runs} runs for each op)")
    for name in sorted(best, key=lambda n: -best[n] * calls[n])[:30]:
        print(f"{best[name] * calls[name] * 1e3:8.1f} ms {calls[name]:7d} x {best[name] * 1e6:7.1f} us  {name}")
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(PROFILE)))


def main(argv: list[str]) -> int:
    if argv[:1] in (["_node"], ["replay"], ["ops"]):
        # a node's process, as the ``gpuwire`` command: a plain ``import gpuwire`` registers the
        # client's device, and with it registered PyTorch's autograd serves no other accelerator
        # (pytorch/pytorch#161129): a CUDA node's kept SDPA graph failed its backward
        # ("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED")
        sys.argv[0] = "gpuwire"
    if len(argv) >= 2 and argv[0] == "_node":
        _recording_node(argv[1])
        return 0
    if len(argv) == 4 and argv[0] == "record":
        record(argv[1], int(argv[2]), argv[3])
        return 0
    if len(argv) in (2, 3) and argv[0] in ("replay", "ops"):
        (replay if argv[0] == "replay" else ops)(argv[1], int(argv[2]) if len(argv) == 3 else 3)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
