"""SDPA graphs a node keeps between a forward and its backward (``gpuwire::sdpa_keep``).

A kept graph's saved tensors count against the session's memory while its handle storage
lives, and are dropped when the client frees the handle or the session closes; a command that
never stores its handle (hostile or malformed) leaves nothing behind for long, and a graph
that would not fit the session's budget is refused."""

from __future__ import annotations

import torch

from gpuwire.protocol import codec
from gpuwire.protocol.events import Free, Op

from .test_session_fast_paths import F32, make_session, tensor, upload

U8 = codec.DTYPE_CODES["uint8"]
SHAPE = (1, 2, 16, 8)
STRIDES = (256, 128, 8, 1)
NBYTES = 4 * 256


def keep(session, first_out: int, outs: int = 3, dropout_p: float = 0.5):
    q = tensor(session, 0x1000, 0, SHAPE, STRIDES)
    declared = [[first_out, NBYTES, list(SHAPE), list(STRIDES), F32],
                [first_out + 0x1000, 0, [0], [1], U8],
                [first_out + 0x2000, 1, [1], [1], U8]][:outs]
    if dropout_p:  # the generator state: its size is the node's
        state = torch.default_generator.get_state()
        declared[1] = [first_out + 0x1000, state.numel(), [state.numel()], [1], U8]
    session.handle(Op(seq=1, name="gpuwire::sdpa_keep", args=[q, q, q, None, dropout_p, False, None, False, False],
                      kwargs={}, outs=declared))


def test_a_kept_graph_is_charged_then_freed_with_its_handle():
    session = make_session()
    upload(session, 0x1000, torch.randn(SHAPE))
    before = session.bytes_in_use
    keep(session, 0x10000)
    assert session.pending_error is None, session.pending_error
    assert len(session._kept) == 1
    attention = 2 * 16 * 16 * 4  # the softmax the math path saves, at least
    assert session.bytes_in_use - before >= NBYTES + attention + 1
    session.handle(Free(seq=2, storage_ids=[0x10000, 0x11000, 0x12000]))
    assert not session._kept
    assert session.bytes_in_use == before
    keep(session, 0x20000)
    session.close()
    assert not session._kept


def test_commands_that_never_store_their_handle_leave_a_bounded_charged_residue():
    session = make_session()
    upload(session, 0x1000, torch.randn(SHAPE))
    most = 0
    for i in range(3 * session._sweep_kept_above):  # outputs declared short: an error, handle never stored
        keep(session, 0x100000 * (i + 1), outs=2)
        assert session.pending_error is not None
        session.pending_error = None
        most = max(most, len(session._kept))
        # whatever is kept is charged to this session, never to the node at large
        stored = sum(storage.nbytes() for storage in session.storages.values())
        assert session.bytes_in_use == stored + sum(entry[3] for entry in session._kept.values())
    assert most <= 64 + 1  # swept of the dead each time there are more than 64
    session.close()
    assert not session._kept


def test_a_graph_past_the_session_budget_is_refused():
    session = make_session()
    upload(session, 0x1000, torch.randn(SHAPE))
    session.memory_budget = session.bytes_in_use + NBYTES + 5000 + 64  # the outputs fit, the graph does not
    keep(session, 0x10000)
    error = session.pending_error
    assert error is not None and "memory budget" in str(error)
    assert not session._kept


def test_a_generator_state_written_by_fills_keeps_every_byte():
    """A CUDA node writes the generator state it keeps for a recomputing backward by fill_
    kernels (no host-to-device copy, which would wait for the stream): every byte, the sign
    bit of each word included, must come through as get_state() gave it."""
    from gpuwire.node.composite import state_by_fills
    state = torch.tensor([255] * 8 + [1, 2, 3, 4, 5, 6, 7, 128], dtype=torch.uint8)
    out = state_by_fills(state, torch.device("cpu"))
    assert out.dtype == torch.uint8 and torch.equal(out, state)
    odd = torch.arange(13, dtype=torch.uint8)  # not whole 64-bit words: copied as it is
    assert torch.equal(state_by_fills(odd, torch.device("cpu")), odd)
