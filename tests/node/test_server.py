"""The node under bad input: it drops the offending session and keeps serving the others."""

import socket
import struct
import time

import msgpack
import pytest
import torch

from gpuwire.client.runtime import Runtime
from gpuwire.protocol import Connection, Role
from gpuwire.protocol.events import Hello, Reject, Welcome


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _handshake(sock: socket.socket) -> Connection:
    conn = Connection(Role.CLIENT)
    sock.sendall(conn.send(Hello(client_version="test")))
    while True:
        event = conn.next_event()
        if isinstance(event, (Welcome, Reject)):
            return conn
        conn.receive_data(sock.recv(65536))


def _healthy(address: str) -> bool:
    rt = Runtime(address)
    try:
        rt.synchronize()
        return True
    finally:
        rt.close()


def test_garbage_bytes_drop_only_that_session(fresh_node):
    survivor = Runtime(fresh_node.address)
    with _raw(fresh_node.address) as sock:
        _handshake(sock)
        sock.sendall(b"\x00\x00\x00\x05" + b"\x00" * 8 + b"\xc1\xc1\xc1\xc1\xc1")
        sock.settimeout(10)
        said = b""
        while chunk := sock.recv(4096):  # the node says Goodbye (naming the cause), then closes
            said += chunk
        assert b"protocol error" in said
    survivor.synchronize()  # another session is unaffected
    assert _healthy(fresh_node.address)
    deadline = time.monotonic() + 5
    while "protocol error" not in fresh_node.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "protocol error" in fresh_node.log_text()
    survivor.close()


def test_garbage_before_handshake(fresh_node):
    with _raw(fresh_node.address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(100) == b""
    assert _healthy(fresh_node.address)


def test_version_mismatch_is_refused_naming_both_versions(node):
    with _raw(node.address) as sock:
        conn = Connection(Role.CLIENT)
        sock.sendall(conn.send(Hello(client_version="9.9", protocol_version=99)))
        conn.receive_data(sock.recv(65536))
        event = conn.next_event()
    assert isinstance(event, Reject)
    assert "v99" in event.reason and "v1" in event.reason


def test_oversized_frame_is_refused_before_allocation(fresh_node):
    with _raw(fresh_node.address) as sock:
        _handshake(sock)
        sock.sendall(struct.pack("!IQ", 1 << 31, 1 << 62))
        sock.settimeout(10)
        said = b""
        while chunk := sock.recv(4096):  # a Goodbye naming the cause, then the node closes
            said += chunk
        assert b"protocol error" in said and len(said) < 1000
    assert _healthy(fresh_node.address)


def test_foreign_storage_and_out_of_bounds_views_are_refused(node):
    """A session cannot name another session's storage or read past its own allocation."""
    from gpuwire.protocol.events import Alloc, Read, Write
    victim = Runtime(node.address)
    secret_id = victim.allocate(64)
    victim.write(secret_id, 0, memoryview(b"S" * 64))
    victim.synchronize()

    attacker = Runtime(node.address)
    with pytest.raises(Exception, match="not allocated in this session"):
        attacker.read(secret_id, 0, 64)
    own = attacker.allocate(16)
    with pytest.raises(Exception, match="outside its storage"):
        attacker.read(own, 0, 4096)
    with pytest.raises(Exception, match="outside its storage"):
        attacker.read(own, 1 << 40, 16)
    assert bytes(attacker.read(own, 0, 16)) == b"\x00" * 16  # fresh memory is zeroed
    assert bytes(victim.read(secret_id, 0, 64)) == b"S" * 64
    attacker.close()
    victim.close()


def test_non_aten_and_side_effect_ops_are_refused(node):
    rt = Runtime(node.address)
    for name in ("prims::add", "builtins::eval", "aten::from_file", "aten::_print", "os::system"):
        with pytest.raises(Exception, match="refused"):
            rt.call_sync(name, ["x"], {})
    rt.synchronize()
    rt.close()


def test_hostile_op_cannot_allocate_the_machine_away(node):
    """Ops whose results could not fit are refused before they run: factory ops sized by
    their arguments, and results larger than declared room."""
    from gpuwire.protocol.events import Op
    rt = Runtime(node.address)
    huge = [1 << 22, 1 << 22]  # 16 Ti elements
    for name, args, kwargs in (("aten::zeros", [huge], {}), ("aten::ones", [huge], {}),
                               ("aten::empty.memory_format", [huge], {}), ("aten::full", [huge, 1.0], {})):
        rt.enqueue(rt.conn.encode_op(rt.next_seq(), name, args, kwargs, [[1 << 40, 64, [4], [1], 0]]))
        with pytest.raises(torch.OutOfMemoryError, match="would allocate"):
            rt.synchronize()
    rt.enqueue(rt.conn.encode_op(rt.next_seq(), "aten::zeros", [[4]], {}, [[(1 << 40) + 4096, 1 << 62, [4], [1], 0]]))
    with pytest.raises(torch.OutOfMemoryError, match="would allocate"):
        rt.synchronize()
    rt.close()
    assert _healthy(node.address)


def _in_process_node(frame_timeout: float):
    """A real node server on loopback, in this process, with a short ``frame_timeout``."""
    from gpuwire.node.backend import Backend
    from gpuwire.node.server import NodeServer
    server = NodeServer(port=0, backend=Backend.select("cpu"))
    server.frame_timeout = frame_timeout
    host, port = server.bind()
    server.start_background()
    return server, f"{host}:{port}"


def _sync_in_pieces(sock: socket.socket, conn: Connection, pause: float):
    """A Sync sent in two pieces ``pause`` apart; the reply, or b"" if the node hung up."""
    from gpuwire.protocol.events import Sync, SyncDone
    frame = conn.send(Sync(seq=1))
    sock.sendall(frame[:6])
    time.sleep(pause)
    try:
        sock.sendall(frame[6:])
    except OSError:
        return b""
    sock.settimeout(10)
    while True:
        event = conn.next_event()
        if isinstance(event, SyncDone):
            return event
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        conn.receive_data(chunk)


def test_a_session_idle_longer_than_a_command_may_take_still_takes_a_command_in_pieces():
    # A command has frame_timeout to arrive once its first bytes did; that clock ran from the last
    # complete command, so a session idle for longer (a notebook, a test suite between uses) was
    # dropped as soon as its next command reached the node in two pieces.
    server, address = _in_process_node(frame_timeout=1.0)
    try:
        with _raw(address) as sock:
            conn = _handshake(sock)
            time.sleep(1.5)  # idle: longer than a command may take
            assert _sync_in_pieces(sock, conn, pause=0.2) != b""
        with _raw(address) as sock:  # and a command that stalls half-way is still cut off
            conn = _handshake(sock)
            assert _sync_in_pieces(sock, conn, pause=2.0) == b""
    finally:
        server.close()
