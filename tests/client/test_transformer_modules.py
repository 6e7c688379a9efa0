"""``torch.nn`` transformer modules on the gpuwire device, compared with local CPU.

In eval mode PyTorch takes "fast paths" for these modules on CPU, CUDA and PrivateUse1 alike:
fused encoder-layer and attention kernels (sent whole to the node, so bit for bit with CPU), and
for ``TransformerEncoder`` with a padding mask a nested-tensor batch, which has no remote form:
there the encoder runs on the dense batch and zeroes the padded positions, as the nested path
does (equal to CPU up to float rounding, padded positions exactly as CPU's)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def _padding(batch: int, length: int, dtype=torch.bool):
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[0, length - 3:] = True
    pad[1, length - 1:] = True
    if dtype is torch.bool:
        return pad
    return torch.zeros(batch, length).masked_fill(pad, float("-inf"))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("with_norm", [False, True])
def test_encoder_with_padding_mask_in_eval_matches_cpu(device, batch_first, mask_dtype, with_norm):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(16) if with_norm else None).eval()
    x = torch.randn(3, 8, 16) if batch_first else torch.randn(8, 3, 16)
    pad = _padding(3, 8, mask_dtype)
    with torch.no_grad():
        local = encoder(x, src_key_padding_mask=pad)
        remote = encoder.to(device)(x.to(device), src_key_padding_mask=pad.to(device)).cpu()
    assert remote.shape == local.shape
    assert torch.allclose(remote, local, atol=1e-5, rtol=1e-5), (remote - local).abs().max()
    padded = pad if mask_dtype is torch.bool else pad != 0
    padded = padded if batch_first else padded.t()
    assert torch.equal(remote[padded], local[padded])  # the padded positions: exactly CPU's


def test_encoder_in_training_and_without_padding_is_bit_for_bit(device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    x = torch.randn(3, 8, 16)
    local = encoder(x)
    local.sum().backward()
    grad = encoder.layers[0].linear1.weight.grad.clone()
    encoder.zero_grad()
    encoder = encoder.to(device)
    remote = encoder(x.to(device))
    remote.sum().backward()
    assert torch.equal(remote.detach().cpu(), local.detach())
    assert torch.equal(encoder.layers[0].linear1.weight.grad.cpu(), grad)
    encoder.eval()
    with torch.no_grad():
        assert torch.equal(encoder(x.to(device)).cpu(), encoder.cpu()(x))


def test_multihead_attention_fast_path_in_eval_matches_cpu(device):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    pad = _padding(2, 6)
    with torch.no_grad():
        local, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
        remote, _ = mha.to(device)(*(x.to(device),) * 3, key_padding_mask=pad.to(device), need_weights=False)
    assert torch.equal(remote.cpu(), local)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "no input needs grad"])
def test_attention_without_a_graph_equals_a_local_run(device, context):
    """SDPA where autograd records nothing (``generate``, evaluation) goes as one message with
    no autograd Function around it: values and layout as a local run's, no graph."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.randn(5, 5, generator=g) > 0
    weights = context != "no input needs grad"
    remote = [t.to(device).requires_grad_(weights) for t in (q, k, v)]
    scope = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(context, torch.enable_grad)
    for kwargs in ({}, {"attn_mask": mask}, {"is_causal": True}, {"scale": 0.3}):
        with scope():
            got = F.scaled_dot_product_attention(*remote, **{k_: (v_.to(device) if k_ == "attn_mask" else v_)
                                                            for k_, v_ in kwargs.items()})
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        assert got.grad_fn is None and not got.requires_grad, kwargs
        assert got.stride() == want.stride() and torch.equal(got.cpu(), want), kwargs


@pytest.mark.parametrize("layer", ["lstm", "gru", "dropout"])
def test_ops_sent_whole_stay_whole_under_inference_mode(device, layer):
    """``torch.inference_mode()`` skips the autograd key, where the ops sent whole (RNNs,
    attention, dropout) are registered; they are registered at the device's key too, so a model
    evaluated under it runs the node's kernel as a local run would: bit for bit with CPU."""
    torch.manual_seed(0)
    module = {"lstm": lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True),
              "gru": lambda: nn.GRU(6, 5, bidirectional=True),
              "dropout": lambda: nn.Dropout(0.3)}[layer]()
    remote = {"lstm": lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True),
              "gru": lambda: nn.GRU(6, 5, bidirectional=True),
              "dropout": lambda: nn.Dropout(0.3)}[layer]().to(device)
    remote.load_state_dict(module.state_dict())
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.manual_seed(2)
        want = module(x)
        torch.manual_seed(2)
        got = remote(x.to(device))
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    assert torch.equal(got.cpu(), want)


