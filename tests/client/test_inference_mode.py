"""Programs under ``torch.inference_mode()`` (what inference servers and ``generate`` loops
use): tensors made there have no version counter and skip autograd's dispatch keys entirely.
Compared with local CPU runs bit for bit."""

import pytest
import torch

import gpuwire


@pytest.mark.parametrize("numel", [3, 1 << 17])  # (the large one is logged by reference when it can be)
def test_inference_tensors_upload_and_read_back(device, numel):
    with torch.inference_mode():
        host = torch.arange(numel, dtype=torch.float32)
        assert host.is_inference()
        remote = host.to(device)
        made_there = torch.tensor([1, 2, 3], device=device)  # (Hugging Face's generate does this)
        host.add_(1)  # (allowed in inference mode, and not seen by any version counter)
        assert torch.equal(remote.cpu(), torch.arange(numel, dtype=torch.float32))
        assert torch.equal(made_there.cpu(), torch.tensor([1, 2, 3]))
    gpuwire.synchronize()


def test_generate_under_inference_mode_equals_local(device):
    transformers = pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    local = GPT2LMHeadModel(cfg).eval()
    remote = GPT2LMHeadModel(cfg).eval()
    remote.load_state_dict(local.state_dict())
    remote = remote.to(device)
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = local.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = remote.generate(prompt.to(device), max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = remote(prompt.to(device)).logits
    assert torch.equal(got.cpu(), want)
    assert torch.equal(logits.cpu(), local(prompt).logits)
