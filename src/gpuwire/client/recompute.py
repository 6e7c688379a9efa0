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


def under_transforms() -> bool:
    """Whether forward-mode AD (a JVP, forward-over-reverse) or a torch.func transform is active:
    both refuse an ``autograd.Function`` without their rules, and a call without a graph would
    drop the tangent. The ops sent whole with one take their composite's ops then, which carry
    the gradient and the tangent (at the composite's rounding)."""
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def batched(tensors) -> bool:
    """Whether a backward is being vmapped: gradcheck's batched-gradient check and
    ``torch.autograd.grad(..., is_grads_batched=True)`` hand a backward gradients that wrap a
    batch of them (no storage of their own to name on the wire). Such a backward takes the
    op's composite, whose ops the batching rules run."""
    functorch = torch._C._functorch
    return any(isinstance(t, torch.Tensor) and (functorch.is_legacy_batchedtensor(t) or functorch.is_batchedtensor(t))
               for t in tensors)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, args, *flat):
        ctx.plan = plan
        ctx.args = args
        # which inputs require grad: CPU kernels choose their path by it (oneDNN's RNNs run only
        # where no parameter does), so the node's run must see the same (a GRU/RNN with
        # batch_first differed from a local training run in the last bit)
        result, rng_state = _forward(plan, args, {"requires_grad": [t.requires_grad for t in flat]})
        ctx.save_for_backward(*flat, rng_state)
        return result

    @staticmethod
    def backward(ctx, *grads):
        *flat, rng_state = ctx.saved_tensors
        if torch.is_grad_enabled() or batched(grads):
            return _differentiable_backward(ctx, grads, flat)
        args = _rebuild(ctx.args, iter(flat))
        specs = [_device.output_spec(t.shape, _device._contiguous_strides(tuple(t.shape)), t.dtype) for t in flat]
        input_grads = _device.submit_with_outputs(
            "gpuwire::backward_by_recompute", (ctx.plan.name, rng_state, list(grads), *args), {}, specs)
        return (None, None, *[g if need else None for g, need in zip(input_grads, ctx.needs_input_grad[2:])])


def _differentiable_backward(ctx, grads, flat):
    """The backward as ops autograd can differentiate again (``create_graph=True``): the node's
    recomputation gives gradients without a graph of their own, so the op is recomputed here
    through its composite (the cell arithmetic a CPU run without oneDNN does, each op remote;
    gradients equal a local run's to float rounding). Each input goes through a view of its
    own, so the gradients are the partial ones. A vmapped backward (``batched``) takes this
    path too. Dropout between layers is refused: the composite's masks are not drawn as the
    node's forward drew them."""
    args = ctx.args
    names = [a.name for a in ctx.plan.meta_op._schema.arguments]
    if "dropout" in names and "train" in names and args[names.index("train")] and args[names.index("dropout")] > 0:
        raise RuntimeError(
            f"gpuwire: a double backward (create_graph=True) or a vmapped backward (batched gradients) through "
            f"{ctx.plan.name} with dropout between its layers is not supported: the recomputation cannot draw the "
            "forward's dropout masks. Run this pass with the RNN's dropout=0 (or in eval mode)")
    composite = ctx.plan.meta_op.decompose
    if ctx.plan.name in _CELLS_AS_ON_CPU and _device.runtime().device_info.get("backend") == "cpu":
        composite = _CELLS_AS_ON_CPU[ctx.plan.name]
    input_grads = differentiable_grads(lambda views: composite(*_rebuild(args, iter(views))),
                                       flat, ctx.needs_input_grad[2:], grads)
    return (None, None, *input_grads)


def _lstm_cell_as_on_cpu(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``lstm_cell``'s arithmetic as ATen's CPU kernel does it. The op's composite takes the
    CUDA-only fused kernel (``_thnn_fused_lstm_cell``) for any device but the CPU, which a CPU
    node has not got."""
    h, c = hx
    gates = torch.nn.functional.linear(h, w_hh, b_hh) + torch.nn.functional.linear(input, w_ih, b_ih)
    in_gate, forget_gate, cell_gate, out_gate = gates.chunk(4, 1)
    cy = forget_gate.sigmoid() * c + in_gate.sigmoid() * cell_gate.tanh()
    return out_gate.sigmoid() * cy.tanh(), cy


def _gru_cell_as_on_cpu(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``gru_cell``'s arithmetic as ATen's CPU kernel does it (see ``_lstm_cell_as_on_cpu``)."""
    input_gates = torch.nn.functional.linear(input, w_ih, b_ih).chunk(3, 1)
    hidden_gates = torch.nn.functional.linear(hx, w_hh, b_hh).chunk(3, 1)
    reset_gate = (hidden_gates[0] + input_gates[0]).sigmoid()
    update_gate = (hidden_gates[1] + input_gates[1]).sigmoid()
    new_gate = (input_gates[2] + hidden_gates[2] * reset_gate).tanh()
    return (hx - new_gate) * update_gate + new_gate


_CELLS_AS_ON_CPU = {"aten::lstm_cell": _lstm_cell_as_on_cpu, "aten::gru_cell": _gru_cell_as_on_cpu}


def differentiable_grads(compute, inputs, needed, grads) -> list:
    """Gradients of ``compute(inputs)`` that autograd can differentiate again (a backward under
    ``create_graph=True``), for the inputs ``needed`` marks (None for the others). Each input
    goes through a view of its own, so the gradients are the partial ones (a key computed from
    the query, ``k = x * 2`` with ``q = x``, would otherwise add its path into the query's
    gradient, which autograd then adds again); the views keep the graph to the inputs. Torch-
    function modes are off while ``compute`` runs: under CUDA compatibility the mode's handler
    sent a composite's call back through the dispatcher, to the Function asking, for ever."""
    create_graph = torch.is_grad_enabled()  # (off for a vmapped first-order backward)
    with torch.enable_grad():
        views = [t.view_as(t) for t in inputs]
        with torch._C.DisableTorchFunction():
            outputs = _flatten(compute(views), [])
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    wanted = [i for i, need in enumerate(needed[:len(views)]) if need]
    found = torch.autograd.grad([o for o, _ in pairs], [views[i] for i in wanted], [g for _, g in pairs],
                                create_graph=create_graph, allow_unused=True) if pairs and wanted else ()
    result = [None] * len(views)
    for i, g in zip(wanted, found):
        result[i] = g
    return result


def _forward(plan, args, options: dict):
    """(the op's result, the node's generator state from before it) of a whole op."""
    entry = plan.outputs(plan.meta_op, args, {})
    if entry is None:
        # shape inference refused the call (``nn.GRUCell(10, 20)`` of an input of 11 features):
        # its meta kernel says why in the kernel's words (the checks come before any of the
        # arguments' devices are), else the node runs it with a reply, which raises here
        plan.meta_op(*_device._to_meta(list(args)))
        _device._call_sync(plan.meta_op, plan.name, args, {})
    if entry is None or entry is _device.SYNC:
        raise RuntimeError(f"gpuwire cannot compute the output shapes of {plan.name}")
    outs = _device.submit_with_outputs("gpuwire::forward_with_rng", (plan.name, *args), options,
                                       list(entry.specs) + [_rng_spec()])
    result = outs[:-1]
    return (tuple(result) if len(result) > 1 else result[0]), outs[-1]


def _kernel(op):
    plan = _device.FunctionalPlan(op)

    def kernel(*args):
        if under_transforms():
            return op.decompose(*args)
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
