"""Sans-IO connection state machine for the data plane (in the style of h11).

No sockets here: ``send(event)`` returns the bytes to write, ``receive_data(bytes)`` feeds
what was read (``b""`` for end of stream), ``next_event()`` returns the next complete event,
``NEED_DATA`` or ``CLOSED``. The transport (client runtime, node server) owns all I/O.

Frame layout (all integers big-endian)::

    u32 header_len | u64 payload_len | header (msgpack array [code, *fields]) | payload

Every length is checked against ``Limits`` before anything is buffered or allocated; msgpack
decoding runs with per-container bounds and a hard nesting limit. A malformed frame raises
:class:`ProtocolError` naming what was wrong, and the connection is then unusable.

Op names are interned per connection: the first ``Op`` naming an op carries a definition
frame, later ones a small integer, invisibly to both sides' application code.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import msgpack

from . import codec
from .events import (
    CLIENT_EVENTS,
    Alloc,
    EVENT_TYPES,
    MAGIC,
    PROTOCOL_VERSION,
    SERVER_EVENTS,
    CallSync,
    Event,
    Goodbye,
    Hello,
    Op,
    Reject,
    Sync,
    SyncDone,
    Welcome,
    wire_fields,
)

PREFIX = struct.Struct("!IQ")
_PREFIX_PACK = PREFIX.pack
_PREFIX_UNPACK_FROM = PREFIX.unpack_from
_PREFIX_SIZE = PREFIX.size
LARGE_PAYLOAD = 64 << 10  # payloads at least this large bypass the frame buffer
_DEFINE_OP = 10  # internal frame: [10, op_index, name]
_OP = Op.code
_OP_HEAD = bytes([0x96]) + msgpack.packb(_OP)  # [_OP, seq, index, args, kwargs, outs]

# Events whose header is [code, seq] and nothing else: the synchronize round trip (one a
# training step, one an ``.item()``) is one of each, and the generic encoder and decoder cost
# ~4 us a frame each end (field tuples, msgpack calls, per-field type checks), as much as the
# system calls; these frames are written and read by hand.
_SEQ_ONLY = {Sync: Sync.code, SyncDone: SyncDone.code}
_SEQ_ONLY_BY_CODE = {code: cls for cls, code in _SEQ_ONLY.items()}
_UINT8, _UINT16, _UINT32, _UINT64 = struct.Struct("!BBBB"), struct.Struct("!BBBH"), struct.Struct("!BBBI"), struct.Struct("!BBBQ")


def _seq_only_frame(code: int, seq: int) -> bytes:
    """The frame of a [code, seq] event, bytes exactly as msgpack writes them."""
    if seq < 0x80:
        header = bytes((0x92, code, seq))
    elif seq <= 0xFF:
        header = _UINT8.pack(0x92, code, 0xCC, seq)
    elif seq <= 0xFFFF:
        header = _UINT16.pack(0x92, code, 0xCD, seq)
    elif seq <= 0xFFFFFFFF:
        header = _UINT32.pack(0x92, code, 0xCE, seq)
    else:
        header = _UINT64.pack(0x92, code, 0xCF, seq)
    return _PREFIX_PACK(len(header), 0) + header


# a [code, seq] header's length -> the msgpack type byte its seq carries (None: a positive fixint)
_SEQ_WIDTHS = {3: None, 4: (0xCC, _UINT8), 5: (0xCD, _UINT16), 7: (0xCE, _UINT32), 11: (0xCF, _UINT64)}


class ProtocolError(Exception):
    """The peer sent something that is not valid gpuwire protocol."""


class StreamCut(ProtocolError):
    """The byte stream ended in the middle of a frame: the connection was cut (a network failure,
    a peer that reconnects after an interrupted send), not a violation of the protocol. The frame
    may come again, whole, on another connection."""


class VersionMismatch(ProtocolError):
    """The two sides speak different protocol versions."""


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


_OPEN = State.OPEN

NEED_DATA = _Sentinel("NEED_DATA")
CLOSED = _Sentinel("CLOSED")


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every received frame before allocation."""

    max_header_bytes: int = 16 << 20
    max_payload_bytes: int = 256 << 20
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 12
    max_str_len: int = 1 << 20
    max_bin_len: int = 1 << 24
    max_ext_len: int = 1 << 20
    max_op_names: int = 1 << 16

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check_hello(hello: Hello, server_version: str) -> None:
    """Server side: raise VersionMismatch (naming both versions) unless the client is compatible."""
    if hello.magic != MAGIC:
        raise ProtocolError(f"not a gpuwire client (magic {hello.magic!r})")
    if hello.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: client {hello.client_version or '?'} speaks protocol "
            f"v{hello.protocol_version}, node {server_version} speaks v{PROTOCOL_VERSION}; "
            "install the same gpuwire release on both sides")


