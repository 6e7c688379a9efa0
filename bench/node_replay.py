"""Deterministic node-side A/B: record what a client sends, replay it through a real Session.

Not a benchmark of the suite (``python -m bench`` does not run it): a tool for changes to the
node's hot path, whose effect on a live step drowns in the noise of a shared 2-core machine.

    python -m bench.node_replay record gpt2 60 /tmp/gpt2.bin   # a node that records, 60 steps
    python -m bench.node_replay replay /tmp/gpt2.bin 3          # node CPU per event, 3 runs

``record`` starts a node whose connections keep every byte they receive, runs the workload
(bench/models.py) against it and saves the session's byte stream. ``replay`` feeds that stream
through ``Connection`` + ``Session`` in this process (no sockets, no client) and prints the
thread CPU time per event split into decoding, kernels and the rest of ``Session.handle``,
skipping the first 4,000 events (model set-up and warm-up; GPUWIRE_REPLAY_WARM_EVENTS sets
another count: an MLP recording of 80 steps has ~2,700 events).
"""

from __future__ import annotations

import os
import signal
import sys
import time

WARM_EVENTS = int(os.environ.get("GPUWIRE_REPLAY_WARM_EVENTS", "4000"))  # model set-up and warm-up


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

    torch.set_num_threads(1)
    node = Child([sys.executable, "-m", "bench.node_replay", "_node", out, "serve", "--host", "127.0.0.1",
                  "--port", "0", "--backend", "cpu", "--threads", "1", "--log-level", "warning",
                  "--exit-with-stdin"], what="recording node", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    try:
        gpuwire.attach(node.address)
        workload = Workload(kind, torch.device("gpuwire"))
        for _ in range(steps):
            workload.step()
        os.kill(node.pid, signal.SIGUSR1)
        time.sleep(1.0)
        print(f"{os.path.getsize(out)} bytes of {steps} {kind} steps in {out}")
    finally:
        node.kill()


def replay(path: str, runs: int) -> None:
    import torch

    from gpuwire.node import session as node_session
    from gpuwire.node.backend import Backend
    from gpuwire.node.ops import OpTable
    from gpuwire.protocol.connection import CLOSED, NEED_DATA, Connection, Role
    from gpuwire.protocol.events import Goodbye, Welcome

    torch.set_num_threads(1)
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
    from gpuwire.node import native
    native.install()
    from gpuwire.node import loop
    print(f"node helpers: {native.status()}, op loop: {loop.status()}")
    backend = Backend.select("cpu")
    rng, ops = node_session.RngOwner(backend), OpTable()
    node_session.settle_garbage_collector()  # as a serving node's process does once it listens
    for _ in range(runs):
        conn = Connection(Role.SERVER)
        session = node_session.Session(backend, rng, ops)
        conn.receive_data(data)
        conn.next_event()  # the Hello
        conn.bind(ext_hook=session.decode_hook, payload_sink=session.payload_sink, op_runner=session.op_runner)
        conn.send(Welcome(server_version="replay", capabilities=[], session_id=session.id,
                          device=backend.describe(), limits={}, resume={}))
        events, decoding, handling = 0, 0.0, 0.0
        clock = time.thread_time
        while True:
            t0 = clock()
            event = conn.next_event()
            t1 = clock()
            if event is NEED_DATA or event is CLOSED or type(event) is Goodbye:
                break
            session.handle(event)
            t2 = clock()
            events += 1
            if events == WARM_EVENTS:
                kernel_seconds[0] = 0.0
            elif events > WARM_EVENTS:
                decoding += t1 - t0
                handling += t2 - t1
        session.close()
        counted = max(events - WARM_EVENTS, 1)
        kernels = kernel_seconds[0]
        print(f"{counted} events: decode {decoding / counted * 1e6:.1f} us, handle {handling / counted * 1e6:.1f} us "
              f"(kernels {kernels / counted * 1e6:.1f}, the rest {(handling - kernels) / counted * 1e6:.1f}) "
              f"per event; node CPU {(decoding + handling) * 1e3:.0f} ms")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "_node":
        _recording_node(argv[1])
        return 0
    if len(argv) == 4 and argv[0] == "record":
        record(argv[1], int(argv[2]), argv[3])
        return 0
    if len(argv) in (2, 3) and argv[0] == "replay":
        replay(argv[1], int(argv[2]) if len(argv) == 3 else 3)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
