"""Unit tests for the sans-IO connection state machine (gpuwire.protocol.connection).

No sockets: bytes produced by one ``Connection`` are fed straight into another.
"""

from __future__ import annotations

import struct

import msgpack
import pytest

from gpuwire.protocol import (
    CLOSED,
    NEED_DATA,
    PROTOCOL_VERSION,
    Connection,
    Limits,
    ProtocolError,
    Role,
    State,
    StreamCut,
    VersionMismatch,
    check_hello,
)
from gpuwire.protocol import codec
from gpuwire.protocol.events import (
    Alloc,
    CallSync,
    Data,
    Device,
    DType,
    Error,
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
    Reject,
    Result,
    Seed,
    SessionGenerator,
    SetRngState,
    Sync,
    SyncDone,
    TensorRef,
    Welcome,
    Write,
)

PREFIX = struct.Struct("!IQ")  # u32 header_len | u64 payload_len, big-endian
DEFINE_OP = 10  # internal frame code: [10, op_index, name]


# ---------------------------------------------------------------- helpers


def frame(header, payload: bytes = b"", *, payload_len: int | None = None) -> bytes:
    """A raw frame; ``header`` is an object to msgpack or already-packed bytes."""
    raw = header if isinstance(header, (bytes, bytearray)) else msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(raw), len(payload) if payload_len is None else payload_len) + bytes(raw) + payload


def open_pair(*, client_limits: Limits | None = None, server_limits: Limits | None = None):
    """A client and a server connection that completed the handshake."""
    client = Connection(Role.CLIENT, limits=client_limits)
    server = Connection(Role.SERVER, limits=server_limits)
    server.receive_data(client.send(Hello(client_version="test")))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(Welcome(server_version="test", session_id="s1")))
    assert isinstance(client.next_event(), Welcome)
    assert client.state is State.OPEN and server.state is State.OPEN
    return client, server


def open_server(limits: Limits | None = None) -> Connection:
    """A server that received a Hello and sent its Welcome."""
    server = Connection(Role.SERVER, limits=limits)
    server.receive_data(Connection(Role.CLIENT).send(Hello()))
    assert isinstance(server.next_event(), Hello)
    server.send(Welcome())
    return server


def open_client(limits: Limits | None = None) -> Connection:
    client = Connection(Role.CLIENT, limits=limits)
    client.send(Hello())
    client.receive_data(Connection(Role.SERVER).send(Welcome()))
    assert isinstance(client.next_event(), Welcome)
    return client


def drain(conn: Connection) -> list:
    """Every complete event currently buffered (stops at NEED_DATA / CLOSED)."""
    events = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA or event is CLOSED:
            return events
        events.append(event)


def transfer(sender: Connection, receiver: Connection, event):
    receiver.receive_data(sender.send(event))
    got = receiver.next_event()
    assert receiver.next_event() is NEED_DATA
    return got


def op_frames(index: int, name: str, seq: int = 0, args=None, kwargs=None, outs=None) -> bytes:
    """Raw definition + Op frames, as a client would send them."""
    return frame([DEFINE_OP, index, name]) + frame(
        [Op.code, seq, index, [] if args is None else args, {} if kwargs is None else kwargs,
         [] if outs is None else outs])


def raw_op_with_arg(raw_arg: bytes) -> bytes:
    """Definition + Op frame whose single positional argument is the given raw msgpack."""
    header = bytes([0x96, Op.code, 0, 0, 0x91]) + raw_arg + b"\x80\x90"
    return frame([DEFINE_OP, 0, "aten::x"]) + frame(header)


def expect_error(conn: Connection, data: bytes, match: str | None = None) -> ProtocolError:
    conn.receive_data(data)
    with pytest.raises(ProtocolError, match=match) as info:
        drain(conn)
    return info.value


# ---------------------------------------------------------------- handshake


