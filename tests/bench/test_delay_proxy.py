"""The latency benchmark's delay proxy (bench/delay_proxy.py): real sockets on loopback, an echo
server behind the proxy. What the benchmark relies on: every byte arrives, in order, both ways
at once; each direction adds the configured delay (no less, and not much more); an end of
stream passes through."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from bench.delay_proxy import DelayProxy


class EchoServer:
    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def close(self):
        self.server.close()


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def _through(proxy):
    sock = socket.create_connection(proxy.address, timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _round_trip(sock) -> float:
    t0 = time.perf_counter()
    sock.sendall(b"x")
    assert sock.recv(1) == b"x"
    return time.perf_counter() - t0


@pytest.mark.parametrize("one_way_ms", [0.0, 10.0])
def test_a_round_trip_takes_twice_the_delay(echo, one_way_ms):
    proxy = DelayProxy(echo.address, one_way_ms).start()
    try:
        with _through(proxy) as sock:
            _round_trip(sock)
            times = sorted(_round_trip(sock) for _ in range(15))
        median = times[len(times) // 2]
        assert median >= 2 * one_way_ms / 1000
        # (a loaded 2-core machine: the bound is loose, the delay must dominate at 10 ms)
        assert median < 2 * one_way_ms / 1000 + 0.02
    finally:
        proxy.close()


def test_bytes_stream_both_ways_at_once_in_order_and_the_end_passes_through(echo):
    """4 MiB sent while the echo comes back (a writer that waited for its reader would stall
    both sides once the socket buffers fill), then the sender's end of stream reaches the echo
    server, whose end comes back."""
    proxy = DelayProxy(echo.address, 2.0).start()
    payload = os.urandom(4 << 20)
    received = bytearray()
    try:
        with _through(proxy) as sock:
            def read_all():
                while data := sock.recv(1 << 16):
                    received.extend(data)
            reader = threading.Thread(target=read_all)
            reader.start()
            view = memoryview(payload)
            for start in range(0, len(payload), 100_000):
                sock.sendall(view[start:start + 100_000])
            sock.shutdown(socket.SHUT_WR)
            reader.join(30)
            assert not reader.is_alive(), "the echo's end of stream did not come back through the proxy"
        assert bytes(received) == payload
    finally:
        proxy.close()


def test_chunks_keep_their_spacing(echo):
    """A chunk sent 30 ms after another arrives ~30 ms after it: the delay is added to each chunk,
    not to the queue (streaming, as a link)."""
    proxy = DelayProxy(echo.address, 20.0).start()
    try:
        with _through(proxy) as sock:
            t0 = time.perf_counter()
            sock.sendall(b"a")
            time.sleep(0.03)
            sock.sendall(b"b")
            assert sock.recv(1) == b"a"
            first = time.perf_counter() - t0
            assert sock.recv(1) == b"b"
            second = time.perf_counter() - t0
        assert first >= 0.04 and second >= 0.07
        assert second - first < 0.05  # not 40 ms after the first: the two delays overlapped
    finally:
        proxy.close()
