"""Tensor descriptors whose element count overflows int64 are refused like any other bad
view: an Error for that command, and the session goes on. (A size past the codec's 2**62 is a
malformed frame: the node closes that connection, as for any protocol error.)"""

import pytest

from gpuwire.protocol import CLOSED
from gpuwire.protocol.codec import DTYPE_CODES, pack_tensor_ref
from gpuwire.protocol.events import Alloc, Error, Op, Sync, SyncDone
from tests.node.test_request_fuzz import Attacker

F32 = DTYPE_CODES["float32"]


@pytest.fixture
def node():
    from tests.conftest import NodeProcess
    proc = NodeProcess()
    yield proc
    proc.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes, strides", [
    ((1 << 32, 1 << 32, 1 << 32), (0, 0, 0)),       # in bounds (stride 0) but 2**96 elements
    ((0, 1 << 62, 1 << 62), (1, 1, 1)),             # empty, yet its strides overflow int64
])
def test_an_overflowing_view_is_refused_and_the_session_goes_on(node, sizes, strides):
    client = Attacker(node.address)
    try:
        client.send(client.conn.send(Alloc(seq=client.next_seq(), storage_id=1, nbytes=64, overwrite=False)))
        bad = pack_tensor_ref(1, 0, sizes, strides, F32)
        op_seq = client.next_seq()
        client.send(client.conn.send(Op(seq=op_seq, name="aten::neg", args=[bad], kwargs={}, outs=[])))
        seq = client.next_seq()
        client.send(client.conn.send(Sync(seq=seq)))
        replies = []
        while not any(type(e) is SyncDone or (type(e) is Error and e.reply_to == seq) for e in replies):
            event = client._next()
            assert event is not CLOSED, f"the node dropped the session: {node.log_text()[-1500:]}"
            replies.append(event)
        errors = [e for e in replies if type(e) is Error]
        assert errors and ("int64" in errors[0].message or "overflow" in errors[0].message), replies
        assert client.sync() == "answered"  # the session is alive and well
    finally:
        client.close()
