"""The events that cross the data plane between a client and a node.

Pure data: no sockets, no torch. Each event has a one-byte type code and an ordered tuple of
fields; on the wire a frame is a msgpack array ``[code, *fields]`` plus an optional raw
payload (bulk tensor bytes, never serialised through msgpack).

Argument trees inside :class:`Op` and :class:`CallSync` may contain the value types defined
at the bottom of this module (``TensorRef``, ``DType`` …); the codec turns them into msgpack
extension types. Clients and nodes may plug in their own hooks (see ``codec``) so that torch
objects are encoded without an intermediate copy of the tree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 1
MAGIC = "gpuwire"


class Event:
    """Base class. Subclasses are dataclasses whose field order is the wire order."""

    code: ClassVar[int]
    has_payload: ClassVar[bool] = False
    # True for events the node answers (the client waits for the answer).
    expects_reply: ClassVar[bool] = False

    def fields(self) -> tuple:
        return tuple(getattr(self, name) for name in wire_fields(type(self)))


# ---------------------------------------------------------------- handshake


@dataclass
class Hello(Event):
    """Client → node, first frame of every connection."""

    code: ClassVar[int] = 1
    magic: str = MAGIC
    protocol_version: int = PROTOCOL_VERSION
    client_version: str = ""
    capabilities: list = field(default_factory=list)
    token: str | None = None
    options: dict = field(default_factory=dict)


@dataclass
class Welcome(Event):
    """Node → client, accepts the session. ``device`` describes the GPU (or CPU backend)."""

    code: ClassVar[int] = 2
    magic: str = MAGIC
    protocol_version: int = PROTOCOL_VERSION
    server_version: str = ""
    capabilities: list = field(default_factory=list)
    session_id: str = ""
    device: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)
    # durable sessions: {"key": resume secret, "resumed": bool, "last_seq": highest command seq
    # the node has handled}; see docs/failover.md
    resume: dict = field(default_factory=dict)


@dataclass
class Reject(Event):
    """Node → client, refuses the session; the connection closes after it."""

    code: ClassVar[int] = 3
    reason: str = ""
    server_version: str = ""
    protocol_version: int = PROTOCOL_VERSION


# ---------------------------------------------------------------- client → node commands


@dataclass
class Op(Event):
    """Run one ATen op, streamed: no reply unless it fails (reported at the next sync point).

    ``outs`` lists the fresh storages the client already created for the op's results, in
    flattened order, each as ``[storage_id, nbytes, sizes, strides, dtype_code]``; the node
    stores the results there (copying if its kernel chose other strides).
    """

    code: ClassVar[int] = 11
    seq: int = 0
    name: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    outs: list = field(default_factory=list)


@dataclass
class CallSync(Event):
    """Run one ATen op and reply with its results (data-dependent shapes, non-tensor results)."""

    code: ClassVar[int] = 12
    expects_reply: ClassVar[bool] = True
    seq: int = 0
    name: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)


@dataclass
class Alloc(Event):
    """Allocate ``nbytes`` under ``storage_id``. ``overwrite``: the next commands are Writes
    covering the whole storage in order, so the node may skip zeroing what they cover (it
    zeroes whatever they turn out not to cover)."""

    code: ClassVar[int] = 13
    seq: int = 0
    storage_id: int = 0
    nbytes: int = 0
    overwrite: bool = False


@dataclass
class Free(Event):
    code: ClassVar[int] = 14
    seq: int = 0
    storage_ids: list = field(default_factory=list)


@dataclass
class Write(Event):
    """Host → device bytes, written at ``byte_offset`` into a storage. Payload: the bytes."""

    code: ClassVar[int] = 15
    has_payload: ClassVar[bool] = True
    seq: int = 0
    storage_id: int = 0
    byte_offset: int = 0
    payload: Any = b""


@dataclass
class Read(Event):
    """Device → host: ask for ``nbytes`` at ``byte_offset`` of a storage; answered by Data."""

    code: ClassVar[int] = 16
    expects_reply: ClassVar[bool] = True
    seq: int = 0
    storage_id: int = 0
    byte_offset: int = 0
    nbytes: int = 0


@dataclass
class Sync(Event):
    """Wait until every earlier command ran; answered by SyncDone (or Error)."""

    code: ClassVar[int] = 17
    expects_reply: ClassVar[bool] = True
    seq: int = 0


@dataclass
class Seed(Event):
    """Seed the session's random generator (``torch.manual_seed`` on the client)."""

    code: ClassVar[int] = 18
    seq: int = 0
    seed: int = 0


