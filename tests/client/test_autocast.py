"""Autocast on the gpuwire device: CUDA's op lists and cast policies, in both implementations
(the C++ kernels a program gets from its first attach, and the Python ones kept where they
cannot be built). Values are compared bit for bit with local CPU runs of the same casts."""

import pytest
import torch
import torch.nn.functional as F

import gpuwire

from ..node.test_native import BUILDS
from gpuwire.client import autocast
from gpuwire.client import device as dev

BF16 = torch.bfloat16


@pytest.fixture(params=["native", "python"])
def kernels(request, device):
    """The device with autocast served by one implementation; the C++ one again afterwards."""
    if request.param == "native":
        if not BUILDS:
            pytest.skip("no C++ compiler or GPUWIRE_NATIVE=0: only the Python kernels exist")
        assert autocast.use_native() is None
    else:
        autocast.use_python()
    assert autocast.status() == request.param
    yield device
    if BUILDS:
        assert autocast.use_native() is None


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _same(remote, local):
    assert remote.dtype == local.dtype, (remote.dtype, local.dtype)
    assert torch.equal(remote.cpu(), local), (remote.cpu() - local).abs().max()


def test_lower_precision_ops_run_in_the_autocast_dtype(kernels):
    a, b, bias = _data(8, 16), _data(16, 4, seed=1), _data(4, seed=2)
    with torch.autocast("gpuwire", dtype=BF16):
        mm = torch.mm(a.to(kernels), b.to(kernels))
        linear = F.linear(a.to(kernels), b.t().to(kernels), bias.to(kernels))
        addmm = torch.addmm(bias.to(kernels), a.to(kernels), b.to(kernels))
        double = torch.mm(a.double().to(kernels), b.double().to(kernels))  # (float64 is never cast)
    _same(mm, torch.mm(a.to(BF16), b.to(BF16)))
    _same(linear, F.linear(a.to(BF16), b.t().to(BF16), bias.to(BF16)))
    _same(addmm, torch.addmm(bias.to(BF16), a.to(BF16), b.to(BF16)))
    _same(double, torch.mm(a.double(), b.double()))
    _same(torch.mm(a.to(kernels), b.to(kernels)), torch.mm(a, b))  # (outside the region: as written)


def test_float32_ops_and_optional_dtypes(kernels):
    x = _data(4, 8).to(BF16)
    weight = torch.ones(8)
    with torch.autocast("gpuwire", dtype=BF16):
        d = x.to(kernels)
        layer_norm = F.layer_norm(d, (8,))
        rms_norm = F.rms_norm(d, (8,), weight.to(kernels))
        softmax = torch.softmax(d, -1)
        softmax_half = torch.softmax(d, -1, dtype=torch.float16)  # (a dtype given is kept)
        total = d.sum()
        norm = torch.ops.aten.norm.Scalar(d)  # (CUDA: norm.ScalarOpt_dtype asked for float32, input as is)
        norm_dim = torch.ops.aten.norm.ScalarOpt_dim(d, 3, [1])
        upsampled = F.interpolate(d.view(1, 1, 4, 8), scale_factor=2)
        exp = torch.exp(d)
    wide = x.float()
    _same(layer_norm, F.layer_norm(wide, (8,)))
    _same(rms_norm, F.rms_norm(wide, (8,), weight))
    _same(softmax, torch.softmax(x, -1, dtype=torch.float32))
    _same(softmax_half, torch.softmax(x, -1, dtype=torch.float16))
    _same(total, x.sum(dtype=torch.float32))
    _same(norm, torch.ops.aten.norm.ScalarOpt_dtype(x, 2, dtype=torch.float32))
    _same(norm_dim, torch.ops.aten.norm.ScalarOpt_dim_dtype(x, 3, [1], False, dtype=torch.float32))
    _same(upsampled, F.interpolate(wide.view(1, 1, 4, 8), scale_factor=2))
    _same(exp, torch.exp(wide))


def test_promoting_ops_run_in_the_widest_input_dtype(kernels):
    full, low = _data(6), _data(6, seed=1).to(BF16)
    with torch.autocast("gpuwire", dtype=BF16):
        mixed = torch.addcmul(full.to(kernels), low.to(kernels), low.to(kernels))
        narrow = torch.addcmul(low.to(kernels), low.to(kernels), low.to(kernels))
        dot = torch.vdot(full.to(kernels), low.to(kernels))
    _same(mixed, torch.addcmul(full, low.float(), low.float()))
    _same(narrow, torch.addcmul(low, low, low))
    _same(dot, torch.vdot(full, low.float()))


def test_a_training_step_under_autocast_equals_the_same_casts_on_cpu(kernels):
    """Forward, backward and gradients of a small MLP: float32 parameters, bf16 matmuls,
    float32 loss, as CUDA autocast runs it."""
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 3))
    remote = torch.nn.Sequential(*[torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                   torch.nn.Linear(16, 3)]).to(kernels)
    remote.load_state_dict(local.state_dict())
    x, target = _data(5, 12), torch.tensor([0, 2, 1, 1, 0])
    with torch.autocast("gpuwire", dtype=BF16):
        logits = remote(x.to(kernels))
        loss = F.cross_entropy(logits, target.to(kernels))
    loss.backward()

    def by_hand(x):
        first, _, norm, last = local
        h = F.gelu(F.linear(x.to(BF16), first.weight.to(BF16), first.bias.to(BF16)))
        h = F.layer_norm(h.float(), (16,), norm.weight, norm.bias)
        return F.linear(h.to(BF16), last.weight.to(BF16), last.bias.to(BF16))
    want_logits = by_hand(x)
    # (cross_entropy is composite: its log_softmax is asked for the input's dtype, so it runs in
    # bf16 on CUDA too; nll_loss then runs in float32)
    want_loss = F.nll_loss(torch.log_softmax(want_logits, -1).float(), target)
    want_loss.backward()
    _same(logits, want_logits)
    _same(loss, want_loss)
    for (name, got), want in zip(remote.named_parameters(), local.parameters()):
        assert got.grad.dtype == torch.float32, name
        assert torch.equal(got.grad.cpu(), want.grad), name


@pytest.mark.skipif(not BUILDS, reason="no C++ compiler or GPUWIRE_NATIVE=0: the Python kernels keep no cast cache")
def test_a_weight_used_twice_in_one_region_is_cast_once(device):
    """ATen's autocast cache (the C++ kernels a program attaches with): a float32 leaf weight
    is cast once per region, as on CUDA."""
    assert autocast.use_native() is None
    kernels = device
    weight = torch.randn(8, 8).to(kernels).requires_grad_()
    x = torch.randn(4, 8).to(kernels)
    rt = dev.current_runtime()

    def ops_of(uses, cache):
        with torch.autocast("gpuwire", dtype=BF16, cache_enabled=cache):
            F.linear(x, weight)  # (the first use: the cast)
            gpuwire.synchronize()
            before = rt.ops_sent
            for _ in range(uses):
                F.linear(x, weight)
            gpuwire.synchronize()
            return rt.ops_sent - before
    cached, uncached = ops_of(3, True), ops_of(3, False)
    assert uncached - cached == 3  # (without the cache each use casts the weight again)


def test_binary_cross_entropy_is_refused_as_on_cuda(kernels):
    p = torch.rand(4).to(kernels)
    with torch.autocast("gpuwire", dtype=BF16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)
