"""Host (CPU) tensors among the arguments of an op on the device: refused where CUDA refuses
them, taken where CUDA takes them, so a program that runs here runs on a real GPU and the
other way round, at every size (by value they would work up to 1 MiB and fail above)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuwire
from gpuwire.client import wire

MISMATCH = "Expected all tensors to be on the same device"


@pytest.mark.parametrize("call, argument", [
    (lambda dev, host, idx: dev @ host, "mat2"),
    (lambda dev, host, idx: F.linear(dev, host), "mat2"),
    (lambda dev, host, idx: F.embedding(idx, dev), "index"),  # generate(input_ids=<cpu>) on CUDA
    (lambda dev, host, idx: dev.index_select(0, idx), "index"),
    (lambda dev, host, idx: dev.gather(0, idx.view(2, 1).expand(2, 3)), "index"),
    (lambda dev, host, idx: torch.where(host > 0, dev, dev), "condition"),
])
def test_host_tensor_where_cuda_refuses_one_raises_cudas_error_naming_the_argument(device, call, argument):
    host = torch.randn(3, 3)
    dev, idx = host.to(device), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match=MISMATCH) as info:
        call(dev, host, idx)
    assert f"got {argument} is on cpu" in str(info.value)
    assert "move it to the device first" in str(info.value)
    # nothing half-sent: the session goes on, bit for bit
    assert torch.equal((dev * 2).cpu(), host * 2)
    gpuwire.synchronize()


def test_large_host_tensor_is_refused_the_same_way_as_a_small_one(device):
    """By value, a host tensor worked up to 1 MiB and failed above with another message."""
    dev = torch.randn(4, 4, device=device)
    for columns in (4, 1 << 17):  # 64 bytes; 2 MiB
        with pytest.raises(RuntimeError, match=MISMATCH):
            dev @ torch.randn(4, columns)


def test_host_tensors_where_cuda_takes_them_match_cpu_bit_for_bit(device):
    base = torch.randn(5, 3)
    dev = base.to(device)
    idx, mask = torch.tensor([0, 4, 2]), torch.tensor([True, False, True, False, True])
    assert torch.equal(dev[idx].cpu(), base[idx])            # indices of index: converted on the device
    assert torch.equal(dev[mask].cpu(), base[mask])          # a host boolean mask
    assert torch.equal((dev + torch.tensor(2.0)).cpu(), base + torch.tensor(2.0))  # a 0-dim host tensor
    values = torch.randn(3, 3)
    dev[idx] = values.to(device)
    expected = base.clone()
    expected[idx] = values
    assert torch.equal(dev.cpu(), expected)
    dev.copy_(base)                                          # copies across devices
    assert torch.equal(dev.cpu(), base)


def test_packed_sequences_and_ctc_lengths_stay_on_the_host_as_cuda_wants(device):
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4)
    x, lengths = torch.randn(5, 2, 3), torch.tensor([5, 3])  # lengths must be a CPU tensor
    expected = lstm(nn.utils.rnn.pack_padded_sequence(x, lengths))[0]
    remote = nn.LSTM(3, 4)
    remote.load_state_dict(lstm.state_dict())
    remote.to(device)
    packed = remote(nn.utils.rnn.pack_padded_sequence(x.to(device), lengths))[0]  # lstm.data: batch_sizes on the host
    assert torch.equal(packed.data.cpu(), expected.data)
    padded, padded_lengths = nn.utils.rnn.pad_packed_sequence(packed)
    assert torch.equal(padded.cpu(), nn.utils.rnn.pad_packed_sequence(expected)[0])
    assert torch.equal(padded_lengths, lengths)
    log_probs = torch.randn(6, 2, 5).log_softmax(2)
    targets = torch.randint(1, 5, (2, 3))
    input_lengths, target_lengths = torch.tensor([6, 5]), torch.tensor([3, 2])
    local = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    remote_loss = F.ctc_loss(log_probs.to(device), targets.to(device), input_lengths, target_lengths)
    assert torch.equal(remote_loss.cpu(), local)


def test_every_op_named_as_taking_host_tensors_exists_in_this_torch():
    """A misspelt name would silently refuse what CUDA takes."""
    for name in wire.HOST_TENSOR_OPS:
        base, _, overload = name[len("aten::"):].partition(".")
        getattr(getattr(torch.ops.aten, base), overload or "default")._schema  # raises if absent
