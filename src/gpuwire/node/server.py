"""``gpuwire serve``: the node's TCP server.

Sits at the I/O edge of the node: it accepts connections, runs the handshake, and feeds the
bytes of each connection through a sans-IO ``protocol.Connection`` into that connection's
``Session``; replies go back with scatter-gather writes (bulk bytes are never joined).
One thread per connection; ops of all sessions run one batch at a time on the device.
A session's failure (bad input, protocol error, dropped client) ends only that session.
"""

from __future__ import annotations

import hmac
import ssl
import logging
import socket
import threading
import time
from time import perf_counter

from .. import __version__
from .._io import send_parts
from ..protocol import CLOSED, NEED_DATA, Connection, Limits, ProtocolError, Role, check_hello
from ..protocol.events import Goodbye, Hello, Reject, Welcome
from .backend import Backend
from .ops import OpTable
from .scheduler import FairScheduler
from .session import RngOwner, Session

log = logging.getLogger("gpuwire.node")

RECV_BYTES = 1 << 20


class NodeServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 7070, *, backend: Backend | None = None,
                 token: str | None = None, limits: Limits | None = None, max_sessions: int = 64,
                 handshake_timeout: float = 10.0, idle_timeout: float | None = None,
                 session_memory: int | None = None, tls=None):
        self.host = host
        self.port = port
        self.backend = backend or Backend.select("auto")
        self.token = token
        self.limits = limits or Limits()
        self.max_sessions = max_sessions
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.session_memory = session_memory
        self.tls = tls  # ssl.SSLContext for the data plane, or None (plain TCP)
        self.token_verifier = None  # pool mode: verify(token) -> lease claims (gpuwire.pool.agent)
        # a session outlives its token's expiry by this much: a pool restart pauses renewals,
        # and running jobs must not notice
        self.lease_grace = 30.0
        self._sockets: dict[str, socket.socket] = {}
        self.rng = RngOwner(self.backend)
        self.scheduler = FairScheduler()
        self.quantum = 0.005  # seconds of device time a session runs before the scheduler may switch
        self.ops = OpTable()
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closing = threading.Event()
        self._threads: set[threading.Thread] = set()
        self.started = time.monotonic()
        self._utilization_mark = (self.started, 0.0)

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        return self.host, self.port

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        self._start_reaper()
        listener = self._listener
        while not self._closing.is_set():
            try:
                sock, addr = listener.accept()
            except OSError:
                if self._closing.is_set():
                    break
                raise
            thread = threading.Thread(target=self._serve_connection, args=(sock, addr), daemon=True,
                                      name=f"gpuwire-session-{addr[0]}:{addr[1]}")
            self._threads.add(thread)
            thread.start()

    def start_background(self) -> threading.Thread:
        if self._listener is None:
            self.bind()
        thread = threading.Thread(target=self.serve_forever, daemon=True, name="gpuwire-accept")
        thread.start()
        return thread

    def _start_reaper(self) -> None:
        if not getattr(self, "_reaper_started", False):
            self._reaper_started = True
            threading.Thread(target=self._reap_expired_leases, daemon=True, name="gpuwire-lease-reaper").start()

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass

    def node_info(self) -> dict:
        """What `gpuwire smi` / nvidia-smi show: the device, its use, and every session."""
        now = time.monotonic()
        mark_time, mark_busy = self._utilization_mark
        elapsed = now - mark_time
        busy = self.scheduler.busy_seconds
        utilization = min(100.0, 100.0 * (busy - mark_busy) / elapsed) if elapsed > 0 else 0.0
        self._utilization_mark = (now, busy)
        with self._lock:
            sessions = [{"id": s.id, "peer": s.peer, "pid": s.client_pid, "client_version": s.client_version,
                         "bytes_in_use": s.bytes_in_use, "peak_bytes": s.peak_bytes, "ops": s.ops_run,
                         "share": s.share, "device_seconds": round(s.device_seconds, 4),
                         "memory_budget": s.memory_budget}
                        for s in self.sessions.values()]
        return {"device": self.backend.describe(), "server_version": __version__, "utilization": round(utilization, 1),
                "bytes_in_use": sum(s["bytes_in_use"] for s in sessions), "sessions": sessions,
                "uptime_s": round(now - self.started, 1)}

    # ------------------------------------------------------------ one connection

    def _serve_connection(self, sock: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        session = Session(self.backend, self.rng, self.ops, peer=peer)
        session.node_info = self.node_info
        session.memory_budget = self.session_memory
        session.token_verifier = self.token_verifier
        conn = Connection(Role.SERVER, limits=self.limits, ext_hook=session.ext_hook,
                          payload_sink=session.payload_sink)
        registered = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.handshake_timeout)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    log.warning("TLS handshake with %s failed: %s", peer, exc)
                    return
            hello = self._read_hello(sock, conn)
            if hello is None:
                return
            refusal = self._refusal(hello) or self._admit_lease(hello, session)
            if refusal is None:
                with self._lock:
                    if len(self.sessions) >= self.max_sessions:
                        refusal = f"node is full ({self.max_sessions} sessions); try again later or use another node"
                    else:
                        self.sessions[session.id] = session
                        self._sockets[session.id] = sock
                        registered = True
            if refusal is not None:
                log.warning("refused session from %s: %s", peer, refusal)
                sock.sendall(conn.send(Reject(reason=refusal, server_version=__version__)))
                return
            sock.sendall(conn.send(Welcome(server_version=__version__, capabilities=["sync-ops"],
                                           session_id=session.id, device=self.backend.describe(),
                                           limits={**self.limits.as_dict(),
                                                   "memory_budget": session.memory_budget})))
            pid = hello.options.get("pid") if isinstance(hello.options, dict) else None
            session.client_pid = pid if isinstance(pid, int) else 0
            session.client_version = hello.client_version
            share = hello.options.get("share") if isinstance(hello.options, dict) else None
            if session.lease_id is None and isinstance(share, (int, float)) and 0 < share <= 1:
                session.share = float(share)  # standalone nodes trust the client; pool leases set it
            log.info("session %s opened from %s (client %s)", session.id, peer, hello.client_version)
            sock.settimeout(self.idle_timeout)
            self._session_loop(sock, conn, session)
        except ProtocolError as exc:
            log.warning("session %s from %s dropped: protocol error: %s", session.id, peer, exc)
        except (ConnectionError, socket.timeout, OSError) as exc:
            log.info("session %s from %s ended: %s", session.id, peer, exc)
        except Exception:  # noqa: BLE001 - a bug must not take the node down
            log.exception("session %s from %s failed", session.id, peer)
        finally:
            if registered:
                with self._lock:
                    self.sessions.pop(session.id, None)
                    self._sockets.pop(session.id, None)
                log.info("session %s closed: freed %d bytes in %d storages after %d ops", session.id,
                         session.bytes_in_use, len(session.storages), session.ops_run)
            session.close()
            try:
                sock.close()
            except OSError:
                pass
            self._threads.discard(threading.current_thread())

    def _read_hello(self, sock: socket.socket, conn: Connection) -> Hello | None:
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                data = sock.recv(65536)
                conn.receive_data(data)
                continue
            if event is CLOSED:
                return None
            return event

    def _admit_lease(self, hello: Hello, session: Session) -> str | None:
        """In pool mode a session needs a valid lease token; its claims set the session's memory
        budget and compute share, and its expiry ends the session (unless refreshed)."""
        if self.token_verifier is None:
            return None
        try:
            claims = self.token_verifier(hello.token or "")
        except Exception as exc:  # noqa: BLE001 - TokenError and friends: the reason goes to the client
            return f"lease token refused: {exc}"
        if int(claims.get("device", -1)) != (self.backend.device.index or 0):
            return f"lease token is for device {claims.get('device')}, this node serves device {self.backend.device.index or 0}"
        memory = int(claims.get("memory") or 0)
        total = int(self.backend.describe().get("total_memory") or 0)
        if total and memory > total:
            return f"lease token claims {memory} bytes, more than this device has ({total})"
        session.apply_lease(claims)
        return None

    def _reap_expired_leases(self) -> None:
        """Ends sessions whose lease expired (frees their memory), once a second."""
        while not self._closing.wait(1.0):
            now = time.time()
            with self._lock:
                expired = [(s, self._sockets.get(s.id)) for s in self.sessions.values()
                           if s.lease_expiry is not None and now > s.lease_expiry + self.lease_grace]
            for session, sock in expired:
                log.warning("session %s: lease %s expired; ending the session", session.id, session.lease_id)
                session.ended_reason = f"lease {session.lease_id} expired"
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _refusal(self, hello: Hello) -> str | None:
        try:
            check_hello(hello, __version__)
        except ProtocolError as exc:
            return str(exc)
        if self.token is not None:
            offered = hello.token or ""
            if not hmac.compare_digest(offered.encode(), self.token.encode()):
                return "invalid or missing token for this node (set GPUWIRE_TOKEN or pass --token)"
        return None

    def _session_loop(self, sock: socket.socket, conn: Connection, session: Session) -> None:
        handle = session.handle
        next_event = conn.next_event
        turn = self.scheduler.turn
        quantum = self.quantum
        starved = True
        while True:
            if starved:
                conn.buffer_updated(sock.recv_into(conn.get_buffer(RECV_BYTES)))
            replies = []
            closing = False
            starved = False
            with turn(session):  # run what arrived when the fair scheduler says so, a quantum at most
                deadline = perf_counter() + quantum
                while True:
                    event = next_event()
                    if event is NEED_DATA:
                        starved = True
                        break
                    if event is CLOSED or type(event) is Goodbye:
                        closing = True
                        break
                    reply = handle(event)
                    if reply is not None:
                        replies.extend(conn.send_parts(reply))
                    if perf_counter() > deadline:
                        break  # let other sessions run; the rest of this batch waits its next turn
            if replies:
                send_parts(sock, replies)
            if closing:
                return
