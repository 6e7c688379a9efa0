"""Large payloads bypass the frame buffer: received in place (get_buffer/buffer_updated) or into
a buffer the application provides (payload_sink)."""

import pytest

from gpuwire.protocol import Connection, ProtocolError, Role, StreamCut
from gpuwire.protocol.connection import LARGE_PAYLOAD
from gpuwire.protocol.events import Data, Hello, Read, Welcome, Write


def _pair(**server_kwargs):
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER, **server_kwargs)
    server.receive_data(client.send(Hello()))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(Welcome()))
    assert isinstance(client.next_event(), Welcome)
    return client, server


def _feed_like_a_socket(conn: Connection, data: bytes, chunk: int):
    """What a transport does: recv_into(get_buffer()) then buffer_updated(n)."""
    events, pos = [], 0
    while pos < len(data):
        buf = conn.get_buffer(chunk)
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        conn.buffer_updated(n)
        pos += n
        while (event := conn.next_event()).__class__.__name__ not in ("_Sentinel",):
            events.append(event)
    return events


@pytest.mark.parametrize("chunk", [1000, 65536, 1 << 20])
def test_large_write_arrives_intact_through_get_buffer(chunk):
    client, server = _pair()
    payload = bytes(range(256)) * (LARGE_PAYLOAD // 256 * 5 + 3)
    wire = client.send(Write(seq=1, storage_id=7, byte_offset=0, payload=payload)) + client.send(
        Read(seq=2, storage_id=7, byte_offset=0, nbytes=4))
    events = _feed_like_a_socket(server, wire, chunk)
    assert [type(e) for e in events] == [Write, Read]
    assert bytes(events[0].payload) == payload


def test_payload_sink_receives_in_place():
    target = bytearray(3 * LARGE_PAYLOAD)
    seen = []

    def sink(header, nbytes):
        seen.append((header[2], nbytes))
        return memoryview(target)

    client, server = _pair(payload_sink=sink)
    payload = b"\x07" * len(target)
    events = _feed_like_a_socket(server, client.send(Write(seq=1, storage_id=9, byte_offset=0, payload=payload)),
                                 100_000)
    assert seen == [(9, len(target))]
    assert events[0].payload.obj is target and target == payload  # the sink's view, filled in place


def test_eof_inside_a_large_payload_is_a_cut_stream():
    client, server = _pair()
    wire = client.send(Write(seq=1, storage_id=1, byte_offset=0, payload=b"x" * (2 * LARGE_PAYLOAD)))
    server.receive_data(wire[: len(wire) // 2])
    server.next_event()
    server.receive_data(b"")
    with pytest.raises(StreamCut, match="middle of a"):
        server.next_event()


def test_large_payload_on_an_event_without_payload_is_refused_before_allocation():
    import struct

    import msgpack
    client, server = _pair()
    header = msgpack.packb([Read.code, 1, 2, 3, 4])
    server.receive_data(struct.pack("!IQ", len(header), 1 << 27) + header)
    with pytest.raises(ProtocolError, match="cannot carry"):
        server.next_event()


def test_client_side_data_sink():
    destination = bytearray(LARGE_PAYLOAD * 2)
    client = Connection(Role.CLIENT, payload_sink=lambda header, n: memoryview(destination))
    server = Connection(Role.SERVER)
    server.receive_data(client.send(Hello()))
    server.next_event()
    client.receive_data(server.send(Welcome()))
    client.next_event()
    events = _feed_like_a_socket(client, server.send(Data(seq=5, payload=b"\x01" * len(destination))), 50_000)
    assert events[0].seq == 5 and destination == b"\x01" * len(destination)
