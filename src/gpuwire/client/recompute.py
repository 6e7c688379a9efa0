"""Composite ops sent whole, with a backward that recomputes them on the node.

Sits beside ``client.fused``. LSTM/GRU/RNN layers and cells are composites whose C++ path
depends on the device type: on CPU they use oneDNN, on every other device a fused cell that
exists only for CUDA. Sent whole, the node runs them exactly as a local run on its device
would. The forward also returns the node's generator state from before the op, which the
backward hands back so the recomputation draws the same dropout masks.
"""

from __future__ import annotations

import torch

from . import device as _device

RECOMPUTED = ("lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input", "lstm.data", "gru.data", "rnn_tanh.data",
              "rnn_relu.data", "lstm_cell", "gru_cell",
              "rnn_tanh_cell", "rnn_relu_cell")
_rng_state_bytes: int | None = None


def _flatten(value, out: list):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _flatten(v, out)
    return out


def _rebuild(value, tensors):
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


def _rng_spec():
    global _rng_state_bytes
    if _rng_state_bytes is None:
        _rng_state_bytes = len(_device.runtime().query("rng_state"))
    return _device.output_spec((_rng_state_bytes,), (1,), torch.uint8)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, args, *flat):
        ctx.plan = plan
        ctx.args = args
        result, rng_state = _forward(plan, args, {})
        ctx.save_for_backward(*flat, rng_state)
        return result

    @staticmethod
    def backward(ctx, *grads):
        *flat, rng_state = ctx.saved_tensors
        args = _rebuild(ctx.args, iter(flat))
        specs = [_device.output_spec(t.shape, _device._contiguous_strides(tuple(t.shape)), t.dtype) for t in flat]
        input_grads = _device.submit_with_outputs(
            "gpuwire::backward_by_recompute", (ctx.plan.name, rng_state, list(grads), *args), {}, specs)
        return (None, None, *[g if need else None for g, need in zip(input_grads, ctx.needs_input_grad[2:])])


def _forward(plan, args, options: dict):
    """(the op's result, the node's generator state from before it) of a whole op."""
    entry = plan.outputs(plan.meta_op, args, {})
    if entry is None or entry is _device.SYNC:
        raise RuntimeError(f"gpuwire cannot compute the output shapes of {plan.name}")
    outs = _device.submit_with_outputs("gpuwire::forward_with_rng", (plan.name, *args), options,
                                       list(entry.specs) + [_rng_spec()])
    result = outs[:-1]
    return (tuple(result) if len(result) > 1 else result[0]), outs[-1]


def _kernel(op):
    plan = _device.FunctionalPlan(op)

    def kernel(*args):
        if not torch.is_grad_enabled():
            # (no_grad, inference_mode: no graph, and the node runs the op with grad off as a
            # local run does: CPU's oneDNN RNNs take their inference path then, other rounding)
            return _forward(plan, args, {"grad": False})[0]
        flat = _flatten(args, [])
        return _Recomputed.apply(plan, args, *flat)
    return kernel


def register(aten_library: torch.library.Library, keys: tuple) -> None:
    for name in RECOMPUTED:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        for key in keys:
            aten_library.impl(name, _kernel(op), key)
