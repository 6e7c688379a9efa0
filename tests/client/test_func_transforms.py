"""``torch.func`` transforms (``grad``, ``vmap``, ``functional_call``: per-sample gradients,
meta-learning) through ops the client sends whole with an ``autograd.Function`` (attention,
dropout), compared with local CPU bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def test_grad_of_attention(device):
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))

    def loss(t):
        return (F.scaled_dot_product_attention(t, t, t, is_causal=True) ** 2).sum()
    assert torch.equal(grad(loss)(q.to(device)).cpu(), grad(loss)(q))


def test_per_sample_gradients_of_an_attention_model(device):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return F.scaled_dot_product_attention(y, y, y).sum()
    torch.manual_seed(0)
    local = Model()
    remote = Model()
    remote.load_state_dict(local.state_dict())
    remote = remote.to(device)
    xs = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))

    def per_sample(model, batch):
        params = {name: p.detach() for name, p in model.named_parameters()}
        return vmap(grad(lambda p, x: functional_call(model, p, (x.unsqueeze(0),))), in_dims=(None, 0))(params, batch)
    want, got = per_sample(local, xs), per_sample(remote, xs.to(device))
    for name in want:
        assert torch.equal(got[name].cpu(), want[name]), name


def test_grad_through_dropout_draws_what_a_local_run_draws(device):
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    drop = torch.nn.Dropout(0.2).train()
    torch.manual_seed(5)
    want = grad(lambda t: (drop(t) * t).sum())(q)
    torch.manual_seed(5)
    got = grad(lambda t: (drop(t) * t).sum())(q.to(device))
    assert torch.equal(got.cpu(), want)


def test_forward_mode_ad_through_dropout_draws_what_a_local_run_draws(device):
    """Forward-mode AD (``torch.autograd.forward_ad`` dual tensors: JVPs, as PyTorch's
    TestCompositeCompliance test_forward_ad makes them) through dropout raised "You must implement
    the jvp function for custom autograd.Function" (the one-message dropout); it runs as the plain
    ops there, which draw the same mask."""
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    tangent = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    results = []
    for where in ("cpu", device):
        with fwAD.dual_level():
            torch.manual_seed(7)
            primal, jvp = fwAD.unpack_dual(F.dropout(fwAD.make_dual(x.to(where), tangent.to(where)), 0.4, True))
            results.append((primal.cpu(), jvp.cpu()))
    (want_primal, want_jvp), (got_primal, got_jvp) = results
    assert torch.equal(got_primal, want_primal) and torch.equal(got_jvp, want_jvp)


def _gradient_penalty(device, dropout_p: float):
    """A gradient penalty through attention (``create_graph=True``, then a second backward), as a
    local run computes it under ``sdpa_kernel(SDPBackend.MATH)``: the kernel with a double backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(11)
    proj = torch.nn.Linear(8, 24).to(device)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    torch.manual_seed(12)  # (the dropout's draws: the local generator's, or the node's)
    with sdpa_kernel(SDPBackend.MATH):
        q, k, v = proj(x).unsqueeze(1).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        (gx,) = torch.autograd.grad((out ** 2).sum(), x, create_graph=True)
        penalty = (gx.norm(dim=-1) - 1).pow(2).mean()
        penalty.backward()
    return [t.detach().cpu() for t in (out, gx, penalty, proj.weight.grad, x.grad)]


def test_double_backward_through_attention_as_a_local_run(device):
    # the second backward raised "element 0 of tensors does not require grad": the node's kept
    # graph gives first-order gradients only; with dropout the recomputation draws the forward's mask
    for dropout_p in (0.0, 0.3):
        want, got = _gradient_penalty("cpu", dropout_p), _gradient_penalty(device, dropout_p)
        for a, b in zip(want[:3], got[:3]):  # the output, the first-order gradient, the penalty
            assert torch.equal(a, b), (dropout_p, (a - b).abs().max())
        # the second-order gradients add the same terms in another order (the recomputed
        # attention is a second copy of the forward in the graph): float rounding apart
        for a, b in zip(want[3:], got[3:]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _rnn_gradient_penalty(device, module, dropout: float):
    torch.manual_seed(0)
    rnn = module(4, 5, num_layers=2, dropout=dropout).to(device)
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    out = rnn(x)[0]
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return [t.detach().cpu() for t in (out, gx, x.grad, rnn.weight_hh_l0.grad)]


def test_double_backward_through_rnn_layers(device):
    # the second backward raised "element 0 of tensors does not require grad" (the node's
    # recomputed backward gives gradients without a graph); CPU's RNNs have a double backward
    for module in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        want, got = _rnn_gradient_penalty("cpu", module, 0.0), _rnn_gradient_penalty(device, module, 0.0)
        assert torch.equal(got[0], want[0]), module  # (the forward is the node's own kernel)
        for a, b in zip(want[1:], got[1:]):  # the recomputation is the composite's cell arithmetic
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # dropout between layers cannot be redrawn as the forward drew it: refused, not wrong
    with pytest.raises(RuntimeError, match="dropout between its layers is not supported"):
        _rnn_gradient_penalty(device, torch.nn.LSTM, 0.5)