class Connection:
    """One side of one data-plane connection."""

    def __init__(self, role: Role, *, limits: Limits | None = None, default=None, ext_hook=None, payload_sink=None):
        self.role = role
        self.limits = limits or Limits()
        self._max_header = self.limits.max_header_bytes
        self.state = State.HANDSHAKE
        self._packer = msgpack.Packer(default=default or codec.default, use_bin_type=True, autoreset=True)
        self._default = default or codec.default
        self._packing = False  # see ``_pack``
        self._ext_hook = ext_hook or codec.ext_hook
        self._op_runner = None  # see ``bind``
        self._op_frames_runner = None
        self._buffer = bytearray()
        self._pos = 0
        self._eof = False
        self._op_index: dict[str, int] = {}  # our outgoing interned names
        self._op_names: list[str] = []  # the peer's interned names
        self._outgoing = CLIENT_EVENTS if role is Role.CLIENT else SERVER_EVENTS
        self._incoming = SERVER_EVENTS if role is Role.CLIENT else CLIENT_EVENTS
        self._receives_ops = Op in self._incoming
        self.peer_hello: Hello | None = None
        self.peer_welcome: Welcome | None = None
        # large payloads are received straight into their own buffer (or one the application
        # provides through ``payload_sink(header, nbytes)``) instead of the frame buffer
        self._payload_sink = payload_sink
        self._pending = None  # [header, view, filled, total] while a large payload arrives
        self._scratch = bytearray(0)
        self._direct = False

    # ------------------------------------------------------------ sending

    def send(self, event: Event) -> bytes:
        """Bytes to write for ``event`` (frame header and payload joined)."""
        return b"".join(self.send_parts(event))

    def send_parts(self, event: Event) -> list:
        """Like ``send`` but returns a list of buffers for scatter-gather I/O; a payload is
        returned as-is (no copy), so large transfers can go straight to ``socket.sendmsg``."""
        cls = type(event)
        code = _SEQ_ONLY.get(cls)
        if code is not None and self.state is _OPEN and cls in self._outgoing:
            seq = event.seq
            if type(seq) is int and 0 <= seq < (1 << 64):
                return [_seq_only_frame(code, seq)]
        if cls not in self._outgoing:
            raise ProtocolError(f"a {self.role.value} cannot send {cls.__name__}")
        if self.state is State.CLOSED:
            raise ProtocolError("connection is closed")
        if self.state is State.HANDSHAKE:
            expected = Hello if self.role is Role.CLIENT else (Welcome, Reject)
            if not isinstance(event, expected):
                raise ProtocolError(f"{cls.__name__} sent before the handshake completed")
        parts = []
        if cls is Op or cls is CallSync:
            fields = list(event.fields())
            index, header = self._pack_named(event.name, lambda index: (cls.code, fields[0], index, *fields[2:]))
            if index is None:
                index = len(self._op_index)
                self._op_index[event.name] = index
                parts.append(self._frame(self._pack((_DEFINE_OP, index, event.name)), 0))
        else:
            header = self._pack((cls.code, *event.fields()))
        payload = event.payload if cls.has_payload else b""
        payload_len = memoryview(payload).nbytes if payload else 0
        parts.append(self._frame(header, payload_len))
        if payload_len:
            parts.append(payload)
        self._after_send(event)
        return parts

    def encode_op(self, seq: int, name: str, args, kwargs, outs) -> bytes:
        """Hot path for the client: the frame(s) of an ``Op`` without building the event."""
        if self.state is not State.OPEN:
            raise ProtocolError("Op sent before the handshake completed")
        index = self._op_index.get(name)
        if index is not None and not self._packing:  # (the usual case, written out: see ``_pack``)
            self._packing = True
            try:
                header = self._packer.pack((_OP, seq, index, args, kwargs, outs))
            finally:
                self._packing = False
            return _PREFIX_PACK(len(header), 0) + header
        known, header = self._pack_named(name, lambda index: (_OP, seq, index, args, kwargs, outs))
        if known is None:
            index = len(self._op_index)
            self._op_index[name] = index
            return self._frame(self._pack((_DEFINE_OP, index, name)), 0) + _PREFIX_PACK(len(header), 0) + header
        return _PREFIX_PACK(len(header), 0) + header

    def _pack_named(self, name: str, fields):
        """(the index ``name`` already had or None, the msgpack of ``fields(index)``) where a
        new name takes the next index, interned by the caller only once this succeeded (a
        failed encoding must not leave a half-defined name). Packed again should a nested
        encoding (``_pack``) have interned names meanwhile, so indices stay in definition order."""
        while True:
            known = self._op_index.get(name)
            index = known if known is not None else len(self._op_index)
            header = self._pack(fields(index))
            if self._op_index.get(name) == known and (known is not None or len(self._op_index) == index):
                return known, header

    def encode_prepared_op(self, seq: int, name: str, body: bytes, outs: bytes) -> bytes | None:
        """Hot path for the client's native kernels: the frame of an ``Op`` whose arguments
        (``body``: the msgpack of its args and kwargs) and out declarations (``outs``: their
        msgpack array) come encoded. None where the op has no index on this connection yet or
        the connection is not open (the caller takes the general path, ``encode_op``, which
        names the op or raises)."""
        index = self._op_index.get(name)
        if index is None or self.state is not State.OPEN:
            return None
        pack = self._packer.pack if not self._packing else self._pack  # (ints: no hook runs here)
        header = b"".join((_OP_HEAD, pack(seq), pack(index), body, outs))
        return _PREFIX_PACK(len(header), 0) + header

    def encode_alloc(self, seq: int, storage_id: int, nbytes: int, overwrite: bool = False) -> bytes:
        """Hot path for the client: the frame of an ``Alloc`` without building the event."""
        return self._frame(self._pack((Alloc.code, seq, storage_id, nbytes, overwrite)), 0)

    # ------------------------------------------------------------ moving a session between connections

    @property
    def defined_op_names(self) -> list[str]:
        """The names this side has interned for sending, in index order."""
        return sorted(self._op_index, key=self._op_index.__getitem__)

    @property
    def peer_op_names(self) -> list[str]:
        """The names the peer has defined for us so far, in index order."""
        return list(self._op_names)

    def continue_encoding_from(self, other: "Connection") -> None:
        """Reuse ``other``'s outgoing name table, so frames encoded on ``other`` stay valid here
        (a resumed or rebuilt session; the peer learns the names from ``op_definitions``)."""
        self._op_index = dict(other._op_index)

    def continue_decoding_from(self, names: list[str]) -> None:
        """Start with the peer's name table of an earlier connection of the same session."""
        if len(names) > self.limits.max_op_names:
            raise ProtocolError("too many distinct op names on one connection")
        self._op_names = list(names)

    def bind(self, *, ext_hook=None, payload_sink=None, op_runner=None, op_frames_runner=None) -> None:
        """Attach the application's decoding hooks once it knows who the peer is (a node learns
        from the Hello whether the connection starts a session or resumes one).

        ``op_runner(raw_header, op_names)``: offered each complete ``Op`` frame's header bytes
        before they are decoded; it returns the event to hand out in its place (the node's
        native loop ran the op from the bytes: node/loop.py), or None and the frame is decoded
        as usual. ``op_frames_runner(buffer, start, op_names, max_header)`` (with ``op_runner``):
        offered the receive buffer where a complete ``Op`` frame starts; it may take several
        frames at once and returns (the position after the last one it took, the event for
        them), or None when it took none, and that frame is decoded as usual. The protocol
        itself stays pure: the hooks are the application's."""
        self._ext_hook = ext_hook or codec.ext_hook
        self._payload_sink = payload_sink
        self._op_runner = op_runner
        self._op_frames_runner = op_frames_runner if op_runner is not None else None

    def adopt_op_names(self, names: list[str]) -> bytes:
        """Take ``names`` as our outgoing table (a node handing a client's session to another
        node) and return the definition frames that teach it to the peer."""
        self._op_index = {name: index for index, name in enumerate(names)}
        return self.op_definitions(len(names))

    def op_definitions(self, count: int) -> bytes:
        """Definition frames for the first ``count`` outgoing names (a rebuilt session's node
        must know the names the replayed frames use before it sees them)."""
        return b"".join(self._frame(self._pack((_DEFINE_OP, index, name)), 0)
                        for index, name in enumerate(self.defined_op_names[:count]))

    def _pack(self, obj) -> bytes:
        """The msgpack of ``obj``, safe to re-enter. The ``default`` hook runs Python (a tensor's
        descriptor), and what runs inside it may encode another frame on this connection
        meanwhile: torch.compile's frame hook did (it resets global flags, which the client
        records as an op). Sharing the packer then interleaved the two frames' bytes and the
        node dropped the session; a nested call gets a packer of its own."""
        if self._packing:
            return msgpack.Packer(default=self._default, use_bin_type=True).pack(obj)
        self._packing = True
        try:
            return self._packer.pack(obj)
        finally:
            self._packing = False

    @staticmethod
    def _frame(header: bytes, payload_len: int) -> bytes:
        return PREFIX.pack(len(header), payload_len) + header

    def _after_send(self, event: Event) -> None:
        if isinstance(event, (Reject, Goodbye)):
            self.state = State.CLOSED
        elif isinstance(event, Welcome):
            self.state = State.OPEN

    # ------------------------------------------------------------ receiving

    def receive_data(self, data: bytes) -> None:
        if data:
            if self._eof:
                raise ProtocolError("data received after end of stream")
            self._buffer += data
        else:
            self._eof = True

    def get_buffer(self, sizehint: int = 1 << 20) -> memoryview:
        """A writable buffer for the transport to ``recv_into``; report how much it filled with
        ``buffer_updated`` (the asyncio BufferedProtocol pattern). While a large payload is
        arriving this is the payload's own destination, so bulk bytes are copied only by the
        kernel."""
        pending = self._pending
        if pending is not None and self._pos == len(self._buffer):
            self._direct = True
            return pending[1][pending[2]:]
        self._direct = False
        if len(self._scratch) < sizehint:
            self._scratch = bytearray(sizehint)
        return memoryview(self._scratch)[:sizehint]

    def buffer_updated(self, nbytes: int) -> None:
        if nbytes == 0:
            self.receive_data(b"")
        elif self._direct:
            self._pending[2] += nbytes
        else:
            self.receive_data(memoryview(self._scratch)[:nbytes])

    @property
    def payload_remaining(self) -> int:
        """Bytes of a large payload still to come while nothing else is buffered: the transport
        may receive them into ``get_buffer()`` back to back, with no event to look for between."""
        pending = self._pending
        if pending is None or self._pos != len(self._buffer):
            return 0
        return pending[3] - pending[2]

    @property
    def mid_frame(self) -> bool:
        """Part of a frame has arrived and the rest has not."""
        return self._pending is not None or len(self._buffer) > self._pos

    @property
    def buffered(self) -> int:
        return len(self._buffer) - self._pos

    def next_event(self):
        while True:
            # the common frame, inline: complete in the buffer, no payload, no compaction due;
            # anything else (and every limit violation) takes ``_next_frame``
            buf = self._buffer
            start = self._pos
            if self._pending is None and len(buf) - start >= _PREFIX_SIZE:
                header_len, payload_len = _PREFIX_UNPACK_FROM(buf, start)
                end = start + _PREFIX_SIZE + header_len
                if (not payload_len and 0 < header_len <= self._max_header and end <= len(buf)
                        and not (end > (1 << 20) and end * 2 > len(buf))):
                    runner = self._op_runner
                    offer = (runner is not None and self.state is _OPEN
                             and buf.startswith(_OP_HEAD, start + _PREFIX_SIZE))
                    if offer and self._op_frames_runner is not None:
                        ran = self._op_frames_runner(buf, start, self._op_names, self._max_header)
                        if ran is not None:
                            self._pos, event = ran
                            return event
                        offer = False  # (it refused this frame: so would ``runner``)
                    if header_len in _SEQ_WIDTHS and self.state is _OPEN:
                        event = self._seq_only_event(buf, start + _PREFIX_SIZE, header_len)
                        if event is not None:
                            self._pos = end
                            return event
                    raw_header = buf[start + _PREFIX_SIZE:end]
                    self._pos = end  # consumed before decoding: a bad frame is never seen twice
                    if offer:
                        event = runner(raw_header, self._op_names)
                        if event is not None:
                            return event
                    header = self._decode_header(raw_header)
                    if header[0] == _OP and self.state is _OPEN and self._receives_ops:
                        event = self._fast_op(header)
                        if event is not None:
                            return event
                    event = self._to_event(header, b"", 0)
                    if event is not _DEFINE:
                        return event
                    continue
            event = self._next_frame()
            if event is not _DEFINE:
                return event

    def _seq_only_event(self, buf, at: int, header_len: int):
        """The event of a well-formed [code, seq] frame this side may receive (``Sync`` on a
        node, ``SyncDone`` on a client), read without msgpack; None for anything else, which
        then takes the generic path (and fails there with its usual message)."""
        if buf[at] != 0x92:
            return None
        cls = _SEQ_ONLY_BY_CODE.get(buf[at + 1])
        if cls is None or cls not in self._incoming:
            return None
        width = _SEQ_WIDTHS[header_len]
        if width is None:
            seq = buf[at + 2]
            if seq >= 0x80:
                return None
        else:
            kind, layout = width
            if buf[at + 2] != kind:
                return None
            seq = layout.unpack_from(buf, at)[3]
        return cls(seq)

    def _fast_op(self, header: list):
        """The event of a well-formed ``Op`` frame on an open server connection, built with
        the same checks as ``_to_event`` (field count, op index, field types) but inline: it
        is most of what a node receives. None for anything else, which then takes the generic
        path and fails there with its usual message."""
        if len(header) == 6:
            _, seq, index, args, kwargs, outs = header
            names = self._op_names
            if (type(index) is int and 0 <= index < len(names) and type(seq) is int and seq >= 0
                    and type(args) is list and type(kwargs) is dict and type(outs) is list):
                return Op(seq, names[index], args, kwargs, outs)
        return None

    def _next_frame(self):
        if self._pending is not None:
            return self._continue_payload()
        buf = self._buffer
        start = self._pos
        available = len(buf) - start
        if available < PREFIX.size:
            return self._starved(available)
        header_len, payload_len = PREFIX.unpack_from(buf, start)
        if header_len == 0 or header_len > self.limits.max_header_bytes:
            raise ProtocolError(f"frame header of {header_len} bytes is outside 1..{self.limits.max_header_bytes}")
        if payload_len > self.limits.max_payload_bytes:
            raise ProtocolError(f"frame payload of {payload_len} bytes exceeds the limit of {self.limits.max_payload_bytes}")
        end = start + PREFIX.size + header_len + payload_len
        header_end = start + PREFIX.size + header_len
        if len(buf) < end and payload_len >= LARGE_PAYLOAD and len(buf) >= header_end:
            return self._begin_payload(bytes(buf[start + PREFIX.size:header_end]), header_end, payload_len)
        if len(buf) < end:
            return self._starved(available)
        raw_header = buf[start + PREFIX.size:header_end]  # a copy: the buffer may move below
        payload = bytes(buf[header_end:end]) if payload_len else b""
        # consume the frame before decoding it: a frame that fails to decode is never seen twice
        self._pos = end
        if self._pos > (1 << 20) and self._pos * 2 > len(buf):
            del buf[:self._pos]
            self._pos = 0
        return self._to_event(self._decode_header(raw_header), payload, payload_len)

    def _begin_payload(self, raw_header: bytes, header_end: int, payload_len: int):
        self._pos = header_end
        header = self._decode_header(raw_header)
        cls = EVENT_TYPES.get(header[0])
        if cls is None or not cls.has_payload or cls not in self._incoming:
            raise ProtocolError(f"event code {header[0]} cannot carry a {payload_len}-byte payload here")
        view = self._payload_sink(header, payload_len) if self._payload_sink is not None else None
        own = view is None
        if own:
            view = memoryview(bytearray(payload_len))
        elif view.nbytes != payload_len or view.readonly:
            raise ValueError("payload_sink must return a writable buffer of exactly the payload's size")
        self._pending = [header, view.cast("B") if view.format != "B" else view, 0, payload_len, own]
        return self._continue_payload()

    def _continue_payload(self):
        header, view, filled, total, own = self._pending
        buf = self._buffer
        leftover = len(buf) - self._pos
        if leftover and filled < total:
            take = min(leftover, total - filled)
            view[filled:filled + take] = memoryview(buf)[self._pos:self._pos + take]
            self._pos += take
            filled = self._pending[2] = filled + take
            if self._pos == len(buf):
                buf.clear()
                self._pos = 0
        if filled < total:
            if self._eof:
                raise StreamCut(f"connection closed in the middle of a {total}-byte payload ({filled} received)")
            return NEED_DATA
        self._pending = None
        # our own buffer is handed over as the bytearray; a sink's buffer as the view it gave
        return self._to_event(header, view.obj if own else view, total)

    def _starved(self, available: int):
        if self._eof:
            if available:
                raise StreamCut(f"connection closed in the middle of a frame ({available} bytes left over)")
            self.state = State.CLOSED
            return CLOSED
        return NEED_DATA

    def _decode_header(self, raw: bytes):
        lim = self.limits
        try:
            header = msgpack.unpackb(
                raw, raw=False, use_list=True, strict_map_key=True, ext_hook=self._ext_hook,
                max_array_len=lim.max_array_len, max_map_len=lim.max_map_len, max_str_len=lim.max_str_len,
                max_bin_len=lim.max_bin_len, max_ext_len=lim.max_ext_len)
        except msgpack.StackError:
            raise ProtocolError("frame header nests too deeply") from None
        except ProtocolError:
            raise
        except codec.DecodeError as exc:
            raise ProtocolError(f"bad value in frame: {exc}") from None
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"frame header is not valid msgpack: {exc}") from None
        if not isinstance(header, list) or not header or type(header[0]) is not int:
            raise ProtocolError("frame header must be a non-empty array starting with an event code")
        return header

    def _to_event(self, header: list, payload: bytes, payload_len: int):
        code = header[0]
        if code == _DEFINE_OP:
            if payload_len:
                raise ProtocolError("op definition frames carry no payload")
            self._define_op(header)
            return _DEFINE
        cls = EVENT_TYPES.get(code)
        if cls is None:
            raise ProtocolError(f"unknown event code {code}")
        if cls not in self._incoming:
            raise ProtocolError(f"a {self.role.value} cannot receive {cls.__name__}")
        if bool(payload_len) and not cls.has_payload:
            raise ProtocolError(f"{cls.__name__} frames carry no payload")
        fields = header[1:]
        checks = _field_checks(cls)
        if len(fields) != len(checks):
            raise ProtocolError(f"{cls.__name__} frame has {len(fields)} fields, expected {len(checks)}")
        if cls is Op or cls is CallSync:
            index = fields[1]
            if type(index) is not int or not 0 <= index < len(self._op_names):
                raise ProtocolError(f"{cls.__name__} names undefined op index {index!r}")
            fields[1] = self._op_names[index]
        # the wire values are the event's fields, in order: checked before the event is built
        for value, (name, accepted) in zip(fields, checks):
            if accepted is not None and type(value) not in accepted:
                raise ProtocolError(f"{cls.__name__}.{name} has type {type(value).__name__}")
            if accepted is _INT and value < 0:
                raise ProtocolError(f"{cls.__name__}.{name} is negative")
        try:
            event = cls(*fields, payload) if cls.has_payload else cls(*fields)
        except TypeError as exc:
            raise ProtocolError(f"malformed {cls.__name__}: {exc}") from None
        if self.state is not _OPEN or cls is Goodbye or cls is Reject:  # (nothing else changes an open one)
            self._after_receive(event)
        return event

    def _define_op(self, header: list) -> None:
        if len(header) != 3 or type(header[1]) is not int or not isinstance(header[2], str):
            raise ProtocolError("malformed op definition frame")
        if 0 <= header[1] < len(self._op_names) and self._op_names[header[1]] == header[2]:
            return  # a resumed connection may resend a definition the peer already has
        if header[1] != len(self._op_names):
            raise ProtocolError(f"op definitions out of order: got index {header[1]}, expected {len(self._op_names)}")
        if len(self._op_names) >= self.limits.max_op_names:
            raise ProtocolError("too many distinct op names on one connection")
        if len(header[2]) > 256:
            raise ProtocolError("op name longer than 256 characters")
        self._op_names.append(header[2])

    def _after_receive(self, event: Event) -> None:
        if self.state is State.HANDSHAKE:
            expected = Hello if self.role is Role.SERVER else (Welcome, Reject)
            if not isinstance(event, expected):
                raise ProtocolError(f"expected a handshake, got {type(event).__name__}")
            if isinstance(event, Hello):
                if event.magic != MAGIC:
                    raise ProtocolError(f"not a gpuwire client (magic {event.magic!r})")
                self.peer_hello = event
            elif isinstance(event, Welcome):
                if event.magic != MAGIC:
                    raise ProtocolError(f"not a gpuwire node (magic {event.magic!r})")
                if event.protocol_version != PROTOCOL_VERSION:
                    raise VersionMismatch(
                        f"protocol version mismatch: node {event.server_version} speaks protocol "
                        f"v{event.protocol_version}, this client speaks v{PROTOCOL_VERSION}; "
                        "install the same gpuwire release on both sides")
                self.peer_welcome = event
                self.state = State.OPEN
            else:
                self.state = State.CLOSED
        elif isinstance(event, (Goodbye, Reject)):
            self.state = State.CLOSED


