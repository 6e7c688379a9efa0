"""Regression tests for the gpuwire bugs that PyTorch's own test/test_ops.py found (one per
root cause; docs/opinfo.md "PyTorch's test_ops.py"). Results are compared with local CPU bit
for bit where the op is deterministic."""

import pytest
import torch


def test_out_on_host_raises_instead_of_writing_a_copy(device):
    """An out= (or in-place ``self``) tensor on the CPU was sent by value: the node wrote a copy
    and the caller's tensor kept its uninitialized bytes, silently. CUDA raises; so do we."""
    x = torch.randn(3).to(device)
    for out in (torch.empty(3), torch.empty(())):
        with pytest.raises(RuntimeError, match="same device"):
            torch.add(x, x, out=out)
    with pytest.raises(RuntimeError, match="same device"):
        torch.sort(x, out=(torch.empty(3), torch.empty(3, dtype=torch.long)))
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3).add_(x)
    # the device path is unchanged
    out = torch.empty(3, device=device)
    torch.add(x, x, out=out)
    assert torch.equal(out.cpu(), x.cpu() + x.cpu())
