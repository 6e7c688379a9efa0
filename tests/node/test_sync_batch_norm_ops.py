"""``nn.SyncBatchNorm``'s CUDA-only ops on the device: the client infers their outputs from meta
kernels (no round trip a call) and a CPU node computes them after CUDA's arithmetic. Checked
against the same statistics computed in float64 on the local CPU; the two-rank end-to-end run
is tests/cli/test_distributed.py."""

import pytest
import torch

import gpuwire

EPS = 1e-5


def _reference(x):
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)
    return mean, (var + EPS).rsqrt()


def _shaped(v, x):
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


@pytest.mark.parametrize("dtype, channels_last", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_sync_batch_norm_ops_match_a_float64_reference_without_a_round_trip_a_call(device, dtype, channels_last):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.rand(3) + 0.5, torch.rand(3) - 0.5
    grad_out = torch.randn(x.shape).to(dtype)
    dx, dw, db, dg = x.to(device), weight.to(device), bias.to(device), grad_out.to(device)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=2e-3, rtol=2e-3)

    def sync_batch_norm_calls():
        mean, invstd = torch.batch_norm_stats(dx, EPS)
        # one rank's statistics gathered as if from two ranks of equal counts: the same statistics
        counts = torch.tensor([100.0, 100.0], device=device)
        running_mean, running_var = torch.zeros(3, device=device), torch.ones(3, device=device)
        gmean, ginvstd = torch.batch_norm_gather_stats_with_counts(
            dx, torch.stack([mean, mean]), torch.stack([invstd, invstd]), running_mean, running_var, 0.1, EPS, counts)
        out = torch.batch_norm_elemt(dx, dw, db, gmean, ginvstd, EPS)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(dg, dx, gmean, ginvstd, dw,
                                                                                      True, True, True)
        grad_in = torch.batch_norm_backward_elemt(dg, dx, gmean, ginvstd, dw, sum_dy, sum_dy_xmu,
                                                  torch.tensor([x.numel() // 3], dtype=torch.int32, device=device))
        return (mean, invstd, running_mean, running_var, gmean, ginvstd, out, sum_dy, sum_dy_xmu, grad_weight,
                grad_bias, grad_in)

    sync_batch_norm_calls()  # (an op's first call with dtypes other than float32/64 alone runs with a reply)
    before = gpuwire.stats()["round_trips"]
    (mean, invstd, running_mean, running_var, gmean, ginvstd, out, sum_dy, sum_dy_xmu, grad_weight, grad_bias,
     grad_in) = sync_batch_norm_calls()
    assert gpuwire.stats()["round_trips"] == before  # every shape came from a meta kernel

    ref_mean, ref_invstd = _reference(x)
    assert mean.dtype == invstd.dtype == torch.float32  # CUDA's accumulation dtype, also for half inputs
    assert torch.allclose(mean.cpu().double(), ref_mean, atol=1e-5)
    assert torch.allclose(invstd.cpu().double(), ref_invstd, rtol=1e-4)
    assert torch.allclose(gmean.cpu().double(), ref_mean, atol=1e-5)
    assert torch.allclose(ginvstd.cpu().double(), ref_invstd, rtol=1e-4)
    # 200 counted elements a channel were declared: the unbiased variance uses that count
    unbiased_declared = (1 / ref_invstd.square() - EPS) * 200 / 199
    assert torch.allclose(running_mean.cpu().double(), 0.1 * ref_mean, atol=1e-6)
    assert torch.allclose(running_var.cpu().double(), 0.9 + 0.1 * unbiased_declared, atol=1e-5)

    xd, gd = x.double(), grad_out.double()
    normalized = (xd - _shaped(ref_mean, xd)) * _shaped(ref_invstd, xd)
    expected_out = normalized * _shaped(weight.double(), xd) + _shaped(bias.double(), xd)
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert torch.allclose(out.cpu().double(), expected_out, **tolerance)
    dims = [0, 2, 3]
    assert torch.allclose(sum_dy.cpu().double(), gd.sum(dims), **tolerance)
    assert torch.allclose(sum_dy_xmu.cpu().double(), (gd * (xd - _shaped(ref_mean, xd))).sum(dims), rtol=1e-3,
                          atol=1e-3)
    assert torch.allclose(grad_weight.cpu().double(), (gd * normalized).sum(dims), rtol=1e-3, atol=1e-3)
    assert torch.allclose(grad_bias.cpu().double(), gd.sum(dims), **tolerance)
    # batch norm's input gradient over one batch, by autograd in float64
    xr = xd.clone().requires_grad_()
    torch.nn.functional.batch_norm(xr, None, None, weight.double(), bias.double(), training=True, eps=EPS).backward(gd)
    assert grad_in.dtype == dtype
    assert torch.allclose(grad_in.cpu().double(), xr.grad, **tolerance)
