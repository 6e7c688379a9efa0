"""``torch.func`` transforms (``grad``, ``vmap``, ``functional_call``: per-sample gradients,
meta-learning) through ops the client sends whole with an ``autograd.Function`` (attention,
dropout), compared with local CPU bit for bit."""

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
