"""The node's per-op shortcuts agree with the general path they stand in for.

``Session._adopt`` caches an op's result as the view of the descriptor the client will send for
it; ``Session._run_op`` calls an aten overload's C++ callable directly. Each must give what
the general path gives: the same tensor contents and layout, and a stale cache entry (storage
freed or replaced, metadata changed in place by a later op) must never be returned."""

from __future__ import annotations

import msgpack
import torch

from gpuwire.node.backend import Backend
from gpuwire.node.ops import OpTable
from gpuwire.node.session import RngOwner, Session, _direct
from gpuwire.protocol import codec
from gpuwire.protocol.events import Alloc, Free, Op, Write

F32 = codec.DTYPE_CODES["float32"]


def make_session() -> Session:
    backend = Backend.select("cpu")
    return Session(backend, RngOwner(backend), OpTable())


def descriptor(storage_id, offset, sizes, strides, dtype=F32, flags=0) -> bytes:
    """The bytes a client sends for a tensor (``client.wire``)."""
    return msgpack.packb((storage_id, offset, tuple(sizes), tuple(strides), dtype, flags), use_bin_type=True)


def tensor(session: Session, *fields) -> torch.Tensor:
    return session.ext_hook(codec.EXT_TENSOR, descriptor(*fields))


def upload(session: Session, storage_id: int, values: torch.Tensor) -> None:
    data = values.contiguous().view(torch.uint8).numpy().tobytes()
    assert session.handle(Alloc(seq=0, storage_id=storage_id, nbytes=len(data), overwrite=True)) is None
    assert session.handle(Write(seq=0, storage_id=storage_id, byte_offset=0, payload=data)) is None


def run_add(session: Session, out_id: int, out_strides=(3, 1)) -> None:
    a, b = tensor(session, 0x1000, 0, (2, 3), (3, 1)), tensor(session, 0x2000, 0, (2, 3), (3, 1))
    op = Op(seq=1, name="aten::add.Tensor", args=[a, b], kwargs={},
            outs=[[out_id, 24, [2, 3], list(out_strides), F32]])
    assert session.handle(op) is None
    assert session.pending_error is None, session.pending_error


def test_a_result_is_its_descriptors_view():
    session = make_session()
    x, y = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.full((2, 3), 0.5)
    upload(session, 0x1000, x)
    upload(session, 0x2000, y)
    run_add(session, 0x3000)
    key = descriptor(0x3000, 0, (2, 3), (3, 1))
    assert key in session._views  # cached by _adopt, before the client named it
    cached = tensor(session, 0x3000, 0, (2, 3), (3, 1))
    fresh = session.view(0x3000, 0, (2, 3), (3, 1), F32)
    assert torch.equal(cached, x + y) and torch.equal(cached, fresh)
    assert (cached.shape, cached.stride(), cached.storage_offset(), cached.dtype) == \
        (fresh.shape, fresh.stride(), fresh.storage_offset(), fresh.dtype)
    assert cached.untyped_storage().data_ptr() == session.storages[0x3000].data_ptr()
    assert not cached.requires_grad and not cached.is_conj() and not cached.is_neg()
    # another layout of the same storage is decoded and checked as before
    flat = tensor(session, 0x3000, 0, (6,), (1,))
    assert torch.equal(flat, (x + y).reshape(-1))


def test_a_result_changed_in_place_is_not_returned_stale():
    session = make_session()
    upload(session, 0x1000, torch.ones(2, 3))
    upload(session, 0x2000, torch.ones(2, 3))
    run_add(session, 0x3000)
    t = tensor(session, 0x3000, 0, (2, 3), (3, 1))
    assert session.handle(Op(seq=2, name="aten::unsqueeze_", args=[t, 0], kwargs={}, outs=[])) is None
    assert session.pending_error is None, session.pending_error
    again = tensor(session, 0x3000, 0, (2, 3), (3, 1))
    assert again.shape == (2, 3) and again.stride() == (3, 1)


def test_a_freed_or_replaced_result_is_not_returned():
    session = make_session()
    upload(session, 0x1000, torch.ones(2, 3))
    upload(session, 0x2000, torch.ones(2, 3))
    run_add(session, 0x3000)
    key = descriptor(0x3000, 0, (2, 3), (3, 1))
    assert session.handle(Free(seq=3, storage_ids=[0x3000])) is None
    assert key not in session._views
    assert tensor(session, 0x3000, 0, (2, 3), (3, 1)) is None  # no longer this session's storage
    assert "not allocated" in str(session.decode_error)
    session.decode_error = None
    # the same id stored again (a replayed command): the entry follows the new storage
    run_add(session, 0x3000)
    run_add(session, 0x3000)
    assert session._view_keys[0x3000].count(key) == 1
    t = tensor(session, 0x3000, 0, (2, 3), (3, 1))
    assert t.untyped_storage().data_ptr() == session.storages[0x3000].data_ptr()
    assert torch.equal(t, torch.full((2, 3), 2.0))


def test_a_result_copied_to_the_declared_layout_is_cached_as_the_copy():
    session = make_session()
    upload(session, 0x1000, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    upload(session, 0x2000, torch.ones(2, 3))
    # the client declares a column-major result: the kernel's row-major one is copied
    run_add(session, 0x3000, out_strides=(1, 2))
    t = tensor(session, 0x3000, 0, (2, 3), (1, 2))
    assert t.stride() == (1, 2)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1)
    assert t.untyped_storage().data_ptr() == session.storages[0x3000].data_ptr()


