"""``gpuwire serve``: the node's TCP server.

Sits at the I/O edge of the node: it accepts connections, runs the handshake, and feeds the
bytes of each connection through a sans-IO ``protocol.Connection`` into that connection's
``Session``; replies go back with scatter-gather writes (bulk bytes are never joined).
One thread per connection; ops of all sessions run one batch at a time on the device.
A session's failure (bad input, protocol error, dropped client) ends only that session.
"""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import os
import secrets
import select
import ssl
import socket
import threading
import time
from time import perf_counter

from .. import __version__
from .._io import listen, send_parts
from ..protocol import CLOSED, NEED_DATA, Connection, Limits, ProtocolError, Role, StreamCut, check_hello
from ..protocol.events import Data, Goodbye, Hello, Notice, Read, Reject, Welcome
from . import loop as node_loop
from . import native as node_native
from .backend import Backend
from .ops import OpTable
from .scheduler import FairScheduler
from .session import RngOwner, Session

log = logging.getLogger("gpuwire.node")

RECV_BYTES = 1 << 20


def warnings_notice(kept: list, dropped: int) -> Notice:
    """What a session's kernels warned since its last reply (``native.take_warnings``: the first
    64, and how many more it did not keep), for its client to warn its program of."""
    return Notice(kind="warnings", data={
        "warnings": [["DeprecationWarning" if is_deprecation else "UserWarning", text] for is_deprecation, text in kept],
        "dropped": dropped})


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _profiled(serve, directory: str, sock, addr) -> None:
    """A session's thread under cProfile (GPUWIRE_PROFILE_SESSIONS=DIR, a developer's tool): its
    statistics go to DIR/session-<client port>.prof when the session ends."""
    import cProfile
    profiler = cProfile.Profile()
    try:
        profiler.runcall(serve, sock, addr)
    finally:
        path = os.path.join(directory, f"session-{addr[1]}.prof")
        profiler.dump_stats(path + ".partial")
        os.replace(path + ".partial", path)  # whole, or not there: a reader polls for it