class TestHandshake:
    def test_initial_state(self):
        assert Connection(Role.CLIENT).state is State.HANDSHAKE
        assert Connection(Role.SERVER).state is State.HANDSHAKE

    def test_hello_reaches_server(self):
        client = Connection(Role.CLIENT)
        server = Connection(Role.SERVER)
        hello = Hello(client_version="1.2.3", capabilities=["a", "b"], token="secret", options={"x": 1})
        server.receive_data(client.send(hello))
        got = server.next_event()
        assert got == hello
        assert server.peer_hello == hello
        # the server is not open until it answers
        assert server.state is State.HANDSHAKE
        assert client.state is State.HANDSHAKE

    def test_welcome_opens_client(self):
        client = Connection(Role.CLIENT)
        server = Connection(Role.SERVER)
        server.receive_data(client.send(Hello()))
        server.next_event()
        welcome = Welcome(server_version="9", capabilities=["c"], session_id="abc",
                          device={"type": "cuda", "index": 0, "name": "H100"}, limits={"max_payload_bytes": 5})
        data = server.send(welcome)
        assert server.state is State.OPEN
        client.receive_data(data)
        assert client.next_event() == welcome
        assert client.state is State.OPEN
        assert client.peer_welcome == welcome

    def test_open_pair_can_exchange_commands(self):
        client, server = open_pair()
        assert transfer(client, server, Sync(seq=1)) == Sync(seq=1)
        assert transfer(server, client, SyncDone(seq=1)) == SyncDone(seq=1)

    def test_reject_closes_both_sides(self):
        client = Connection(Role.CLIENT)
        server = Connection(Role.SERVER)
        server.receive_data(client.send(Hello()))
        server.next_event()
        reject = Reject(reason="bad token", server_version="1.0")
        data = server.send(reject)
        assert server.state is State.CLOSED
        client.receive_data(data)
        assert client.next_event() == reject
        assert client.state is State.CLOSED
        with pytest.raises(ProtocolError):
            client.send(Sync(seq=1))
        with pytest.raises(ProtocolError):
            server.send(SyncDone(seq=1))

    def test_op_before_handshake_raises(self):
        client = Connection(Role.CLIENT)
        with pytest.raises(ProtocolError):
            client.send(Op(seq=1, name="aten::add"))
        client.send(Hello())
        # still waiting for the Welcome
        with pytest.raises(ProtocolError):
            client.send(Op(seq=1, name="aten::add"))
        with pytest.raises(ProtocolError):
            client.send(Sync(seq=1))

    def test_encode_op_before_handshake_raises(self):
        client = Connection(Role.CLIENT)
        with pytest.raises(ProtocolError):
            client.encode_op(1, "aten::add", [], {}, [])
        client.send(Hello())
        with pytest.raises(ProtocolError):
            client.encode_op(1, "aten::add", [], {}, [])

    def test_server_cannot_reply_before_handshake(self):
        server = Connection(Role.SERVER)
        with pytest.raises(ProtocolError):
            server.send(SyncDone(seq=1))

    @pytest.mark.parametrize("event", [Sync(seq=1), Alloc(seq=1, storage_id=1, nbytes=4), Goodbye(reason="x")])
    def test_server_receiving_non_hello_first_raises(self, event):
        server = Connection(Role.SERVER)
        # build the frame with an open client: a HANDSHAKE client refuses to send it
        client, _ = open_pair()
        with pytest.raises(ProtocolError):
            server.receive_data(client.send(event))
            server.next_event()

    def test_server_receiving_op_first_raises(self):
        server = Connection(Role.SERVER)
        expect_error(server, op_frames(0, "aten::add"))

    def test_op_before_welcome_is_sent_raises(self):
        server = Connection(Role.SERVER)
        server.receive_data(Connection(Role.CLIENT).send(Hello()))
        server.next_event()
        expect_error(server, frame([Sync.code, 1]))

    def test_client_receiving_non_handshake_first_raises(self):
        client = Connection(Role.CLIENT)
        client.send(Hello())
        expect_error(client, frame([SyncDone.code, 1]))

    def test_hello_with_wrong_magic_rejected(self):
        server = Connection(Role.SERVER)
        client = Connection(Role.CLIENT)
        with pytest.raises(ProtocolError, match="magic"):
            server.receive_data(client.send(Hello(magic="http")))
            server.next_event()

    def test_welcome_with_wrong_magic_rejected(self):
        client = Connection(Role.CLIENT)
        client.send(Hello())
        server = Connection(Role.SERVER)
        with pytest.raises(ProtocolError, match="magic"):
            client.receive_data(server.send(Welcome(magic="nope")))
            client.next_event()
        assert client.state is not State.OPEN

    def test_welcome_version_mismatch(self):
        client = Connection(Role.CLIENT)
        client.send(Hello())
        server = Connection(Role.SERVER)
        other = PROTOCOL_VERSION + 1
        client.receive_data(server.send(Welcome(protocol_version=other, server_version="7.7.7")))
        with pytest.raises(VersionMismatch) as info:
            client.next_event()
        message = str(info.value)
        assert f"v{other}" in message
        assert f"v{PROTOCOL_VERSION}" in message
        assert isinstance(info.value, ProtocolError)
        assert client.state is not State.OPEN

    def test_check_hello_accepts_current_version(self):
        assert check_hello(Hello(client_version="1.0"), "1.0") is None

    def test_check_hello_version_mismatch_names_both_versions(self):
        other = PROTOCOL_VERSION + 1
        with pytest.raises(VersionMismatch) as info:
            check_hello(Hello(protocol_version=other, client_version="0.9.0"), "1.2.3")
        message = str(info.value)
        assert f"v{other}" in message
        assert f"v{PROTOCOL_VERSION}" in message
        assert "0.9.0" in message
        assert "1.2.3" in message

    def test_check_hello_older_version(self):
        with pytest.raises(VersionMismatch, match=f"v{PROTOCOL_VERSION}"):
            check_hello(Hello(protocol_version=0), "1.2.3")

    def test_check_hello_wrong_magic(self):
        with pytest.raises(ProtocolError) as info:
            check_hello(Hello(magic="notgpuwire"), "1.0")
        assert not isinstance(info.value, VersionMismatch)

    def test_role_restrictions_on_send(self):
        client, server = open_pair()
        with pytest.raises(ProtocolError):
            client.send(Welcome())
        with pytest.raises(ProtocolError):
            client.send(Data(seq=1, payload=b"x"))
        with pytest.raises(ProtocolError):
            server.send(Op(seq=1, name="aten::add"))
        with pytest.raises(ProtocolError):
            server.send(Hello())

    def test_client_goodbye_closes(self):
        client, server = open_pair()
        data = client.send(Goodbye(reason="done"))
        assert client.state is State.CLOSED
        server.receive_data(data)
        assert server.next_event() == Goodbye(reason="done")
        assert server.state is State.CLOSED
        with pytest.raises(ProtocolError):
            client.send(Sync(seq=2))

    def test_server_goodbye_closes_client(self):
        client, server = open_pair()
        client.receive_data(server.send(Goodbye(reason="shutdown")))
        assert server.state is State.CLOSED
        assert client.next_event() == Goodbye(reason="shutdown")
        assert client.state is State.CLOSED


# ---------------------------------------------------------------- round trips


TREF = TensorRef(storage_id=7, offset=2, sizes=(2, 3), strides=(3, 1), dtype=0, flags=0)


CLIENT_EVENTS = [
    Op(seq=1, name="aten::add.Tensor", args=[TREF, TREF], kwargs={"alpha": 2}, outs=[[9, 24, [2, 3], [3, 1], 0]]),
    Op(seq=2, name="aten::empty", args=[[]], kwargs={}, outs=[]),
    CallSync(seq=3, name="aten::nonzero", args=[TREF], kwargs={}),
    Alloc(seq=4, storage_id=11, nbytes=4096),
    Free(seq=5, storage_ids=[1, 2, 3]),
    Free(seq=6, storage_ids=[]),
    Write(seq=7, storage_id=11, byte_offset=16, payload=b"\x00\x01\x02\x03"),
    Write(seq=8, storage_id=11, byte_offset=0, payload=b""),
    Read(seq=9, storage_id=11, byte_offset=4, nbytes=100),
    Sync(seq=10),
    Seed(seq=11, seed=2**64 - 1),
    Seed(seq=12, seed=0),
    Query(seq=13, what="memory"),
    SetRngState(seq=14, payload=bytes(range(256)) * 3),
    Goodbye(reason="bye"),
]

SERVER_EVENTS = [
    Data(seq=1, payload=b"hello world"),
    Data(seq=2, payload=b""),
    Result(seq=3, value=None),
    Result(seq=4, value=[NewTensor(storage_id=100, nbytes=80, offset=0, sizes=(10,), strides=(1,), dtype=8), 10]),
    Result(seq=5, value={"device": "cuda:0", "free": 123, "total": 1 << 40, "ratio": 0.5}),
    Result(seq=6, value=[1, 2.5, "x", True, None, complex(1, -1), DType(3)]),
    SyncDone(seq=7),
    Error(seq=8, reply_to=9, op="aten::mm", exc_type="RuntimeError", message="shape mismatch"),
    Goodbye(reason="node shutting down"),
]


@pytest.mark.parametrize("event", CLIENT_EVENTS, ids=lambda e: type(e).__name__)
def test_client_event_round_trip(event):
    client, server = open_pair()
    got = transfer(client, server, event)
    assert type(got) is type(event)
    assert got == event
    if event.has_payload:
        assert bytes(got.payload) == bytes(event.payload)


@pytest.mark.parametrize("event", SERVER_EVENTS, ids=lambda e: type(e).__name__)
def test_server_event_round_trip(event):
    client, server = open_pair()
    got = transfer(server, client, event)
    assert type(got) is type(event)
    assert got == event


SEQ_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


@pytest.mark.parametrize("seq", SEQ_EDGES)
def test_sync_frames_are_written_as_msgpack_writes_them_and_read_back(seq):
    """The synchronize round trip's frames (``Sync``, ``SyncDone``) are written and read by
    hand: the bytes must be msgpack's, and every integer width must read back."""
    client, server = open_pair()
    for sender, receiver, event in ((client, server, Sync(seq=seq)), (server, client, SyncDone(seq=seq))):
        header = msgpack.packb([event.code, seq])
        assert sender.send(event) == struct.pack("!IQ", len(header), 0) + header
        receiver.receive_data(sender.send(event))
        got = receiver.next_event()
        assert type(got) is type(event) and got.seq == seq
        assert receiver.next_event() is NEED_DATA


