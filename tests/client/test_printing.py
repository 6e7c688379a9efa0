"""Printing a device tensor: PyTorch's own text, in one round trip (client/shims.py
``_patch_tensor_printing``). PyTorch's formatter reads a tensor piece by piece: 7 round trips
for a scalar loss and 25 for a 20x20 matrix, each a network round trip to the node."""

import itertools

import pytest
import torch
import torch._tensor_str as printing

import gpuwire

SHAPES = [(), (7,), (2000,), (3, 4000), (40, 40), (2, 3, 500), (3, 3, 3, 3, 3, 3, 3), (0, 5), (5, 1, 300)]
DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool, torch.complex64]
OPTIONS = [{}, {"precision": 2, "sci_mode": True}, {"threshold": 5, "edgeitems": 1}, {"edgeitems": 5, "linewidth": 40}]


def _sample(shape, dtype, generator):
    values = torch.randn(shape, generator=generator) * 1000
    if dtype is torch.complex64:
        values = torch.complex(values, torch.randn(shape, generator=generator))
    values = values.to(dtype) if dtype is not torch.bool else values > 0
    if dtype.is_floating_point and values.numel() > 3:
        values.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
    return values


def _as_pytorch_prints_it(tensor) -> str:
    patched = printing._tensor_str
    printing._tensor_str = patched.__wrapped__
    try:
        return repr(tensor)
    finally:
        printing._tensor_str = patched


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_printed_text_is_pytorchs_own(device, options):
    generator = torch.Generator().manual_seed(0)
    torch.set_printoptions(**options)
    try:
        for shape, dtype in itertools.product(SHAPES, DTYPES):
            tensor = _sample(shape, dtype, generator).to(device)
            for shown in (tensor, tensor.mT if tensor.dim() >= 2 else tensor.flip(0) if tensor.dim() else tensor.clone()):
                assert repr(shown) == _as_pytorch_prints_it(shown), (shape, dtype)
    finally:
        torch.set_printoptions(profile="default")


def test_printing_costs_one_round_trip(device):
    loss = torch.randn(3, device=device, requires_grad=True).square().mean()
    matrix = torch.randn(20, 20, device=device) * 3
    big = torch.randn(1000, 1000, device=device).half()
    for tensor in (loss, matrix, big):
        # (a signature's first call checks its dtypes with a reply: printing a tensor of the same
        # kind first leaves the round trip of the print itself)
        repr(tensor.detach().clone())
        gpuwire.synchronize()
        before = gpuwire.stats()["round_trips"]
        text = repr(tensor)
        assert gpuwire.stats()["round_trips"] - before == 1, text
    assert "grad_fn=<MeanBackward0>" in repr(loss) and "..." in repr(big)