@dataclass
class Query(Event):
    """Ask the node for information (``what``: "device", "memory", "rng_state"); answered by Result."""

    code: ClassVar[int] = 19
    expects_reply: ClassVar[bool] = True
    seq: int = 0
    what: str = ""


@dataclass
class SetRngState(Event):
    code: ClassVar[int] = 20
    has_payload: ClassVar[bool] = True
    seq: int = 0
    payload: Any = b""


@dataclass
class Goodbye(Event):
    code: ClassVar[int] = 21
    reason: str = ""


@dataclass
class Restore(Event):
    """Client (or a draining node) → node: the non-tensor state of a session being rebuilt or
    moved: random generator states, the node-chosen id counter, and the highest command seq
    already applied. Sent after the storages themselves (Alloc + Write)."""

    code: ClassVar[int] = 22
    seq: int = 0
    rng_state: bytes = b""
    generators: list = field(default_factory=list)  # [[generator id, state bytes], ...]
    next_node_id: int = 0
    last_seq: int = 0


# ---------------------------------------------------------------- node → client replies


@dataclass
class Data(Event):
    code: ClassVar[int] = 30
    has_payload: ClassVar[bool] = True
    seq: int = 0
    payload: Any = b""


@dataclass
class Result(Event):
    """Reply to CallSync/Query. ``value`` is the result tree; fresh tensors in it are
    ``NewTensor`` values naming node-chosen storage ids."""

    code: ClassVar[int] = 31
    seq: int = 0
    value: Any = None


@dataclass
class SyncDone(Event):
    code: ClassVar[int] = 32
    seq: int = 0


@dataclass
class Notice(Event):
    """Node → client, unsolicited, just before a reply: ``kind`` "drain" asks the client to move
    its session elsewhere at this sync point (``data`` says why and by when); ``kind``
    "warnings", sent only to clients whose Hello lists the "warnings" capability, carries what
    the session's kernels warned since its last reply (``data``: {"warnings": [[category, text],
    ...], "dropped": number not kept}) for the client to warn its program of."""

    code: ClassVar[int] = 34
    kind: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class Error(Event):
    """Reply in place of Data/Result/SyncDone when a command failed.

    ``seq``/``op`` name the first command that failed since the last sync point (it may be an
    earlier streamed op); ``reply_to`` is the request this answers.
    """

    code: ClassVar[int] = 33
    seq: int = 0
    reply_to: int = 0
    op: str = ""
    exc_type: str = ""
    message: str = ""


def wire_fields(cls: type[Event]) -> tuple[str, ...]:
    """Names of the fields that go into the msgpack header, in wire order (no payload)."""
    names = cls.__dict__.get("_wire_fields")
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls) if f.name != "payload")
        cls._wire_fields = names
    return names


EVENT_TYPES: dict[int, type[Event]] = {
    cls.code: cls
    for cls in (Hello, Welcome, Reject, Op, CallSync, Alloc, Free, Write, Read, Sync, Seed,
                Query, SetRngState, Goodbye, Restore, Data, Result, SyncDone, Notice, Error)
}
CLIENT_EVENTS = frozenset({Hello, Op, CallSync, Alloc, Free, Write, Read, Sync, Seed, Query,
                           SetRngState, Goodbye, Restore})
SERVER_EVENTS = frozenset({Welcome, Reject, Data, Result, SyncDone, Notice, Error, Goodbye})


# ---------------------------------------------------------------- values inside argument trees


@dataclass(frozen=True)
class TensorRef:
    """A view of a remote storage: what a client tensor means on the node."""

    storage_id: int
    offset: int  # in elements of ``dtype``
    sizes: tuple
    strides: tuple
    dtype: int  # a code from ``codec.DTYPE_CODES``
    flags: int = 0  # bit 0: conjugate, bit 1: negative


@dataclass(frozen=True)
class InlineTensor:
    """A small host (CPU) tensor passed by value, e.g. a 0-dim scalar tensor argument."""

    dtype: int
    sizes: tuple
    data: bytes


@dataclass(frozen=True)
class NewTensor:
    """In a Result: a tensor the node created under a node-chosen storage id."""

    storage_id: int
    nbytes: int
    offset: int
    sizes: tuple
    strides: tuple
    dtype: int


@dataclass(frozen=True)
class DType:
    code: int


@dataclass(frozen=True)
class Device:
    type: str
    index: int | None = None


@dataclass(frozen=True)
class MemoryFormat:
    code: int


@dataclass(frozen=True)
class Layout:
    code: int


@dataclass(frozen=True)
class SessionGenerator:
    """Stands for a ``torch.Generator`` argument: the session's generator on the node."""
