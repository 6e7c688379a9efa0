"""The inline decode path for ``Op`` frames (``Connection.next_event`` / ``_fast_op``) against the
generic one (``_next_frame`` / ``_to_event``): the same event for every well-formed frame, the
same ProtocolError for every malformed one, and the generic path for every frame it does not
take (payloads, other events, other states)."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwire.protocol import NEED_DATA, Connection, ProtocolError, Role
from gpuwire.protocol.events import Hello, Op, TensorRef, Welcome
from gpuwire.protocol import codec

PREFIX = struct.Struct("!IQ")
DEFINE_OP = 10


def frame(header, payload_len: int = 0) -> bytes:
    raw = header if isinstance(header, (bytes, bytearray)) else msgpack.packb(header, use_bin_type=True, default=codec.default)
    return PREFIX.pack(len(raw), payload_len) + bytes(raw)


def server(names=("aten::add.Tensor", "aten::mul.Tensor")) -> Connection:
    conn = Connection(Role.SERVER)
    conn.receive_data(Connection(Role.CLIENT).send(Hello()))
    assert isinstance(conn.next_event(), Hello)
    conn.send(Welcome())
    for index, name in enumerate(names):
        conn.receive_data(frame([DEFINE_OP, index, name]))
    assert conn.next_event() is NEED_DATA
    return conn


def _outcome(conn: Connection, data: bytes, read):
    conn.receive_data(data)
    try:
        return read()
    except ProtocolError as exc:
        return ("error", type(exc), str(exc))


def generic(conn: Connection, data: bytes):
    """What the generic path makes of one frame: ``_next_frame`` alone (never the inline path)."""
    return _outcome(conn, data, conn._next_frame)


def fast(conn: Connection, data: bytes):
    return _outcome(conn, data, conn.next_event)


def same(header, payload_len: int = 0):
    data = frame(header, payload_len)
    a, b = server(), server()
    got_fast, got_generic = fast(a, data), generic(b, data)
    assert got_fast == got_generic
    if isinstance(got_fast, Op):
        assert type(got_fast.args) is list and type(got_fast.kwargs) is dict and type(got_fast.outs) is list
    assert a._pos == b._pos and a.state is b.state
    return got_fast


def test_well_formed_op_is_the_same_event():
    ref = TensorRef(0x1000, 0, (2, 3), (3, 1), 0)
    event = same([Op.code, 7, 1, [ref, 1.5], {"alpha": 2}, [[0x2000, 24, [2, 3], [3, 1], 0]]])
    assert event == Op(7, "aten::mul.Tensor", [ref, 1.5], {"alpha": 2}, [[0x2000, 24, [2, 3], [3, 1], 0]])


@pytest.mark.parametrize("header", [
    [Op.code, 0, 2, [], {}, []],  # undefined op index
    [Op.code, 0, -1, [], {}, []],
    [Op.code, 0, "0", [], {}, []],
    [Op.code, 0, True, [], {}, []],
    [Op.code, 0, 1.0, [], {}, []],
    [Op.code, -1, 0, [], {}, []],  # negative seq
    [Op.code, True, 0, [], {}, []],  # bool is not an int on the wire
    [Op.code, 1.0, 0, [], {}, []],
    [Op.code, None, 0, [], {}, []],
    [Op.code, 0, 0, {}, {}, []],  # args not a list
    [Op.code, 0, 0, [], [], []],  # kwargs not a map
    [Op.code, 0, 0, [], {}, {}],  # outs not a list
    [Op.code, 0, 0, [], {}, None],
    [Op.code, 0, 0, [], {}],  # too few fields
    [Op.code, 0, 0, [], {}, [], []],  # too many
    [Op.code],
])
def test_malformed_op_fails_the_same_way(header):
    result = same(header)
    assert isinstance(result, tuple) and result[0] == "error"


def test_op_with_a_payload_is_refused_by_the_generic_path():
    data = frame([Op.code, 0, 0, [], {}, []], payload_len=4) + b"abcd"
    assert fast(server(), data) == generic(server(), data)
    assert fast(server(), data)[0] == "error"


def test_op_before_the_handshake_and_at_a_client():
    data = frame([DEFINE_OP, 0, "aten::add.Tensor"]) + frame([Op.code, 0, 0, [], {}, []])
    for make in (lambda: Connection(Role.SERVER), client):
        a, b = make(), make()
        a.receive_data(data)
        b.receive_data(data)
        with pytest.raises(ProtocolError) as fast_error:
            while a.next_event() is not NEED_DATA:
                pass
        with pytest.raises(ProtocolError) as generic_error:
            while b._next_frame() is not NEED_DATA:
                pass
        assert str(fast_error.value) == str(generic_error.value)


def client() -> Connection:
    conn = Connection(Role.CLIENT)
    conn.send(Hello())
    conn.receive_data(Connection(Role.SERVER).send(Welcome()))
    assert isinstance(conn.next_event(), Welcome)
    return conn


def test_frames_split_anywhere_decode_the_same():
    frames = b"".join(frame([Op.code, seq, seq % 2, [seq], {}, []]) for seq in range(20))
    conn = server()
    events = []
    for i in range(0, len(frames), 7):  # 7-byte pieces: prefixes and headers arrive in parts
        conn.receive_data(frames[i:i + 7])
        while (event := conn.next_event()) is not NEED_DATA:
            events.append(event)
    assert [e.seq for e in events] == list(range(20))
    assert all(e.args == [e.seq] for e in events)


_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=4), st.binary(max_size=4), st.just([]), st.just({}), st.lists(st.integers(0, 3), max_size=3),
                    st.dictionaries(st.text(max_size=2), st.integers(-(2**63), 2**64 - 1), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.lists(_values, min_size=0, max_size=7), valid_prefix=st.booleans())
def test_any_op_header_decodes_the_same(fields, valid_prefix):
    if valid_prefix and len(fields) >= 5:
        fields[0], fields[1] = abs(fields[0]) if type(fields[0]) is int else 0, 1
    same([Op.code, *fields])
