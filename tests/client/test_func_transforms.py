"""``torch.func`` transforms (``grad``, ``vmap``, ``functional_call``: per-sample gradients,
meta-learning) through ops the client sends whole with an ``autograd.Function`` (attention,
dropout), compared with local CPU bit for bit."""

import contextlib
import warnings

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


def test_forward_mode_ad_through_attention(device):
    """A JVP through ``F.scaled_dot_product_attention`` (dual tensors, with and without a graph)
    and forward-over-reverse (PyTorch's test_ops_fwd_gradients ``fwgrad_bwgrad``) raised "You
    must implement the jvp function for custom autograd.Function" (the one-message attention), or,
    without a graph, dropped the tangent; they run as the composite's ops, as on the CPU."""
    import torch.autograd.forward_ad as fwAD
    g = torch.Generator().manual_seed(0)
    q, k, v, tq = (torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=g) for _ in range(4))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    results = []
    for where in ("cpu", device):
        for requires_grad in (False, True):
            # (a CPU run's flash kernel has no forward AD: compared with its math path, which has)
            with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH) if where == "cpu" else contextlib.nullcontext():
                dual = fwAD.make_dual(q.to(where).detach().requires_grad_(requires_grad), tq.to(where))
                out = F.scaled_dot_product_attention(dual, k.to(where), v.to(where), is_causal=True)
                primal, tangent = fwAD.unpack_dual(out)
                assert tangent is not None
                results.append((primal.detach().cpu(), tangent.detach().cpu()))
    for (want_primal, want_tangent), (got_primal, got_tangent) in zip(results[:2], results[2:]):
        torch.testing.assert_close(got_primal, want_primal)
        torch.testing.assert_close(got_tangent, want_tangent)
    inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradgradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), inputs,
                                        check_fwd_over_rev=True, check_rev_over_rev=False, check_undefined_grad=False)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN], ids=lambda c: c.__name__)
def test_rnn_layers_under_forward_ad_and_torch_func(device, cls):
    """RNN layers are sent whole with an autograd.Function (client/recompute.py): a JVP through
    one and ``torch.func.grad`` of one raised ("You must implement the jvp function", "must
    override the setup_context staticmethod"); they run as the layer's composite ops there."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad
    torch.manual_seed(0)
    reference = cls(4, 5, batch_first=True).double()
    x, tangent = (torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    results = []
    for where in ("cpu", device):
        layer = cls(4, 5, batch_first=True).double().to(where)
        layer.load_state_dict(reference.state_dict())
        with fwAD.dual_level():
            _, jvp = fwAD.unpack_dual(layer(fwAD.make_dual(x.to(where), tangent.to(where)))[0])
        params = {k: v.detach() for k, v in layer.named_parameters()}
        grads = grad(lambda p: functional_call(layer, p, (x.to(where),))[0].pow(2).sum())(params)
        results.append([jvp.cpu(), *(g.cpu() for g in grads.values())])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


def test_torch_func_through_max_min_and_median_of_a_whole_tensor(device):
    """``x.max()``/``min()``/``median()``/``nanmedian()`` without a dim carry an autograd.Function
    here (client/fused.py ``_EvenlyDistributed``: the gradient spread evenly without CPU's
    ``.item()`` round trip), which torch.func's transforms refused; under them the same values and
    gradients come from plain ops, bit for bit with CPU (signs of zeros included)."""
    from torch.func import jvp
    results = []
    for where in ("cpu", device):
        got = []
        for values in ([1.0, 3.0, 3.0, 2.0], [-0.0, -1.0, -0.0, -2.0], [1.0, float("nan"), 2.0, 0.5], [0.1, 0.1, 0.1, -5.0]):
            x = torch.tensor(values, dtype=torch.float64, device=where)
            for name in ("max", "min", "median", "nanmedian"):
                f = getattr(torch.Tensor, name)
                got += [f(x), grad(f)(x), jvp(f, (x,), (torch.arange(1.0, 5.0, dtype=torch.float64, device=where),))[1],
                        vmap(grad(f))(x.reshape(2, 2))]
        results.append([t.cpu() for t in got])
    for want, got in zip(*results):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(got.nan_to_num().signbit(), want.nan_to_num().signbit())  # (a NaN's sign means nothing)


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


def _cell_gradient_penalty(device, module):
    torch.manual_seed(0)
    cell = module(4, 5).double().to(device)
    x = torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    out = cell(x)
    out = out[0] if isinstance(out, tuple) else out
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    return [t.detach().cpu() for t in (out, gx, x.grad, cell.weight_hh.grad)]


def test_double_backward_through_rnn_cells(device):
    # an LSTM/GRU cell's composite takes CUDA's fused kernel on any device but the CPU: on a
    # CPU node the second backward raised "Could not run 'aten::_thnn_fused_lstm_cell' with
    # arguments from the 'CPU' backend"
    for module in (torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell):
        want, got = _cell_gradient_penalty("cpu", module), _cell_gradient_penalty(device, module)
        assert torch.equal(got[0], want[0]), module
        for a, b in zip(want[1:], got[1:]):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def _batched_vjp(device, make, shapes):
    """Input gradients for three output gradients at once through the legacy vmap, as
    ``gradcheck``'s batched-gradient check (every ``test_modules`` gradcheck) computes them."""
    from torch._vmap_internals import vmap as legacy_vmap
    torch.manual_seed(0)
    fn = make()
    if isinstance(fn, torch.nn.Module):
        fn = fn.double().to(device)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*s, dtype=torch.double, generator=generator).to(device).requires_grad_() for s in shapes]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    grad_outputs = torch.randn(3, *out.shape, dtype=torch.double, generator=generator).to(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use `torch.vmap`", FutureWarning)
        batched = legacy_vmap(lambda g: torch.autograd.grad(out, inputs, g, retain_graph=True))(grad_outputs)
    one_by_one = [torch.stack(gs) for gs in zip(*(torch.autograd.grad(out, inputs, g, retain_graph=True)
                                                   for g in grad_outputs))]
    return [t.cpu() for t in batched], [t.cpu() for t in one_by_one]


@pytest.mark.parametrize("case", ["attention", "lstm", "gru", "lstm_cell", "gru_cell", "transformer_layer"])
def test_batched_gradients_through_ops_sent_whole(device, case):
    # gradcheck's batched-gradient check vmaps the backward: the whole ops' backward got the
    # batch's wrapper tensor and raised "Cannot access storage of BatchedTensorImpl"
    make, shapes = {
        "attention": (lambda: lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(2, 3, 4)] * 3),
        "lstm": (lambda: torch.nn.LSTM(4, 3, num_layers=2), [(5, 2, 4)]),
        "gru": (lambda: torch.nn.GRU(4, 3), [(5, 2, 4)]),
        "lstm_cell": (lambda: torch.nn.LSTMCell(4, 3), [(2, 4)]),
        "gru_cell": (lambda: torch.nn.GRUCell(4, 3), [(2, 4)]),
        "transformer_layer": (lambda: torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0), [(2, 3, 4)]),
    }[case]
    remote_batched, remote_one_by_one = _batched_vjp(device, make, shapes)
    local_batched, _ = _batched_vjp("cpu", make, shapes)
    for got, each, want in zip(remote_batched, remote_one_by_one, local_batched):
        torch.testing.assert_close(got, each, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
