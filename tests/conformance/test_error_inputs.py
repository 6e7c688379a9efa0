"""Errors at the user's line: every OpInfo ``error_inputs`` sample raises at the call on the
device, as on the CPU (see error_inputs.py), except value checks that a CUDA GPU makes
asynchronously too."""

from __future__ import annotations

import torch

from .error_inputs import survey, unexpected


def test_error_inputs_raise_at_the_call_as_on_cpu(device):
    found = survey(device)
    assert found["ok"] >= 600, f"too few error inputs ran: {found['ok']}"
    assert not unexpected(found), "\n".join(f"{kind}: {op}: expected /{regex}/: {what}"
                                            for kind, op, regex, what in unexpected(found))


def test_checks_the_meta_kernels_miss_raise_before_anything_is_sent(device):
    import pytest

    import gpuwire
    x = torch.randn(6, device=device)
    cases = [
        (lambda: x.uniform_(3, -1), "uniform_ expects to return a \\[from, to\\) range, but found from=3 > to=-1"),
        (lambda: x.masked_fill(x > 0, 1e300), "value cannot be converted to type float without overflow"),
        (lambda: torch.masked_select(x, x > 0, out=x), "refer to a single memory location"),
        (lambda: torch.add(x, 1, out=torch.empty(1, device=device).expand(6)), "more than one element"),
        (lambda: torch.empty(2, -1, device=device), "Trying to create tensor with negative dimension -1: \\[2, -1\\]"),
        (lambda: torch.nn.functional.gelu(x, approximate="fast"), "approximate argument must be either none or tanh"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    gpuwire.synchronize()  # nothing the node would refuse was queued: the session goes on
    assert torch.equal(torch.add(x, 1, out=torch.empty(6, device=device)).cpu(), x.cpu() + 1)
