"""Ops outside aten (torchvision's nms/roi_align, torch_scatter, a program's own torch.library ops)
on gpuwire tensors: a node runs aten ops only, so they run on the client's CPU and match a CPU run."""

import pytest
import torch

_lib = torch.library.Library("gwhost", "DEF")
_lib.define("scaled_sum(Tensor x, Tensor y, float alpha) -> Tensor")
_lib.define("min_max(Tensor x) -> (Tensor, Tensor)")
_lib.define("clamp_inplace(Tensor(a!) x, float bound) -> Tensor(a!)")
_lib.define("nms_like(Tensor boxes, Tensor scores, float threshold) -> Tensor")
_lib.define("first_row(Tensor(a) x) -> Tensor(a)")
_lib.define("scale_all(Tensor[] xs, Tensor? bias, float s) -> Tensor[]")


def _nms_like(boxes, scores, threshold):
    # data-dependent output size, as torchvision's nms
    order = scores.argsort(descending=True)
    return order[scores[order] > threshold]


_lib.impl("scaled_sum", lambda x, y, alpha: x * alpha + y, "CPU")
_lib.impl("min_max", lambda x: (x.min(0).values, x.max(0).values), "CPU")
_lib.impl("clamp_inplace", lambda x, bound: x.clamp_(-bound, bound), "CPU")
_lib.impl("nms_like", _nms_like, "CPU")
_lib.impl("first_row", lambda x: x[0], "CPU")
_lib.impl("scale_all", lambda xs, bias, s: [x * s + (0 if bias is None else bias) for x in xs], "CPU")


@torch.library.custom_op("gwhost::soft_threshold", mutates_args=(), device_types="cpu")
def soft_threshold(x: torch.Tensor, t: float) -> torch.Tensor:
    return torch.sign(x) * torch.clamp(x.abs() - t, min=0)


@soft_threshold.register_fake
def _(x, t):
    return torch.empty_like(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * (x.abs() > ctx.t), None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.t = inputs[1]


soft_threshold.register_autograd(_backward, setup_context=_setup)


def test_an_op_outside_aten_runs_on_the_host_and_matches_cpu(device, capfd):
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    got = torch.ops.gwhost.scaled_sum(x.to(device), y.to(device), 2.5)
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), torch.ops.gwhost.scaled_sum(x, y, 2.5))
    assert "gwhost::scaled_sum is not an aten op" in capfd.readouterr().err
    (got * 2).sum().item()  # the uploaded result is an ordinary device tensor
    torch.ops.gwhost.scaled_sum(x.to(device), y.to(device), 1.0)
    assert "scaled_sum" not in capfd.readouterr().err  # said once per op


def test_several_results_in_place_writes_and_data_dependent_sizes(device):
    torch.manual_seed(1)
    x = torch.randn(6, 4)
    low, high = torch.ops.gwhost.min_max(x.to(device))
    assert torch.equal(low.cpu(), x.min(0).values) and torch.equal(high.cpu(), x.max(0).values)

    on_device = x.to(device)
    returned = torch.ops.gwhost.clamp_inplace(on_device, 0.5)
    assert returned is on_device
    assert torch.equal(on_device.cpu(), x.clamp(-0.5, 0.5))

    scores = torch.rand(10)
    kept = torch.ops.gwhost.nms_like(torch.zeros(10, 4).to(device), scores.to(device), 0.4)
    assert torch.equal(kept.cpu(), _nms_like(torch.zeros(10, 4), scores, 0.4))


def test_lists_of_tensors_and_optional_arguments(device):
    xs = [torch.randn(3), torch.randn(2, 3)]
    bias = torch.randn(3)
    got = torch.ops.gwhost.scale_all([x.to(device) for x in xs], bias.to(device), 3.0)
    expected = torch.ops.gwhost.scale_all(xs, bias, 3.0)
    assert isinstance(got, list) and all(g.device.type == device.type for g in got)
    assert all(torch.equal(g.cpu(), e) for g, e in zip(got, expected))
    got = torch.ops.gwhost.scale_all([x.to(device) for x in xs], None, 0.5)
    assert all(torch.equal(g.cpu(), x * 0.5) for g, x in zip(got, xs))


def test_a_custom_op_with_autograd_trains_through_the_host(device):
    torch.manual_seed(2)
    x = torch.randn(8)
    grads = {}
    for where in ("cpu", device):
        leaf = x.to(where).detach().requires_grad_()
        (soft_threshold(leaf, 0.3) * torch.arange(8.0, device=where)).sum().backward()
        grads[where] = leaf.grad.cpu()
    assert torch.equal(grads[device], grads["cpu"])


def test_an_op_returning_a_view_says_what_to_do(device):
    with pytest.raises(NotImplementedError, match="returns a view of its input"):
        torch.ops.gwhost.first_row(torch.ones(3, 2, device=device))