@pytest.mark.parametrize("seq", SEQ_EDGES)
def test_sync_frames_written_by_any_msgpack_encoder_are_read(seq):
    """A peer may write the seq wider than it needs (any msgpack encoder's choice is valid)."""
    client, server = open_pair()
    widths = [(0xCC, "!B", 2**8), (0xCD, "!H", 2**16), (0xCE, "!I", 2**32), (0xCF, "!Q", 2**64)]
    for kind, layout, bound in widths:
        if seq < bound:
            header = bytes([0x92, Sync.code, kind]) + struct.pack(layout, seq)
            server.receive_data(struct.pack("!IQ", len(header), 0) + header)
            got = server.next_event()
            assert type(got) is Sync and got.seq == seq


def test_sync_frames_keep_the_generic_checks():
    """The hand-read path takes only what this side may receive, well formed; anything else
    fails as before."""
    client, server = open_pair()
    client.receive_data(server.send(SyncDone(seq=1)))
    assert client.next_event() == SyncDone(seq=1)
    # a node receiving SyncDone, a client receiving Sync: refused by role
    with pytest.raises(ProtocolError, match="cannot receive SyncDone"):
        client2, server2 = open_pair()
        server2.receive_data(server.send(SyncDone(seq=2)))
        server2.next_event()
    with pytest.raises(ProtocolError, match="cannot receive Sync"):
        client3, _ = open_pair()
        client3.receive_data(client.send(Sync(seq=2)))
        client3.next_event()
    # a negative seq (msgpack's negative fixint 0xff) and a seq that is not an integer
    for header in (bytes([0x92, Sync.code, 0xFF]), bytes([0x92, Sync.code, 0xC3]), bytes([0x92, Sync.code, 0xCA]) + b"\0" * 4):
        _, server4 = open_pair()
        server4.receive_data(struct.pack("!IQ", len(header), 0) + header)
        with pytest.raises(ProtocolError):
            server4.next_event()
    # before the handshake a Sync is refused
    fresh = Connection(Role.SERVER)
    fresh.receive_data(client.send(Sync(seq=3)))
    with pytest.raises(ProtocolError):
        fresh.next_event()
    with pytest.raises(ProtocolError):
        Connection(Role.CLIENT).send(Sync(seq=1))


def test_result_with_new_tensor_nested():
    client, server = open_pair()
    nt = NewTensor(storage_id=5, nbytes=48, offset=1, sizes=(2, 0, 3), strides=(3, 3, 1), dtype=1)
    value = {"values": [nt, (nt,)], "indices": {"k": nt}, "n": 2}
    got = transfer(server, client, Result(seq=3, value=value))
    assert got.value == {"values": [nt, [nt]], "indices": {"k": nt}, "n": 2}
    assert type(got.value["values"][0]) is NewTensor


def test_all_events_in_one_stream():
    client, server = open_pair()
    data = b"".join(client.send(e) for e in CLIENT_EVENTS)
    server.receive_data(data)
    assert drain(server) == CLIENT_EVENTS
    assert server.state is State.CLOSED  # the last event was a Goodbye


def test_event_fields_exclude_payload():
    w = Write(seq=1, storage_id=2, byte_offset=3, payload=b"abc")
    assert w.fields() == (1, 2, 3)
    assert Sync(seq=5).fields() == (5,)


def test_op_arguments_with_all_value_types():
    client, server = open_pair()
    args = [
        TREF,
        TensorRef(1, 0, (), (), 9, 3),
        InlineTensor(dtype=1, sizes=(), data=struct.pack("<d", 1.5)),
        DType(11),
        Device("cuda", 0),
        Device("cpu"),
        MemoryFormat(1),
        Layout(0),
        complex(1.5, -2.25),
        SessionGenerator(),
        [1, [2, [3, [TREF]]]],
        {"nested": {"dtype": DType(0), "list": [complex(0, 1), None]}},
        -(2**63),
        2**64 - 1,
        1e300,
        "ünïcødé",
        b"raw-bytes",
        True,
        False,
        None,
    ]
    kwargs = {"memory_format": MemoryFormat(3), "generator": SessionGenerator(), "device": Device("cuda", 1)}
    got = transfer(client, server, Op(seq=1, name="aten::foo", args=args, kwargs=kwargs))
    assert got.args == args
    assert got.kwargs == kwargs
    assert got.args[-3] is True and got.args[-2] is False
    assert type(got.args[-4]) is bytes


def test_tuples_arrive_as_lists():
    client, server = open_pair()
    got = transfer(client, server, Op(seq=1, name="aten::view", args=[(1, 2, (3, 4))]))
    assert got.args == [[1, 2, [3, 4]]]


# ---------------------------------------------------------------- op-name interning


class TestInterning:
    def test_second_op_is_smaller_and_omits_name(self):
        client, server = open_pair()
        name = "aten::convolution_backward_overrideable"
        first = client.send(Op(seq=1, name=name, args=[1, 2]))
        second = client.send(Op(seq=2, name=name, args=[1, 2]))
        assert len(second) < len(first)
        assert name.encode() in first
        assert name.encode() not in second
        server.receive_data(first + second)
        got = drain(server)
        assert [e.name for e in got] == [name, name]
        assert [e.seq for e in got] == [1, 2]

    def test_size_difference_is_the_definition_frame(self):
        client, _ = open_pair()
        name = "aten::mul.Tensor"
        first = client.send(Op(seq=1, name=name))
        second = client.send(Op(seq=1, name=name))
        definition = frame([DEFINE_OP, 0, name])
        assert len(first) - len(second) == len(definition)

    def test_many_ops_interleaved(self):
        client, server = open_pair()
        names = [f"aten::op_{i}" for i in range(300)]
        events = []
        for rnd in range(3):
            for i, name in enumerate(names):
                seq = rnd * 1000 + i
                if i % 5 == 0:
                    events.append(CallSync(seq=seq, name=name, args=[i]))
                else:
                    events.append(Op(seq=seq, name=name, args=[i], kwargs={"r": rnd}))
        sizes = {}
        data = bytearray()
        for event in events:
            chunk = client.send(event)
            sizes.setdefault(event.name, []).append(len(chunk))
            data += chunk
        for name, lens in sizes.items():
            assert lens[1] < lens[0] and lens[2] < lens[0], name
        server.receive_data(bytes(data))
        assert drain(server) == events

    def test_op_and_callsync_share_the_table(self):
        client, server = open_pair()
        first = client.send(CallSync(seq=1, name="aten::nonzero"))
        second = client.send(Op(seq=2, name="aten::nonzero"))
        assert b"aten::nonzero" in first and b"aten::nonzero" not in second
        server.receive_data(first + second)
        assert drain(server) == [CallSync(seq=1, name="aten::nonzero"), Op(seq=2, name="aten::nonzero")]

    def test_interning_is_per_connection(self):
        c1, _ = open_pair()
        c2, s2 = open_pair()
        c1.send(Op(seq=1, name="aten::abs"))
        data = c2.send(Op(seq=1, name="aten::abs"))
        assert b"aten::abs" in data
        s2.receive_data(data)
        assert drain(s2) == [Op(seq=1, name="aten::abs")]

    def test_many_distinct_names(self):
        client, server = open_pair()
        events = [Op(seq=i, name=f"n{i}") for i in range(2000)]
        server.receive_data(b"".join(client.send(e) for e in events))
        assert drain(server) == events

    def test_too_many_op_names(self):
        server = open_server(Limits(max_op_names=3))
        data = b"".join(frame([DEFINE_OP, i, f"op{i}"]) for i in range(4))
        expect_error(server, data, "too many")

    def test_op_name_length_limit(self):
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "x" * 257]), "256")
        server = open_server()
        server.receive_data(op_frames(0, "y" * 256))
        assert drain(server)[0].name == "y" * 256

    def test_failed_send_does_not_desync_interning(self):
        client, server = open_pair()
        with pytest.raises(TypeError):
            client.send(Op(seq=1, name="aten::add", args=[object()]))
        server.receive_data(client.send(Op(seq=2, name="aten::add", args=[1])))
        assert drain(server) == [Op(seq=2, name="aten::add", args=[1])]

    def test_failed_encode_op_does_not_desync_interning(self):
        client, server = open_pair()
        with pytest.raises(TypeError):
            client.encode_op(1, "aten::mul", [object()], {}, [])
        server.receive_data(client.encode_op(2, "aten::mul", [1], {}, []))
        assert drain(server) == [Op(seq=2, name="aten::mul", args=[1])]

    def test_a_frame_encoded_inside_another_frames_default_hook_leaves_both_intact(self):
        """The ``default`` hook runs Python, which may encode another frame on the same
        connection meanwhile (torch.compile's frame hook resetting flags the client records as
        an op): each frame must come out whole, not the two interleaved."""
        nested = []

        class Late:  # an argument whose encoding sends something first
            pass

        def default(obj):
            if isinstance(obj, Late):
                if not nested:  # (the outer op is packed again once a nested one interned a name)
                    nested.append(client.encode_op(2, "aten::nested", [7], {}, []))
                    nested.append(client.encode_prepared_op(3, "aten::nested", b"\x91\x08\x80", b"\x90"))
                return 5
            raise TypeError(obj)
        client = Connection(Role.CLIENT, default=default)
        server = Connection(Role.SERVER)
        server.receive_data(client.send(Hello(client_version="test")))
        server.next_event()
        client.receive_data(server.send(Welcome(server_version="test", session_id="s1")))
        client.next_event()
        outer = client.encode_op(1, "aten::outer", [Late(), [1, 2]], {"k": 3}, [])
        server.receive_data(b"".join(nested) + outer)
        assert drain(server) == [Op(seq=2, name="aten::nested", args=[7]), Op(seq=3, name="aten::nested", args=[8]),
                                 Op(seq=1, name="aten::outer", args=[5, [1, 2]], kwargs={"k": 3})]


