"""Jobs that survive a lost connection, a lost node, and a drained node.

Sits inside the client runtime (``client.runtime.Runtime`` owns one ``Recovery``): the runtime
calls ``log`` for every command it sends, ``after_request`` at every sync point and ``recover``
when the socket breaks. Nothing crosses to the program: it only waits. See docs/failover.md.

Durability modes (``GPUWIRE_DURABILITY``):

* ``none``: a broken connection raises ``gpuwire.ConnectionLost``.
* ``reconnect`` (default without a pool): the client keeps the commands sent since the last
  sync point; the node keeps a durable session for ``GPUWIRE_RECONNECT_GRACE`` seconds after its
  connection drops. The client reconnects to the same node, learns the last command the node
  applied (sequence numbers), resends only what came after, and gets again the replies it
  missed. Nothing runs twice, nothing is lost.
* ``checkpoint`` (default under ``gpuwire run --pool``): as ``reconnect``, plus a snapshot of
  every live remote tensor, the generator states and the node-id counter taken at a sync point
  every ``GPUWIRE_CHECKPOINT_INTERVAL`` seconds, and the log of every command sent since. When the
  node is gone, the client gets a replacement lease from the pool (or, without a pool, waits for
  the node to come back), uploads the snapshot to a fresh session and replays the log there:
  deterministic kernels give the same tensors, bit for bit, as the run that never failed.

Drain: a node being drained puts a ``Notice`` before its replies; at the end of that request (a
sync point, nothing in flight) the client gets a replacement lease, asks the old node to copy
the session to the new node directly (``migrate:`` query; ``node.migrate``), and resumes it there.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .._io import dial, read_event, send_parts
from ..protocol import ProtocolError
from ..protocol.events import Alloc, Query, Reject, Restore, Write
from . import precision
from .errors import ConnectionLost

MODES = ("none", "reconnect", "checkpoint")
LOG_LIMIT = 1 << 30  # a checkpoint is taken early once the replay log holds this many bytes
CHUNK_BYTES = 16 << 20
MAX_FRUITLESS_RECOVERIES = 3  # connections lost in a row with nothing applied in between


# what a node answers a resume while the session's old connection is still running a command
# (node/server.py ``_take_over``)
STILL_ATTACHED = "still attached to another connection"


def _say(message: str) -> None:
    print(f"gpuwire: {message}", file=sys.stderr, flush=True)


class Recovery:
    def __init__(self, runtime, mode: str, *, grace: float, interval: float):
        if mode not in MODES:
            raise ValueError(f"GPUWIRE_DURABILITY={mode!r}: choose one of {', '.join(MODES)}")
        self.rt = runtime
        self.mode = mode
        self.grace = grace
        self.interval = interval
        self.logging = mode != "none"
        self.notice = None
        self._ready = False
        self._busy = False  # recovering: a failure now is final
        self._nested = False  # taking a checkpoint or moving: no sync-point work inside
        self._log: list[tuple[int, bytes, bool]] = []  # (seq, frame bytes, is a Read)
        self.log_bytes = 0
        self._snapshot: dict[int, tuple[int, bytearray]] = {}
        self._snapshot_state: dict = {}
        self._snapshot_names = 0
        self._last_checkpoint = time.monotonic()
        self.lease_id = os.environ.get("GPUWIRE_LEASE_ID") or None
        self.pool_url = os.environ.get("GPUWIRE_POOL") or None
        # recoveries since the last completed request, and the node's last applied command at
        # the latest resume: a connection the node closes again at the same command every time
        # (a fault on the node's side that this command triggers) must end in an error, not loop
        self._fruitless = 0
        self._refusal = ""  # the last resume refusal's words (why the node ended the session, if it said)
        self._unanswered = ""  # why the last resume got no answer, where known
        self._resumed_at_seq = None
        self.stats = {"reconnects": 0, "rebuilds": 0, "migrations": 0, "checkpoints": 0,
                      "checkpoint_seconds": 0.0, "last_recovery_seconds": None, "last_migration_pause": None}

    @classmethod
    def from_env(cls, runtime) -> "Recovery":
        pool = bool(os.environ.get("GPUWIRE_POOL") and os.environ.get("GPUWIRE_LEASE_ID"))
        mode = os.environ.get("GPUWIRE_DURABILITY") or ("checkpoint" if pool else "reconnect")
        return cls(runtime, mode.strip().lower(),
                   grace=float(os.environ.get("GPUWIRE_RECONNECT_GRACE", "10")),
                   interval=float(os.environ.get("GPUWIRE_CHECKPOINT_INTERVAL", "60")))

    def started(self) -> None:
        self._ready = True
        if self.rt.resume_key is None and self.mode != "none":
            self.logging = self.mode == "checkpoint"  # an old node keeps no session to resume

    @property
    def busy(self) -> bool:
        """Recovering the connection now (it may look lost meanwhile)."""
        return self._busy

    @property
    def can_recover(self) -> bool:
        return self._ready and not self._busy and self.mode != "none"

    @property
    def snapshot_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self._snapshot.values())

    # ------------------------------------------------------------ the log

    def log(self, seq: int, frame: bytes, read: bool = False) -> None:
        self._log.append((seq, frame, read))
        self.log_bytes += len(frame)

    def log_borrowed(self, seq: int, parts: list, unchanged) -> None:
        """Log a large Write without copying its payload: the parts refer to the program's own
        buffer, replayable while ``unchanged()`` says the program has not written to it since."""
        entry = Borrowed(parts, unchanged)
        self._log.append((seq, entry, False))
        self.log_bytes += entry.nbytes

    def replace_last(self, old_frame: bytes, seq: int, frame: bytes) -> None:
        if self._log and self._log[-1][1] is old_frame:
            self.log_bytes += len(frame) - len(old_frame)
            self._log[-1] = (seq, frame, False)

    def after_request(self) -> None:
        """A sync point: the node has applied every command sent so far."""
        if self._busy or self._nested:
            return
        self._fruitless, self._resumed_at_seq = 0, None
        if self.mode == "reconnect":
            self._log.clear()
            self.log_bytes = 0
        elif self.mode == "checkpoint" and (time.monotonic() - self._last_checkpoint >= self.interval
                                            or self.log_bytes >= LOG_LIMIT):
            self.checkpoint()
        if self.notice is not None:
            notice, self.notice = self.notice, None
            if notice.kind == "drain":
                self._move_away(notice.data)

    def checkpoint(self) -> None:
        """Copy every live remote tensor and the session's generator states to this process,
        then start the replay log afresh."""
        rt = self.rt
        started = time.monotonic()
        self._nested = True
        try:
            rt._collect_garbage()
            spare: dict[int, list[bytearray]] = {}
            for nbytes, buffer in self._snapshot.values():
                spare.setdefault(nbytes, []).append(buffer)
            snapshot, reads = {}, []
            for storage_id, ref in list(rt._live.items()):
                if ref.expired():
                    continue
                nbytes = rt._live_bytes.get(storage_id, 0)
                pool = spare.get(nbytes)
                buffer = pool.pop() if pool else bytearray(nbytes)
                snapshot[storage_id] = (nbytes, buffer)
                if nbytes:
                    reads.append((storage_id, 0, nbytes, memoryview(buffer)))
            error = rt._read_many(reads)
            if error is not None:
                raise ConnectionLost(f"could not take a checkpoint: {error.message}")
            state = rt.request(Query(seq=rt.next_seq(), what="snapshot")).value
        finally:
            self._nested = False
        self._snapshot, self._snapshot_state = snapshot, dict(state)
        self._snapshot_names = len(rt.conn.defined_op_names)
        self._log.clear()
        self.log_bytes = 0
        self._last_checkpoint = time.monotonic()
        self.stats["checkpoints"] += 1
        self.stats["checkpoint_seconds"] += self._last_checkpoint - started

    # ------------------------------------------------------------ recovering

    def recover(self, cause: BaseException) -> None:
        """The connection broke: reconnect (resume) or rebuild the session, or raise."""
        rt = self.rt
        if not self.can_recover:
            if isinstance(cause, ConnectionLost):
                raise cause
            raise rt._lost(cause) from None
        lost_address, at_op = rt.address, rt.ops_sent
        if self._fruitless >= MAX_FRUITLESS_RECOVERIES:
            raise rt._lost(cause, f"lost the connection to gpuwire node {lost_address} ({cause}) "
                                  f"{self._fruitless + 1} times in a row at the same command, without any progress "
                                  "in between: the node fails on what this program sends next rather than the "
                                  "network (see the node's log). Gave up instead of retrying forever") from None
        self._fruitless += 1
        self._busy = True
        started = time.monotonic()
        try:
            rt._dead = None
            _close(rt._sock)
            outcome = self._resume(started + self.grace) if rt.resume_key else False
            if outcome is True:
                self.stats["reconnects"] += 1
                self.stats["last_recovery_seconds"] = round(time.monotonic() - started, 3)
                _say(f"connection to node {lost_address} restored after {time.monotonic() - started:.1f} s "
                     f"({cause}); nothing lost")
                return
            if self.mode != "checkpoint":
                if outcome is False:
                    restarted = self._refusal.partition("unknown session: ")[2]
                    why = restarted if restarted.startswith("the node restarted") else \
                        "the node no longer has this session"
                else:
                    why = self._unanswered or f"no answer within {self.grace:g} s"
                ended = self._refusal.partition("the node ended it: ")[2] if outcome is False else ""
                if ended:  # (its Goodbye was lost with the connection: the resume refusal carries it)
                    raise rt._lost(ConnectionError(f"the node ended the session: {ended}")) from None
                raise rt._lost(cause, f"lost the connection to gpuwire node {lost_address} ({cause}) and could "
                                      f"not reconnect: {why}. Remote tensors of this session are gone (the next use "
                                      "of the device starts a new session); run with GPUWIRE_DURABILITY=checkpoint "
                                      "to survive the loss of a node")
            self._rebuild_somewhere(outcome, started + max(self.grace, 5.0))
            seconds = time.monotonic() - started
            self.stats["rebuilds"] += 1
            self.stats["last_recovery_seconds"] = round(seconds, 3)
            _say(f"node {lost_address} lost at op {at_op:,}; resumed on {rt.address} in {seconds:.1f} s")
        except Unreplayable as exc:  # no node can be given what is gone: say so, do not retry
            raise rt._lost(cause, f"lost the connection to gpuwire node {lost_address} ({cause}) and cannot "
                                  f"restore the session: {exc}") from None
        finally:
            self._busy = False

    def _resume(self, deadline: float):
        """Reconnect to the same node and take the session back. True: resumed; False: the node
        answers but has no such session; None: the node did not answer in time (or refuses
        connections while a pool can give us another one)."""
        rt = self.rt
        delay, refused_since, said_busy = 0.05, None, False
        self._unanswered = ""
        while True:
            try:
                welcome = self._open(rt.address, rt.token, resume={
                    "session": rt.session_id, "key": rt.resume_key, "awaiting": sorted(rt._awaiting or ())})
            except _Refused as exc:
                if "unknown session" in exc.reason:
                    self._refusal = exc.reason
                    return False
                if STILL_ATTACHED in exc.reason:
                    # the node is up and holds the session, still running one long command on the
                    # old connection (it ends that connection at the command's end): wait for it,
                    # as a local run waits for its kernel, instead of giving the session up when
                    # the grace for an unreachable node runs out (a Ctrl-C or a test runner's
                    # timeout during a minutes-long kernel lost every remote tensor)
                    if not said_busy:
                        said_busy = True
                        _say(f"node {rt.address} is still running a command of this session; the session "
                             "resumes when it finishes (Ctrl-C again to stop waiting)")
                    deadline = max(deadline, time.monotonic() + 2 * delay)
                welcome = None
            except ConnectionRefusedError:
                refused_since = refused_since or time.monotonic()
                # nothing listens there: the node process is gone, and the session with it
                if self.mode == "reconnect" and time.monotonic() - refused_since > 1.0:
                    self._unanswered = "nothing listens there any more (the node's process ended)"
                    return None
                if self._pool_available() and time.monotonic() - refused_since > 0.5:
                    return None
                welcome = None
            except (OSError, ProtocolError, ConnectionError):
                welcome = None
            if welcome is not None:
                break
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        last_seq = int(welcome.resume.get("last_seq", 0))
        if self._resumed_at_seq is not None and last_seq > self._resumed_at_seq:
            self._fruitless = 1  # the node applied commands since the last loss: this one is new
        self._resumed_at_seq = last_seq
        awaiting = rt._awaiting or set()
        frames = [frame for seq, frame, read in self._log if seq > last_seq or (read and seq in awaiting)]
        self._send(frames)
        return True

    def _rebuild_somewhere(self, outcome, deadline: float) -> None:
        """Rebuild the session: on the same node when only it can take us (no pool: wait for it
        to come back until ``deadline``) or when it answers without our session (it restarted);
        else on the node of a replacement lease from the pool."""
        rt = self.rt
        failures = (OSError, ProtocolError, ConnectionError, _Refused)
        if not self._pool_available():
            while True:
                try:
                    return self._rebuild(rt.address, rt.token)
                except failures as exc:
                    if time.monotonic() > deadline:
                        raise rt._lost(exc, f"node {rt.address} is gone and no pool is configured to replace "
                                            f"it ({exc}); remote tensors are lost") from None
                    time.sleep(0.5)
        if outcome is False:
            try:
                return self._rebuild(rt.address, rt.token)
            except failures:
                pass
        while True:
            address, token = self._replacement("lost", rt.address)
            try:
                return self._rebuild(address, token)
            except failures as exc:
                _say(f"rebuilding the session on {address} failed ({exc}); asking the pool again")
                time.sleep(0.5)

    def _rebuild(self, address: str, token: str | None) -> None:
        """A fresh session at ``address``: the snapshot, the op names, then the replay log."""
        rt = self.rt
        old_conn = rt.conn
        self._open(address, token)
        conn = rt.conn
        conn.continue_encoding_from(old_conn)
        frames = []
        for storage_id, (nbytes, buffer) in self._snapshot.items():
            frames.append(conn.send(Alloc(seq=0, storage_id=storage_id, nbytes=nbytes, overwrite=True)))
            view = memoryview(buffer)
            for start in range(0, nbytes, CHUNK_BYTES):
                frames.extend(conn.send_parts(Write(seq=0, storage_id=storage_id, byte_offset=start,
                                                    payload=view[start:start + CHUNK_BYTES])))
        if self._snapshot_state:
            state = self._snapshot_state
            frames.append(conn.send(Restore(seq=0, rng_state=state.get("rng_state", b""),
                                            generators=state.get("generators", []),
                                            next_node_id=state.get("next_node_id", 0),
                                            last_seq=state.get("last_seq", 0))))
        frames.append(conn.op_definitions(self._snapshot_names))
        # math-mode flags set before the snapshot are not in the log (sent later: they are)
        if precision.OP_NAME in conn.defined_op_names[:self._snapshot_names]:
            frames.append(precision.frame(conn))
        frames.extend(frame for _, frame, _ in self._log)
        self._send(frames)

    def _open(self, address: str, token: str | None, *, resume: dict | None = None):
        """Connect and handshake; on success the runtime talks to the new connection."""
        from ..security.tls import client_context_from_env
        from .probe import parse_address

        rt = self.rt
        host, port = parse_address(address)
        timeout = min(rt.connect_timeout, 5.0)
        sock = dial(host, port, timeout, client_context_from_env())
        try:
            conn = rt.new_connection()
            sock.sendall(conn.send(rt._hello(token, resume)))
            welcome = read_event(sock, conn, "the node")
        except BaseException:
            _close(sock)
            raise
        if isinstance(welcome, Reject):
            _close(sock)
            raise _Refused(welcome.reason)
        if resume is not None:
            if not welcome.resume.get("resumed"):
                _close(sock)
                raise _Refused("unknown session: the node did not resume it")
            conn.continue_encoding_from(rt.conn)
        sock.settimeout(None)
        rt._sock, rt.conn = sock, conn
        rt.address, rt.host, rt.port, rt.token = address, host, port, token
        rt.adopt_welcome(welcome)
        rt._dead = None
        return welcome

    def _send(self, frames: list) -> None:
        if any(type(frame) is Borrowed for frame in frames):
            flat = []
            for frame in frames:
                if type(frame) is not Borrowed:
                    flat.append(frame)
                elif frame.unchanged():
                    flat.extend(frame.parts)
                else:
                    raise Unreplayable(
                        f"a {frame.nbytes / 2**20:.1f} MiB upload cannot be sent again: the program changed its "
                        "source tensor in place after the upload, before the node confirmed it (the next sync "
                        "point). Keep an uploaded tensor unchanged until then (or upload a .clone()), or run "
                        "with GPUWIRE_DURABILITY=none")
            frames = flat
        if frames:
            self.rt.bytes_sent += send_parts(self.rt._sock, frames)

    # ------------------------------------------------------------ the pool

    def _pool_available(self) -> bool:
        return bool(self.pool_url and self.lease_id)

    def _replacement(self, reason: str, lost_address: str | None) -> tuple[str, str | None]:
        """Ask the pool to move our lease off the lost (or draining) node; wait in its queue,
        saying where we are, until a GPU that fits is free."""
        from ..pool.client import PoolClient, PoolError, PoolUnreachable

        client = PoolClient(self.pool_url)
        said = None
        try:
            while True:
                try:
                    data = client.replace_lease(self.lease_id, reason=reason, lost_address=lost_address)
                    while data.get("state") == "queued":
                        text = data.get("position_text") or f"position {data.get('position')}"
                        if text != said:
                            _say(f"waiting for a replacement GPU: {text}")
                            said = text
                        time.sleep(1.0)
                        data = client.get_lease(self.lease_id)
                except PoolUnreachable as exc:
                    _say(f"pool unreachable ({exc}); retrying")
                    time.sleep(1.0)
                    continue
                except PoolError as exc:
                    raise ConnectionLost(f"the pool could not replace lease {self.lease_id}: {exc}") from None
                if data.get("state") != "active" or not data.get("address"):
                    raise ConnectionLost(f"the pool could not replace lease {self.lease_id}: it is "
                                         f"{data.get('state')} ({data.get('reason')})")
                return data["address"], data.get("token")
        finally:
            client.close()

    def _move_away(self, drain: dict) -> None:
        """The node is being drained: at this sync point, move the session node-to-node."""
        rt = self.rt
        if not self._pool_available():
            _say(f"node {rt.address} is being drained ({drain.get('reason')}), but no pool is configured to "
                 "move this session; it ends at the drain deadline")
            return
        started = time.monotonic()
        self._nested = True
        try:
            old_address = rt.address
            address, token = self._replacement("drain", None)
            migrate_seq = rt.next_seq()
            try:
                moved = rt.request(Query(seq=migrate_seq, what="migrate:" + json.dumps(
                    {"address": address, "token": token}))).value
            except Exception as exc:  # noqa: BLE001 - the session stays, intact, where it is
                _say(f"could not move the session off the draining node {old_address}: {exc}")
                return
            finally:  # a rebuild must never replay the move
                self._log = [entry for entry in self._log if entry[0] != migrate_seq]
            from ..protocol.events import Goodbye
            try:
                rt._sock.sendall(rt.conn.send(Goodbye(reason="moved")))
            except OSError:
                pass
            _close(rt._sock)
            rt.session_id, rt.resume_key = moved["session"], moved["key"]
            rt.address = address
            rt.token = token
            self._open(address, token, resume={"session": moved["session"], "key": moved["key"], "awaiting": []})
            pause = time.monotonic() - started
            self.stats["migrations"] += 1
            self.stats["last_migration_pause"] = round(pause, 3)
            _say(f"node {old_address} is draining: session moved to {address} "
                 f"({moved.get('bytes', 0) / 2**20:.1f} MiB node to node), paused {pause:.2f} s")
        finally:
            self._nested = False
            self.notice = None


class Unreplayable(Exception):
    """The log cannot be replayed (an upload's source changed since): no retry will help."""


class Borrowed:
    """A logged frame whose payload is not copied: header bytes + the program's own buffer."""

    __slots__ = ("parts", "unchanged", "nbytes")

    def __init__(self, parts: list, unchanged):
        self.parts = parts
        self.unchanged = unchanged
        self.nbytes = sum(memoryview(part).nbytes for part in parts)


class _Refused(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _close(sock) -> None:
    try:
        sock.close()
    except OSError:
        pass
