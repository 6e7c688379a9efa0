"""``torch.compile`` with gpuwire installed: graphs on the device run op by op (inductor has no
gpuwire code generator), graphs elsewhere are untouched, and compiling never starts a node."""

import os
import subprocess
import sys
import textwrap

import torch

import gpuwire


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def _train(model, device, compiled):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).to(device)
        loss = step(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step, losses


def test_compiled_model_trains_on_the_device_like_eager_cpu(device, capfd):
    torch._dynamo.reset()
    compiled, remote = _train(_model().to(device), device, compiled=True)
    _, local = _train(_model(), "cpu", compiled=False)
    assert remote == local  # the graph's ops are the eager ops: bit for bit
    # still torch.compile's module: code that unwraps it (``_orig_mod``, state-dict keys) works
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    assert "op by op on the gpuwire device" in capfd.readouterr().err

    @torch.compile(fullgraph=True)
    def fn(a, b):
        return (a * b).sin().sum(dim=-1)

    a, b = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.equal(fn(a.to(device), b.to(device)).cpu(), (a * b).sin().sum(dim=-1))


def test_compiling_for_the_cpu_never_starts_a_node(tmp_path):
    # dynamo asks the accelerator (gpuwire, once installed) for its current stream at every
    # compile; that must not connect, nor start an embedded node, in a program that never
    # uses the device
    program = textwrap.dedent("""
        import torch
        model = torch.compile(torch.nn.Linear(4, 2), backend="eager")
        print(model(torch.ones(1, 4)).shape, torch.accelerator.current_stream().device_type)
        import gpuwire
        print("connected", gpuwire.client.device.current_runtime() is not None)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWIRE_NODE", "GPUWIRE_TOKEN")}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "connected False" in done.stdout and "embedded node" not in done.stderr


def test_compiled_model_with_ops_sent_whole_equals_eager_cpu(device):
    """An LSTM and attention (ops the client sends whole, through Python kernels) in a compiled
    model, with gradients and without: dynamo's frame hook once compiled gpuwire's own frames
    as they ran and broke the message stream, which ended the session."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(6, 5, batch_first=True)
            self.head = torch.nn.Linear(5, 2)

        def forward(self, x):
            q = self.rnn(x)[0]
            return self.head(torch.nn.functional.scaled_dot_product_attention(q, q, q))
    torch._dynamo.reset()
    torch.manual_seed(0)
    local = Model()
    remote = Model()
    remote.load_state_dict(local.state_dict())
    compiled = torch.compile(remote.to(device))
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    for scope in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with scope():
            assert torch.equal(compiled(x.to(device)).cpu(), local(x)), scope.__name__
    compiled(x.to(device)).square().mean().backward()
    local(x).square().mean().backward()
    for (name, got), want in zip(remote.named_parameters(), local.parameters()):
        # (AOT autograd's backward graph may sum a gradient's parts in another order than eager)
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-7, msg=name)