# ---------------------------------------------------------------- encode_op


class TestEncodeOp:
    CASES = [
        (1, "aten::add.Tensor", [TREF, TREF], {"alpha": 1.5}, [[3, 24, [2, 3], [3, 1], 0]]),
        (2, "aten::zeros", [[2, 3]], {"dtype": DType(0), "device": Device("cuda", 0)}, [[4, 24, [2, 3], [3, 1], 0]]),
        (3, "aten::add.Tensor", [TREF, 3], {}, []),
        (4, "aten::randn", [[5]], {"generator": SessionGenerator()}, [[5, 20, [5], [1], 0]]),
    ]

    def test_same_meaning_as_send(self):
        c1, s1 = open_pair()
        c2, s2 = open_pair()
        for seq, name, args, kwargs, outs in self.CASES:
            s1.receive_data(c1.encode_op(seq, name, args, kwargs, outs))
            s2.receive_data(c2.send(Op(seq=seq, name=name, args=args, kwargs=kwargs, outs=outs)))
        got1, got2 = drain(s1), drain(s2)
        assert got1 == got2
        assert got1 == [Op(seq=s, name=n, args=a, kwargs=k, outs=o) for s, n, a, k, o in self.CASES]

    def test_interns_like_send(self):
        client, server = open_pair()
        first = client.encode_op(1, "aten::sub", [1], {}, [])
        second = client.encode_op(2, "aten::sub", [1], {}, [])
        assert len(second) < len(first)
        assert b"aten::sub" not in second
        # send() knows the name encode_op defined, and vice versa
        third = client.send(Op(seq=3, name="aten::sub", args=[1]))
        assert b"aten::sub" not in third
        client.send(Op(seq=4, name="aten::div", args=[1]))
        fourth = client.encode_op(5, "aten::div", [1], {}, [])
        assert b"aten::div" not in fourth

    def test_mixed_with_send_decodes(self):
        client, server = open_pair()
        data = (client.encode_op(1, "a", [1], {}, []) + client.send(Op(seq=2, name="a", args=[2]))
                + client.send(Op(seq=3, name="b")) + client.encode_op(4, "b", [], {"k": "v"}, [[1, 2, [], [], 0]]))
        server.receive_data(data)
        assert drain(server) == [Op(seq=1, name="a", args=[1]), Op(seq=2, name="a", args=[2]),
                                 Op(seq=3, name="b"), Op(seq=4, name="b", kwargs={"k": "v"}, outs=[[1, 2, [], [], 0]])]


# ---------------------------------------------------------------- payloads


class TestPayloads:
    def test_bytearray_payload(self):
        client, server = open_pair()
        buf = bytearray(b"abcdefgh" * 100)
        got = transfer(client, server, Write(seq=1, storage_id=2, byte_offset=8, payload=buf))
        assert got.payload == bytes(buf)
        assert (got.seq, got.storage_id, got.byte_offset) == (1, 2, 8)

    def test_memoryview_payload(self):
        client, server = open_pair()
        raw = bytes(range(256)) * 8
        view = memoryview(raw)[16:1040]
        got = transfer(client, server, Write(seq=1, storage_id=2, byte_offset=0, payload=view))
        assert got.payload == raw[16:1040]

    def test_non_byte_format_memoryview_counts_bytes(self):
        client, server = open_pair()
        values = [1.0, -2.5, 3.25, 4e10]
        view = memoryview(struct.pack("<4d", *values)).cast("d")
        assert len(view) == 4 and view.nbytes == 32
        got = transfer(client, server, Write(seq=1, storage_id=2, byte_offset=0, payload=view))
        assert len(got.payload) == 32
        assert list(struct.unpack("<4d", got.payload)) == values

    @pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(bytearray(b))],
                             ids=["bytes", "bytearray", "memoryview"])
    def test_send_parts_returns_payload_uncopied(self, make):
        client, server = open_pair()
        payload = make(b"\x07" * 4096)
        parts = client.send_parts(Write(seq=1, storage_id=3, byte_offset=0, payload=payload))
        assert parts[-1] is payload
        assert all(p is not payload for p in parts[:-1])
        server.receive_data(b"".join(bytes(p) for p in parts))
        got = drain(server)
        assert got == [Write(seq=1, storage_id=3, byte_offset=0, payload=b"\x07" * 4096)]

    def test_send_parts_data_and_rng_state(self):
        client, server = open_pair()
        payload = bytearray(b"rng" * 10)
        parts = client.send_parts(SetRngState(seq=1, payload=payload))
        assert parts[-1] is payload
        view = memoryview(b"result-bytes")
        parts = server.send_parts(Data(seq=2, payload=view))
        assert parts[-1] is view
        client.receive_data(b"".join(bytes(p) for p in parts))
        assert drain(client) == [Data(seq=2, payload=b"result-bytes")]

    def test_send_parts_without_payload(self):
        client, server = open_pair()
        parts = client.send_parts(Write(seq=1, storage_id=3, byte_offset=0, payload=b""))
        server.receive_data(b"".join(parts))
        assert drain(server) == [Write(seq=1, storage_id=3, byte_offset=0, payload=b"")]

    def test_send_parts_matches_send(self):
        c1, _ = open_pair()
        c2, _ = open_pair()
        event = Op(seq=1, name="aten::add", args=[TREF])
        assert b"".join(c1.send_parts(event)) == c2.send(event)

    def test_received_payload_is_independent_of_buffer(self):
        client, server = open_pair()
        server.receive_data(client.send(Write(seq=1, storage_id=1, byte_offset=0, payload=b"aaaa")))
        got = server.next_event()
        server.receive_data(client.send(Write(seq=2, storage_id=1, byte_offset=0, payload=b"bbbb")))
        server.next_event()
        assert bytes(got.payload) == b"aaaa"

    def test_large_payloads_and_buffer_compaction(self):
        # several MiB through one connection in uneven chunks: exercises buffer reuse
        client, server = open_pair()
        events = [Write(seq=i, storage_id=i, byte_offset=0, payload=bytes([i]) * (300_000 + i)) for i in range(12)]
        events += [Sync(seq=100), Op(seq=101, name="aten::x", args=[1])]
        data = b"".join(client.send(e) for e in events)
        got = []
        step = 123_457
        for i in range(0, len(data), step):
            server.receive_data(data[i:i + step])
            got.extend(drain(server))
        assert got == events
        assert server.buffered == 0


