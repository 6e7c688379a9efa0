"""Training with dropout through a real node, compared with local CPU bit for bit.

Dropout draws from the node's generator, which ``torch.manual_seed`` seeds as it seeds the
local one; seeded right before training, a remote run draws the same masks as a local run.
Attention dropout travels as one op each way (``gpuwire::sdpa_keep``: the node keeps the
graph for the backward, or recomputes the forward from the generator state it started at);
``nn.Dropout`` as one op (``gpuwire::dropout``)."""

import gc

import pytest
import torch
import torch.nn.functional as F

import gpuwire

from .test_training import assert_states_equal


def _gpt2_with_dropout():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.2, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


def _train_gpt2(dev, steps=3):
    torch.manual_seed(0)
    model = _gpt2_with_dropout().to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(dev)
    torch.manual_seed(7)  # the masks: the same stream on the node as in a local run
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_gpt2_with_attention_and_residual_dropout_trains_bit_for_bit(device):
    cpu_losses, cpu_state = _train_gpt2("cpu")
    losses, state = _train_gpt2(device)
    assert losses == cpu_losses
    assert_states_equal(state, cpu_state)


def test_attention_dropout_is_one_message_each_way_and_matches_cpu(device):
    def run(dev):
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 2, 8, 4, generator=g).to(dev).requires_grad_() for _ in range(3))
        mask = torch.randn(8, 8, generator=g).to(dev)
        torch.manual_seed(11)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
        (out * out).sum().backward()
        after = torch.rand(3, device=dev)  # the backward's recomputation left the generator where it was
        return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad, after)]

    expected = run("cpu")
    got = run(device)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    q = torch.randn(1, 1, 4, 4, device=device, requires_grad=True)
    before = gpuwire.stats()["ops_sent"]
    out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert gpuwire.stats()["ops_sent"] - before == 1  # the forward: one message, whatever PyTorch decomposes
    grad = torch.ones_like(out)
    before = gpuwire.stats()["ops_sent"]
    (q_grad,) = torch.autograd.grad(out, q, grad)
    assert gpuwire.stats()["ops_sent"] - before == 3  # the recomputing backward, then two adds: q is q, k and v


def test_dropout_module_trains_bit_for_bit_and_eval_is_identity(device):
    def run(dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(32, 4)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dev)
        torch.manual_seed(5)
        losses = []
        for _ in range(4):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        return losses, model(x).detach().cpu(), {k: v.detach().cpu() for k, v in model.state_dict().items()}

    cpu_losses, cpu_eval, cpu_state = run("cpu")
    losses, evaluated, state = run(device)
    assert losses == cpu_losses
    assert torch.equal(evaluated, cpu_eval)
    assert_states_equal(state, cpu_state)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edge_probabilities(device, p):
    x = torch.randn(4, 5)
    remote = F.dropout(x.to(device).requires_grad_(), p)
    local = F.dropout(x.clone().requires_grad_(), p)
    assert torch.equal(remote.detach().cpu(), local.detach())


def in_use():
    """Bytes the node holds for this session once every dead tensor's Free has reached it."""
    gc.collect()
    torch.gpuwire.empty_cache()
    return torch.gpuwire.memory_allocated()


def test_the_kept_attention_graph_counts_against_the_session_and_is_freed_with_it(device):
    q, k, v = (torch.randn(2, 2, 64, 16).to(device).requires_grad_() for _ in range(3))
    base = in_use()
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    held = in_use() - base
    attention_weights = 2 * 2 * 64 * 64 * 4  # what the math path saves for its backward, at least
    assert held >= out.numel() * 4 + attention_weights
    out.sum().backward()
    del out
    q.grad = k.grad = v.grad = None
    assert in_use() == base  # graph, handle, generator state and output all gone on the node


def test_a_second_backward_recomputes_from_the_generator_state(device):
    def run(dev):
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, 2, 6, 4, generator=g).to(dev).requires_grad_() for _ in range(3))
        torch.manual_seed(9)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True)
        grad = torch.randn(out.shape, generator=g).to(dev)
        out.backward(grad, retain_graph=True)  # the node's graph frees its buffers here
        out.backward(grad)  # so this one recomputes, drawing the same mask
        return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]

    assert all(torch.equal(a, b) for a, b in zip(run(device), run("cpu")))


def test_attention_without_gradients_keeps_no_graph(device):
    q = torch.randn(1, 1, 8, 4).to(device)
    wq = torch.randn(1, 1, 8, 4).to(device).requires_grad_()
    base = in_use()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(wq, q, q, dropout_p=0.5)
    assert in_use() - base == out.numel() * 4  # the output alone


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_attention_output_has_the_layout_a_local_cpu_run_gives(device, dropout_p):
    # heads split by view + transpose, as Hugging Face models do: CPU's flash kernel returns
    # that layout, its math path (dropout) a contiguous one; later views and copies depend on it
    q = torch.randn(2, 16, 2, 8).transpose(1, 2)
    remote = q.to(device)
    for _ in range(2):  # the second call is answered from the layout cache
        torch.manual_seed(3)
        local = F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=dropout_p)
        torch.manual_seed(3)
        got = F.scaled_dot_product_attention(remote, remote, remote, is_causal=True, dropout_p=dropout_p)
        assert got.stride() == local.stride()
        assert torch.equal(got.cpu(), local)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_with_dropout_trains_bit_for_bit(device, reentrant):
    # checkpointing restores the device's random state before recomputing a segment only if
    # ``torch.gpuwire._initialized`` says so; otherwise the recomputed dropout masks differ
    def run(dev):
        torch.manual_seed(0)
        model = _gpt2_with_dropout().to(dev)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(dev)
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}

    cpu_loss, cpu_grads = run("cpu")
    loss, grads = run(device)
    assert loss == cpu_loss
    assert_states_equal(grads, cpu_grads)
