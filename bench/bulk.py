"""Bulk throughput host→device and device→host, next to raw TCP on the same loopback.

gpuwire: h2d = ``y = x.to("gpuwire"); gpuwire.synchronize()`` (the bytes are on the node and
stored when it returns); d2h = ``y.cpu()`` (one round trip, bytes in a new host tensor, whose
fresh pages the kernel faults in as they arrive) and ``host.copy_(y)`` into an existing one. Raw TCP:
a sender thread ``sendall``s the same number of bytes from a host buffer over a persistent
loopback connection to a receiver thread that ``recv_into``s a preallocated buffer; timed
from the send until the receiver holds the last byte. The two alternate per repetition;
medians are reported in GiB/s, ratio = gpuwire / raw TCP (1.0 = as fast as the socket), after
warm-up rounds of both (``WARM_ROUNDS_SMALL``).
"""

from __future__ import annotations

import queue
import socket
import threading
import time

import torch

from .common import median

NAME = "bulk"
DESCRIPTION = "bulk transfer GiB/s host->device and device->host vs raw TCP on loopback"

MiB = 1 << 20
GiB = 1 << 30


class RawTcp:
    """A persistent loopback connection with a sender and a receiver thread."""

    def __init__(self):
        server = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(server.getsockname())
        self.rx, _ = server.accept()
        server.close()
        for s in (self.tx, self.rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_jobs: queue.Queue = queue.Queue()
        self._recv_jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._sender, daemon=True),
                         threading.Thread(target=self._receiver, daemon=True)]
        for t in self._threads:
            t.start()

    def _sender(self):
        while (job := self._send_jobs.get()) is not None:
            self.tx.sendall(job)

    def _receiver(self):
        while (buf := self._recv_jobs.get()) is not None:
            n, got = len(buf), 0
            try:
                while got < n:
                    k = self.rx.recv_into(buf[got:], n - got)
                    if not k:
                        raise ConnectionError("raw TCP peer closed")
                    got += k
                self._done.put(time.perf_counter())
            except Exception as exc:  # noqa: BLE001
                self._done.put(exc)

    def transfer(self, src: memoryview, dst: memoryview) -> float:
        self._recv_jobs.put(dst)
        t0 = time.perf_counter()
        self._send_jobs.put(src)
        end = self._done.get(timeout=300)
        if isinstance(end, BaseException):
            raise end
        return end - t0

    def close(self):
        self._send_jobs.put(None)
        self._recv_jobs.put(None)
        for s in (self.tx, self.rx):
            s.close()


# The bound: bulk transfer at >= 80 % of a raw TCP socket on the same link.
RAW_TCP_SHARE_TARGET = 0.8
# Rounds of each path run before timing the small size: a process's first 1 MiB buffers come
# from fresh pages (glibc maps each one until its threshold adapts: ~256 page faults, ~450 us,
# a round on either side for the first ~10 rounds), which is start-up, not throughput; the
# raw TCP side's buffers are preallocated and touched. A steady loop then measures what a
# program moving a 1 MiB batch every step sees.
WARM_ROUNDS_SMALL = 12


def run(ctx, result) -> None:
    import gpuwire

    sizes = [1, 64] if ctx.quick else [1, 64, 512]
    reps = {1: 50, 64: 5, 512: 3} if not ctx.quick else {1: 10, 64: 3}
    warm = {1: WARM_ROUNDS_SMALL, 64: 1, 512: 1}
    result.config.update({"sizes_mib": sizes, "repetitions": reps, "warm_up_rounds": warm})
    ctx.attach()
    dev = torch.device("gpuwire")
    raw = RawTcp()
    try:
        for mib in sizes:
            label = f"{mib} MiB"
            try:
                nbytes = mib * MiB
                x = torch.ones(nbytes, dtype=torch.uint8)
                src = memoryview(x.numpy())
                sink = bytearray(nbytes)
                dst = memoryview(sink)
                landing = torch.zeros(nbytes, dtype=torch.uint8)  # an existing host tensor (touched)
                y = None
                for _ in range(warm[mib]):  # warm-up of both paths, as the timed rounds run them
                    raw.transfer(src, dst)
                    del y
                    y = x.to(dev)
                    gpuwire.synchronize()
                    y.cpu()
                    landing.copy_(y)
                h2d, d2h, d2h_into, tcp = [], [], [], []
                for _ in range(reps[mib]):
                    tcp.append(raw.transfer(src, dst))
                    del y
                    t0 = time.perf_counter()
                    y = x.to(dev)
                    gpuwire.synchronize()
                    h2d.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    back = y.cpu()
                    d2h.append(time.perf_counter() - t0)
                    del back
                    t0 = time.perf_counter()
                    landing.copy_(y)
                    d2h_into.append(time.perf_counter() - t0)
                if not torch.equal(y.cpu()[:4096], x[:4096]):
                    raise AssertionError("bytes read back differ from those written")
                del y
                raw_gibs = nbytes / GiB / median(tcp)
                for figure, seconds, extra in (
                        (f"host->device {label}", h2d, {}),
                        (f"device->host {label}", d2h, {"note": "y.cpu(): into a new host tensor"}),
                        (f"device->host {label}, into an existing tensor", d2h_into,
                         {"note": "host.copy_(y): no fresh pages to fault in, as the raw TCP receiver"})):
                    gibs = nbytes / GiB / median(seconds)
                    result.add(figure, gibs, "GiB/s", raw_gibs, baseline_label="raw TCP GiB/s",
                               target=f">= {RAW_TCP_SHARE_TARGET:g}x raw TCP",
                               ok=gibs >= RAW_TCP_SHARE_TARGET * raw_gibs, **extra)
                del x, src, dst, sink, landing
            except Exception as exc:  # noqa: BLE001
                result.fail(label, exc)
    finally:
        raw.close()