# ---------------------------------------------------------------- feeding bytes


class TestFeeding:
    def _stream(self):
        client, _ = open_pair()
        events = [e for e in CLIENT_EVENTS if not isinstance(e, Goodbye)]
        return events, b"".join(client.send(e) for e in events)

    def test_byte_at_a_time(self):
        events, data = self._stream()
        server = open_server()
        got = []
        for i in range(len(data)):
            server.receive_data(data[i:i + 1])
            got.extend(drain(server))
        assert got == events
        assert server.next_event() is NEED_DATA
        assert server.buffered == 0

    def test_byte_at_a_time_handshake(self):
        client = Connection(Role.CLIENT)
        server = Connection(Role.SERVER)
        hello = client.send(Hello(client_version="x"))
        for i in range(len(hello) - 1):
            server.receive_data(hello[i:i + 1])
            assert server.next_event() is NEED_DATA
        server.receive_data(hello[-1:])
        assert server.next_event() == Hello(client_version="x")

    def test_many_frames_one_call(self):
        events, data = self._stream()
        server = open_server()
        server.receive_data(data)
        assert drain(server) == events

    def test_arbitrary_split_points(self):
        events, data = self._stream()
        for split in (1, 5, 11, 12, 13, 50, len(data) // 2, len(data) - 1):
            server = open_server()
            server.receive_data(data[:split])
            got = drain(server)
            server.receive_data(data[split:])
            got.extend(drain(server))
            assert got == events, split

    def test_need_data_when_incomplete(self):
        client, server = open_pair()
        data = client.send(Write(seq=1, storage_id=1, byte_offset=0, payload=b"x" * 100))
        assert server.next_event() is NEED_DATA
        for cut in (1, 11, 12, 13, len(data) - 1):
            s = open_server()
            s.receive_data(data[:cut])
            assert s.next_event() is NEED_DATA
            assert s.next_event() is NEED_DATA  # idempotent
            assert s.buffered == cut
            s.receive_data(data[cut:])
            assert isinstance(s.next_event(), Write)
            assert s.next_event() is NEED_DATA

    def test_empty_receive_is_end_of_stream(self):
        client, server = open_pair()
        server.receive_data(client.send(Sync(seq=1)))
        server.receive_data(b"")
        assert server.next_event() == Sync(seq=1)
        assert server.next_event() is CLOSED
        assert server.state is State.CLOSED
        assert server.next_event() is CLOSED

    def test_closed_at_frame_boundary_before_handshake(self):
        server = Connection(Role.SERVER)
        server.receive_data(b"")
        assert server.next_event() is CLOSED

    def test_data_after_eof_raises(self):
        server = open_server()
        server.receive_data(b"")
        with pytest.raises(ProtocolError):
            server.receive_data(frame([Sync.code, 1]))

    @pytest.mark.parametrize("cut", [1, 5, 11, 12, 13, -1])
    def test_eof_mid_frame_raises(self, cut):
        client, server = open_pair()
        data = client.send(Write(seq=1, storage_id=1, byte_offset=0, payload=b"x" * 10))
        server.receive_data(data[:cut])
        server.receive_data(b"")
        # a cut connection (the node keeps a durable session for its client), still a ProtocolError
        with pytest.raises(StreamCut, match="middle of a frame") as raised:
            server.next_event()
        assert isinstance(raised.value, ProtocolError)

    def test_eof_mid_frame_after_complete_frames(self):
        client, server = open_pair()
        data = client.send(Sync(seq=1)) + client.send(Sync(seq=2))
        server.receive_data(data[:-3])
        server.receive_data(b"")
        assert server.next_event() == Sync(seq=1)
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_accepts_bytearray_and_memoryview_input(self):
        events, data = self._stream()
        server = open_server()
        half = len(data) // 2
        server.receive_data(bytearray(data[:half]))
        server.receive_data(memoryview(data)[half:])
        assert drain(server) == events

    def test_buffered_counts_unconsumed_bytes(self):
        client, server = open_pair()
        data = client.send(Sync(seq=1)) + client.send(Sync(seq=2))
        server.receive_data(data)
        assert server.buffered == len(data)
        server.next_event()
        assert server.buffered == len(data) // 2
        server.next_event()
        assert server.buffered == 0


# ---------------------------------------------------------------- limits


class TestFrameLimits:
    def test_zero_header_len_rejected_from_prefix(self):
        server = open_server()
        server.receive_data(PREFIX.pack(0, 0))
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_oversized_header_rejected_from_prefix(self):
        limits = Limits()
        server = open_server()
        server.receive_data(PREFIX.pack(limits.max_header_bytes + 1, 0))
        with pytest.raises(ProtocolError, match="header"):
            server.next_event()

    def test_oversized_header_with_custom_limit(self):
        server = open_server(Limits(max_header_bytes=64))
        server.receive_data(PREFIX.pack(65, 0))
        with pytest.raises(ProtocolError):
            server.next_event()
        server = open_server(Limits(max_header_bytes=64))
        server.receive_data(PREFIX.pack(64, 0))
        assert server.next_event() is NEED_DATA  # exactly at the limit: waits for the rest

    def test_max_u32_header_rejected(self):
        server = open_server()
        server.receive_data(PREFIX.pack(2**32 - 1, 0))
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_oversized_payload_rejected_from_prefix(self):
        limits = Limits()
        server = open_server()
        server.receive_data(PREFIX.pack(3, limits.max_payload_bytes + 1))
        with pytest.raises(ProtocolError, match="payload"):
            server.next_event()

    def test_max_u64_payload_rejected(self):
        server = open_server()
        server.receive_data(PREFIX.pack(3, 2**64 - 1))
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_payload_limit_custom(self):
        server = open_server(Limits(max_payload_bytes=16))
        server.receive_data(frame([Write.code, 1, 1, 0], b"x" * 16))
        assert drain(server) == [Write(seq=1, storage_id=1, byte_offset=0, payload=b"x" * 16)]
        server = open_server(Limits(max_payload_bytes=16))
        server.receive_data(PREFIX.pack(4, 17))
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_oversized_prefix_rejected_before_handshake(self):
        server = Connection(Role.SERVER)
        server.receive_data(PREFIX.pack(2**31, 0))
        with pytest.raises(ProtocolError):
            server.next_event()

    def test_client_also_checks_limits(self):
        client = open_client(Limits(max_payload_bytes=8))
        client.receive_data(PREFIX.pack(3, 9))
        with pytest.raises(ProtocolError):
            client.next_event()

    def test_long_array_rejected(self):
        client, server = open_pair(server_limits=Limits(max_array_len=10))
        server.receive_data(client.send(Op(seq=1, name="a", args=[list(range(10))])))
        assert drain(server)[0].args == [list(range(10))]
        server.receive_data(client.send(Op(seq=2, name="a", args=[list(range(11))])))
        with pytest.raises(ProtocolError):
            drain(server)

    def test_long_map_rejected(self):
        client, server = open_pair(server_limits=Limits(max_map_len=4))
        server.receive_data(client.send(Op(seq=1, name="a", kwargs={str(i): i for i in range(4)})))
        assert len(drain(server)[0].kwargs) == 4
        server.receive_data(client.send(Op(seq=2, name="a", kwargs={str(i): i for i in range(5)})))
        with pytest.raises(ProtocolError):
            drain(server)

    def test_long_string_rejected(self):
        client, server = open_pair(server_limits=Limits(max_str_len=16))
        server.receive_data(client.send(Op(seq=1, name="a", args=["s" * 16])))
        assert drain(server)[0].args == ["s" * 16]
        server.receive_data(client.send(Op(seq=2, name="a", args=["s" * 17])))
        with pytest.raises(ProtocolError):
            drain(server)

    def test_long_binary_rejected(self):
        client, server = open_pair(server_limits=Limits(max_bin_len=8))
        server.receive_data(client.send(Op(seq=1, name="a", args=[b"b" * 9])))
        with pytest.raises(ProtocolError):
            drain(server)

    def test_long_extension_rejected(self):
        client, server = open_pair(server_limits=Limits(max_ext_len=32))
        inline = InlineTensor(dtype=4, sizes=(64,), data=bytes(64))
        server.receive_data(client.send(Op(seq=1, name="a", args=[inline])))
        with pytest.raises(ProtocolError):
            drain(server)

    def test_deep_nesting_in_header(self):
        server = open_server()
        expect_error(server, frame(b"\x91" * 5000 + b"\xc0"), "nests too deeply")

    def test_deep_nesting_in_op_args(self):
        server = open_server()
        expect_error(server, raw_op_with_arg(b"\x91" * 5000 + b"\xc0"), "nests too deeply")

    def test_deep_nesting_in_maps(self):
        server = open_server()
        expect_error(server, raw_op_with_arg(b"\x81\xa1k" * 5000 + b"\xc0"), "nests too deeply")

    def test_moderate_nesting_is_fine(self):
        client, server = open_pair()
        value = 1
        for _ in range(100):
            value = [value]
        got = transfer(client, server, Op(seq=1, name="a", args=[value]))
        assert got.args == [value]


# ---------------------------------------------------------------- malformed frames


class TestMalformedFrames:
    def test_header_not_msgpack(self):
        expect_error(open_server(), frame(b"\xc1"))  # 0xc1 is never used in msgpack

    def test_header_with_trailing_bytes(self):
        expect_error(open_server(), frame(msgpack.packb([Sync.code, 1]) + b"\x00"))

    def test_truncated_header_msgpack(self):
        expect_error(open_server(), frame(msgpack.packb([Sync.code, 1, "abcdef"])[:-2]))

    @pytest.mark.parametrize("header", [5, "x", {"a": 1}, [], ["11"], [1.0], [None], [True]],
                             ids=repr)
    def test_header_must_be_array_with_int_code(self, header):
        expect_error(open_server(), frame(header))

    @pytest.mark.parametrize("code", [0, 4, 9, 23, 29, 35, 99, 255, 2**40, -1])
    def test_unknown_event_code(self, code):
        expect_error(open_server(), frame([code, 0]), "unknown event code")

    @pytest.mark.parametrize("header,payload", [
        ([Data.code, 1], b"abc"),
        ([Result.code, 1, None], b""),
        ([SyncDone.code, 1], b""),
        ([Error.code, 1, 1, "op", "E", "m"], b""),
        ([Welcome.code, "gpuwire", 1, "", [], "", {}, {}], b""),
        ([Reject.code, "r", "", 1], b""),
    ], ids=lambda v: str(v)[:20])
    def test_server_receiving_server_only_event(self, header, payload):
        expect_error(open_server(), frame(header, payload), "cannot receive")

    @pytest.mark.parametrize("header", [
        [Sync.code, 1], [Alloc.code, 1, 2, 3], [Read.code, 1, 2, 3, 4], [Hello.code, "gpuwire", 1, "", [], None, {}],
    ], ids=lambda v: str(v[0]))
    def test_client_receiving_client_only_event(self, header):
        expect_error(open_client(), frame(header), "cannot receive")

    @pytest.mark.parametrize("header", [
        [Sync.code, 1], [Alloc.code, 1, 2, 3], [Free.code, 1, [1]], [Seed.code, 1, 5], [Goodbye.code, "x"],
    ], ids=lambda v: str(v[0]))
    def test_payload_on_event_without_payload(self, header):
        expect_error(open_server(), frame(header, b"unexpected"), "payload")

    def test_payload_on_op(self):
        server = open_server()
        data = frame([DEFINE_OP, 0, "a"]) + frame([Op.code, 1, 0, [], {}, []], b"xx")
        expect_error(server, data, "payload")

    def test_payload_on_client_result(self):
        expect_error(open_client(), frame([SyncDone.code, 1], b"zz"), "payload")

    @pytest.mark.parametrize("header", [
        [Sync.code], [Sync.code, 1, 2], [Alloc.code, 1, 2], [Alloc.code, 1, 2, 3, True, 5], [Free.code],
        [Write.code, 1, 2], [Read.code, 1, 2, 3], [Seed.code, 1], [Query.code, 1, "x", "y"],
        [Goodbye.code], [Goodbye.code, "a", "b"], [SetRngState.code, 1, 2],
    ], ids=repr)
    def test_wrong_field_count(self, header):
        expect_error(open_server(), frame(header), "fields")

    def test_wrong_field_count_op(self):
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([Op.code, 1, 0, [], {}]), "fields")
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([CallSync.code, 1, 0, [], {}, []]), "fields")

    def test_wrong_field_count_hello(self):
        expect_error(Connection(Role.SERVER), frame([Hello.code, "gpuwire", 1]), "fields")

    @pytest.mark.parametrize("header", [
        [Sync.code, "1"],
        [Sync.code, 1.0],
        [Sync.code, None],
        [Sync.code, True],
        [Sync.code, -1],
        [Alloc.code, 1, -1, 10],
        [Alloc.code, 1, "7", 10],
        [Alloc.code, 1, 7, -10],
        [Alloc.code, 1, 7, [10]],
        [Free.code, 1, 3],
        [Free.code, 1, {"a": 1}],
        [Read.code, 1, 2, -3, 4],
        [Seed.code, 1, -5],
        [Seed.code, 1, "5"],
        [Query.code, 1, 5],
        [Query.code, 1, None],
        [Goodbye.code, 5],
        [Goodbye.code, None],
    ], ids=repr)
    def test_wrong_field_types(self, header):
        expect_error(open_server(), frame(header))

    @pytest.mark.parametrize("header", [
        [Write.code, "1", 1, 0], [Write.code, 1, -1, 0], [Write.code, 1, 1, -2], [SetRngState.code, "s"],
    ], ids=repr)
    def test_wrong_field_types_with_payload(self, header):
        expect_error(open_server(), frame(header, b"payload"))

    @pytest.mark.parametrize("fields", [
        ["1", 0, [], {}, []],
        [-1, 0, [], {}, []],
        [1, 0, "args", {}, []],
        [1, 0, [], [], []],
        [1, 0, [], {}, {}],
        [1, 0, [], {}, None],
        [1, 0, None, {}, []],
    ], ids=repr)
    def test_wrong_op_field_types(self, fields):
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([Op.code, *fields]))

    @pytest.mark.parametrize("fields", [
        ["gpuwire", "1", "", [], None, {}],
        ["gpuwire", 1, 5, [], None, {}],
        ["gpuwire", 1, "", {}, None, {}],
        ["gpuwire", 1, "", [], 5, {}],
        ["gpuwire", 1, "", [], None, []],
        [5, 1, "", [], None, {}],
        ["gpuwire", -1, "", [], None, {}],
    ], ids=repr)
    def test_wrong_hello_field_types(self, fields):
        expect_error(Connection(Role.SERVER), frame([Hello.code, *fields]))

    @pytest.mark.parametrize("fields", [
        ["gpuwire", 1, "", [], "", {}, []],
        ["gpuwire", 1, "", [], 5, {}, {}],
        ["gpuwire", 1, "", "caps", "", {}, {}],
        ["gpuwire", "1", "", [], "", {}, {}],
    ], ids=repr)
    def test_wrong_welcome_field_types(self, fields):
        client = Connection(Role.CLIENT)
        client.send(Hello())
        expect_error(client, frame([Welcome.code, *fields]))
        assert client.state is not State.OPEN

    @pytest.mark.parametrize("header", [
        [Error.code, 1, "2", "op", "E", "m"],
        [Error.code, 1, 2, None, "E", "m"],
        [Error.code, 1, 2, "op", "E", 5],
        [SyncDone.code, -1],
        [Result.code, "x", None],
    ], ids=repr)
    def test_wrong_server_event_field_types(self, header):
        expect_error(open_client(), frame(header))

    def test_wrong_data_field_type(self):
        expect_error(open_client(), frame([Data.code, "1"], b"abc"))

    def test_undefined_op_index(self):
        expect_error(open_server(), frame([Op.code, 1, 0, [], {}, []]), "undefined op index")

    @pytest.mark.parametrize("index", [1, -1, "0", None, 1.0, 2**40])
    def test_undefined_op_index_after_definition(self, index):
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([Op.code, 1, index, [], {}, []]))

    def test_undefined_callsync_index(self):
        expect_error(open_server(), frame([CallSync.code, 1, 3, [], {}]), "undefined op index")

    def test_op_definition_out_of_order(self):
        expect_error(open_server(), frame([DEFINE_OP, 1, "a"]), "out of order")
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([DEFINE_OP, 0, "b"]), "out of order")
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([DEFINE_OP, 2, "b"]), "out of order")

    @pytest.mark.parametrize("header", [
        [DEFINE_OP], [DEFINE_OP, 0], [DEFINE_OP, 0, "a", "b"], [DEFINE_OP, "0", "a"], [DEFINE_OP, 0, 5],
        [DEFINE_OP, 0, None], [DEFINE_OP, -1, "a"], [DEFINE_OP, 0, b"bytes"],
    ], ids=repr)
    def test_malformed_op_definition(self, header):
        expect_error(open_server(), frame(header))

    def test_valid_definition_yields_no_event(self):
        server = open_server()
        server.receive_data(frame([DEFINE_OP, 0, "aten::add"]))
        assert server.next_event() is NEED_DATA
        server.receive_data(frame([Op.code, 5, 0, [1], {}, []]))
        assert server.next_event() == Op(seq=5, name="aten::add", args=[1])

    def test_non_string_map_keys_rejected(self):
        server = open_server()
        expect_error(server, frame([DEFINE_OP, 0, "a"]) + frame([Op.code, 1, 0, [], {1: 2}, []]))

    def test_invalid_utf8_rejected(self):
        server = open_server()
        header = bytes([0x93, Query.code, 0x01, 0xa2, 0xff, 0xfe])
        expect_error(server, frame(header))

    def test_unknown_extension_type(self):
        expect_error(open_server(), raw_op_with_arg(b"\xd4\x2a\x00"), "extension")  # fixext1, type 42

    def test_negative_extension_type(self):
        expect_error(open_server(), raw_op_with_arg(b"\xd4\xfb\x00"))  # fixext1, type -5

    def test_malformed_timestamp_extension(self):
        expect_error(open_server(), raw_op_with_arg(b"\xc7\x03\xff\x00\x00\x01"))  # ext8 len 3 type -1


