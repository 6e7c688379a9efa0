"""A TCP proxy that can cut every connection through it, to test reconnects for real.

``CutProxy(target).start()`` forwards a loopback port to ``target``; ``cut(seconds)`` closes
every open connection at once and, for ``seconds``, closes each new one as soon as it is
accepted (what a client sees when a link flaps or a NAT forgets it). Runs in threads of the
test process; ``close()`` stops everything it started.
"""

from __future__ import annotations

import socket
import threading
import time


class CutProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._cut_until = 0.0
        self._closed = False
        self.connections = 0
        self.cuts = 0

    def start(self) -> "CutProxy":
        threading.Thread(target=self._accept, daemon=True, name="cut-proxy").start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self._cut_until:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self, seconds: float = 0.0) -> None:
        """Drop every connection now; refuse new ones for ``seconds``."""
        self._cut_until = time.monotonic() + seconds
        self.cuts += 1
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()
