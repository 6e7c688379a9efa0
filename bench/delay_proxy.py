"""A user-space TCP proxy that adds a fixed one-way delay (netem is not available here).

Listens on loopback and forwards every accepted connection to ``--target``, bytes both
ways. Each chunk read from one side is stamped with ``arrival + delay`` and written to the
other side once that time has come; reading never waits for writing, so data streams (a
chunk read 1 ms after another leaves 1 ms after it) and order is preserved (one FIFO per
direction). RTT added = 2 × ``--delay-ms``. Bandwidth is not limited; a direction stops
reading while ``MAX_QUEUED`` bytes wait in it (backpressure).

One thread per connection runs both directions as an event loop (``selectors``: reads, due
times, non-blocking writes). It shares the machine with the client and the node it measures,
and a real link costs them nothing: the first version's reader and writer threads a direction
(a queue hand-off and a GIL hand-off a chunk, then a sleep) added 0.15-0.7 ms to a round trip
at 0 ms delay and ~5 ms to a GPT-2 step of ~50 sends.

    python -m bench.delay_proxy --target 127.0.0.1:7070 --delay-ms 5 [--listen 127.0.0.1:0]

prints ``delay proxy listening on HOST:PORT -> TARGET (one-way N ms)`` on stdout first.
"""

from __future__ import annotations

import argparse
import collections
import selectors
import socket
import threading
import time

from gpuwire._process import exit_when_stdin_closes

CHUNK = 256 << 10
MAX_QUEUED = 64 << 20


class _Direction:
    """Bytes read from ``src`` on their way to ``dst``: (due time, chunk) in arrival order, and
    the unsent rest of the chunk being written."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float):
        self.src, self.dst, self.delay = src, dst, delay
        self.waiting: collections.deque = collections.deque()
        self.queued = 0
        self.writing = memoryview(b"")
        self.eof = False  # src ended: shut dst's write side once everything before it is out
        self.closed = False


def _pipe_both(a: socket.socket, b: socket.socket, delay: float) -> None:
    """Forward a <-> b with ``delay`` added to every chunk, until both directions ended."""
    directions = [_Direction(a, b, delay), _Direction(b, a, delay)]
    for s in (a, b):
        s.setblocking(False)
    selector = selectors.SelectSelector()  # (epoll and poll round a timeout up to whole ms)
    clock = time.monotonic
    try:
        while not all(d.closed for d in directions):
            now = clock()
            for d in directions:
                _write_due(d, now)
            interest: dict = {}
            next_due = None
            for d in directions:
                if not d.eof and d.queued < MAX_QUEUED:
                    interest[d.src] = interest.get(d.src, 0) | selectors.EVENT_READ
                if d.writing:
                    interest[d.dst] = interest.get(d.dst, 0) | selectors.EVENT_WRITE
                elif d.waiting:
                    due = d.waiting[0][0]
                    next_due = due if next_due is None else min(next_due, due)
            for s in (a, b):
                events = interest.get(s, 0)
                registered = selector.get_map().get(s)
                if registered is not None and registered.events != events:
                    selector.unregister(s)
                    registered = None
                if events and registered is None:
                    selector.register(s, events)
            if not interest and next_due is None:
                break
            timeout = None if next_due is None else max(0.0, next_due - clock())
            for key, events in selector.select(timeout):
                if events & selectors.EVENT_READ:
                    for d in directions:
                        if d.src is key.fileobj and not d.eof:
                            _read(d, clock())
    finally:
        selector.close()


def _read(d: _Direction, now: float) -> None:
    try:
        data = d.src.recv(CHUNK)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        data = b""
    if not data:
        d.eof = True
    d.waiting.append((now + d.delay, data))
    d.queued += len(data)


def _write_due(d: _Direction, now: float) -> None:
    """Write what is due (without blocking), in order; an end of stream shuts ``dst`` for writing."""
    while not d.closed:
        if not d.writing:
            if not d.waiting or d.waiting[0][0] > now:
                return
            _, data = d.waiting.popleft()
            d.queued -= len(data)
            if not data:
                try:
                    d.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                d.closed = True
                return
            d.writing = memoryview(data)
        try:
            sent = d.dst.send(d.writing)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            d.closed, d.eof = True, True
            return
        d.writing = d.writing[sent:]


class DelayProxy:
    """The proxy; ``serve_forever`` accepts and pipes connections until ``close``."""

    def __init__(self, target: tuple[str, int], delay_ms: float, listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.target = target
        self.delay = max(0.0, delay_ms) / 1000.0
        self.server = socket.create_server(listen)
        self.address = self.server.getsockname()[:2]
        self._closed = False

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _pipe_both(client, upstream, self.delay)
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass

    def start(self) -> "DelayProxy":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        self.server.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to each chunk, ms")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: pick one)")
    parser.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin closes (parent gone)")
    args = parser.parse_args(argv)
    if args.exit_with_stdin:
        threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    proxy = DelayProxy(_hostport(args.target), args.delay_ms, _hostport(args.listen))
    host, port = proxy.address
    print(f"delay proxy listening on {host}:{port} -> {args.target} (one-way {args.delay_ms:g} ms)", flush=True)
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