def _kernels_traced(serve, directory: str, sock, addr) -> None:
    """A session under torch.profiler's CUDA activity (GPUWIRE_PROFILE_KERNELS=DIR, a developer's
    tool: ``bench.gpu_timeline``): the device's kernels, copies and the launches behind them go
    to DIR/session-<client port>.trace.json, a Chrome trace, when the session ends. The host's
    own ops are not recorded on a GPU: that would slow every launch the trace is meant to time (a
    node with no GPU records them instead, which exercises the tool)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    if os.environ.get("GPUWIRE_PROFILE_KERNELS_CPU") and ProfilerActivity.CPU not in activities:
        activities.append(ProfilerActivity.CPU)  # which host op launched each kernel (timings skewed)
    with profile(activities=activities) as recording:
        serve(sock, addr)
    path = os.path.join(directory, f"session-{addr[1]}.trace.json")
    recording.export_chrome_trace(path + ".partial")
    os.replace(path + ".partial", path)


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
        self.frame_timeout = 60.0  # most seconds one command may take to arrive once it started
        self.max_resume_grace = 120.0  # longest a durable session waits for its client to reconnect
        self.draining: dict | None = None  # {"reason", "deadline"} while the pool drains this node
        # why this node's previous process ended, where its supervisor restarted it (the embedded
        # node's parent: ``GPUWIRE_NODE_RESTARTED_AFTER``): said to clients that ask to resume
        self.restarted_after: str | None = None
        self._sockets: dict[str, socket.socket] = {}
        self.rng = RngOwner(self.backend)
        self.scheduler = FairScheduler()
        self.quantum = 0.005  # seconds of device time a session runs before the scheduler may switch
        self.ops = OpTable(self.backend.kind)
        node_native.install()  # (before any session: each takes the C++ helpers or Python's for life)
        log.info("per-op helpers: %s; op loop: %s", node_native.status(), node_loop.status())
        self.sessions: dict[str, Session] = {}
        # why the node ended recent durable sessions (id -> (resume key, reason)): the client
        # often learns of the end by a failed send, not by the Goodbye, and asks to resume
        self._ended_reasons: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closing = threading.Event()
        self._threads: set[threading.Thread] = set()
        self.started = time.monotonic()
        self._utilization_mark = (self.started, 0.0)

    # ------------------------------------------------------------ lifecycle

    def adopt_listener(self, fd: int) -> tuple[str, int]:
        """Serve on a listening socket this process inherited (file descriptor ``fd``): the
        embedded node's parent binds it, so its program can connect while the node still
        starts (the kernel queues the connection; the handshake waits for the node)."""
        listener = socket.socket(fileno=fd)
        listener.listen(128)
        self._listener = listener
        self.host, self.port = listener.getsockname()[:2]
        return self.host, self.port

    def bind(self) -> tuple[str, int]:
        listener = listen(self.host, self.port)
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
            serve = self._serve_connection
            for variable, wrapper in (("GPUWIRE_PROFILE_SESSIONS", _profiled),
                                      ("GPUWIRE_PROFILE_KERNELS", _kernels_traced)):
                if os.environ.get(variable):
                    serve = functools.partial(wrapper, serve, os.environ[variable])
            thread = threading.Thread(target=serve, args=(sock, addr), daemon=True,
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
                "uptime_s": round(now - self.started, 1), "helpers": node_native.status(), "op_loop": node_loop.status(),
                "op_loop_frames": node_loop.module.stats() if node_loop.module is not None else {}}

    # ------------------------------------------------------------ one connection

    def _serve_connection(self, sock: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        conn = Connection(Role.SERVER, limits=self.limits)
        session: Session | None = None
        registered = False
        ended_cleanly = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)  # a silent peer whose host died is found in about 90 s
            deadline = time.monotonic() + self.handshake_timeout  # overall: a slow-loris gets no slot
            sock.settimeout(self.handshake_timeout)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    log.warning("TLS handshake with %s failed: %s", peer, exc)
                    return
            hello = self._read_hello(sock, conn, deadline)
            if hello is None:
                return
            options = hello.options if isinstance(hello.options, dict) else {}
            refusal = self._refusal(hello)
            resume = options.get("resume")
            if refusal is None and resume is not None:
                session, refusal = self._take_over(resume, hello)
                registered = session is not None
            elif refusal is None:
                session = Session(self.backend, self.rng, self.ops, peer=peer)
                refusal = self._admit_lease(hello, session)
                if refusal is None:
                    with self._lock:
                        if len(self.sessions) >= self.max_sessions:
                            refusal = (f"node is full ({self.max_sessions} sessions); try again later or use "
                                       "another node")
                        else:
                            self.sessions[session.id] = session
                            registered = True
            if refusal is not None:
                log.warning("refused session from %s: %s", peer, refusal)
                sock.sendall(conn.send(Reject(reason=refusal, server_version=__version__)))
                return
            resumed = resume is not None
            if not resumed:
                self._configure(session, hello, options)
            # (old clients take every Notice for a drain notice: only those that asked get warnings)
            session.forward_warnings = (isinstance(hello.capabilities, list) and "warnings" in hello.capabilities
                                        and node_native.module is not None)
            if session.forward_warnings:
                node_native.module.keep_warnings()  # (this thread runs the session's kernels)
            session.peer = peer
            session.parked_until = None
            self._sockets[session.id] = sock
            conn.bind(ext_hook=session.decode_hook, payload_sink=session.payload_sink, op_runner=session.op_runner,
                      op_frames_runner=session.op_frames_runner)
            session.conn = conn
            if resumed:
                conn.continue_decoding_from(session.peer_op_names)
                session.replay_floor = session.applied_seq
            welcome = Welcome(server_version=__version__, capabilities=["sync-ops", "resume", "warnings"],
                              session_id=session.id, device=self.backend.describe(),
                              limits={**self.limits.as_dict(), "memory_budget": session.memory_budget,
                                      "idle_timeout": self.idle_timeout},
                              resume={"key": session.resume_key, "resumed": resumed,
                                      "last_seq": session.applied_seq} if session.resume_key else {})
            parts = conn.send_parts(welcome)
            if resumed:  # replies the client never got (the connection broke before they arrived)
                awaiting = set(resume.get("awaiting") or ()) if isinstance(resume, dict) else set()
                for reply in session.recent_replies:
                    if reply.seq in awaiting or getattr(reply, "reply_to", -1) in awaiting:
                        parts.extend(conn.send_parts(reply))
            send_parts(sock, parts)
            log.info("session %s %s from %s (client %s)", session.id, "resumed" if resumed else "opened", peer,
                     session.client_version)
            sock.settimeout(self.idle_timeout)
            ended_cleanly = self._session_loop(sock, conn, session)
        except StreamCut as exc:  # a cut connection, not bad input: a durable session waits for its client
            log.info("session %s from %s ended: %s", session and session.id, peer, exc)
        except ProtocolError as exc:
            log.warning("session %s from %s dropped: protocol error: %s", session and session.id, peer, exc)
            self._end_with_goodbye(sock, conn, session if registered else None, f"protocol error: {exc}")
        except (ConnectionError, socket.timeout, OSError) as exc:
            log.info("session %s from %s ended: %s", session and session.id, peer, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must not take the node down
            log.exception("session %s from %s failed", session and session.id, peer)
            self._end_with_goodbye(sock, conn, session if registered else None,
                                   f"internal error of the node ({type(exc).__name__}: {exc}); its log has the "
                                   "traceback: please report it")
        finally:
            if registered:
                self._detach(session, conn, ended_cleanly)
            try:
                sock.close()
            except OSError:
                pass
            self._threads.discard(threading.current_thread())

    @staticmethod
    def _end_with_goodbye(sock, conn: Connection, session: Session | None, reason: str) -> None:
        """End ``session`` instead of parking it for a resume: a resumed client would send the same
        frame again and meet the same failure, forever. Say why, so the client's error names it."""
        if session is None:
            return
        session.ended_reason = reason
        try:
            send_parts(sock, conn.send_parts(Goodbye(reason=reason[:400])))
        except Exception:  # noqa: BLE001 - best effort: the session ends either way
            pass

    def _configure(self, session: Session, hello: Hello, options: dict) -> None:
        session.node_info = self.node_info
        session.migrate_hook = self._migrate
        session.drain_notice = self.draining
        if session.memory_budget is None:
            session.memory_budget = self.session_memory
        session.token_verifier = self.token_verifier
        pid = options.get("pid")
        session.client_pid = pid if isinstance(pid, int) else 0
        session.client_version = hello.client_version
        share = options.get("share")
        if session.lease_id is None and isinstance(share, (int, float)) and 0 < share <= 1:
            session.share = float(share)  # standalone nodes trust the client; pool leases set it
        durable = options.get("durable")
        if isinstance(durable, (int, float)) and durable > 0:
            session.resume_key = secrets.token_hex(16)
            session.resume_grace = min(float(durable), self.max_resume_grace)

    def _take_over(self, resume, hello: Hello) -> tuple[Session | None, str | None]:
        """A client reconnects to its durable session (after a network cut, or to one a draining
        node moved here): check the key, detach the old connection, hand the session over."""
        unknown = "unknown session: it expired, was moved, or the node restarted (rebuild it)"
        if self.restarted_after:
            unknown = f"unknown session: the node restarted after {self.restarted_after}; its sessions were lost with it"
        if not isinstance(resume, dict) or not isinstance(resume.get("session"), str):
            return None, "malformed resume request"
        with self._lock:
            session = self.sessions.get(resume["session"])
        key = resume.get("key")
        if session is None or session.ended_reason:
            resume_key, reason = (session.resume_key, session.ended_reason) if session is not None else \
                self._ended_reasons.get(resume["session"], (None, None))
            if reason and resume_key and isinstance(key, str) \
                    and hmac.compare_digest(key.encode(), resume_key.encode()):
                return None, f"unknown session: the node ended it: {reason}"
            return None, unknown
        if session.resume_key is None or not isinstance(key, str) \
                or not hmac.compare_digest(key.encode(), session.resume_key.encode()):
            return None, unknown
        if self.token_verifier is not None:
            try:
                claims = self.token_verifier(hello.token or "")
            except Exception as exc:  # noqa: BLE001
                return None, f"lease token refused: {exc}"
            if claims.get("lease") != session.lease_id:
                return None, "lease token is for another lease than the session's"
            session.lease_expiry = float(claims["exp"]) if claims.get("exp") else session.lease_expiry
        old = self._sockets.get(session.id)
        if session.attached.is_set() and old is not None:
            # the old connection is half-open, or its client gave up on it (an interrupt mid-message)
            # while the session works through a long queue: end it at its next batch boundary
            session.taking_over = True
            try:
                old.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # (well inside the client's 5 s handshake timeout: a refusal that arrives is a node alive and
        # busy, which the client waits for; a timeout reads as a node gone)
        if not session.detached.wait(2.0):
            return None, "the session is still attached to another connection (it is running a command); retry"
        session.taking_over = False
        session.detached.clear()
        session.attached.set()
        return session, None

    def _detach(self, session: Session, conn: Connection, ended_cleanly: bool) -> None:
        """A connection ended: a durable session waits (parked) for its client to come back;
        any other session is closed and its memory freed."""
        park = (not ended_cleanly and session.resume_key is not None and not session.ended_reason
                and not self._closing.is_set())
        if park:
            session.peer_op_names = conn.peer_op_names
            session.parked_until = time.monotonic() + session.resume_grace
            log.info("session %s parked for %.0f s: its client may reconnect", session.id, session.resume_grace)
        else:
            self._close_session(session)
        session.attached.clear()
        session.detached.set()

    def _close_session(self, session: Session) -> None:
        with self._lock:
            if self.sessions.get(session.id) is not session:
                return
            self.sessions.pop(session.id, None)
            self._sockets.pop(session.id, None)
            if session.ended_reason and session.resume_key:
                self._ended_reasons[session.id] = (session.resume_key, session.ended_reason)
                while len(self._ended_reasons) > 256:
                    self._ended_reasons.popitem(last=False)
        log.info("session %s closed: freed %d bytes in %d storages after %d ops", session.id,
                 session.bytes_in_use, len(session.storages), session.ops_run)
        session.close()

    def _read_hello(self, sock: socket.socket, conn: Connection, deadline: float) -> Hello | None:
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout(f"no handshake within {self.handshake_timeout:g} s")
                sock.settimeout(remaining)
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
        """Ends sessions whose lease expired and parked sessions whose client did not come back
        (frees their memory), once a second."""
        while not self._closing.wait(1.0):
            now = time.time()
            with self._lock:
                abandoned = [s for s in self.sessions.values()
                             if s.parked_until is not None and time.monotonic() > s.parked_until]
            for session in abandoned:
                log.warning("session %s: its client did not reconnect within %.0f s; freeing it",
                            session.id, session.resume_grace)
                self._close_session(session)
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

    # ------------------------------------------------------------ drain, stale leases, migration

    def set_draining(self, reason: str | None, deadline: float | None = None) -> None:
        """While draining, every reply to a request is preceded by a drain Notice: each client
        moves its session away at its next sync point. ``deadline`` (unix time): sessions still
        here then are ended (clients with checkpoints rebuild elsewhere)."""
        if reason is None:
            self.draining = None
        else:
            self.draining = {"reason": reason, "deadline": deadline}
        with self._lock:
            for session in self.sessions.values():
                session.drain_notice = self.draining
        if reason is not None and deadline is not None:
            self._start_drain_deadline(deadline)

    def _start_drain_deadline(self, deadline: float) -> None:
        def enforce() -> None:
            while not self._closing.wait(0.5):
                if self.draining is None:
                    return
                if time.time() >= deadline:
                    with self._lock:
                        left = list(self.sessions.values())
                    for session in left:
                        self.end_session(session, "the node was drained and the drain deadline passed")
                    return
        threading.Thread(target=enforce, daemon=True, name="gpuwire-drain-deadline").start()

    def end_session(self, session: Session, reason: str) -> None:
        """End a session now (drain deadline, a lease the pool moved elsewhere) and free its memory."""
        log.warning("session %s: %s", session.id, reason)
        session.ended_reason = reason
        sock = self._sockets.get(session.id)
        if session.parked_until is not None or sock is None:
            self._close_session(session)
        else:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def keep_only_leases(self, lease_ids: set[str], admitted_before: float | None = None) -> int:
        """The pool says which leases live on this node; sessions of any other lease are stale
        (the pool declared this node dead and moved them) and are ended. Sessions admitted after
        the pool was asked are left alone (their lease may be newer than the answer)."""
        if self.draining is not None:
            return 0  # draining: sessions leave by moving (their lease moves first) or at the deadline
        with self._lock:
            stale = [s for s in self.sessions.values() if s.lease_id is not None and s.lease_id not in lease_ids
                     and (admitted_before is None or s.created < admitted_before)]
        for session in stale:
            self.end_session(session, f"lease {session.lease_id} no longer lives on this node")
        return len(stale)

    def _migrate(self, session: Session, address: str, token: str | None) -> dict:
        from ..security.tls import client_context_from_env
        from .migrate import push_session

        # runs in the session's own turn: the session is quiesced (its client waits for this reply)
        result = push_session(session, address, token, tls_context=client_context_from_env())
        session.ended_reason = f"moved to {address}"
        return result

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

    def _receive_payload(self, sock: socket.socket, conn: Connection, frame_started: float) -> None:
        """The rest of a large payload, received straight into its destination back to back:
        a pass through the session loop (scheduler, event decoding) between two chunks let the
        node fall ~300 us behind a 1 MiB upload. A frame still has ``frame_timeout`` to finish;
        an end of stream is left to the session loop, which reports the payload cut short."""
        frame_timeout = self.frame_timeout
        sock.settimeout(frame_timeout)
        while conn.payload_remaining:
            if frame_timeout is not None and time.monotonic() - frame_started > frame_timeout:
                raise socket.timeout(f"a command took more than {frame_timeout:.0f} s to arrive")
            received = sock.recv_into(conn.get_buffer(RECV_BYTES))
            conn.buffer_updated(received)
            if not received:
                return

    def _session_loop(self, sock: socket.socket, conn: Connection, session: Session) -> bool:
        """Serve one connection of a session; True when the client said Goodbye."""
        handle = session.handle
        next_event = conn.next_event
        turn = self.scheduler.turn
        quantum = self.quantum
        idle_timeout = self.idle_timeout
        frame_timeout = self.frame_timeout
        timeout_now = sock.gettimeout()
        recent = session.recent_replies
        take_warnings = node_native.module.take_warnings if session.forward_warnings else None
        # set before this loop and by no one while it runs (a take-over waits for it to end)
        replay_floor = session.replay_floor
        starved = True
        last_event = time.monotonic()
        # when the first bytes of a command not yet complete arrived: a command has
        # ``frame_timeout`` to finish from there (from the last complete one, a session idle for
        # longer than that was dropped as soon as a command reached it in two pieces)
        frame_started = None
        arrived = select.poll()  # (not select.select: a busy node's descriptors pass 1024)
        arrived.register(sock, select.POLLIN)
        while True:
            if session.taking_over:
                raise ConnectionError("its client reconnected: the session goes on there")
            if starved:
                if session.has_dying and not arrived.poll(0):
                    session.bury()  # nothing to run: deallocate what the last Free let go of now
                # a frame that started must finish within frame_timeout: bytes trickling in
                # without ever completing a command do not hold a slot
                wait = frame_timeout if conn.mid_frame else idle_timeout
                if wait != timeout_now:
                    sock.settimeout(wait)
                    timeout_now = wait
                received = sock.recv_into(conn.get_buffer(RECV_BYTES))
                conn.buffer_updated(received)
                now = time.monotonic()
                if conn.mid_frame and frame_started is None:
                    frame_started = now
                if received and conn.payload_remaining:
                    self._receive_payload(sock, conn, frame_started)
                    timeout_now = frame_timeout
                    now = time.monotonic()
                quiet = now - last_event
                if idle_timeout is not None and quiet > idle_timeout:
                    raise socket.timeout(f"no complete command for {quiet:.0f} s")
                if conn.mid_frame and frame_timeout is not None and now - frame_started > frame_timeout:
                    raise socket.timeout(f"a command took more than {frame_timeout:.0f} s to arrive")
            replies = []
            closing = False
            starved = False
            handled = False
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
                    handled = True
                    cls = type(event)
                    seq = event.seq
                    if seq <= replay_floor and seq and cls is not Read:
                        continue  # resent after a reconnect, but this node already ran it
                    reply = handle(event)
                    if seq > session.applied_seq:
                        session.applied_seq = seq
                    if reply is not None:
                        if session.drain_notice is not None:
                            replies.extend(conn.send_parts(Notice(kind="drain", data=session.drain_notice)))
                        if take_warnings is not None:
                            said = take_warnings()
                            if said is not None:
                                replies.extend(conn.send_parts(warnings_notice(*said)))
                        if type(reply) is not Data:
                            recent.append(reply)
                        replies.extend(conn.send_parts(reply))
                    if perf_counter() > deadline:
                        break  # let other sessions run; the rest of this batch waits its next turn
            if handled:
                last_event = time.monotonic()
                # (a command that began in the bytes just read starts its clock now)
                frame_started = last_event if conn.mid_frame else None
            if replies:
                send_parts(sock, replies)
            if closing:
                return event is not CLOSED
