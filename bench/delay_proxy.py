"""A user-space TCP proxy that adds a fixed one-way delay (netem is not available here).

Listens on loopback and forwards every accepted connection to ``--target``, bytes both
ways. Each chunk read from one side is stamped with ``arrival + delay`` and written to the
other side once that time has come; reading never waits for writing, so data streams (a
chunk read 1 ms after another leaves 1 ms after it) and order is preserved (one FIFO per
direction). RTT added = 2 × ``--delay-ms``. Bandwidth is not limited. Per direction: one
reader thread, one writer thread, a bounded queue (backpressure beyond ``MAX_QUEUED`` chunks).

    python -m bench.delay_proxy --target 127.0.0.1:7070 --delay-ms 5 [--listen 127.0.0.1:0]

prints ``delay proxy listening on HOST:PORT -> TARGET (one-way N ms)`` on stdout first.
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time

from gpuwire._process import exit_when_stdin_closes

CHUNK = 256 << 10
MAX_QUEUED = 1024


def _pipe(src: socket.socket, dst: socket.socket, delay: float, done: threading.Event) -> None:
    q: queue.Queue = queue.Queue(MAX_QUEUED)

    def reader():
        try:
            while True:
                data = src.recv(CHUNK)
                q.put((time.monotonic() + delay, data))
                if not data:
                    return
        except OSError:
            q.put((time.monotonic(), b""))

    def writer():
        try:
            while True:
                due, data = q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=reader, daemon=True).start()
    threading.Thread(target=writer, daemon=True).start()


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
        up_done, down_done = threading.Event(), threading.Event()
        _pipe(client, upstream, self.delay, up_done)
        _pipe(upstream, client, self.delay, down_done)
        up_done.wait()
        down_done.wait()
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
