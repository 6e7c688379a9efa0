"""Node-to-node session transfer: how a draining node hands a live session to another node.

Sits at the node's I/O edge, next to the server. A client at a sync point asks its node (a
``migrate:`` query) to move the session to the node its replacement lease names; this module
connects there as a durable client, sends every storage of the session (Alloc + Write, straight
from device memory: the bytes never pass through the client), the op-name table, and a
``Restore`` with the generators, the node-id counter and the last applied seq, then leaves the
session parked there. The client resumes it with the key returned here.
What crosses the boundary: a Session in, a small dict (address, session id, resume key) out.
"""

from __future__ import annotations

import logging
import time

import torch

from .. import __version__
from .._io import dial, read_event, send_parts
from ..protocol import Connection, Role
from ..protocol.events import Alloc, Error, Hello, Reject, Restore, Sync, SyncDone, Write

log = logging.getLogger("gpuwire.node")

CHUNK_BYTES = 16 << 20
PARK_SECONDS = 60.0  # how long the target keeps the session for the client to take over


class MigrationError(Exception):
    """The session could not be moved; it stays where it is, intact."""


def check_target(session, address: str, token: str | None) -> None:
    """Refuse a move anywhere but to the node a pool-signed token for this session's own lease
    names: otherwise a client could make a node push a session's memory to any host."""
    from ..client.probe import parse_address

    verifier = getattr(session, "token_verifier", None)
    any_node = getattr(verifier, "any_node", None)
    if session.lease_id is None or any_node is None:
        raise MigrationError("only sessions of pool leases on a pool-mode node can move node to node")
    try:
        claims = any_node(token or "")
    except Exception as exc:  # noqa: BLE001 - every token error is a refusal
        raise MigrationError(f"the target's lease token is refused: {exc}") from None
    if claims.get("lease") != session.lease_id:
        raise MigrationError("the target's lease token is for another lease than this session's")
    named = claims.get("addr")
    try:
        same = named is not None and parse_address(named) == parse_address(address)
    except ValueError:
        same = False
    if not same:
        raise MigrationError(f"the target address {address} is not the node the lease token names "
                             f"({named or 'no address'}): a session moves only to the node its new lease is on")


def push_session(session, address: str, token: str | None, *, tls_context=None, timeout: float = 30.0) -> dict:
    from ..client.probe import parse_address

    check_target(session, address, token)
    host, port = parse_address(address)
    started = time.monotonic()
    try:
        sock = dial(host, port, timeout, tls_context)
    except OSError as exc:
        raise MigrationError(f"cannot reach the target node {address}: {exc}") from None
    conn = Connection(Role.CLIENT)
    try:
        sock.sendall(conn.send(Hello(client_version=__version__, token=token, capabilities=["sync-ops"],
                                     options={"pid": session.client_pid, "durable": PARK_SECONDS,
                                              "share": session.share})))
        welcome = read_event(sock, conn, "the target node")
        if isinstance(welcome, Reject):
            raise MigrationError(f"the target node {address} refused the session: {welcome.reason}")
        if not welcome.resume.get("key"):
            raise MigrationError(f"the target node {address} does not keep sessions for a takeover")
        moved = 0
        send_parts(sock, [conn.adopt_op_names(session.conn.peer_op_names)])
        for storage_id, storage in list(session.storages.items()):
            nbytes = storage.nbytes()
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if data.device.type != "cpu":
                data = data.cpu()
            view = memoryview(data.numpy())
            parts = conn.send_parts(Alloc(seq=0, storage_id=storage_id, nbytes=nbytes, overwrite=True))
            for start in range(0, nbytes, CHUNK_BYTES):
                parts += conn.send_parts(Write(seq=0, storage_id=storage_id, byte_offset=start,
                                               payload=view[start:start + CHUNK_BYTES]))
            send_parts(sock, parts)
            moved += nbytes
        state = session.export_state()
        sock.sendall(conn.send(Restore(seq=0, **state)))
        sock.sendall(conn.send(Sync(seq=0)))
        reply = read_event(sock, conn, "the target node")
        if isinstance(reply, Error):
            raise MigrationError(f"the target node {address} could not rebuild the session: {reply.message}")
        if not isinstance(reply, SyncDone):
            raise MigrationError(f"unexpected {type(reply).__name__} from the target node {address}")
    except (OSError, ConnectionError) as exc:
        raise MigrationError(f"moving the session to {address} failed: {exc}") from None
    finally:
        sock.close()  # no Goodbye: the target parks the session for its client
    seconds = time.monotonic() - started
    log.info("session %s moved to %s as %s: %d bytes in %.3f s", session.id, address, welcome.session_id,
             moved, seconds)
    return {"address": address, "session": welcome.session_id, "key": welcome.resume["key"],
            "bytes": moved, "seconds": round(seconds, 4)}
