"""One training step of each architecture in ``hf_zoo`` on the device and on CPU: the loss and
every parameter's gradient bit for bit (dropout included: both runs seed the same stream)."""

from __future__ import annotations

import copy

import pytest
import torch

from .hf_zoo import CASES, loss_of


@pytest.mark.parametrize("name", sorted(CASES))
def test_architecture_trains_one_step_bit_for_bit(device, name):
    build, make_inputs = CASES[name]
    torch.manual_seed(0)
    model = build().train()
    remote = copy.deepcopy(model).to(device)
    inputs = make_inputs()
    torch.manual_seed(7)
    expected = loss_of(model(**inputs))
    expected.backward()
    torch.manual_seed(7)
    got = loss_of(remote(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}))
    got.backward()
    assert got.item() == expected.item()
    for (param_name, local), param in zip(model.named_parameters(), remote.parameters()):
        if local.grad is None:
            assert param.grad is None, param_name
        else:
            assert torch.equal(param.grad.cpu(), local.grad), param_name
