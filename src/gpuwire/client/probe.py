"""Opening a session with a node, without torch: the address, the dial (TLS as the environment
says) and the gpuwire handshake, each failure told as what to fix.

Sits under ``client/runtime.py``, which opens every session of a program through these, and
serves on its own the commands that only ask a node who it is before anything runs: ``gpuwire
run``'s check of ``--node`` and ``gpuwire smi`` / the ``nvidia-smi`` stand-in. Through the runtime
those imported torch for one round trip (2-3 s on a 2-core VM, before the program's own import
of torch even began). What crosses: a socket and ``protocol`` events (Hello, Welcome/Reject,
Query/Result, Goodbye); no tensor.
"""

from __future__ import annotations

import os
import socket
import ssl

from .. import __version__
from .._io import dial, read_event
from ..protocol import Connection, ProtocolError, Role, VersionMismatch
from ..protocol.events import Error, Goodbye, Hello, Query, Reject, Result, Welcome
from .errors import ConnectionLost, NodeUnreachable, RemoteError


def parse_address(address: str, default_port: int = 7070) -> tuple[str, int]:
    text = address.strip()
    for prefix in ("gpuwire://", "tcp://"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":") or str(default_port)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, str(default_port)
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ValueError(f"invalid node address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:7070") from None


def connect_timeout_from_env() -> float:
    return float(os.environ.get("GPUWIRE_CONNECT_TIMEOUT", "10"))


def dial_node(address: str, timeout: float) -> tuple[socket.socket, bool]:
    """A connection to the node at ``address`` and whether it is TLS (``GPUWIRE_TLS_*``);
    NodeUnreachable saying what to check when there is none."""
    from ..security.tls import TLSConfigError, client_context_from_env
    host, port = parse_address(address)
    try:
        tls = client_context_from_env()
    except TLSConfigError as exc:
        raise NodeUnreachable(str(exc)) from None
    try:
        return dial(host, port, timeout, tls), tls is not None
    except ssl.SSLCertVerificationError as exc:
        raise NodeUnreachable(f"the TLS certificate of {address} is not trusted: {exc.verify_message}; "
                              "check GPUWIRE_TLS_CA names the CA that signed the node's certificate") from None
    except ssl.SSLError as exc:
        raise NodeUnreachable(f"TLS with {address} failed: {exc.reason or exc}; is the node serving TLS, "
                              "and does it require a client certificate (GPUWIRE_TLS_CERT/KEY)?") from None
    except socket.timeout:
        raise NodeUnreachable(f"no gpuwire node answered at {address} within {timeout:g} s; "
                              "check the address (GPUWIRE_NODE) and that `gpuwire serve` runs there") from None
    except OSError as exc:
        raise NodeUnreachable(f"cannot connect to a gpuwire node at {address}: {exc.strerror or exc}; "
                              "start one with `gpuwire serve` or fix GPUWIRE_NODE") from None


def handshake(sock: socket.socket, conn: Connection, hello: Hello, address: str, tls: bool, timeout: float,
              next_event) -> Welcome:
    """Send ``hello`` and return the node's Welcome (``next_event()`` reads the reply); the
    socket is closed and NodeUnreachable raised, saying why, when there is none."""
    sock.settimeout(timeout)
    try:
        sock.sendall(conn.send(hello))
        event = next_event()
    except (socket.timeout, TimeoutError):
        sock.close()
        raise NodeUnreachable(f"{address} accepted the connection but did not answer the gpuwire "
                              f"handshake within {timeout:g} s; is it a gpuwire node? (one still starting "
                              "may need longer: GPUWIRE_CONNECT_TIMEOUT=SECONDS)") from None
    except (ProtocolError, ConnectionLost, OSError) as exc:
        sock.close()
        if isinstance(exc, VersionMismatch):
            raise NodeUnreachable(str(exc)) from None
        hint = "" if tls else " (if the node serves TLS, set GPUWIRE_TLS_CA)"
        raise NodeUnreachable(f"{address} is not a gpuwire node (or speaks another protocol){hint}: {exc}") from None
    if isinstance(event, Reject):
        sock.close()
        raise NodeUnreachable(f"node {address} refused the session: {event.reason}")
    return event


class NodeProbe:
    """A short session for asking a node about itself (``with NodeProbe(address) as probe:
    probe.welcome.device``, ``probe.query("node")``); says Goodbye when it closes."""

    def __init__(self, address: str, *, token: str | None = None, timeout: float | None = None):
        self.address = address
        timeout = connect_timeout_from_env() if timeout is None else timeout
        self._sock, tls = dial_node(address, timeout)
        self._conn = Connection(Role.CLIENT)
        self._seq = 0
        hello = Hello(client_version=__version__, token=token, capabilities=["sync-ops"], options={"pid": os.getpid()})
        self.welcome = handshake(self._sock, self._conn, hello, address, tls, timeout, self._next_event)

    def _next_event(self):
        try:
            return read_event(self._sock, self._conn, f"gpuwire node {self.address}")
        except ConnectionError as exc:
            raise ConnectionLost(str(exc)) from None

    def query(self, what: str):
        """The node's answer to ``Query(what)`` ("node": its devices and sessions)."""
        self._seq += 1
        self._sock.sendall(self._conn.send(Query(seq=self._seq, what=what)))
        while True:
            event = self._next_event()
            if type(event) is Result and event.seq == self._seq:
                return event.value
            if type(event) is Error:
                raise RemoteError(f"node {self.address} could not answer {what!r}: {event.message}")

    def close(self) -> None:
        try:
            self._sock.sendall(self._conn.send(Goodbye(reason="probe done")))
        except (OSError, ProtocolError):
            pass
        self._sock.close()

    def __enter__(self) -> "NodeProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
