"""Socket helpers shared by the client runtime and the node server (the I/O edge)."""

from __future__ import annotations

import socket

from .protocol import CLOSED, NEED_DATA


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 where the host has a colon; port 0 picks a
    free one). Raises what ``bind`` raises; nothing is left open on failure."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def dial(host: str, port: int, timeout: float, tls=None) -> socket.socket:
    """A TCP connection (TLS over it with ``tls``, an ``ssl.SSLContext``), TCP_NODELAY set.
    Raises what the socket raises; nothing is left open on failure."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def read_event(sock: socket.socket, conn, peer: str = "the peer"):
    """Block until ``conn`` (a ``protocol.Connection``) yields an event; ConnectionError if
    ``peer`` closes first. For handshakes and other one-off exchanges, not the hot path."""
    while True:
        event = conn.next_event()
        if event is CLOSED:
            raise ConnectionError(f"{peer} closed the connection")
        if event is not NEED_DATA:
            return event
        conn.receive_data(sock.recv(1 << 16))


JOIN_BELOW = 1 << 20


def send_parts(sock: socket.socket, parts: list) -> int:
    """Write every buffer in ``parts`` (bytes, bytearrays, memoryviews) with scatter-gather
    ``sendmsg``, never joining them, so bulk payloads are not copied. Returns bytes sent.
    A batch of small frames (all ``bytes``, less than ``JOIN_BELOW`` in all: the client's
    command queue) is joined and written with one ``sendall``: cheaper than a memoryview per
    frame, and the copy is small."""
    total = 0
    for part in parts:
        if part.__class__ is not bytes:
            break
        total += len(part)
    else:
        if total < JOIN_BELOW:
            sock.sendall(b"".join(parts) if len(parts) > 1 else parts[0] if parts else b"")
            return total
    views = []
    for part in parts:
        view = memoryview(part)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes:
            views.append(view)
    total = 0
    if not hasattr(sock, "sendmsg") or getattr(sock, "_sslobj", None) is not None:
        for view in views:  # TLS sockets have no scatter-gather write
            sock.sendall(view)
            total += view.nbytes
        return total
    while views:
        sent = sock.sendmsg(views[:512])
        total += sent
        while sent:
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
    return total
