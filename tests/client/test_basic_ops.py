"""Everyday tensor work on the gpuwire device, compared with the same work on CPU."""

import copy
import gc

import pytest
import torch

import gpuwire


def test_device_prints_as_gpuwire(device):
    t = torch.ones(2, device=device)
    assert str(t.device) == "gpuwire:0"
    assert "device='gpuwire:0'" in repr(t)


def test_roundtrip_copy_is_exact(device):
    x = torch.randn(33, 17)
    assert torch.equal(x.to(device).cpu(), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_dtypes_roundtrip(device, dtype, monkeypatch):
    from gpuwire.client import mirror
    monkeypatch.setattr(mirror, "ENABLED", False)  # read the node's bytes, not the client's copy
    x = (torch.randn(5, 7) * 10).to(dtype)
    assert torch.equal(x.to(device).cpu(), x)


def test_noncontiguous_and_converting_copies(device):
    x = torch.randn(6, 8)
    d = x.to(device)
    assert torch.equal(d.t().cpu(), x.t())
    assert torch.equal(d[:, ::2].cpu(), x[:, ::2])
    assert torch.equal(d.to(torch.float16).cpu(), x.to(torch.float16))
    target = torch.zeros(8, 6, device=device)
    target.copy_(x.t())
    assert torch.equal(target.cpu(), x.t())
    back = torch.empty(6, 8, dtype=torch.float64)
    back.copy_(d)
    assert torch.equal(back, x.double())
    strided = torch.zeros(6, 16, device=device)[:, ::2]
    strided.copy_(x)
    assert torch.equal(strided.cpu(), x)


def test_views_send_no_message(device):
    d = torch.randn(4, 6, device=device)
    gpuwire.synchronize()
    rt = gpuwire.client.device.current_runtime()
    before = rt.ops_sent
    v = d.view(24)
    v = v.view(6, 4).t()
    v = v[1:, ::2]
    v = d.unsqueeze(0).expand(3, 4, 6)
    assert rt.ops_sent == before
    assert v.shape == (3, 4, 6)


def test_inplace_and_out(device):
    x = torch.randn(5, 5)
    d = x.to(device)
    d.mul_(2).add_(1)
    assert torch.equal(d.cpu(), x * 2 + 1)
    out = torch.empty(0, device=device)
    torch.add(d, d, out=out)
    assert out.shape == (5, 5)
    assert torch.equal(out.cpu(), (x * 2 + 1) * 2)


def test_reductions_and_indexing(device):
    x = torch.randn(7, 9)
    d = x.to(device)
    assert torch.equal(d.sum(0).cpu(), x.sum(0))
    assert torch.equal(d.amax(1).cpu(), x.amax(1))
    assert torch.equal(d.argmax(1).cpu(), x.argmax(1))
    assert d.mean().item() == x.mean().item()
    assert torch.equal(d[d > 0].cpu(), x[x > 0])
    assert torch.equal(d.nonzero().cpu(), x.nonzero())
    assert torch.equal(torch.where(d > 0, d, -d).cpu(), torch.where(x > 0, x, -x))
    idx = torch.tensor([0, 3, 3, 6])
    assert torch.equal(d[idx.to(device)].cpu(), x[idx])
    d[idx.to(device)] = 0.0
    x[idx] = 0.0
    assert torch.equal(d.cpu(), x)


def test_cat_stack_split_matmul(device):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    da, db = a.to(device), b.to(device)
    assert torch.equal(torch.cat([da, db], 1).cpu(), torch.cat([a, b], 1))
    assert torch.equal(torch.stack([da, db]).cpu(), torch.stack([a, b]))
    assert all(torch.equal(p.cpu(), q) for p, q in zip(da.split(2, 1), a.split(2, 1)))
    assert torch.equal((da @ db.t()).cpu(), a @ b.t())
    assert torch.equal(torch.bmm(da[None], db.t()[None]).cpu(), torch.bmm(a[None], b.t()[None]))
    assert torch.equal(torch.einsum("ij,kj->ik", da, db).cpu(), torch.einsum("ij,kj->ik", a, b))


def test_random_is_reproducible_and_matches_cpu(device):
    torch.manual_seed(123)
    r1 = torch.randn(100, device=device).cpu()
    torch.manual_seed(123)
    r2 = torch.randn(100, device=device).cpu()
    torch.manual_seed(123)
    local = torch.randn(100)
    assert torch.equal(r1, r2)
    assert torch.equal(r1, local)


def test_item_tolist_and_scalars(device):
    d = torch.tensor([1.5, 2.5], device=device)
    assert d.tolist() == [1.5, 2.5]
    assert (d * torch.tensor(2.0)).cpu().tolist() == [3.0, 5.0]
    assert bool((d > 1).all())


def test_generator_on_the_device(device):
    g = torch.Generator(device="gpuwire")
    assert g.device == torch.device("gpuwire", 0)
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    g.manual_seed(7)
    a = torch.randn(50, device=device, generator=g).cpu()
    g.manual_seed(7)
    b = torch.randn(50, device=device, generator=g).cpu()
    assert torch.equal(a, b)
    assert torch.equal(a, torch.randn(50, generator=torch.Generator().manual_seed(7)))
    state = g.get_state()
    x = torch.rand(8, device=device, generator=g).cpu()
    g.set_state(state)
    assert torch.equal(torch.rand(8, device=device, generator=g).cpu(), x)
    with pytest.raises(RuntimeError, match="Expected a 'gpuwire' device type for generator"):
        torch.randn(3, device=device, generator=torch.Generator())


def test_dropout_reproducible_with_manual_seed(device):
    x = torch.ones(1000, device=device)
    torch.manual_seed(5)
    a = torch.nn.functional.dropout(x, 0.3).cpu()
    torch.manual_seed(5)
    b = torch.nn.functional.dropout(x, 0.3).cpu()
    assert torch.equal(a, b)
    assert 200 < int((a == 0).sum()) < 400


def test_sparse_tensors_fail_with_a_message_that_says_what_to_do(device):
    indices, values = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
    with pytest.raises(NotImplementedError, match="sparse tensors are not supported on the gpuwire device"):
        torch.sparse_coo_tensor(indices, values, (2, 2)).to(device)
    # an Embedding(sparse=True)'s gradient is dense on the device (tests/conformance/test_test_ops_regressions.py)
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(device)
    embedding(torch.tensor([1, 2]).to(device)).sum().backward()
    assert not embedding.weight.grad.is_sparse and embedding.weight.grad.cpu()[1:3].eq(1).all()
    # a dense device tensor made sparse is refused at the call (the node's "unsupported memory
    # format option Contiguous" came at the next sync before session 31), and nothing is queued
    x = torch.arange(9.0).reshape(3, 3).to(device)
    for to_sparse in (x.to_sparse, x.to_sparse_csr, lambda: x.to_sparse(layout=torch.sparse_bsr, blocksize=(1, 1))):
        with pytest.raises(NotImplementedError, match="sparse tensors are not supported on the gpuwire device"):
            to_sparse()
    assert x.sum().item() == 36.0


def test_nested_tensors_run_jagged_and_the_strided_layout_says_so(device):
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    jagged = torch.nested.nested_tensor([a, b], layout=torch.jagged, device=device)
    parts = (jagged * 2 + 1).unbind()
    assert all(torch.equal(p.cpu(), q * 2 + 1) for p, q in zip(parts, (a, b)))
    strided = torch.nested.nested_tensor([a, b], device=device)
    with pytest.raises(NotImplementedError, match="layout=torch.jagged"):
        strided * 2


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")
def test_quantized_tensors_are_refused_where_they_are_made_with_the_way_out(device):
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    makers = {
        "upload": lambda: quantized.to(device),
        "per tensor": lambda: torch.quantize_per_tensor(torch.randn(4, device=device), 0.1, 0, torch.qint8),
        "per channel": lambda: torch.quantize_per_channel(torch.randn(2, 4, device=device), torch.tensor([0.1, 0.2]),
                                                          torch.tensor([0, 0]), 0, torch.quint8),
        "dynamic": lambda: torch.quantize_per_tensor_dynamic(torch.randn(4, device=device), torch.quint8, False),
    }
    for make in makers.values():
        with pytest.raises(NotImplementedError, match="quantized tensors are not supported on the gpuwire device"):
            make()
    # the session goes on, and the way out the message gives works
    assert torch.equal(quantized.dequantize().to(device).cpu(), quantized.dequantize())
    assert torch.equal((torch.ones(3, device=device) * 2).cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("name, make", [
    ("clone", lambda t, d: t.clone()),
    ("contiguous", lambda t, d: t.contiguous()),
    ("zeros_like", lambda t, d: torch.zeros_like(t)),
    ("ones_like", lambda t, d: torch.ones_like(t, dtype=torch.float64)),
    ("full_like", lambda t, d: torch.full_like(t, 7.5)),
    ("new_zeros", lambda t, d: t.new_zeros(3, 2)),
    ("new_ones", lambda t, d: t.new_ones((3, 2), dtype=torch.int32)),
    ("zeros", lambda t, d: torch.zeros(5, 3, device=d)),
    ("ones", lambda t, d: torch.ones(5, dtype=torch.int64, device=d)),
    ("full", lambda t, d: torch.full((2, 3), 2.5, device=d)),
    ("full of an int", lambda t, d: torch.full((4,), 7, device=d)),
    ("full of a bool", lambda t, d: torch.full((1,), False, device=d)),
    ("full, 0-dim -inf", lambda t, d: torch.full((), float("-inf"), device=d)),
    ("new_full", lambda t, d: t.new_full((3,), 4)),
    ("scalar_tensor", lambda t, d: torch.scalar_tensor(3, device=d)),
    ("arange", lambda t, d: torch.arange(10, device=d)),
    ("arange start step", lambda t, d: torch.arange(2, 11, 3, device=d)),
    ("arange of floats", lambda t, d: torch.arange(0.0, 1.0, 0.1, device=d)),
    ("arange backwards", lambda t, d: torch.arange(5, 1, -1, device=d)),
    ("arange, empty", lambda t, d: torch.arange(0, device=d)),
    ("arange in half", lambda t, d: torch.arange(3, dtype=torch.float16, device=d)),
    ("linspace", lambda t, d: torch.linspace(0, 1, 7, device=d)),
    ("eye", lambda t, d: torch.eye(2, 4, device=d)),
])
def test_small_fills_and_copies_are_one_message_with_no_allocation(device, name, make):
    # PyTorch decomposes these into ``empty`` + a fill or copy on a PrivateUse1 device: two
    # messages (an Alloc and the op); sent whole they are one
    host = torch.randn(4, 6).t()  # a transposed layout: clone keeps it, contiguous does not
    remote = host.to(device)
    make(remote, device)  # (an op's first call with a dtype other than float32/64 runs with a reply)
    rt = gpuwire.client.device.current_runtime()
    allocate = rt.allocate
    allocations = []
    rt.allocate = lambda nbytes: allocations.append(nbytes) or allocate(nbytes)
    try:
        gpuwire.synchronize()
        before = rt.ops_sent
        got = make(remote, device)
        sent = rt.ops_sent - before
    finally:
        del rt.allocate
    expected = make(host, "cpu")
    assert (sent, allocations) == (1, [])
    assert got.stride() == expected.stride() and got.dtype == expected.dtype
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("name, make", [
    ("rand", lambda d, g: torch.rand(5, device=d)),
    ("randn", lambda d, g: torch.randn(2, 3, device=d)),
    ("randint low high", lambda d, g: torch.randint(0, 9, (7,), device=d)),
    ("randint high", lambda d, g: torch.randint(9, (7,), device=d)),
    ("randperm", lambda d, g: torch.randperm(12, device=d)),
    ("randn with a generator", lambda d, g: torch.randn(3, generator=g, device=d)),
])
def test_small_random_factories_are_one_message_and_draw_what_cpu_draws(device, name, make):
    rt = gpuwire.client.device.current_runtime()
    generator = torch.Generator(device=device).manual_seed(5)
    gpuwire.synchronize()
    allocate = rt.allocate
    allocations = []
    rt.allocate = lambda nbytes: allocations.append(nbytes) or allocate(nbytes)
    try:
        torch.manual_seed(11)
        before = rt.ops_sent
        got = make(device, generator)
        sent = rt.ops_sent - before
    finally:
        del rt.allocate
    torch.manual_seed(11)
    expected = make("cpu", torch.Generator().manual_seed(5))
    assert (sent, allocations) == (1, [])
    assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)


def test_factory_arguments_that_make_no_tensor_fail_like_cpu(device):
    with pytest.raises(RuntimeError, match="step must be nonzero"):
        torch.arange(0, 10, 0, device=device).cpu()
    with pytest.raises(RuntimeError, match="negative dimension"):
        torch.full((-1,), 1.0, device=device).cpu()
    assert torch.equal(torch.arange(3, device=device).cpu(), torch.arange(3))  # and the session goes on


def test_large_fills_and_copies_keep_the_allocation_path(device):
    # from 1 MiB the node serves an Alloc from blocks freed earlier (warm memory): kept
    rt = gpuwire.client.device.current_runtime()
    allocate = rt.allocate
    allocations = []
    rt.allocate = lambda nbytes: allocations.append(nbytes) or allocate(nbytes)
    try:
        big = torch.zeros(1 << 18, device=device)
    finally:
        del rt.allocate
    assert allocations == [1 << 20]
    assert torch.equal(big.cpu(), torch.zeros(1 << 18))


_NORMS = {
    # module, input shape, the aten forward that returns (output, saved statistics...)
    "batch_norm": (lambda: torch.nn.BatchNorm1d(6), (8, 6), lambda x, m: torch.ops.aten.native_batch_norm(
        x, m.weight, m.bias, m.running_mean.clone(), m.running_var.clone(), True, 0.1, 1e-5)),
    "layer_norm": (lambda: torch.nn.LayerNorm(5), (4, 6, 5), lambda x, m: torch.ops.aten.native_layer_norm(
        x, [5], m.weight, m.bias, 1e-5)),
    "group_norm": (lambda: torch.nn.GroupNorm(2, 6), (2, 6, 3, 3), lambda x, m: torch.ops.aten.native_group_norm(
        x, m.weight, m.bias, 2, 6, 9, 2, 1e-5)),
}


@pytest.mark.parametrize("norm", sorted(_NORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_of_half_input_with_float_weights_train_like_cpu(device, dtype, norm):
    """A half input and float32 weights: what CUDA autocast makes of Linear -> BatchNorm, and a
    bf16 model that keeps its norms in float32. The saved statistics are float32 (as the CPU
    and CUDA kernels return them; stored as half they lost precision and the batch-norm
    backward refused them), and forward and backward match CPU bit for bit."""
    import copy

    make, shape, forward = _NORMS[norm]
    torch.manual_seed(0)
    module = make()
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    results = []
    for dev in ("cpu", device):
        layer = copy.deepcopy(module).to(dev)
        xi = x.to(dev).detach().clone().requires_grad_()
        y = layer(xi)
        (y.float() * torch.linspace(-1, 2, shape[-1], device=dev)).sum().backward()
        with torch.no_grad():
            saved = forward(xi.detach(), layer)[1:3]
        results.append([t.cpu() for t in (y, xi.grad, layer.weight.grad, layer.bias.grad, *saved)])
    assert [t.dtype for t in results[1][4:]] == [torch.float32, torch.float32]
    for local, remote in zip(*results):
        assert local.dtype == remote.dtype and torch.equal(local, remote)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_without_update_runs_as_on_cpu(device, dtype):
    """``aten._batch_norm_no_update`` (an eval BatchNorm in PyTorch's training-IR and exported
    graphs): ATen's only kernel calls ``batch_norm_cpu``, which raised "Expected tensor to have CPU
    Backend" for a device tensor. Results bit for bit with CPU, its gradients too."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(4, 3, 5).to(dtype), torch.rand(3) + 0.5, torch.randn(3)
    mean, var = torch.randn(3), torch.rand(3) + 0.1
    results = []
    for dev in ("cpu", device):
        xi = x.to(dev).detach().requires_grad_()
        outs = torch.ops.aten._batch_norm_no_update(xi, weight.to(dev), bias.to(dev), mean.to(dev), var.to(dev),
                                                     0.1, 1e-5)
        (outs[0].float() * torch.linspace(-1, 1, 5, device=dev)).sum().backward()
        results.append([t.cpu() for t in (*outs, xi.grad)])
    for local, remote in zip(*results):
        assert local.shape == remote.shape and local.dtype == remote.dtype and torch.equal(local, remote)


def test_large_downloads_recycle_warm_blocks_but_never_alias_a_live_tensor(device):
    """``y.cpu()`` of >= 8 MiB lands in a block freed by an earlier download of that size (no
    page faults); a block is reused only once nothing refers to its tensor."""
    from gpuwire.client.device import DOWNLOADS

    x = torch.randn(3 << 20)  # 12 MiB
    y = x.to(device)
    DOWNLOADS.cache.clear()
    hits = DOWNLOADS.cache.hits
    first = y.cpu()
    second = (y * 2).cpu()  # the first is alive: a block of its own
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, x) and torch.equal(second, x * 2)
    viewed = first.numpy()  # a NumPy view keeps the block alive too
    address = first.data_ptr()
    del first
    third = (y + 1).cpu()
    assert third.data_ptr() != address and float(viewed[0]) == float(x[0])
    assert DOWNLOADS.cache.hits == hits  # nothing was free to reuse
    del viewed, third
    fourth = (y - 1).cpu()
    assert DOWNLOADS.cache.hits == hits + 1
    assert torch.equal(fourth, x - 1) and torch.equal(second, x * 2)
    assert fourth.is_contiguous() and fourth.dtype == torch.float32 and fourth.shape == x.shape
    fourth.mul_(2)  # an ordinary CPU tensor
    assert torch.equal(fourth, (x - 1) * 2)


@pytest.mark.parametrize("name, fn", [
    ("x % 2", lambda x: x % 2),
    ("fmod(x, 1.5)", lambda x: torch.fmod(x, 1.5)),
    ("remainder(x, -3)", lambda x: torch.remainder(x, -3)),
    ("int64 fmod(x, 2)", lambda x: torch.fmod((x * 10).to(torch.int64), 2)),
])
def test_a_number_for_a_tensor_argument_is_streamed_not_a_round_trip(device, name, fn):
    # ``x % 2`` reaches the device as ``remainder.Tensor(x, 2)`` (C++ wraps the number): it
    # used to make a round trip on every call
    x = torch.randn(6, 5)
    d = x.to(device)
    fn(d)  # the first call with these argument kinds learns the output layout
    gpuwire.synchronize()
    rt = gpuwire.client.device.current_runtime()
    trips = rt.round_trips
    results = [fn(d) for _ in range(4)]
    assert rt.round_trips == trips
    for r in results:
        assert torch.equal(r.cpu(), fn(x)), name


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_a_number_that_does_not_fit_a_0dim_integer_tensor_is_converted_not_promoted(device, dtype):
    # ``t % 300`` of a 0-dim int8 ``t``: C++ wraps 300 as a number that takes ``t``'s dtype (the
    # cast wraps it, 300 -> 44); the client sent an int64 0-dim tensor, which promoted the result
    # to int64 (or, with the layout learned from an earlier call, int8 of the int64 values)
    for value in (-1, 128, 200, 255, 256, 300, -129, 2**31, 2**40):
        for t in (torch.tensor(-3, dtype=dtype), torch.tensor(5, dtype=dtype)):
            for fn in (lambda a: a % value, lambda a: torch.fmod(a, value), lambda a: a & value,
                       lambda a: a | value, lambda a: a ^ value):
                try:
                    want = fn(t)
                except RuntimeError:  # the value wraps to 0: the CPU kernel raises "ZeroDivisionError"
                    # where a GPU's leaves all ones (int64: by the dividend's sign), which a CPU node gives
                    got = fn(t.to(device)).cpu()
                    ones = torch.where(t >= 0, 4294967295, -1) if dtype == torch.int64 else torch.tensor(-1).to(dtype)
                    assert got.dtype == t.dtype and torch.equal(got, ones.to(dtype)), (dtype, value, t)
                    continue
                got = fn(t.to(device)).cpu()
                assert got.dtype == want.dtype and torch.equal(got, want), (dtype, value, t)


@pytest.mark.parametrize("loss", [torch.nn.functional.mse_loss, torch.nn.functional.smooth_l1_loss])
def test_reduced_losses_are_one_message_from_the_first_call(device, loss):
    # their generic kernel (``empty`` + ``X.out``) was two messages every call, and made a CPU
    # node print PyTorch's "output ... was resized" deprecation warning each time
    x, y = torch.randn(7, 3), torch.rand(7, 3)
    dx, dy = x.to(device), y.to(device)
    gpuwire.synchronize()
    rt = gpuwire.client.device.current_runtime()
    for _ in range(3):
        before = rt.seq  # every command sent counts, an Alloc included
        result = loss(dx, dy)
        assert rt.seq - before == 1
        assert torch.equal(result.cpu(), loss(x, y))
    for reduction in ("sum", "none"):
        assert torch.equal(loss(dx, dy, reduction=reduction).cpu(), loss(x, y, reduction=reduction))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_histc_of_integers_counts_like_cuda(device, dtype):
    # CUDA's histc takes integer tensors (bins in integer arithmetic, counts in the input's
    # dtype); a CPU node's kernel refused them, which failed Hugging Face's MoE layers
    x = torch.tensor([0, 1, 1, 3, 3, 3, 7, 2, 9, 5], dtype=dtype)
    d = x.to(device)
    counts = torch.histc(d, bins=4, min=0, max=3)
    assert counts.dtype == dtype
    assert counts.cpu().tolist() == [1, 2, 1, 3]  # 7, 9 and 5 lie outside [0, 3]
    whole = torch.histc(d, bins=5)  # min == max: the data's range, 0..9
    assert whole.cpu().tolist() == torch.histc(x.float(), bins=5).to(dtype).tolist()
    assert torch.histc(d[:0], bins=3).cpu().tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        torch.histc(d, bins=3, min=5, max=1).cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_ops_a_cpu_kernel_lacks_run_like_cuda(device, dtype):
    # CUDA programs under AMP run avg_pool3d, antialiased resizing ... in half precision; the
    # CPU kernels refuse those dtypes ("not implemented for 'Half'"). A CPU node computes them
    # in float32 and rounds, as CUDA's half kernels do inside.
    F = torch.nn.functional
    x = torch.randn(2, 3, 4, 6, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    d = x.to(device).requires_grad_()
    pooled = F.avg_pool3d(d, 2)
    assert pooled.dtype == dtype
    assert torch.equal(pooled.cpu(), F.avg_pool3d(x.float(), 2).to(dtype))
    pooled.sum().backward()
    assert d.grad.dtype == dtype and torch.equal(d.grad.cpu(), torch.full(x.shape, 1 / 8, dtype=dtype))
    image = x[:, :, 0]
    resized = F.interpolate(image.to(device), size=(3, 3), mode="bilinear", antialias=True)
    assert torch.equal(resized.cpu(), F.interpolate(image.float(), size=(3, 3), mode="bilinear", antialias=True).to(dtype))
    target = image.to(device)
    F.rrelu(target, training=False, inplace=True)  # in place: the values come back in half precision
    assert target.dtype == dtype and torch.equal(target.cpu(), F.rrelu(image.float(), training=False).to(dtype))


@pytest.mark.parametrize("reduce", [torch.max, torch.min, torch.median, torch.nanmedian])
@pytest.mark.parametrize("case", ["ties", "nan"])
def test_global_max_min_median_backward_streams_and_matches_cpu(device, reduce, case):
    # their backward spreads the gradient evenly over the elements equal to the result;
    # PyTorch's formula did a .item() (a round trip) every backward on any non-CUDA device
    x = torch.tensor([[1.0, 5.0, 5.0], [-2.0, 5.0, 0.5]]) if case == "ties" else \
        torch.tensor([[1.0, float("nan"), 3.0], [float("nan"), 2.0, 0.0]])
    local = x.clone().requires_grad_()
    (reduce(local) * 3).backward()
    remote = x.to(device).requires_grad_()
    (reduce(remote) * 3).backward()  # (an op's first call with a dtype other than float32/64 runs with a reply)
    remote.grad = None
    gpuwire.synchronize()
    rt = gpuwire.client.device.current_runtime()
    trips = rt.round_trips
    value = reduce(remote) * 3
    value.backward()
    assert rt.round_trips == trips
    assert torch.equal(value.cpu(), reduce(x) * 3) or (value.isnan().item() and (reduce(x) * 3).isnan())
    assert torch.equal(remote.grad.cpu(), local.grad)
    with torch.no_grad():
        assert torch.equal(reduce(remote).cpu(), reduce(x)) or reduce(x).isnan()


def test_global_max_forward_mode_ad_matches_cpu(device):
    import torch.autograd.forward_ad as fwAD
    x, tangent = torch.tensor([1.0, 5.0, 5.0, -1.0]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    results = []
    for where in ("cpu", device):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.to(where), tangent.to(where))
            results.append([fwAD.unpack_dual(reduce(dual)).tangent.cpu() for reduce in (torch.max, torch.min, torch.median)])
    for local, remote in zip(*results):
        assert torch.equal(remote, local)


def test_indexing_with_host_boolean_masks_of_the_same_shape(device):
    # the meta kernel reads a CPU mask's values: a layout cached by the mask's shape alone was
    # reused for the next mask ("the kernel returned an output of shape [0, 4] ... predicted [2, 4]")
    x = torch.randn(3, 4)
    d = x.to(device)
    for values in ([True, False, True], [False, False, False], [True, True, True], [True, False, True]):
        for mask in (torch.tensor(values), torch.tensor(values, dtype=torch.uint8).bool()):
            assert torch.equal(d[mask].cpu(), x[mask])
            written, expected = d.clone(), x.clone()
            written[mask] = 7.0
            expected[mask] = 7.0
            assert torch.equal(written.cpu(), expected)


def test_conj_physical_in_place_and_zero_gradients(device):
    # conj_physical_ ran its CPU stub on the client ("DispatchStub: missing kernel for gpuwire");
    # sgn's backward of a real tensor is a ZeroTensor, which the node could not store
    x = torch.randn(4, dtype=torch.complex64)
    for make in (lambda t: t.clone(), lambda t: t.conj_physical().conj()):
        local, remote = make(x), make(x.to(device))
        local.conj_physical_()
        remote.conj_physical_()
        assert torch.equal(remote.cpu(), local) and remote.is_conj() == local.is_conj()
    r = torch.randn(5, dtype=torch.float64, requires_grad=True)
    rd = r.detach().to(device).requires_grad_()
    torch.sgn(r).sum().backward()
    torch.sgn(rd).sum().backward()
    assert torch.equal(rd.grad.cpu(), r.grad)


def test_storage_resize_frees_and_brings_back_memory_keeping_its_leading_bytes():
    """``UntypedStorage.resize_`` on the device (what FSDP does to free a flat parameter between
    uses): it raised "register PrivateUse1HooksInterface ... resizePrivateUse1Bytes". The storage
    object and the tensors on it stay; its bytes move to a fresh allocation."""
    import gpuwire
    x = torch.arange(10.0, device="gpuwire")
    view = x[2:5]
    storage = x.untyped_storage()
    in_use = gpuwire.client.device.runtime().bytes_in_use
    storage.resize_(0)
    assert storage.nbytes() == 0 and gpuwire.client.device.runtime().bytes_in_use == in_use - 40
    storage.resize_(40)
    x.copy_(torch.arange(10.0) * 2)
    assert torch.equal(view.cpu(), torch.tensor([4.0, 6.0, 8.0]))
    storage.resize_(20)  # shrinking keeps the leading bytes
    assert torch.equal(torch.empty(0, device="gpuwire").set_(storage, 0, (5,), (1,)).cpu(), torch.arange(5.0) * 2)
    storage.resize_(48)  # growing too (the rest is zero here; uninitialised on CPU)
    grown = torch.empty(0, device="gpuwire").set_(storage, 0, (12,), (1,)).cpu()
    assert torch.equal(grown[:5], torch.arange(5.0) * 2) and grown.shape == (12,)
    typed = torch.randn(6, device="gpuwire")
    before = typed.cpu()
    typed._typed_storage()._resize_(0)
    typed._typed_storage()._resize_(6)
    typed.copy_(before.to("gpuwire"))
    assert torch.equal(typed.cpu(), before)
    host = torch.ones(3)
    host.untyped_storage().resize_(8)  # host storages keep torch's own resize
    assert host.untyped_storage().nbytes() == 8


def test_data_assignment_moves_a_parameter_across_the_boundary_keeping_the_object():
    """``param.data = param.to(device)`` (FSDP2 moves a CPU model's parameters so; Hugging Face's
    Trainer with ``fsdp="full_shard"`` goes through it): PyTorch's ``set_data`` raised
    "incompatible tensor type" for the gpuwire device. The Parameter object, its class and
    ``requires_grad`` stay, so a module and an optimizer holding it see the moved tensor."""
    linear = torch.nn.Linear(3, 2)
    weight = linear.weight
    expected = weight.detach().clone()
    weight.data = weight.to("gpuwire")
    linear.bias.data = linear.bias.to("gpuwire")
    assert linear.weight is weight and type(weight) is torch.nn.Parameter and weight.requires_grad
    assert weight.device.type == "gpuwire" and torch.equal(weight.detach().cpu(), expected)
    linear(torch.ones(1, 3, device="gpuwire")).sum().backward()
    assert torch.equal(weight.grad.cpu(), torch.ones(2, 3))
    back = torch.zeros(2, device="gpuwire")
    back.data = torch.ones(2)  # and back to the host, as set_data moves a CUDA tensor
    assert back.device.type == "cpu" and torch.equal(back, torch.ones(2))
    host = torch.zeros(2)
    host.data = torch.ones(2)  # host to host: torch's own set_data
    assert torch.equal(host, torch.ones(2))
    pinned = torch.zeros(3, device="gpuwire")
    view = pinned.view(3)  # a tensor the swap cannot move: the error says what to do instead
    with pytest.raises(RuntimeError, match=r"incompatible tensor type.*Use `tensor.to\(...\)`"):
        pinned.data = torch.ones(3)
    del view


def test_deleting_a_tensors_data_raises_pytorchs_error():
    """gpuwire's ``Tensor.data`` property (above) kept PyTorch's refusal to delete it: ``del
    x.data`` said "property of 'Tensor' object has no deleter" (an AttributeError) on every
    tensor, host ones too, wherever gpuwire was installed."""
    host = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="Deleting tensor data is not allowed"):
        del host.data
    assert torch.equal(host.data, torch.ones(2))


def test_data_parallel_runs_a_host_model_on_the_device(device):
    """With gpuwire installed, ``nn.DataParallel`` picks the gpuwire device as it picks ``cuda:0``
    on a machine with a GPU (the model moves there); its scatter is CUDA-only C++
    (``torch._C._scatter`` raised AttributeError), so the module runs on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    inputs = torch.randn(5, 4)
    parallel = torch.nn.DataParallel(model)
    assert next(model.parameters()).device.type == "gpuwire"
    out = parallel(inputs)
    assert out.device.type == "gpuwire"
    out.sum().backward()
    expected = reference(inputs)
    expected.sum().backward()
    assert torch.equal(out.detach().cpu(), expected.detach())
    assert torch.equal(model[0].weight.grad.cpu(), reference[0].weight.grad)


def test_free_memory_is_never_more_than_a_cpu_node_host_has(device):
    """``mem_get_info`` said total RAM minus this session's bytes: PyTorch's large-tensor tests
    (``_has_sufficient_memory``) and batch-size finders trusted it, asked the CPU node for more
    than the host had, and the out-of-memory killer took the node."""
    free, total = torch.gpuwire.mem_get_info()
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    assert 0 < free <= total
    assert free <= available * 1.05 + (64 << 20)  # (the host's use moves between the two readings)


def test_dropped_large_tensors_are_freed_without_waiting_for_a_sync(device):
    """Dead storages were looked for every 256 allocations, whatever their size: a loop of a
    few large tensors (PyTorch's masked-softmax test, 200 MB attention maps) kept up to 256 of
    them dead on the node, and a CPU node ran the host out of memory. Each MiB now counts as an
    allocation, so at most ~256 MiB of dropped tensors wait."""
    from gpuwire.client.device import current_runtime
    gpuwire.synchronize()
    rt = current_runtime()
    before = rt.bytes_in_use
    for _ in range(24):
        x = torch.empty(16 << 20, device=device)  # 64 MiB, dropped at once
        del x
    assert rt.bytes_in_use - before <= (256 + 64) << 20, rt.bytes_in_use - before


def test_memory_allocated_drops_as_soon_as_a_tensor_is_dropped(device):
    """The frees of dropped tensors go out with the memory query: ``memory_allocated()`` right
    after ``del x`` counted x until the next synchronize (or 256 allocations later)."""
    gc.collect()
    gpuwire.synchronize()
    before = torch.accelerator.memory_allocated()
    x = torch.empty(250_000, device=device)
    assert torch.accelerator.memory_allocated() == before + 1_000_000
    del x
    assert torch.accelerator.memory_allocated() == before
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] == before


def test_torch_accelerator_memory_api_reports_the_devices_memory(device):
    # (a device backed from Python has no C++ DeviceAllocator: these asserted inside PyTorch)
    assert torch.accelerator.current_accelerator().type == "gpuwire"
    gc.collect()
    torch.accelerator.empty_cache()  # (frees what earlier tests left dead)
    before = torch.accelerator.memory_allocated()
    x = torch.empty(250_000, device=device)  # 1 MB
    assert torch.accelerator.memory_allocated() == before + 1_000_000 == torch.gpuwire.memory_allocated()
    assert torch.accelerator.memory_reserved() >= torch.accelerator.memory_allocated()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == before + 1_000_000
    assert torch.accelerator.max_memory_allocated() >= before + 1_000_000
    del x
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    # (at most ``before``: a collection can free more that earlier tests left behind)
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated() <= before
    free, total = torch.accelerator.get_memory_info()
    assert total > 0 and 0 <= free <= total


def test_device_generic_streams_and_events_wait_for_the_node(device):
    """``torch.Stream.synchronize()``, ``torch.Event`` (device-generic code, as PyTorch now
    writes it: ``torch.accelerator.current_stream()``) wait for the node, as
    ``torch.cuda.synchronize()`` does: a stream synchronization returned at once, and a timing
    event raised "Backend doesn't support synchronizing events" (session 31)."""
    from gpuwire.client import native
    if native.status() != "native":
        pytest.skip("no C++ compiler or GPUWIRE_NATIVE=0: PyTorch's Python device guard has no events")
    d = torch.arange(10.0, device=device)
    d.index_select(0, torch.tensor([1], device=device))  # (the dtypes' first call runs with a reply)
    d.index_select(0, torch.tensor([100], device=device))  # queued; only the node finds it out of range
    with pytest.raises(gpuwire.RemoteError, match="index"):
        torch.accelerator.current_stream().synchronize()
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    x = torch.randn(256, 256, device=device)
    for _ in range(10):
        x = torch.tanh(x @ x)
    end.record()
    end.synchronize()
    assert start.query() and end.query() and start.elapsed_time(end) > 0
    d.index_select(0, torch.tensor([100], device=device))
    untimed = torch.Event()
    untimed.record()
    with pytest.raises(gpuwire.RemoteError, match="index"):
        untimed.synchronize()
    assert torch.equal((d * 2).cpu(), torch.arange(10.0) * 2)