# ---------------------------------------------------------------- tensor descriptors in frames


def _ext(code: int, obj) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(obj))


BAD_TENSOR_REFS = [
    pytest.param((1, 0, (2,), (1,), 0), id="five-fields"),
    pytest.param((1, 0, (2,), (1,), 0, 0, 0), id="seven-fields"),
    pytest.param((1, 0, (-2,), (1,), 0, 0), id="negative-size"),
    pytest.param((1, 0, (2, 3), (1,), 0, 0), id="sizes-strides-mismatch"),
    pytest.param((1, 0, (2,), (1,), 20, 0), id="dtype-out-of-range"),
    pytest.param((1, 0, (2,), (1,), -1, 0), id="dtype-negative"),
    pytest.param((1, 0, (2,), (1,), 255, 0), id="dtype-255"),
    pytest.param((-1, 0, (2,), (1,), 0, 0), id="negative-storage"),
    pytest.param((1, -1, (2,), (1,), 0, 0), id="negative-offset"),
    pytest.param((1, 0, (2,), (1,), 0, 4), id="bad-flags"),
    pytest.param((1, 0, (2.0,), (1,), 0, 0), id="float-size"),
    pytest.param((1, 0, (True,), (1,), 0, 0), id="bool-size"),
    pytest.param((1, 0, ("2",), (1,), 0, 0), id="str-size"),
    pytest.param((1, 0, 2, 1, 0, 0), id="scalar-sizes"),
    pytest.param(("1", 0, (2,), (1,), 0, 0), id="str-storage"),
    pytest.param((1, 0, (1,) * (codec.MAX_DIMS + 1), (1,) * (codec.MAX_DIMS + 1), 0, 0), id="too-many-dims"),
    pytest.param(None, id="nil"),
    pytest.param(5, id="int"),
]