def test_direct_call_is_the_overloads_own():
    add = torch.ops.aten.add.Tensor
    call = _direct(add)
    a, b = torch.randn(5), torch.randn(5)
    assert torch.equal(call(a, b, alpha=2), add(a, b, alpha=2))
    not_an_overload = OpTable().resolve("gpuwire::sdpa")
    assert _direct(not_an_overload) is not_an_overload


def test_meta_warm_up_switches_threads_often_only_while_it_runs():
    """The node's background meta warm-up asks the interpreter to switch threads every 0.2 ms
    while it imports (so a session's command does not wait 5 ms for the GIL), and leaves the
    process's own switch interval as it found it, also when the warm-up fails."""
    import sys

    from gpuwire.node import session as node_session

    before = sys.getswitchinterval()
    seen = []
    real_empty = node_session.torch.empty

    def spying_empty(*args, **kwargs):
        seen.append(sys.getswitchinterval())
        raise RuntimeError("no meta today")

    node_session.torch.empty = spying_empty
    try:
        node_session._warm_up_meta()
    finally:
        node_session.torch.empty = real_empty
    assert len(seen) == 1 and abs(seen[0] - node_session.WARM_UP_SWITCH_INTERVAL) < 1e-6  # (microsecond units)
    assert sys.getswitchinterval() == before


def test_a_cuda_node_runs_cuda_kernels_and_a_cpu_node_cudas_arithmetic():
    """A CPU node stands in for CUDA-only kernels (SyncBatchNorm's) with its own; a CUDA node
    runs CUDA's. A CUDA node instead runs group norm on a contiguous copy of its input, as a CUDA
    program's ``group_norm`` hands it over (CUDA's kernel refuses channels-last: seen on an H200).
    The wrapper runs on CPU tensors here; bench/gpu_check.py runs it on a GPU."""
    cpu, cuda = OpTable("cpu"), OpTable("cuda")
    assert cuda.resolve("aten::batch_norm_stats") is torch.ops.aten.batch_norm_stats.default
    assert cpu.resolve("aten::batch_norm_stats") is not torch.ops.aten.batch_norm_stats.default
    assert cpu.resolve("aten::native_group_norm") is torch.ops.aten.native_group_norm.default
    group_norm = cuda.resolve("aten::native_group_norm")
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(4), torch.randn(4)
    out, mean, rstd = group_norm(x, weight, bias, 2, 4, 25, 2, 1e-5)
    expected = torch.ops.aten.native_group_norm.default(x.contiguous(), weight, bias, 2, 4, 25, 2, 1e-5)
    assert out.is_contiguous() and torch.equal(out, expected[0]) and torch.equal(mean, expected[1])
    grads = cuda.resolve("aten::native_group_norm_backward")(torch.ones_like(x), x, mean, rstd, weight, 2, 4, 25, 2,
                                                             [True, True, True])
    assert grads[0].is_contiguous() and grads[0].shape == x.shape


def test_a_cuda_nodes_batch_norm_takes_cudnn_where_cuda_would_and_else_the_native_kernel():
    """On a CUDA node a training batch norm runs cuDNN's kernels where a CUDA program's
    ``_batch_norm_impl_index`` would (a PrivateUse1 device's picks the native ones, which round
    otherwise: an H200's CNN gradients were 1e-8 off); where cuDNN cannot run (here: no CUDA) or
    does not apply, the native kernel gives what it gave before."""
    from gpuwire.node.ops import _cudnn_takes_batch_norm
    x, w, b = torch.randn(4, 3, 5, 5), torch.ones(3), torch.zeros(3)
    mean, var = torch.zeros(3), torch.ones(3)
    assert _cudnn_takes_batch_norm(x, w, b, mean, var, True, 1e-5)
    assert _cudnn_takes_batch_norm(x.half(), w, b, mean, var, True, 1e-5)  # half input, float weights (AMP)
    assert not _cudnn_takes_batch_norm(x, w, b, mean, var, False, 1e-5)  # eval: the native kernel
    assert not _cudnn_takes_batch_norm(x, None, None, mean, var, True, 1e-5)  # affine=False
    assert not _cudnn_takes_batch_norm(x, w, b, mean, var, True, 1e-6)  # below cuDNN's smallest epsilon
    assert not _cudnn_takes_batch_norm(x[:, :, 0, 0], w, b, mean, var, True, 1e-5)  # 2-d input
    assert not _cudnn_takes_batch_norm(x.bfloat16(), w.bfloat16(), b.bfloat16(), mean, var, True, 1e-5)
    with torch.backends.cudnn.flags(enabled=False):
        assert not _cudnn_takes_batch_norm(x, w, b, mean, var, True, 1e-5)

    cuda = OpTable("cuda")
    m1, v1, m2, v2 = mean.clone(), var.clone(), mean.clone(), var.clone()
    out, save_mean, save_invstd = cuda.resolve("aten::native_batch_norm")(x, w, b, m1, v1, True, 0.1, 1e-5)
    expected = torch.ops.aten.native_batch_norm.default(x, w, b, m2, v2, True, 0.1, 1e-5)
    assert all(torch.equal(a, e) for a, e in zip((out, save_mean, save_invstd), expected))
    assert torch.equal(m1, m2) and torch.equal(v1, v2)
    grad = torch.randn_like(x)
    grads = cuda.resolve("aten::native_batch_norm_backward")(grad, x, w, m1, v1, save_mean, save_invstd, True, 1e-5,
                                                             [True, True, True])
    expected = torch.ops.aten.native_batch_norm_backward.default(grad, x, w, m1, v1, save_mean, save_invstd, True,
                                                                 1e-5, [True, True, True])
    assert all(torch.equal(a, e) for a, e in zip(grads, expected))