@pytest.fixture
def gpu_declarations(device):
    """The client declaring results as it does for a CUDA node (the meta device's layouts and
    CUDA's attention layouts) while a CPU node runs them: the node copies any result whose kernel
    chose another layout into the declared one, so values stay CPU's. Every layout learned
    meanwhile is forgotten on the way back (later tests expect CPU's)."""
    from gpuwire.client import device as client_device
    client_device.infer_as_cpu(False)
    try:
        yield
    finally:
        client_device.infer_as_cpu(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_split_from_one_projection_keep_cudas_attention_layouts(device, gpu_declarations, dtype):
    # GPT-2's attention: q, k, v split from one projection, seen as (B, H, L, E) by a transpose.
    # CUDA's efficient (float32) and cuDNN (bfloat16) attention return the output and the three
    # gradients in that (B, L, H, E) memory (an H100, torch 2.11); declared contiguous, each cost
    # the node a copy and the heads' reshape another, in the forward and in the backward
    batch, length, heads, size = 2, 16, 4, 8
    torch.manual_seed(0)
    x = torch.randn(batch, length, 3 * heads * size, dtype=dtype)
    sequence_major = (length * heads * size, size, heads * size, 1)

    def attention(inputs, seen):
        q, k, v = (t.view(batch, length, heads, size).transpose(1, 2) for t in inputs.split(heads * size, dim=2))
        for name, t in (("q", q), ("k", k), ("v", v)):
            t.register_hook(lambda grad, name=name: seen.__setitem__(name, grad.stride()))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seen["out"] = out.stride()
        return out.transpose(1, 2).reshape(batch, length, heads * size)

    local_x = x.clone().requires_grad_()
    local_out = attention(local_x, {})
    local_out.sum().backward()
    seen: dict = {}
    remote_x = x.to(device).requires_grad_()
    remote_out = attention(remote_x, seen)
    remote_out.sum().backward()
    assert seen == {"out": sequence_major, "q": sequence_major, "k": sequence_major, "v": sequence_major}
    assert torch.equal(remote_out.detach().cpu(), local_out.detach())
    assert torch.equal(remote_x.grad.cpu(), local_x.grad)


def test_a_contiguous_half_precision_query_keeps_the_contiguous_layout(device, gpu_declarations):
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    rq, rk, rv = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(rq, rk, rv)
    assert out.stride() == (512, 128, 8, 1)
    out.sum().backward()
    assert rq.grad.stride() == (512, 128, 8, 1)
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert torch.equal(rq.grad.cpu(), q.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gradients_take_the_layouts_cudas_kernels_give(device, gpu_declarations, dtype):
    # float32 runs CUDA's memory-efficient attention, whose backward makes every gradient dense
    # (B, L, H, E) memory whatever its input's layout: a key and value made contiguous by a cat
    # (Hugging Face's cache in a GPT-2 training step) included — declared as their inputs' layouts,
    # four copies a layer came back on an H100 (two gradients, two reshapes). Half precision runs
    # cuDNN (or flash) attention, whose gradients are empty_like their inputs: a dense input's own
    # layout, a contiguous query's gradient contiguous
    torch.manual_seed(0)
    batch, heads, length, size = 2, 4, 16, 8
    sequence_major = (length * heads * size, size, heads * size, 1)
    q, k, v = (torch.randn(batch, length, heads, size, dtype=dtype).transpose(1, 2) for _ in range(3))
    c = torch.randn(batch, heads, length, size, dtype=dtype)
    for inputs in ((q, k, v), (q, c, c.clone()), (c, c.clone(), c.clone())):
        remote = [t.to(device).requires_grad_() for t in inputs]
        seen = {}
        for i, t in enumerate(remote):
            t.register_hook(lambda grad, i=i: seen.__setitem__(i, grad.stride()))
        F.scaled_dot_product_attention(*remote).sum().backward()
        if dtype == torch.float32:
            assert seen == {0: sequence_major, 1: sequence_major, 2: sequence_major}
        else:
            assert seen == {i: inputs[i].stride() for i in range(3)}
        local = [t.clone().requires_grad_() for t in inputs]
        F.scaled_dot_product_attention(*local).sum().backward()
        assert all(torch.equal(r.grad.cpu(), t.grad) for r, t in zip(remote, local))


def test_a_transformer_encoder_scripts_and_its_script_runs_as_the_module(device):
    """``torch.jit.script`` of any ``TransformerEncoder`` failed with "undefined value F" wherever
    gpuwire was installed (it patches the encoder's forward, and TorchScript resolved the original
    source's names in the patch's module), on the CPU too; then it met the patched
    ``torch._nested_tensor_from_mask`` and could not compile a Python function."""
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    torch.manual_seed(0)
    model = nn.TransformerEncoder(MyLayer(d_model=8, nhead=4, dim_feedforward=32, batch_first=True), num_layers=2)
    local_script = torch.jit.script(model)
    src, mask = torch.rand(2, 4, 8), torch.zeros(4, 4, dtype=torch.bool)
    pad = _padding(2, 4)
    for module in (model.eval(), local_script.eval()):
        with torch.no_grad():
            assert torch.equal(module(src, mask=mask), model(src, mask=mask))
    remote = copy.deepcopy(model).to(device)
    remote_script = torch.jit.script(remote).eval()
    with torch.no_grad():
        eager = remote(src.to(device), mask=mask.to(device)).cpu()
        scripted = remote_script(src.to(device), mask=mask.to(device)).cpu()
        assert torch.equal(scripted, eager)
        assert torch.allclose(eager, model(src, mask=mask), atol=1e-6)
        # with a padding mask the script takes PyTorch's nested-tensor path, which the device has
        # not (the eager module runs it dense): said at the call, with the ways around it
        with pytest.raises(RuntimeError, match="enable_nested_tensor=False"):
            remote_script(src.to(device), src_key_padding_mask=pad.to(device))
        remote.use_nested_tensor = False
        padded = torch.jit.script(remote).eval()(src.to(device), src_key_padding_mask=pad.to(device)).cpu()
        dense = copy.deepcopy(model)
        dense.use_nested_tensor = False  # (the padded positions then hold values, not zeros)
        assert torch.allclose(padded, dense(src, src_key_padding_mask=pad), atol=1e-5)
        assert torch.ones(2, device=device).sum().item() == 2.0  # the session goes on