_DEFINE = _Sentinel("DEFINE")

# Field types checked on receipt, so application code never sees e.g. a string where an
# integer storage id belongs. (name -> accepted types)
_INT = (int,)
_FIELD_TYPES = {
    "overwrite": (bool,), "seq": _INT, "storage_id": _INT, "byte_offset": _INT, "nbytes": _INT, "seed": _INT,
    "reply_to": _INT, "protocol_version": _INT,
    "name": (str,), "what": (str,), "magic": (str,), "reason": (str,), "client_version": (str,),
    "server_version": (str,), "session_id": (str,), "op": (str,), "exc_type": (str,), "message": (str,),
    "args": (list,), "kwargs": (dict,), "outs": (list,), "storage_ids": (list,), "capabilities": (list,),
    "options": (dict,), "device": (dict,), "limits": (dict,), "token": (str, type(None)),
    "resume": (dict,), "kind": (str,), "data": (dict,), "rng_state": (bytes,), "generators": (list,),
    "next_node_id": _INT, "last_seq": _INT,
}


def _field_checks(cls) -> tuple:
    """((field name, accepted types or None), ...) of ``cls``'s wire fields, built once."""
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        checks = _FIELD_CHECKS[cls] = tuple((name, _FIELD_TYPES.get(name)) for name in wire_fields(cls))
    return checks


_FIELD_CHECKS: dict = {}

