"""Ops that travel as one remote op instead of their decomposition.

Sits beside ``client.device``: PyTorch picks SDPA's fused kernel through a C++ stub that
ignores PrivateUse1, so on our device attention would decompose into ~15 ops (and differ
numerically from a local run that uses a fused kernel). We override the autograd kernel of
``aten::scaled_dot_product_attention`` for our device: the forward is one remote op running
PyTorch's own SDPA on the node; the backward is one remote op that recomputes the forward
under autograd there (same kernels as local, so the gradients match a local run).
With dropout (on a CUDA node) the forward also returns the node generator's state from before
it ran, and the backward rewinds to it, so the recomputation draws the same mask and the node
keeps the fused kernels a local run uses with dropout; a CPU-backend node runs the math
decomposition, as a local CPU run does (``REPLAY_SDPA_DROPOUT`` says why).

``dropout`` on a CPU-backend node is one remote op too (the bernoulli, scale and multiply a
local CPU run does, returning the scaled mask for the backward): 1 message instead of 4.
"""

from __future__ import annotations

import torch

from . import device as _device


def _specs_like(*tensors):
    return [_device.output_spec(t.shape, _device._contiguous_strides(tuple(t.shape)), t.dtype) for t in tensors]


def _sdpa_out_shape(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    meta = [_device._to_meta(t) for t in (q, k, v, attn_mask)]
    out = torch.nn.functional.scaled_dot_product_attention(
        meta[0], meta[1], meta[2], attn_mask=meta[3], dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa)
    return _device.output_spec(out.shape, out.stride(), out.dtype)


class _RemoteSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, replayable):
        spec = _sdpa_out_shape(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        args = (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if replayable:  # dropout with a backward to come: keep where the generator was
            out, rng_state = _device.submit_with_outputs("gpuwire::sdpa_with_rng", args, {}, [spec, _rng_spec()])
        else:
            (out,) = _device.submit_with_outputs("gpuwire::sdpa", args, {}, [spec])
            rng_state = None
        ctx.save_for_backward(q, k, v, attn_mask, rng_state)
        ctx.options = (dropout_p, is_causal, scale, enable_gqa)
        ctx.mask_requires_grad = attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_mask, rng_state = ctx.saved_tensors
        dropout_p, is_causal, scale, enable_gqa = ctx.options
        if rng_state is None:
            dropout_p = 0.0
        wanted = [q, k, v] + ([attn_mask] if ctx.mask_requires_grad else [])
        grads = _device.submit_with_outputs(
            "gpuwire::sdpa_backward",
            (grad_out.contiguous(), q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, ctx.mask_requires_grad,
             rng_state),
            {}, _specs_like(*wanted))
        grads = list(grads) + [None] * (4 - len(grads))
        return grads[0], grads[1], grads[2], grads[3], None, None, None, None, None


# With dropout and a backward to come, SDPA is sent whole and its backward recomputes the
# forward from the generator state it started at. On a CPU-backend node that recomputation costs
# more than the math decomposition's extra messages (measured: +10 % node CPU on a GPT-2 step),
# so there the decomposition runs as a local CPU run's does; elsewhere (CUDA) the node keeps the
# fused kernels a local run uses with dropout. None: decide by the node's backend.
REPLAY_SDPA_DROPOUT: bool | None = None


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    replayable = dropout_p > 0.0 and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask))
    if replayable:
        replay = REPLAY_SDPA_DROPOUT
        if replay is None:
            replay = _device.runtime().device_info.get("backend") != "cpu"
        if not replay:
            out, _ = torch.ops.aten._scaled_dot_product_attention_math.default(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)
            return out
    return _RemoteSDPA.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, replayable)


class _RemoteDropout(torch.autograd.Function):
    """CPU-backend dropout in one message; the backward multiplies by the returned scaled mask,
    which is what autograd does for the local ``input * noise``."""

    @staticmethod
    def forward(ctx, input, p):
        key = (input.shape, input.stride(), input.dtype)
        specs = _DROPOUT_SPECS.get(key)
        if specs is None:
            meta = _device._to_meta(input)
            noise = torch.empty_like(meta)
            out = meta * noise
            specs = [_device.output_spec(t.shape, t.stride(), t.dtype) for t in (out, noise)]
            if len(_DROPOUT_SPECS) < 4096:
                _DROPOUT_SPECS[key] = specs
        out, noise = _device.submit_with_outputs("gpuwire::dropout", (input, p), {}, specs)
        ctx.save_for_backward(noise)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (noise,) = ctx.saved_tensors
        return grad_out * noise, None


_DROPOUT_SPECS: dict = {}


def _rng_spec():
    from .recompute import _rng_spec as spec
    return spec()


def _dropout(input, p: float, train: bool):
    """``dropout`` as the node's device type runs it locally, so a seeded run draws the same
    random numbers: the CPU path is bernoulli + scale + multiply (ATen's ``_dropout_impl``),
    the CUDA path is the fused ``native_dropout``."""
    if not train or p == 0.0 or input.numel() == 0:
        return input.clone() if train else input
    if p == 1.0:
        return input * torch.zeros_like(input)
    if _device.runtime().device_info.get("backend") == "cpu":
        if input.is_floating_point() and not input.is_complex():
            return _RemoteDropout.apply(input, p)
        noise = torch.empty_like(input).bernoulli_(1 - p)
        noise.div_(1 - p)
        return input * noise
    return torch.ops.aten.native_dropout.default(input, p, train)[0]


def _kernels_that_decompose_only_here() -> list[str]:
    """Ops with a CPU kernel whose PrivateUse1 path would be a composite decomposition
    (different rounding than the kernel the node has); we send them whole instead."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = []
    for name in torch._C._dispatch_get_all_op_names():
        if (name.startswith("aten::") and has(name, "CPU") and not has(name, "PrivateUse1")
                and (has(name, "CompositeExplicitAutograd") or has(name, "CompositeImplicitAutograd"))):
            names.append(name)
    return names


def register(aten_library: torch.library.Library) -> None:
    aten_library.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    aten_library.impl("dropout", _dropout, "AutogradPrivateUse1")
    from . import recompute
    recompute.register(aten_library)
    for qualified in _kernels_that_decompose_only_here():
        name = qualified[len("aten::"):]
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        aten_library.impl(name, _whole(op), "PrivateUse1")


def _whole(op):
    def kernel(*args, **kwargs):
        return _device._fallback(op, *args, **kwargs)
    return kernel
