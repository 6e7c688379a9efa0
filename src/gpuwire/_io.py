"""Socket helpers shared by the client runtime and the node server (the I/O edge)."""

from __future__ import annotations

import socket


def send_parts(sock: socket.socket, parts: list) -> int:
    """Write every buffer in ``parts`` (bytes, bytearrays, memoryviews) with scatter-gather
    ``sendmsg``, never joining them, so bulk payloads are not copied. Returns bytes sent."""
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