@pytest.mark.parametrize("fields", BAD_TENSOR_REFS)
def test_malformed_tensor_ref_in_op(fields):
    expect_error(open_server(), raw_op_with_arg(msgpack.packb(_ext(1, fields))))


def test_tensor_ref_garbage_bytes():
    expect_error(open_server(), raw_op_with_arg(msgpack.packb(msgpack.ExtType(1, b"\xc1\xc1"))))


def test_tensor_ref_with_max_dims_accepted():
    client, server = open_pair()
    ref = TensorRef(1, 0, (1,) * codec.MAX_DIMS, (1,) * codec.MAX_DIMS, 0)
    assert transfer(client, server, Op(seq=1, name="a", args=[ref])).args == [ref]


def test_malformed_tensor_ref_in_callsync_kwargs():
    server = open_server()
    data = frame([DEFINE_OP, 0, "a"]) + frame([CallSync.code, 1, 0, [], {"t": _ext(1, (1, 0, (-1,), (1,), 0, 0))}])
    expect_error(server, data)


def test_malformed_tensor_ref_in_result():
    expect_error(open_client(), frame([Result.code, 1, [_ext(1, (1, 0, (2,), (1,), 99, 0))]]))


@pytest.mark.parametrize("fields", [
    pytest.param((0, (2,), b"\x00" * 7), id="too-few-bytes"),
    pytest.param((0, (2,), b"\x00" * 9), id="too-many-bytes"),
    pytest.param((1, (), b"\x00" * 4), id="0-dim-float64-4-bytes"),
    pytest.param((0, (2, 0), b"\x00" * 4), id="empty-tensor-with-bytes"),
    pytest.param((99, (1,), b"\x00"), id="bad-dtype"),
    pytest.param((0, (-1,), b""), id="negative-size"),
    pytest.param((0, (1,), "abcd"), id="str-data"),
    pytest.param((0, (1,)), id="two-fields"),
])
def test_malformed_inline_tensor_in_op(fields):
    expect_error(open_server(), raw_op_with_arg(msgpack.packb(_ext(8, fields), use_bin_type=True)))


