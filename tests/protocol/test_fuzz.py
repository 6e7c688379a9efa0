"""Property-based tests for the sans-IO protocol (hypothesis).

Whatever bytes a peer sends, a Connection must either produce events or raise
ProtocolError — never another exception, never a hang — and valid events must round-trip
exactly. 10,750 examples in all (see the max_examples settings).
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import struct
import threading

import msgpack
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpuwire.protocol import (
    CLOSED,
    DTYPE_ITEMSIZE,
    DTYPE_NAMES,
    NEED_DATA,
    Connection,
    DecodeError,
    Limits,
    ProtocolError,
    Role,
    State,
)
from gpuwire.protocol import codec
from gpuwire.protocol.events import (
    CLIENT_EVENTS,
    SERVER_EVENTS,
    Alloc,
    CallSync,
    Data,
    Device,
    DType,
    Error,
    Event,
    Free,
    Goodbye,
    Hello,
    InlineTensor,
    Layout,
    MemoryFormat,
    NewTensor,
    Op,
    Query,
    Read,
    Result,
    Seed,
    SessionGenerator,
    SetRngState,
    Sync,
    SyncDone,
    TensorRef,
    Welcome,
    Write,
    wire_fields,
)

PREFIX = struct.Struct("!IQ")
SMALL_LIMITS = Limits(max_header_bytes=1 << 16, max_payload_bytes=1 << 16, max_array_len=256, max_map_len=64,
                      max_str_len=1024, max_bin_len=1 << 16, max_ext_len=1 << 12, max_op_names=64)

FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- helpers


def make_server(limits: Limits | None = None, *, welcome: bool = True) -> Connection:
    """A server that received a valid Hello (and, by default, answered with a Welcome)."""
    server = Connection(Role.SERVER, limits=limits)
    server.receive_data(Connection(Role.CLIENT).send(Hello(client_version="fuzz")))
    assert isinstance(server.next_event(), Hello)
    if welcome:
        server.send(Welcome())
    return server


def make_client(limits: Limits | None = None) -> Connection:
    client = Connection(Role.CLIENT, limits=limits)
    client.send(Hello())
    client.receive_data(Connection(Role.SERVER).send(Welcome()))
    assert isinstance(client.next_event(), Welcome)
    return client


def make_pair():
    client = Connection(Role.CLIENT)
    server = Connection(Role.SERVER)
    server.receive_data(client.send(Hello()))
    server.next_event()
    client.receive_data(server.send(Welcome()))
    client.next_event()
    return client, server


class Hang(Exception):
    pass


@contextlib.contextmanager
def watchdog(seconds: float = 10.0):
    """Fail (instead of hanging the run) if the block spins for more than ``seconds`` of CPU.

    Uses the virtual (CPU-time) timer and SIGVTALRM, so it does not disturb pytest-timeout,
    which uses SIGALRM. Sans-IO code never blocks, so a hang would be a busy loop."""
    if not hasattr(signal, "SIGVTALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise Hang(f"the connection spun for {seconds} s of CPU without returning")

    previous = signal.signal(signal.SIGVTALRM, on_alarm)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def pump(conn: Connection, chunks, *, eof: bool, allowed: frozenset) -> list:
    """Feed ``chunks`` and pull events; return them, or let ProtocolError escape.

    Every call to next_event either consumes a frame or reports NEED_DATA/CLOSED, so the
    loop is bounded by the number of bytes fed; exceeding it means a hang.
    """
    with watchdog():
        return _pump(conn, chunks, eof=eof, allowed=allowed)


def _pump(conn: Connection, chunks, *, eof: bool, allowed: frozenset) -> list:
    events = []
    total = 0
    for chunk in chunks:
        total += len(chunk)
        conn.receive_data(chunk)
        events.extend(_pull(conn, total + 2, allowed))
    if eof:
        conn.receive_data(b"")
        events.extend(_pull(conn, total + 2, allowed))
        assert conn.next_event() is CLOSED
        assert conn.state is State.CLOSED
    return events


def events_or_protocol_error(conn: Connection, chunks, *, eof: bool, allowed: frozenset) -> None:
    """The property of the fuzz tests: the bytes yield valid events or a ProtocolError,
    nothing else, and quickly."""
    try:
        pump(conn, chunks, eof=eof, allowed=allowed)
    except ProtocolError as exc:
        event("ProtocolError: " + re.sub(r"\d+|'.*'", "N", str(exc))[:40])
    else:
        event("accepted")


def _pull(conn: Connection, bound: int, allowed: frozenset) -> list:
    events = []
    for _ in range(bound):
        ev = conn.next_event()
        if ev is NEED_DATA or ev is CLOSED:
            return events
        assert isinstance(ev, Event), ev
        assert type(ev) in allowed, type(ev)
        for name, value in zip(wire_fields(type(ev)), ev.fields()):
            if name in ("seq", "storage_id", "byte_offset", "nbytes", "seed", "reply_to"):
                assert type(value) is int and value >= 0
        if ev.has_payload:
            assert isinstance(ev.payload, (bytes, bytearray, memoryview))
        events.append(ev)
    raise AssertionError("next_event() did not converge: possible infinite loop")


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return [c for c in out if c]


# ---------------------------------------------------------------- strategies

u64 = st.integers(min_value=0, max_value=2**64 - 1)
small_nat = st.integers(min_value=0, max_value=2**31)
msgpack_int = st.integers(min_value=-(2**63), max_value=2**64 - 1)
finite_float = st.floats(allow_nan=False)
text = st.text(max_size=20)
dims = st.integers(min_value=0, max_value=6)


@st.composite
def tensor_refs(draw):
    n = draw(dims)
    sizes = tuple(draw(st.lists(st.integers(0, 2**62), min_size=n, max_size=n)))
    strides = tuple(draw(st.lists(st.integers(-(2**62), 2**62), min_size=n, max_size=n)))
    return TensorRef(draw(u64), draw(st.integers(0, 2**62)), sizes, strides,
                     draw(st.integers(0, len(DTYPE_NAMES) - 1)), draw(st.integers(0, 3)))


@st.composite
def inline_tensors(draw):
    dtype = draw(st.integers(0, len(DTYPE_NAMES) - 1))
    sizes = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    numel = math.prod(sizes)
    data = draw(st.binary(min_size=numel * DTYPE_ITEMSIZE[dtype], max_size=numel * DTYPE_ITEMSIZE[dtype]))
    return InlineTensor(dtype, sizes, data)


@st.composite
def new_tensors(draw):
    n = draw(dims)
    sizes = tuple(draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)))
    strides = tuple(draw(st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n)))
    return NewTensor(draw(u64), draw(small_nat), draw(small_nat), sizes, strides,
                     draw(st.integers(0, len(DTYPE_NAMES) - 1)))


dtypes = st.builds(DType, st.integers(0, len(DTYPE_NAMES) - 1))
complexes = st.complex_numbers(allow_nan=False)

# the leaves the brief asks for, plus the other value types of the codec
leaves = st.one_of(
    st.none(), st.booleans(), msgpack_int, finite_float, text,
    tensor_refs(), dtypes, complexes,
)
extra_leaves = st.one_of(
    st.binary(max_size=16), inline_tensors(), new_tensors(), st.just(SessionGenerator()),
    st.builds(Device, st.sampled_from(["cuda", "cpu", "meta", "mps"]), st.none() | st.integers(0, 16)),
    st.builds(MemoryFormat, st.integers(0, len(codec.MEMORY_FORMAT_NAMES) - 1)),
    st.builds(Layout, st.integers(0, len(codec.LAYOUT_NAMES) - 1)),
)


def trees(leaf):
    return st.recursive(
        leaf,
        lambda children: st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3),
        max_leaves=12,
    )


arg_trees = trees(leaves)
any_trees = trees(st.one_of(leaves, extra_leaves))
op_names = st.text(min_size=1, max_size=40)
outs = st.lists(st.tuples(u64, small_nat, st.lists(small_nat, max_size=4), st.lists(st.integers(-100, 100), max_size=4),
                          st.integers(0, len(DTYPE_NAMES) - 1)).map(list), max_size=3)

ops = st.builds(
    Op,
    seq=u64,
    name=op_names,
    args=st.lists(arg_trees, max_size=3),
    kwargs=st.dictionaries(text, arg_trees, max_size=3),
    outs=outs,
)
payloads = st.binary(max_size=64)
client_events = st.one_of(
    ops,
    ops,
    st.builds(CallSync, seq=u64, name=op_names, args=st.lists(any_trees, max_size=4),
              kwargs=st.dictionaries(text, any_trees, max_size=3)),
    st.builds(Alloc, seq=u64, storage_id=u64, nbytes=u64),
    st.builds(Free, seq=u64, storage_ids=st.lists(u64, max_size=5)),
    st.builds(Write, seq=u64, storage_id=u64, byte_offset=u64, payload=payloads),
    st.builds(Read, seq=u64, storage_id=u64, byte_offset=u64, nbytes=u64),
    st.builds(Sync, seq=u64),
    st.builds(Seed, seq=u64, seed=u64),
    st.builds(Query, seq=u64, what=text),
    st.builds(SetRngState, seq=u64, payload=payloads),
)
server_events = st.one_of(
    st.builds(Data, seq=u64, payload=payloads),
    st.builds(Result, seq=u64, value=any_trees),
    st.builds(SyncDone, seq=u64),
    st.builds(Error, seq=u64, reply_to=u64, op=text, exc_type=text, message=text),
    st.builds(Goodbye, reason=text),
)


def same(a, b) -> bool:
    """Exact structural equality: types must match too (True is not 1, 1.0 is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return struct.pack("!d", a) == struct.pack("!d", b)
    if isinstance(a, complex):
        return struct.pack("!dd", a.real, a.imag) == struct.pack("!dd", b.real, b.imag)
    if isinstance(a, (TensorRef, NewTensor)):
        return a == b and type(b.sizes) is tuple and type(b.strides) is tuple
    if isinstance(a, InlineTensor):
        return a == b and type(b.sizes) is tuple and type(b.data) is bytes
    return a == b


# ---------------------------------------------------------------- (a) random bytes never crash


@settings(max_examples=3500, **FUZZ)
@given(data=st.binary(max_size=512), cuts=st.lists(st.integers(0, 512), max_size=4), eof=st.booleans(),
       welcome=st.booleans())
def test_random_bytes_after_hello(data, cuts, eof, welcome):
    server = make_server(welcome=welcome)
    events_or_protocol_error(server, split(data, cuts), eof=eof, allowed=CLIENT_EVENTS)


raw_header = st.one_of(
    st.binary(min_size=1, max_size=200),
    # plausible headers: a msgpack array whose first element is a valid code, then junk
    st.tuples(st.integers(1, 7), st.sampled_from([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30]),
              st.binary(max_size=120)).map(lambda t: bytes([0x90 + t[0], t[1]]) + t[2]),
)


@settings(max_examples=2000, **FUZZ)
@given(frames=st.lists(st.tuples(raw_header, st.binary(max_size=32)), min_size=1, max_size=4),
       limited=st.booleans(), eof=st.booleans())
def test_random_headers_in_well_formed_frames(frames, limited, eof):
    """Correct length prefixes around random headers: exercises the msgpack/value decoding."""
    server = make_server(SMALL_LIMITS if limited else None)
    data = b"".join(PREFIX.pack(len(h), len(p)) + h + p for h, p in frames)
    events_or_protocol_error(server, [data], eof=eof, allowed=CLIENT_EVENTS)


@settings(max_examples=2000, **FUZZ)
@given(data=st.binary(max_size=400), eof=st.booleans())
def test_random_bytes_to_client(data, eof):
    client = make_client()
    events_or_protocol_error(client, [data], eof=eof, allowed=SERVER_EVENTS)


msgpack_junk = st.recursive(
    st.one_of(st.none(), st.booleans(), msgpack_int, st.floats(), text, st.binary(max_size=20)),
    lambda children: st.lists(children, max_size=7).map(tuple) | st.dictionaries(text, children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=800, **FUZZ)
@given(code=st.integers(0, 12), body=st.one_of(st.binary(max_size=64),
                                                msgpack_junk.map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_extension_hook_raises_only_decode_error(code, body):
    try:
        codec.ext_hook(code, body)
    except DecodeError:
        pass
    # and inside a frame the same data gives an event or ProtocolError
    server = make_server()
    arg = msgpack.packb(msgpack.ExtType(code, body))
    header = bytes([0x96, Op.code, 0, 0, 0x91]) + arg + b"\x80\x90"
    define = msgpack.packb([10, 0, "aten::fuzz"])
    frames = PREFIX.pack(len(define), 0) + define + PREFIX.pack(len(header), 0) + header
    events_or_protocol_error(server, [frames], eof=True, allowed=CLIENT_EVENTS)


# ---------------------------------------------------------------- (b) mutated valid frames


MUTATIONS = ("truncate", "flip", "set_byte", "header_len", "payload_len", "insert", "delete", "swap_frames")


@st.composite
def mutated_streams(draw):
    events = draw(st.lists(client_events, min_size=1, max_size=2))
    client, _ = make_pair()
    frames = [bytearray(client.send(e)) for e in events]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(MUTATIONS))
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        if kind == "truncate":
            del f[draw(st.integers(0, len(f))):]
        elif kind == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            f[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set_byte" and f:
            f[draw(st.integers(0, len(f) - 1))] = draw(st.integers(0, 255))
        elif kind == "header_len" and len(f) >= 4:
            old = struct.unpack_from("!I", f, 0)[0]
            new = draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(-3, 3).map(lambda d: max(0, old + d))))
            struct.pack_into("!I", f, 0, min(new, 2**32 - 1))
        elif kind == "payload_len" and len(f) >= 12:
            old = struct.unpack_from("!Q", f, 4)[0]
            new = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(-3, 3).map(lambda d: max(0, old + d))))
            struct.pack_into("!Q", f, 4, min(new, 2**64 - 1))
        elif kind == "insert":
            pos = draw(st.integers(0, len(f)))
            f[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete" and f:
            pos = draw(st.integers(0, len(f) - 1))
            del f[pos:pos + draw(st.integers(1, 4))]
        elif kind == "swap_frames" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
    return b"".join(bytes(f) for f in frames)


@settings(max_examples=1000, **FUZZ)
@given(data=mutated_streams(), cuts=st.lists(st.integers(0, 4096), max_size=3), eof=st.booleans())
def test_mutated_frames(data, cuts, eof):
    server = make_server()
    events_or_protocol_error(server, split(data, cuts), eof=eof, allowed=CLIENT_EVENTS)


# ---------------------------------------------------------------- (c) round trips


@settings(max_examples=800, **FUZZ)
@given(op=ops, twice=st.booleans(), cuts=st.lists(st.integers(0, 4096), max_size=3))
def test_random_ops_round_trip(op, twice, cuts):
    client, server = make_pair()
    events = [op, Op(seq=op.seq + 1 if op.seq < 2**64 - 1 else 0, name=op.name, args=op.args, kwargs=op.kwargs,
                     outs=op.outs)] if twice else [op]
    data = b"".join(client.send(e) for e in events)
    chunks = split(data, cuts)
    got = pump(server, chunks, eof=False, allowed=CLIENT_EVENTS)
    assert len(got) == len(events)
    for sent, received in zip(events, got):
        assert type(received) is Op
        assert received.seq == sent.seq and received.name == sent.name
        assert same(received.args, sent.args), (received.args, sent.args)
        assert same(received.kwargs, sent.kwargs), (received.kwargs, sent.kwargs)
        assert same(received.outs, sent.outs)
        assert received == sent


@settings(max_examples=250, **FUZZ)
@given(events=st.lists(client_events, min_size=1, max_size=3))
def test_random_client_events_round_trip(events):
    client, server = make_pair()
    data = b"".join(client.send(e) for e in events)
    assert pump(server, [data], eof=False, allowed=CLIENT_EVENTS) == events


@settings(max_examples=250, **FUZZ)
@given(events=st.lists(server_events, min_size=1, max_size=3))
def test_random_server_events_round_trip(events):
    client, server = make_pair()
    data = b""
    for e in events:
        data += server.send(e)
        if isinstance(e, Goodbye):
            break
    n = next((i + 1 for i, e in enumerate(events) if isinstance(e, Goodbye)), len(events))
    expected = events[:n]
    got = pump(client, [data], eof=False, allowed=SERVER_EVENTS)
    assert got == expected
    for sent, received in zip(expected, got):
        if isinstance(sent, Result):
            assert same(received.value, sent.value)


@settings(max_examples=150, **FUZZ)
@given(seq=u64, name=op_names, args=st.lists(arg_trees, max_size=3), kwargs=st.dictionaries(text, arg_trees, max_size=2),
       out=outs, repeat=st.integers(1, 3))
def test_encode_op_matches_send(seq, name, args, kwargs, out, repeat):
    c1, s1 = make_pair()
    c2, s2 = make_pair()
    for _ in range(repeat):
        s1.receive_data(c1.encode_op(seq, name, args, kwargs, out))
        s2.receive_data(c2.send(Op(seq=seq, name=name, args=args, kwargs=kwargs, outs=out)))
    got1 = _pull(s1, 10, CLIENT_EVENTS)
    got2 = _pull(s2, 10, CLIENT_EVENTS)
    assert got1 == got2 == [Op(seq=seq, name=name, args=args, kwargs=kwargs, outs=out)] * repeat
