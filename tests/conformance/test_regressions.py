"""Regression tests for the bugs the OpInfo conformance run found (one per root cause)."""

import pytest
import torch
import torch.nn.functional as F


def test_conj_and_neg_views_download_and_clone(device):
    """_copy_from of a lazily conjugated/negated tensor used to recurse forever (segfault)."""
    x = torch.randn(5, dtype=torch.complex64)
    d = x.to(device)
    assert torch.equal(d.conj().cpu(), x.conj())
    assert torch.equal(d.conj().clone().cpu(), x.conj())
    r = torch.randn(4)
    assert torch.equal(torch._neg_view(r.to(device)).cpu(), -r)
    a = torch.randn(5, 6, 7)
    assert torch.equal(torch.fft.ifft(a.to(device), n=10, dim=1).cpu(), torch.fft.ifft(a, n=10, dim=1))


def test_op_without_returns(device):
    """``_cummax_helper(...) -> ()``: the kernel must return None, not ()."""
    x = torch.randn(4, 5)
    values, indices = torch.cummax(x.to(device), dim=1)
    expected = torch.cummax(x, dim=1)
    assert torch.equal(values.cpu(), expected.values) and torch.equal(indices.cpu(), expected.indices)


def test_batch_norm_eval_on_cpu_node(device):
    """Meta kernels model CUDA (eval batch norm: save_mean of size C); the CPU kernel returns
    size 0, so shape inference for a CPU node runs on fake CPU tensors."""
    with torch.no_grad():
        bn = torch.nn.BatchNorm2d(3).eval()
        x = torch.randn(2, 3, 4, 4)
        expected = bn(x)
        assert torch.equal(bn.to(device)(x.to(device)).cpu(), expected)


def test_embedding_bag_on_cpu_node(device):
    weight, indices, offsets = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5])
    for mode in ("sum", "mean", "max"):
        expected = F.embedding_bag(indices, weight, offsets, mode=mode)
        got = F.embedding_bag(indices.to(device), weight.to(device), offsets.to(device), mode=mode)
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_bag_auxiliary_outputs_as_the_cpu_kernel_makes_them(device, mode, dtype):
    """With ``include_last_offset`` the meta kernel mis-sizes ``bag_size``/``max_indices``, and
    for bfloat16 it misses the CPU sum fast path (no ``offset2bag``): the node's kernel
    returned outputs of another shape than the client declared. Forward, backward and the
    forward-only path (no grad) match CPU."""
    import copy

    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 5, mode=mode, include_last_offset=True).to(dtype)
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 5, 8])
    results = []
    for dev in ("cpu", device):
        layer = copy.deepcopy(bag).to(dev)
        out = layer(indices.to(dev), offsets.to(dev))
        out.float().pow(2).sum().backward()
        with torch.no_grad():
            plain = torch.nn.EmbeddingBag(10, 5, mode=mode).to(dev, dtype)
            plain.weight.copy_(layer.weight)
            forward_only = plain(indices.to(dev), offsets.to(dev))
        results.append([t.cpu() for t in (out, layer.weight.grad, forward_only)])
    for local, remote in zip(*results):
        assert local.dtype == remote.dtype and torch.equal(local, remote)


def test_out_variants_with_data_dependent_or_unknown_sizes(device):
    """out= ops whose out sizes cannot be inferred (no meta kernel, data-dependent) run as
    sync ops and the client's out tensors are resized to what the kernel produced."""
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    out = torch.empty(0, dtype=torch.long, device=device)
    torch.nonzero(x.to(device), out=out)
    assert torch.equal(out.cpu(), torch.nonzero(x))
    a, b = torch.randn(5, 3), torch.randn(5, 2)
    expected = torch.linalg.lstsq(a, b)
    got = torch.linalg.lstsq(a.to(device), b.to(device))
    assert got.solution.shape == expected.solution.shape
    torch.testing.assert_close(got.solution.cpu(), expected.solution)


