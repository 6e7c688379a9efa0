"""The client's connection to one node: command queue, sync points, storage ids, frees.

Sits between the device layer (``client.device``, which turns ATen ops into commands) and the
socket. Commands with no reply are appended to an outgoing queue and written in batches
(flushed at a sync point, or once the queue holds ``FLUSH_OPS`` commands or ``FLUSH_BYTES``
bytes, so the node works while the client keeps dispatching). Commands with a reply flush
the queue and wait: that is the only place the client blocks, and ``round_trips`` counts it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util as _mp_util
import os
import re
import socket
import threading
import time
from time import perf_counter as _perf_counter

import msgpack
import torch

from .. import __version__
from .._io import send_parts
from ..protocol import CLOSED, NEED_DATA, Connection, ProtocolError, Role
from ..protocol.events import (
    CallSync,
    Data,
    Error,
    Free,
    Goodbye,
    Hello,
    Notice,
    Query,
    Read,
    Seed,
    SetRngState,
    Sync,
    Welcome,
    Write,
)
from ..pool.sizes import format_size
from .errors import ConnectionLost, RemoteError, out_of_memory_prefix, remote_error
from .recovery import Recovery
from . import wire
from .mirror import OPS as _MIRRORED_OPS, forget_freed, forget_storages
from .probe import connect_timeout_from_env, dial_node, handshake, parse_address
from .wire import HostTensorArgument, host_tensors_by_value, refuse_host_tensors

log = logging.getLogger("gpuwire.client")

# an op's out declarations for the native kernels (``submit_native``): [storage id, then the
# kernel's encoding of nbytes, sizes, strides, code]
_OUT_HEAD = bytes([0x95])
_ONE_OUT = bytes([0x91]) + _OUT_HEAD
_pack = msgpack.Packer(autoreset=True).pack


def _array_head(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


FLUSH_OPS = 64
FLUSH_BYTES = 1 << 20
# a queued command waits at most this long (seconds) for company: sent with the next command
# after it, so the node starts on a step's first (often largest) kernels while the client is
# still dispatching the rest. The age starts at FLUSH_AGE_FIRST after each sync point, when the
# node has nothing left to run, and doubles with each flush made for age up to FLUSH_AGE. A
# fixed 200 us until session 23: on an H100 the GPU idled 170-200 us before each attention kernel
# of a GPT-2 forward and 2.3 ms at a step's start; swept there (one run each, before the attention
# fix) 200 / 50 / 0 / 25:200 us gave 104.5 / 104.2 / 104.1 / 103.0 ms a step, GPU idle 12.0 /
# 11.5 / 12.0 / 10.9 ms; on this 2-core VM, alternated, GPT-2 generate 5.87 / 5.13 ms a token at
# 200 against 5.79 / 4.67 at 25:200, and training steps within the VM's noise either way.
# Backing off further (800 us) measured slower in session 12: the node starved between batches.
# ``GPUWIRE_FLUSH_AGE_US`` sets it ("N": fixed; "START:MAX": a ramp)
FLUSH_AGE_FIRST = 25e-6
FLUSH_AGE = 200e-6
# After a sync point the node has nothing left to run, so the first commands of what follows
# wait for nobody: this many are each sent at once (``GPUWIRE_FLUSH_EAGER``), then the age ramp
# starts. Without it a step's first commands (the batch's upload, the embedding) waited in the
# queue while the client ran the model's Python before its next op: 0.2-0.8 ms a flush on this
# VM, and on an H100 the GPU idled 2.1 ms from the loss read to the next batch's upload and
# 2.8 ms from there to the embedding (local: 0.5 + 0.5). Measured on an H100 (GPT-2 small fp32,
# b8x512): 0 -> 32 took the GPU's idle time from 13.6 to 7.8 ms a step (timeline) and the step
# to 1.025x local (bench); on this 2-core VM, two alternated rounds, training step ratios and
# generation within the VM's noise either way (generate 2-4 % slower a token).
FLUSH_EAGER = 32


def configured_flush_eager(backend: str | None = None) -> int:
    """``FLUSH_EAGER``, or ``GPUWIRE_FLUSH_EAGER``; 0 for a CPU-backend node, which shares this
    machine's cores as a rule: there each command sent alone costs both ends a send and a
    wake-up for nothing to overlap (session 36, alternated: GPT-2 generate 1.67-1.71 -> 1.56-1.63
    ms a token, 37 -> 7 sends a token; training steps within the VM's noise, as in session 27)."""
    text = os.environ.get("GPUWIRE_FLUSH_EAGER", "").strip()
    if not text:
        return 0 if backend == "cpu" else FLUSH_EAGER
    if not text.isdigit() or int(text) > 100000:
        raise ValueError(f"GPUWIRE_FLUSH_EAGER={text!r}: give how many commands after each sync point are sent "
                         f"at once, without waiting for company (0 to 100000); unset, it is {FLUSH_EAGER}")
    return int(text)


def configured_flush_age() -> tuple[float, float]:
    """(age after a sync point, age it may double up to), in seconds, from ``GPUWIRE_FLUSH_AGE_US``
    ("N", or "START:MAX"; 0 sends each command at once); unset, FLUSH_AGE_FIRST up to FLUSH_AGE."""
    text = os.environ.get("GPUWIRE_FLUSH_AGE_US", "").strip()
    if not text:
        return FLUSH_AGE_FIRST, FLUSH_AGE
    try:
        micros = [float(part) for part in text.split(":")]
    except ValueError:
        micros = []
    if not (1 <= len(micros) <= 2 and all(0 <= m <= 1e6 for m in micros) and micros[0] <= micros[-1]):
        raise ValueError(f"GPUWIRE_FLUSH_AGE_US={text!r}: give the microseconds a queued command may wait for "
                         f"company before it is sent, from 0 (send each at once) to 1000000, or START:MAX to "
                         f"start at START after each sync point and double up to MAX; unset, it is "
                         f"{FLUSH_AGE_FIRST * 1e6:.0f}:{FLUSH_AGE * 1e6:.0f}")
    return micros[0] * 1e-6, micros[-1] * 1e-6


CHUNK_BYTES = 16 << 20  # bulk transfers travel in frames of at most this many bytes
COPY_PAYLOAD_BELOW = 256 << 10  # smaller uploads are copied into the queue; larger ones sent at once
FIRST_ADDRESS = 1 << 32
ALIGN = 512
# dead storages are found and freed once 256 allocations or 256 MiB were made since the last
# look (each MiB counts as an allocation): by count alone, a loop of few large tensors (a
# batch of 200 MB attention maps) left up to 256 of them dead on the node, which ran a CPU
# node out of the host's memory under PyTorch's test_nn.py
SCAN_EVERY = 256
SCAN_UNIT_SHIFT = 20
# storage ids below this were given out by a parent process before it forked this one
# (``device._forget_runtime_in_child``); the parent's session owns them
INHERITED_BELOW = [0]
# the storage ids each session this process ended had given out: (first, end, node). A new
# session starts above them all, so that a tensor left over from an ended session names no storage
# of the new one and says so (``_failed``): both started at FIRST_ADDRESS, and such a tensor read
# and wrote the new session's storage of the same id, another tensor's values
ENDED_SESSIONS: list[tuple[int, int, str, str]] = []  # (first, end, node, how it ended)
_UNALLOCATED = re.compile(r"storage (0x[0-9a-f]+) is not allocated in this session")
ENDED_SESSION_MESSAGE = (
    "this device tensor was made in an earlier gpuwire session of this process, on node {node}, which {how}; "
    "its memory ended with that session. {advice}")
# how a session ended, and what to do about its tensors
DETACHED_SESSION = ("ended when the process attached again (gpuwire.attach or detach, %gpuwire attach)",
                    "Copy tensors to the host (t.cpu()) before switching nodes and back (t.to(device)) after")
LOST_SESSION = ("was lost with its connection to the node (the error then said why)",
                "Make the tensor again (a model's parameters and an optimizer's state: load them from a checkpoint, "
                "or run with GPUWIRE_DURABILITY=checkpoint to survive the loss of a node)")
FORKED_CHILD_MESSAGE = (
    "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use the "
    "'spawn' start method (gpuwire: this device tensor was made by the parent process before it forked; a "
    "forked child has its own session with the node, which cannot reach the parent's memory. Start workers "
    "with the 'spawn' method, or pass them host tensors)")
_storage_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref


def _dead_storage_ids(live: dict) -> list:
    """The ids in ``live`` ({storage id: StorageRef}) whose client storage died; replaced by
    the client helper's C loop when it is built (``use_native``)."""
    return [sid for sid, ref in live.items() if _storage_expired(ref)]


def use_native(helper) -> None:
    global _dead_storage_ids
    _dead_storage_ids = helper.dead_storage_ids


class StorageRef(int):
    """A weak reference to a client storage: the handle ``UntypedStorage._weak_ref()`` returns.
    Unlike ``StorageWeakRef`` it has no ``__del__`` (a Python call for every storage that
    dies): the runtime releases it (``release``) when it forgets the storage."""

    __slots__ = ()

    def expired(self) -> bool:
        return _storage_expired(self)

    def release(self) -> None:
        _free_weak_ref(self)


class Runtime:
    def __init__(self, address: str, *, token: str | None = None, connect_timeout: float | None = None,
                 reply_timeout: float | None = None):
        if connect_timeout is None:
            connect_timeout = connect_timeout_from_env()
        self.address = address
        self.host, self.port = parse_address(address)
        self.tls = False
        self.sync_every_op = os.environ.get("GPUWIRE_SYNC", "") not in ("", "0")
        self.lock = threading.RLock()
        self.seq = 0
        self.round_trips = 0
        self.ops_sent = 0
        # storage id -> CPU storage with the same bytes, for small integer/boolean tensors whose
        # values the client knows (``client/mirror.py``); emptied by anything that may write
        self.mirror: dict = {}
        self.shared_storages: set = set()  # ids of storages shared with other processes (never mirrored)
        # storage id of a tiny predicate result -> the tiny tensor it was computed from, read
        # along with it (``mirror.note_input``)
        self.read_along: dict = {}
        # storage ids of the last few ``.item()`` reads: a second element read of one of them
        # reads all of its storage (``mirror.read_whole``)
        self.scalar_reads: dict = {}  # (a dict: insertion order)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._queue: list = []
        self._queue_bytes = 0
        self._queued_at = 0.0  # perf_counter() when the oldest queued command was queued
        # how long a queued command waits for company now; what it starts at after a sync point
        # and may double up to
        self._flush_age_first, self._flush_age_max = configured_flush_age()
        self._flush_eager = configured_flush_eager()
        self._eager_left = 0  # commands still to send at once (``FLUSH_EAGER``) since the last sync point
        self._flush_age = self._flush_age_first
        # (a forked child starts above what its parent had given out: a tensor it inherited
        # then names no storage of its own session, and says so: ``_failed``)
        # (and above what every session this process ended had: ``ENDED_SESSIONS``)
        self._next_address = max(FIRST_ADDRESS, INHERITED_BELOW[0], *(ended[1] for ended in ENDED_SESSIONS))
        self._first_address = self._next_address
        self._live: dict[int, StorageRef] = {}
        self._live_bytes: dict[int, int] = {}
        self.bytes_in_use = 0
        self._device_capacity: int | None = None  # the device's whole memory (Welcome), checked in ``reserve``
        self.memory_budget: int | None = None  # the least of the two below (read on every allocation)
        self._granted_budget: int | None = None  # the node's or the pool's limit for this session (Welcome)
        self._memory_cap: int | None = None  # the program's own (``set_per_process_memory_fraction``)
        self._allocs_since_scan = 0
        self._dead: BaseException | None = None
        self._torn = False  # an interrupt cut a message: reconnect before the next (``_retie``)
        self._awaiting: set[int] | None = None  # seqs of the replies the client waits for now
        self._token_file = os.environ.get("GPUWIRE_TOKEN_FILE") or None
        self._token_checked = 0.0
        self._token_mtime = None
        self._sock = self._connect(connect_timeout)
        self._sock.settimeout(reply_timeout)
        self._last_alloc = None  # (storage id, nbytes, queued frame) of the latest Alloc
        self._read_into: dict[int, memoryview] = {}  # Read seq -> where its Data payload lands
        self.node_warnings: list = []  # [category, text] the node's kernels said, for the program at this request's end
        self.token = token
        self.connect_timeout = connect_timeout
        self.recovery = Recovery.from_env(self)
        self.conn = self.new_connection()
        self._handshake(token, connect_timeout)
        self.recovery.started()
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)
        # a multiprocessing child (a DataLoader worker, a spawned process) ends by os._exit,
        # which runs no atexit handler, but multiprocessing's finalizers: without a Goodbye the
        # node kept each worker's session for a reconnect and warned when it gave up, 10 s later.
        # Below the queues' own (-5: their feeder threads, which may still be downloading a
        # device tensor they were given, are joined first)
        self._exit_finalizer = _mp_util.Finalize(None, self._close_at_exit, exitpriority=-10)

    def _close_at_exit(self) -> None:
        """Say Goodbye when the program ends, so the node frees the session now rather than
        keeping it parked for a reconnect (never from a forked child: the session is the parent's)."""
        if os.getpid() == self._pid and self._dead is None:
            if self.shared_storages:
                # its writes to storages another process shares land before it is seen to end
                # (``p.join()`` then a read in the parent: Hogwild training), as a CUDA context's do
                try:
                    self.synchronize()
                except Exception:  # noqa: BLE001 - ending must never raise; the error was the program's to see
                    pass
            self.close()

    # ------------------------------------------------------------ connection

    def _connect(self, timeout: float) -> socket.socket:
        sock, self.tls = dial_node(self.address, timeout)
        return sock

    def _handshake(self, token: str | None, timeout: float) -> None:
        self.adopt_welcome(handshake(self._sock, self.conn, self._hello(token), self.address, self.tls, timeout,
                                     self._next_event))
        self._sock.settimeout(None)

    def adopt_welcome(self, welcome: Welcome) -> None:
        """What a node's Welcome tells this session (at the start, and after a reconnect,
        a rebuild or a move to another node)."""
        self.welcome = welcome
        self.device_info = dict(welcome.device)
        self._flush_eager = configured_flush_eager(self.device_info.get("backend"))
        total = self.device_info.get("total_memory")
        self._device_capacity = total if isinstance(total, int) and total > 0 else None
        budget = welcome.limits.get("memory_budget")
        self._granted_budget = budget if isinstance(budget, int) and budget > 0 else None
        self._apply_memory_limits()
        self.session_id = welcome.session_id
        self.resume_key = welcome.resume.get("key")

    def new_connection(self) -> Connection:
        return Connection(Role.CLIENT, default=wire.packer_default(), payload_sink=self._data_sink)

    def _hello(self, token: str | None, resume: dict | None = None) -> Hello:
        options = {"pid": os.getpid()}
        share = os.environ.get("GPUWIRE_SHARE")
        if share:
            options["share"] = float(share)
        if self.recovery.mode != "none":
            options["durable"] = self.recovery.grace
        if resume is not None:
            options["resume"] = resume
        return Hello(client_version=__version__, token=token, capabilities=["sync-ops", "resume", "warnings"],
                     options=options)

    def close(self, ended: tuple[str, str] = DETACHED_SESSION) -> None:
        """End the session (``ended``: how, for its tensors' errors, and what to do about them)."""
        with self.lock:
            if self._first_address is not None:
                ENDED_SESSIONS.append((self._first_address, self._next_address, self.address, ended))
                self._first_address = None
            if self._dead is None:
                try:
                    self._queue.append(self.conn.send(Goodbye(reason="client exit")))
                    self._flush()
                except Exception:  # noqa: BLE001 - closing must never raise
                    pass
                self._dead = ConnectionLost("the gpuwire connection was closed")
            try:
                self._sock.close()
            except OSError:
                pass
            live, self._live = self._live, {}
            for ref in live.values():
                ref.release()
        atexit.unregister(self._close_at_exit)  # (it kept every closed runtime alive until exit)
        self._exit_finalizer.cancel()

    @property
    def alive(self) -> bool:
        return self._dead is None

    def _lost(self, exc: BaseException, why: str | None = None) -> ConnectionLost:
        lost = ConnectionLost(why or f"lost the connection to gpuwire node {self.address}: {exc}. "
                              "Remote tensors of this session are gone; restart the program (or the node), "
                              "or run it with GPUWIRE_DURABILITY=checkpoint (default under `gpuwire run --pool`) "
                              "to survive the loss of a node")
        self._dead = lost
        try:
            self._sock.close()
        except OSError:
            pass
        return lost

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._torn:
            self._retie()

    def _retie(self) -> None:
        """A KeyboardInterrupt (Ctrl-C in a notebook) landed in the middle of a send or a receive:
        Python raises it between bytecodes, so after ``recv_into`` had filled a buffer but before
        the bytes were counted (the next "header" read was payload bytes), or halfway through a
        frame's send. Where the stream stands is unknown: reconnect and resume the session (the
        node's take-over; what it had not run is resent) before anything else is sent or read."""
        self._torn = False
        self._queue, self._queue_bytes = [], 0  # (in the recovery log: the resume sends them, once)
        self.recovery.recover(ConnectionError("a send or receive was interrupted (KeyboardInterrupt), which leaves "
                                              "where the stream stands unknown"))

    def _interrupted_mid_message(self, exc: BaseException, receiving: bool = False) -> None:
        """``exc`` left a send or a receive. KeyboardInterrupt and SystemExit come between any two
        bytecodes: the connection is torn. A receive is torn only where the bytes were taken
        and not counted, which cannot be told from an interrupt of the wait itself (no bytes:
        the common case, a Ctrl-C during a long ``.item()``): a session that can resume does so
        (milliseconds); one that cannot (``GPUWIRE_DURABILITY=none``) goes on, and a stream
        really out of place fails as a protocol error at the next read."""
        if not isinstance(exc, Exception) and (not receiving or self.recovery.can_recover):
            self._torn = True

    # ------------------------------------------------------------ queue

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def enqueue(self, frame: bytes) -> None:
        """Queue an encoded command (the one just numbered ``self.seq``); flush when the batch
        is large enough."""
        queue = self._queue
        now = _perf_counter()
        if not queue:
            self._queued_at = now
        queue.append(frame)
        self._queue_bytes += len(frame)
        recovery = self.recovery
        if recovery.logging:
            recovery.log(self.seq, frame)
        if len(queue) >= FLUSH_OPS or self._queue_bytes >= FLUSH_BYTES:
            self._flush()
        elif now - self._queued_at >= self._flush_age:
            self._flush_for_age()

    def _flush_for_age(self) -> None:
        """Send the queue because its oldest command is due; the age doubles, or, while sends
        after a sync point go out at once, one fewer is left."""
        if self._eager_left:
            self._eager_left -= 1
            if not self._eager_left:
                self._flush_age = self._flush_age_first
        else:
            self._flush_age = min(2 * self._flush_age, self._flush_age_max)
        self._flush()  # (which starts over if it is a sync point's)

    def _flush(self) -> None:
        if not self._queue:
            return
        if self._awaiting is not None:  # a sync point: the node will have nothing left to run
            self._eager_left = self._flush_eager
            self._flush_age = 0.0 if self._flush_eager else self._flush_age_first
        self._check_alive()
        try:
            # (inside: an interrupt between taking the queue and sending it lost those commands)
            parts, self._queue = self._queue, []
            self._queue_bytes = 0
            self.bytes_sent += send_parts(self._sock, parts)
        except OSError as exc:
            self.recovery.recover(exc)  # resends ``parts`` (they are in the log) or raises ConnectionLost
        except BaseException as exc:
            self._interrupted_mid_message(exc)
            raise

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _next_event(self):
        """The next reply this client waits for. A broken connection is recovered here
        (``Recovery``), after which replies the client no longer waits for (of replayed
        commands) are dropped; drain notices are noted for the end of the request."""
        while True:
            try:
                event = self._receive_event()
            except (socket.timeout, TimeoutError):
                raise
            except (ConnectionLost, ProtocolError) as exc:
                if not self.recovery.can_recover:
                    if isinstance(exc, ConnectionLost):
                        raise
                    raise self._lost(exc) from None
                self.recovery.recover(exc)
                continue
            cls = type(event)
            if cls is Notice:
                if event.kind == "warnings":
                    self._keep_node_warnings(event.data)
                else:
                    self.recovery.notice = event
                continue
            awaiting = self._awaiting
            if awaiting is not None:
                seq = event.reply_to if cls is Error else getattr(event, "seq", None)
                if seq not in awaiting:
                    continue  # the reply to a replayed command the program already has
                awaiting.discard(seq)
            return event

    def _receive_event(self):
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is not NEED_DATA:
                if event is CLOSED:
                    raise self._lost(ConnectionError("the node closed the connection"))
                if type(event) is Goodbye:
                    raise self._lost(ConnectionError(f"the node ended the session: {event.reason}"))
                return event
            try:
                received = self._sock.recv_into(conn.get_buffer(1 << 20))
                conn.buffer_updated(received)
            except (socket.timeout, TimeoutError):
                raise
            except OSError as exc:
                raise self._lost(exc) from None
            except BaseException as exc:
                self._interrupted_mid_message(exc, receiving=True)
                raise
            if not received:
                event = conn.next_event()
                if event is NEED_DATA or event is CLOSED:
                    raise self._lost(ConnectionError("the node closed the connection"))
                return event
            self.bytes_received += received

    def _refresh_lease_token(self) -> None:
        """Under ``gpuwire run --pool`` the launcher renews the lease and writes the fresh token
        to GPUWIRE_TOKEN_FILE; hand it to the node (at a sync point, at most every 2 s)."""
        now = time.monotonic()
        if self._token_file is None or now < self._token_checked + 2.0:
            return
        self._token_checked = now
        try:
            mtime = os.stat(self._token_file).st_mtime
            if mtime == self._token_mtime:
                return
            with open(self._token_file) as f:
                token = f.read().strip()
        except OSError:
            return
        self._token_mtime = mtime
        if token and token != self.token:
            try:
                self.request(Query(seq=self.next_seq(), what="lease-token:" + token))
                self.token = token
            except RemoteError:
                pass  # a token for the node we left (failover, drain): the next renewal brings ours

    def request(self, event):
        """Send a command that has a reply; wait for it. Raises RemoteError for a failure of
        this command or of any streamed command before it."""
        self._check_alive()
        if self._token_file is not None and type(event) is not Query:
            self._refresh_lease_token()
        frame = self.conn.send(event)  # (before ``_awaiting``: an argument it cannot encode leaves nothing set)
        self._awaiting = {event.seq}
        self.enqueue(frame)
        try:
            self._flush()
            self.round_trips += 1
            reply = self._next_event()
        finally:
            self._awaiting = None
        if type(reply) is Error:
            if self.node_warnings:  # (said before the failure, as a local run says them)
                self.say_node_warnings()
            raise self._failed(reply)
        self.recovery.after_request()
        return reply

    def _keep_node_warnings(self, data) -> None:
        said = data.get("warnings") if isinstance(data, dict) else None
        if isinstance(said, list):
            self.node_warnings.extend(item for item in said if isinstance(item, list) and len(item) == 2)
        dropped = data.get("dropped") if isinstance(data, dict) else 0
        if isinstance(dropped, int) and dropped > 0:  # (it may have been the client's own, said already)
            log.info("the node's kernels gave %d more different warnings since the last sync point than it keeps",
                     dropped)

    def say_node_warnings(self) -> None:
        """Warn the program of what the node's kernels said, at the line that waited for them
        (a local run warns at the op's own line; a streamed op's warning comes with its reply).
        Called where nothing is left half done if a filter makes a warning an error: after a
        sync or a read, and after a reply's tensors are the program's (``device._call_sync``)."""
        from .checks import say_node_warnings
        said, self.node_warnings = self.node_warnings, []
        say_node_warnings(said)

    def _failed(self, error: Error) -> Exception:
        """The exception for a command the node failed. What ``mirror`` holds for queued ops is
        forgotten: one of them may be the op that failed, so its result never took those values."""
        if self.mirror:
            self.mirror.clear()
        unallocated = _UNALLOCATED.match(error.message) if error.exc_type == "SessionError" else None
        if unallocated:
            storage_id = int(unallocated.group(1), 16)
            for first, end, node, (how, advice) in ENDED_SESSIONS:
                if first <= storage_id < end:
                    return remote_error(error.op, error.seq, "RuntimeError",
                                        ENDED_SESSION_MESSAGE.format(node=node, how=how, advice=advice), self.address)
            if storage_id < INHERITED_BELOW[0]:
                return remote_error(error.op, error.seq, "RuntimeError", FORKED_CHILD_MESSAGE, self.address)
        return remote_error(error.op, error.seq, error.exc_type, error.message, self.address)

    # ------------------------------------------------------------ commands

    def submit(self, frame: bytes) -> None:
        """Queue an op that may write into existing storages (in place, out=, copies)."""
        if self.mirror:
            self.mirror.clear()
        self.submit_fresh(frame)

    def submit_fresh(self, frame: bytes) -> None:
        """Queue an op whose writes ``mirror`` already accounts for: only the fresh storages
        it declares as outputs, or a storage the caller dropped from ``mirror``."""
        if self._dead is not None:
            raise self._dead
        self.ops_sent += 1
        self.enqueue(frame)
        if self.sync_every_op:
            self.synchronize()

    def submit_native(self, name: str, nbytes: int, ref: int, body: bytes, out_tail: bytes, forget=None) -> int | None:
        """Queue op ``name`` for the client's native kernels (client/native.cpp): its arguments
        come encoded (``body``), its one fresh result of ``nbytes`` is tracked by ``ref``.
        Returns the result's address; None, with nothing done, where this runtime cannot take
        the op so (dead, syncing every op, the op not yet named on this connection, the memory
        budget reached): the kernel then takes the general path, which raises or names it.
        ``forget``: storage ids whose mirrored values the op may change (client/mirror.py).

        The hottest Python of a step (one call an op): ``_queue_native``, ``enqueue`` and
        ``track_ref`` are written out here, which measured 0.2-0.3 us an op less than calling
        them (``x + 1``: 5.3-5.5 -> 5.1-5.2 us, alternated in one process)."""
        with self.lock:
            mirror = self.mirror
            if forget and mirror:
                if name in _MIRRORED_OPS:
                    if all(storage_id in mirror for storage_id in forget):
                        return None  # (the Python path computes the result's values: client/mirror.py)
                    forget = None  # (they write nothing but their result)
                elif name == "aten::_to_copy" and forget[0] in mirror:
                    return None  # (the Python path makes the copy's values known too: client/mirror.py)
            if self._dead is not None or self.sync_every_op:
                return None
            budget = self.memory_budget if self.memory_budget is not None else self._device_capacity
            if budget is not None and self.bytes_in_use + nbytes > budget:
                return None
            address = self._next_address
            seq = self.seq + 1
            frame = self.conn.encode_prepared_op(seq, name, body, _ONE_OUT + _pack(address) + out_tail)
            if frame is None:
                return None
            self._next_address = address + ((max(nbytes, 1) + 2 * ALIGN - 1) & ~(ALIGN - 1))
            if forget and mirror:
                forget_storages(self, forget)
            self.seq = seq
            self.ops_sent += 1
            # ``enqueue``
            queue = self._queue
            now = _perf_counter()
            if not queue:
                self._queued_at = now
            queue.append(frame)
            self._queue_bytes += len(frame)
            if self.recovery.logging:
                self.recovery.log(seq, frame)
            # ``track_ref``, before any flush: once ``ref`` is kept the kernel must not release
            # it, whatever is raised after (a send's error)
            self._live[address] = StorageRef(ref)
            self._live_bytes[address] = nbytes
            self.bytes_in_use += nbytes
            self._allocs_since_scan += 1 + (nbytes >> SCAN_UNIT_SHIFT)
            if len(queue) >= FLUSH_OPS or self._queue_bytes >= FLUSH_BYTES:
                self._flush()
            elif now - self._queued_at >= self._flush_age:
                self._flush_for_age()
            if self._allocs_since_scan >= SCAN_EVERY:
                self._collect_garbage()
            return address

    def submit_native_many(self, name: str, body: bytes, nbytes: tuple, refs: tuple, out_tails: tuple,
                           forget=None) -> tuple | None:
        """``submit_native`` of an op with several fresh results (one of ``nbytes``, ``refs`` and
        ``out_tails`` each; none: in place), their addresses, or None with nothing done."""
        with self.lock:
            addresses, outs, address = [], [], self._next_address
            for size, tail in zip(nbytes, out_tails):
                addresses.append(address)
                outs.append(_OUT_HEAD + _pack(address) + tail)
                address += (max(size, 1) + 2 * ALIGN - 1) & ~(ALIGN - 1)
            total = sum(nbytes)
            if not self._queue_native(name, body, _array_head(len(outs)) + b"".join(outs), total, address, forget):
                return None
            # ``track_ref`` of each written out, last, as in ``submit_native`` (``native_layer_norm``,
            # ``nll_loss_forward``, ``max.dim``: 6.6 -> 6.2 us)
            live, live_bytes = self._live, self._live_bytes
            for storage_id, ref, size in zip(addresses, refs, nbytes):
                live[storage_id] = StorageRef(ref)
                live_bytes[storage_id] = size
            self.bytes_in_use += total
            self._allocs_since_scan += len(addresses) + (total >> SCAN_UNIT_SHIFT)
            if self._allocs_since_scan >= SCAN_EVERY:
                self._collect_garbage()
            return tuple(addresses)

    def _queue_native(self, name: str, body: bytes, outs: bytes, nbytes: int, next_address: int, forget) -> bool:
        """(``self.lock`` held) Queue a native kernel's op whose results take ``nbytes`` up to
        ``next_address``; False, with nothing done, where the runtime cannot take it so."""
        if self._dead is not None or self.sync_every_op:
            return False
        budget = self.memory_budget if self.memory_budget is not None else self._device_capacity
        if budget is not None and self.bytes_in_use + nbytes > budget:
            return False
        frame = self.conn.encode_prepared_op(self.seq + 1, name, body, outs)
        if frame is None:
            return False
        self._next_address = next_address
        if forget and self.mirror:
            forget_storages(self, forget)
        self.seq += 1
        self.ops_sent += 1
        self.enqueue(frame)
        return True

    def synchronize(self) -> None:
        with self.lock:
            self._collect_garbage()
            self.request(Sync(seq=self.next_seq()))
            if self.node_warnings:
                self.say_node_warnings()

    def call_sync(self, name: str, args, kwargs):
        with self.lock:
            if self.mirror:  # (an op run with a reply may write into its arguments)
                self.mirror.clear()
            event = CallSync(seq=self.next_seq(), name=name, args=list(args), kwargs=kwargs)
            try:
                reply = self.request(event)
            except HostTensorArgument:
                reply = self._with_host_tensors(name, args, kwargs, lambda: self.request(event))
            return reply.value

    def encode_op(self, name: str, args, kwargs, outs) -> bytes:
        """The frame of op ``name`` under the next sequence number. A host tensor with dimensions
        among the arguments raises as CUDA does, unless CUDA's kernel takes one (then it is
        sent by value, ``wire.refuse_host_tensors``)."""
        seq = self.next_seq()
        try:
            return self.conn.encode_op(seq, name, args, kwargs, outs)
        except HostTensorArgument:
            return self._with_host_tensors(name, args, kwargs,
                                           lambda: self.conn.encode_op(seq, name, args, kwargs, outs))

    @staticmethod
    def _with_host_tensors(name: str, args, kwargs, encode):
        """The second try of an encoding that met a host tensor with dimensions: raise as CUDA
        does where CUDA refuses it, else encode it by value."""
        refuse_host_tensors(name, args, kwargs)
        with host_tensors_by_value():
            return encode()

    def query(self, what: str):
        with self.lock:
            if what in ("memory", "reset_peak"):
                # (the frees of tensors the program dropped go first: ``memory_allocated()`` after
                # ``del x`` must not count x, as a local allocator's would not)
                self._collect_garbage()
            return self.request(Query(seq=self.next_seq(), what=what)).value

    def seed(self, seed: int) -> None:
        with self.lock:
            self._check_alive()
            self.enqueue(self.conn.send(Seed(seq=self.next_seq(), seed=int(seed) & ((1 << 64) - 1))))

    def set_rng_state(self, state: bytes) -> None:
        with self.lock:
            self._check_alive()
            self.enqueue(self.conn.send(SetRngState(seq=self.next_seq(), payload=bytes(state))))

    # ------------------------------------------------------------ memory

    def cap_memory(self, nbytes: int | None) -> None:
        """The program's own cap on this session's memory (``set_per_process_memory_fraction``);
        a later call replaces it, raising it too, but never past what the node or the pool granted."""
        self._memory_cap = nbytes
        self._apply_memory_limits()

    def _apply_memory_limits(self) -> None:
        limits = [limit for limit in (self._granted_budget, self._memory_cap) if limit is not None]
        self.memory_budget = min(limits) if limits else None

    def reserve(self, nbytes: int) -> int:
        """A fresh virtual address (storage id) for ``nbytes``; never reused in this session.
        Raises torch.OutOfMemoryError here, at the user's line, past the session's budget or
        past the device's whole memory (the node checks the rest when the allocation arrives)."""
        budget = self.memory_budget
        if budget is None:
            budget = self._device_capacity
        if budget is not None and self.bytes_in_use + nbytes > budget:
            self._collect_garbage()
            if self.bytes_in_use + nbytes > budget:
                what = ("this session's memory budget" if self.memory_budget is not None
                        else "the device's memory")
                raise torch.OutOfMemoryError(
                    f"{out_of_memory_prefix()}Tried to allocate {format_size(nbytes)}: gpuwire: that would exceed {what} "
                    f"of {format_size(budget)} ({format_size(self.bytes_in_use)} in use by this session on node "
                    f"{self.address}). Free tensors, use smaller sizes, or ask for a larger budget")
        address = self._next_address
        self._next_address = address + ((max(nbytes, 1) + 2 * ALIGN - 1) & ~(ALIGN - 1))
        return address

    def mark_overwrite(self, storage_id: int) -> bool:
        """The storage just allocated will be written whole next: let the node skip zeroing it
        (rewrites its Alloc if that is still the last queued command)."""
        if self._last_alloc is not None and self._last_alloc[0] == storage_id and self._last_alloc[1] \
                and self._queue and self._queue[-1] is self._last_alloc[2]:  # (nothing to zero in 0 bytes)
            _, nbytes, _frame = self._last_alloc
            self._queue[-1] = self.conn.encode_alloc(self.next_seq(), storage_id, nbytes, overwrite=True)
            if self.recovery.logging:
                self.recovery.replace_last(_frame, self.seq, self._queue[-1])
            self._last_alloc = None
            return True
        return False

    def allocate(self, nbytes: int) -> int:
        """A fresh storage id; the node allocates (zeroed) memory for it when the Alloc arrives."""
        address = self.reserve(nbytes)
        self.seq += 1
        frame = self.conn.encode_alloc(self.seq, address, nbytes)
        self._last_alloc = (address, nbytes, frame)
        self.enqueue(frame)
        return address

    def track(self, storage_id: int, storage, nbytes: int | None = None) -> None:
        """Free the remote storage once the last client tensor on it dies (batched).
        ``nbytes``: the storage's size, when the caller knows it."""
        if nbytes is None:
            nbytes = storage.nbytes()
        self.track_ref(storage_id, storage._weak_ref(), nbytes)

    def track_ref(self, storage_id: int, ref: int, nbytes: int) -> None:
        """``track`` of a storage given by its weak reference (``UntypedStorage._weak_ref()``),
        which the runtime now owns."""
        self._live[storage_id] = StorageRef(ref)
        self._live_bytes[storage_id] = nbytes
        self.bytes_in_use += nbytes
        self._allocs_since_scan += 1 + (nbytes >> SCAN_UNIT_SHIFT)
        if self._allocs_since_scan >= SCAN_EVERY:
            self._collect_garbage()

    def retrack(self, old_id: int, new_id: int, storage, nbytes: int) -> None:
        """``storage`` moved from remote storage ``old_id`` to ``new_id`` (a resize): free the
        old one now, track the new one."""
        ref = self._live.pop(old_id, None)
        if ref is not None:
            _free_weak_ref(ref)
            self.bytes_in_use -= self._live_bytes.pop(old_id, 0)
            if self._dead is None:
                self.enqueue(self.conn.send(Free(seq=self.next_seq(), storage_ids=[old_id])))
        self.track(new_id, storage, nbytes)

    def _collect_garbage(self) -> None:
        self._allocs_since_scan = 0
        live = self._live
        dead = _dead_storage_ids(live)
        if dead:
            live_bytes = self._live_bytes
            for sid in dead:
                _free_weak_ref(live.pop(sid))
                self.bytes_in_use -= live_bytes.pop(sid, 0)
            if self.mirror or self.read_along:
                forget_freed(self, dead)
            if self._dead is None:
                self.enqueue(self.conn.send(Free(seq=self.next_seq(), storage_ids=dead)))

    @property
    def live_storages(self) -> int:
        return len(self._live)

    def write(self, storage_id: int, byte_offset: int, data: memoryview, unchanged=None) -> None:
        """Host → device bytes (``data`` must stay unchanged until this returns). ``unchanged``,
        when given, tells whether the program has left ``data`` alone since: then the recovery
        log keeps a reference to it instead of a copy, until the next sync point or checkpoint."""
        total = data.nbytes
        if total == 0:
            return  # (``torch.tensor([], device=...)``: Hugging Face's KV caches make two a layer)
        with self.lock:
            self._check_alive()
            if self.mirror:
                self.mirror.pop(storage_id, None)
            if total <= COPY_PAYLOAD_BELOW:
                self.enqueue(self.conn.send(Write(seq=self.next_seq(), storage_id=storage_id,
                                                  byte_offset=byte_offset, payload=bytes(data))))
                return
            # the queued commands (the Alloc of this very storage, often) go out in the same
            # sendmsg as the payload: one wake-up of the node, not two
            queued, self._queue, self._queue_bytes = self._queue, [], 0
            for start in range(0, total, CHUNK_BYTES):
                chunk = data[start:start + CHUNK_BYTES]
                parts = self.conn.send_parts(Write(seq=self.next_seq(), storage_id=storage_id,
                                                   byte_offset=byte_offset + start, payload=chunk))
                if self.recovery.logging:
                    if unchanged is not None:
                        self.recovery.log_borrowed(self.seq, parts, unchanged)
                    else:
                        self.recovery.log(self.seq, b"".join(parts))  # the program may change ``data`` later
                if queued:
                    parts, queued = queued + parts, []
                try:
                    self.bytes_sent += send_parts(self._sock, parts)
                except OSError as exc:
                    self.recovery.recover(exc)
                except BaseException as exc:
                    self._interrupted_mid_message(exc)
                    raise

    def _data_sink(self, header: list, nbytes: int):
        """Large Data payloads are received straight into the reader's destination."""
        if header[0] == Data.code and len(header) > 1:
            view = self._read_into.get(header[1])
            if view is not None and view.nbytes == nbytes:
                return view
        return None

    def read(self, storage_id: int, byte_offset: int, nbytes: int, into: memoryview | None = None):
        """Device → host bytes into ``into`` (a writable buffer of ``nbytes``; a new bytearray
        if None): one round trip, chunks pipelined, large chunks received in place."""
        with self.lock:
            self._check_alive()
            out = memoryview(bytearray(nbytes) if into is None else into).cast("B")
            if nbytes == 0:
                self.request(Sync(seq=self.next_seq()))
                if self.node_warnings:
                    self.say_node_warnings()
                return out
            self.read_many([(storage_id, byte_offset, nbytes, out)])
            return out

    def read_many(self, reads) -> None:
        """Several (storage id, byte offset, nbytes, destination memoryview of bytes) reads in
        one round trip."""
        with self.lock:
            self._check_alive()
            error = self._read_many(reads)
            if self.node_warnings:
                self.say_node_warnings()
            if error is not None:
                raise self._failed(error)
            self.recovery.after_request()

    def _read_many(self, reads) -> Error | None:
        """One round trip for several (storage id, byte offset, nbytes, destination) reads:
        chunks pipelined, large chunks received in place. Returns the first Error, if any."""
        chunks = {}
        for storage_id, byte_offset, nbytes, out in reads:
            for start in range(0, nbytes, CHUNK_BYTES):
                seq = self.next_seq()
                size = min(CHUNK_BYTES, nbytes - start)
                chunks[seq] = (out, start, size)
                self._read_into[seq] = out[start:start + size]
                self._queue.append(self.conn.send(Read(seq=seq, storage_id=storage_id,
                                                       byte_offset=byte_offset + start, nbytes=size)))
                if self.recovery.logging:
                    self.recovery.log(seq, self._queue[-1], read=True)
        self._awaiting = set(chunks)
        error = None
        try:
            self._flush()
            self.round_trips += 1
            while self._awaiting:
                reply = self._next_event()
                if type(reply) is Error:
                    error = error or reply
                    continue
                if type(reply) is not Data or reply.seq not in chunks:
                    raise self._lost(ProtocolError(f"expected Data, got {type(reply).__name__}"))
                out, start, size = chunks[reply.seq]
                payload = reply.payload
                if not (isinstance(payload, memoryview) and payload.obj is out.obj):
                    out[start:start + size] = payload  # small chunk: came through the frame buffer
        finally:
            self._awaiting = None
            for seq in chunks:
                self._read_into.pop(seq, None)
        return error