@pytest.mark.parametrize("ext", [
    pytest.param(msgpack.ExtType(2, b""), id="dtype-empty"),
    pytest.param(msgpack.ExtType(2, b"\x00\x00"), id="dtype-two-bytes"),
    pytest.param(msgpack.ExtType(2, b"\x14"), id="dtype-20"),
    pytest.param(msgpack.ExtType(4, b"\x09"), id="memory-format-9"),
    pytest.param(msgpack.ExtType(4, b""), id="memory-format-empty"),
    pytest.param(msgpack.ExtType(5, b"\x08"), id="layout-8"),
    pytest.param(msgpack.ExtType(5, b"\x00\x00"), id="layout-two-bytes"),
    pytest.param(msgpack.ExtType(6, b"\x00" * 15), id="complex-15-bytes"),
    pytest.param(msgpack.ExtType(6, b"\x00" * 17), id="complex-17-bytes"),
    pytest.param(msgpack.ExtType(3, msgpack.packb(5)), id="device-int"),
    pytest.param(msgpack.ExtType(3, msgpack.packb(("cuda",))), id="device-one-field"),
    pytest.param(msgpack.ExtType(3, msgpack.packb((5, 0))), id="device-int-type"),
    pytest.param(msgpack.ExtType(3, b"\xc1"), id="device-garbage"),
    pytest.param(msgpack.ExtType(9, msgpack.packb((1, 2, 3))), id="new-tensor-three-fields"),
])
def test_malformed_value_extensions_in_op(ext):
    expect_error(open_server(), raw_op_with_arg(msgpack.packb(ext)), "bad value")


@pytest.mark.parametrize("fields", [
    pytest.param((-1, 8, 0, (2,), (1,), 0), id="negative-storage"),
    pytest.param((1, "8", 0, (2,), (1,), 0), id="str-nbytes"),
    pytest.param((1, 8, 0, (-2,), (1,), 0), id="negative-size"),
    pytest.param((1, 8, 0, (2, 3), (1,), 0), id="sizes-strides-mismatch"),
    pytest.param((1, 8, 0, (2,), (1,), 999), id="dtype-999"),
])
def test_malformed_new_tensor_in_result(fields):
    expect_error(open_client(), frame([Result.code, 1, _ext(9, fields)]))


# ---------------------------------------------------------------- validation gaps (known bugs)


@pytest.mark.xfail(strict=True, reason=(
    "known limitation: Connection._decode_header calls msgpack.unpackb with the default timestamp handling, so "
    "extension type -1 (msgpack Timestamp) bypasses codec.ext_hook and reaches the application as a "
    "msgpack.Timestamp instead of being rejected as an unknown extension type"))
def test_timestamp_extension_rejected():
    expect_error(open_server(), raw_op_with_arg(b"\xd6\xff\x00\x00\x00\x01"))  # fixext4, type -1


@pytest.mark.parametrize("index", [[1, 2], -5, "0", 1.5], ids=repr)
def test_malformed_device_index_rejected(index):
    ext = msgpack.ExtType(3, msgpack.packb(("cuda", index)))
    expect_error(open_server(), raw_op_with_arg(msgpack.packb(ext)))


def test_payload_on_op_definition_rejected():
    expect_error(open_server(), frame([DEFINE_OP, 0, "aten::add"], b"junk") + frame([Sync.code, 1]))


def test_an_op_frames_runner_takes_consecutive_op_frames_and_hands_the_rest_back():
    """``bind(op_frames_runner=...)``: offered the receive buffer where a complete Op frame
    starts; what it takes is consumed and replaced by the event it returns; a frame it refuses
    is decoded as usual and not offered to ``op_runner`` a second time."""
    client, server = open_pair()
    offers, single = [], []

    def frames_runner(buffer, start, names, max_header):
        offers.append(start)
        position, taken = start, []
        while position < len(buffer):
            header_len, payload_len = PREFIX.unpack_from(buffer, position)
            header = msgpack.unpackb(bytes(buffer[position + PREFIX.size:position + PREFIX.size + header_len]),
                                     strict_map_key=False, ext_hook=lambda code, data: None)
            if header[0] != 11 or names[header[2]] != "aten::neg":
                break  # (only neg is "native" here)
            taken.append(header[1])
            position += PREFIX.size + header_len
        return (position, ("ran", taken)) if taken else None

    def runner(raw, names):
        single.append(bytes(raw))
        return None

    server.bind(op_runner=runner, op_frames_runner=frames_runner)
    x = TensorRef(1, 0, (2,), (1,), 0)
    data = b"".join(client.send(Op(seq=seq, name=name, args=[x], kwargs={}, outs=[]))
                    for seq, name in [(1, "aten::neg"), (2, "aten::neg"), (3, "aten::abs"), (4, "aten::neg")])
    data += client.send(Sync(seq=5))
    server.receive_data(data)
    events = drain(server)
    assert events[0] == ("ran", [1, 2])
    assert isinstance(events[1], Op) and events[1].name == "aten::abs" and events[1].seq == 3
    assert events[2] == ("ran", [4])
    assert isinstance(events[3], Sync) and len(events) == 4
    assert single == []  # the refused frame was not offered twice
    assert len(offers) == 3  # (at each Op frame the previous call did not take; never at the Sync)
    # without op_runner, the frames runner is not used either
    client, server = open_pair()
    server.bind(op_frames_runner=frames_runner)
    server.receive_data(client.send(Op(seq=1, name="aten::neg", args=[x], kwargs={}, outs=[])))
    assert isinstance(server.next_event(), Op)