def test_out_tensors_a_sync_op_resizes_are_charged_as_they_grew(device):
    """The kernel of a sync out= op resizes its out tensor on the node, growing the storage in
    place: the session charged it at its old size and took its new size back when it was freed
    (its bytes in use drifted below zero, and a later test counting them failed)."""
    import gc

    from gpuwire.client import device as client_device
    rt = client_device.current_runtime()

    def in_use():
        gc.collect()
        rt._collect_garbage()
        return rt.query("memory")["bytes_in_use"]

    before = in_use()
    out = torch.empty(0, dtype=torch.long, device=device)
    torch.nonzero(torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0]).to(device), out=out)
    assert in_use() >= before + out.numel() * out.element_size()
    del out
    assert in_use() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("zero_dim", [False, True])
def test_numbers_for_tensor_arguments(device, dtype, zero_dim):
    """``torch.copysign(x, 2.5)`` passes a wrapped number for a Tensor argument; it reaches the
    device as a Python number and must promote like the wrapped number would."""
    x = torch.tensor(-1.5).to(dtype) if zero_dim else (torch.randn(6) * 4).to(dtype)
    for value in (2.5, -3, True):
        expected = torch.copysign(x, value)
        got = torch.copysign(x.to(device), value).cpu()
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    idx = torch.tensor([[0], [2], [1]])
    y = torch.randn(3, 4)
    assert torch.equal(torch.take_along_dim(y.to(device), idx.to(device), dim=1).cpu(),
                       torch.take_along_dim(y, idx, dim=1))


def test_empty_view_past_the_end(device):
    """An empty view may have its offset past the end of its storage (negative padding)."""
    x = torch.randn(2, 3)
    expected = F.pad(x, (-3, 0))
    got = F.pad(x.to(device), (-3, 0))
    assert got.shape == expected.shape
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(torch.unbind_copy(torch.randn(0, 3).to(device), 1)[2].cpu(), torch.empty(0))


def test_non_blocking_download(device):
    """A device→host copy with non_blocking=True needs pinned memory through the PrivateUse1
    hooks, which a Python backend cannot provide; it runs as a blocking copy."""
    x = torch.randn(3, 4)
    d = x.to(device)
    assert torch.equal(d.to("cpu", non_blocking=True), x)
    assert torch.equal(d.to("cpu", torch.float64, non_blocking=True, copy=True), x.double())


def test_download_into_contiguous_tensor_with_odd_size_one_stride(device):
    """``.cpu()`` of a one-element diagonal or of an expand: the host tensor is contiguous but
    keeps a stride != 1 on a size-1 dim, which a byte view of it must ignore."""
    x = torch.randn(5, 3)
    assert torch.equal(x.to(device).diagonal(offset=2).cpu(), x.diagonal(offset=2))
    y, like = torch.randn(1, 3), torch.empty(4, 3)
    assert torch.equal(y.to(device).expand_as(like).cpu(), y.expand_as(like))


def test_out_kernels_that_leave_a_conjugate_bit_on_their_out_tensor(device):
    """``linalg_lu_solve(left=False)`` writes through ``out.mH`` and leaves the conjugate bit on
    its out tensor; on the node that bit lived in a tensor object the client never sees, so it
    read conjugated values (found by ``opinfo_runner.py --dtype complex64``)."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 3, dtype=torch.complex64), torch.randn(2, 3, dtype=torch.complex64)
    lu, pivots = torch.linalg.lu_factor(a)
    for adjoint in (False, True):
        expected = torch.linalg.lu_solve(lu, pivots, b, left=False, adjoint=adjoint)
        for _ in range(2):  # the second call reuses the node's cached views
            got = torch.linalg.lu_solve(lu.to(device), pivots.to(device), b.to(device), left=False, adjoint=adjoint)
            assert torch.equal(got.cpu(), expected)
    conj_out = torch.zeros(2, 3, dtype=torch.complex64, device=device).conj()  # a conjugated out= view
    torch.linalg.lu_solve(lu.to(device), pivots.to(device), b.to(device), left=False, out=conj_out)
    local_out = torch.zeros(2, 3, dtype=torch.complex64).conj()
    torch.linalg.lu_solve(lu, pivots, b, left=False, out=local_out)
    assert torch.equal(conj_out.cpu(), local_out)

