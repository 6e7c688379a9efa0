"""Checks a node runs before ATen kernels that trust their arguments.

Sits in the node's op table (``node/ops.py`` wraps every overload of the ops named here): some
ATen kernels read or write where an argument tells them (indices into another tensor, offsets,
the sizes of outputs they are handed) without checking it, because the op is internal and its
usual caller (autograd, a decomposition) only ever passes what the forward produced. Given
something else (a client's bug, or a tenant that means harm), torch 2.13's CPU kernels crashed
the node process, and every tenant's session with it (SIGSEGV, SIGABRT), or hung it; a CUDA
kernel faults the device context the node's sessions share. A local run would have crashed
only its own program. Each check here raises what the op's public caller raises for the same
mistake (or says plainly what is wrong) before the kernel runs; what crosses the boundary is
the op's arguments, unchanged, and an exception.

Found by a sweep of OpInfo error inputs and hand-written hostile arguments against a node
(session 38, docs/opinfo.md "Session 38"); tests/node/test_hostile_inputs.py runs each against
a real node and checks it lives on. The checks that read values (indices, offsets: ``GUARDS``)
run on every call and take their ops off the native loop; each costs a min/max of an index
tensor, which on a CUDA node waits for the device, on ops that are rare in training steps or
small beside their kernel (a pooling or embedding backward). Checks of shapes alone of ops on a
step's hot path (``CHECKED_PER_SIGNATURE``: batch norm, fused optimizers) run on the Python
path, which the native loop follows per argument signature (``OpTable.signature_check``).
"""

from __future__ import annotations

import math

import torch


def _bound(schema, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name (defaults filled in)."""
    named = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(args):
            named[argument.name] = args[index]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            named[argument.name] = argument.default_value
        else:
            named[argument.name] = None
    return named


def _in_range(op: str, what: str, values, low: int, high: int) -> None:
    """Every value of the integer tensor ``values`` in [low, high)."""
    if not isinstance(values, torch.Tensor) or values.numel() == 0:
        return
    smallest, largest = (int(v) for v in torch.aminmax(values.detach().reshape(-1)))
    if smallest < low or largest >= high:
        bad = smallest if smallest < low else largest
        raise IndexError(f"{op}: {what} holds {bad}, out of range [{low}, {high})")


def _shape_is(op: str, what: str, tensor, shape) -> None:
    if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != tuple(shape):
        raise RuntimeError(f"{op}: expected {what} of shape {list(shape)}, but got {list(tensor.shape)}")


def _numel_is(op: str, what: str, tensor, numel: int) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.numel() != numel:
        raise RuntimeError(f"{op}: expected {what} to have {numel} elements, but got {tensor.numel()}")


def _spatial_size(tensor, dims: int) -> int:
    return math.prod(tensor.shape[-dims:]) if tensor.dim() >= dims else 1


def _pooling_backward(dims: int):
    """``max_pool{2,3}d_with_indices_backward`` / ``adaptive_max_pool{2,3}d_backward``: the
    indices say where in each input plane a gradient goes."""
    def check(op: str, a: dict) -> None:
        grad, indices, source = a["grad_output"], a["indices"], a["self"]
        _shape_is(op, "indices", indices, grad.shape)
        _in_range(op, "indices", indices, -1, _spatial_size(source, dims))  # (-1: a window with no maximum, skipped)
    return check


def _embedding_dense_backward(op: str, a: dict) -> None:
    grad, indices = a["grad_output"], a["indices"]
    width = grad.shape[-1] if grad.dim() else 1
    _numel_is(op, "grad_output", grad, indices.numel() * width)
    _in_range(op, "indices", indices, 0, int(a["num_weights"]))


def _embedding_bag_backward(op: str, a: dict) -> None:
    grad, indices = a["grad"], a["indices"]
    rows = int(a["num_weights"]) if "num_weights" in a else a["weight"].shape[0]
    _in_range(op, "indices", indices, 0, rows)
    bags = grad.shape[0] if grad.dim() else 1
    _in_range(op, "offset2bag", a.get("offset2bag"), 0, bags)
    bag_size = a.get("bag_size")
    if isinstance(bag_size, torch.Tensor) and bag_size.numel() and bag_size.numel() < bags:
        raise RuntimeError(f"{op}: bag_size has {bag_size.numel()} entries for {bags} bags")
    maximum = a.get("maximum_indices")
    if int(a.get("mode") or 0) == 2 and isinstance(maximum, torch.Tensor):  # (max mode: rows of the weight)
        _in_range(op, "maximum_indices", maximum, -1, rows)


def _embedding_bag(op: str, a: dict) -> None:
    """The forward: offsets must not decrease nor point past the indices (a decreasing one read
    other memory of the node on one thread), indices must be rows of the weight (said in ATen's
    words, as the RuntimeError CPU's kernel raises). Arguments of dimensions the kernel refuses
    are left to its own error."""
    weight, indices, offsets = a["weight"], a["indices"], a["offsets"]
    if weight.dim() != 2 or indices.dim() not in (1, 2) or (indices.dim() == 1 and getattr(offsets, "ndim", 1) != 1):
        return
    if isinstance(indices, torch.Tensor) and indices.numel():
        smallest, largest = (int(v) for v in torch.aminmax(indices.detach().reshape(-1)))
        if smallest < 0 or largest >= weight.shape[0]:
            bad = smallest if smallest < 0 else largest
            raise RuntimeError(f"{op}: Expected idx >= 0 && idx < num_embeddings ({weight.shape[0]}) but found "
                               f"idx to be {bad}")
    if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() and indices.dim() == 1:
        _in_range(op, "offsets", offsets, 0, indices.numel() + 1)
        if offsets.numel() > 1 and bool((offsets.diff() < 0).any()):
            raise RuntimeError(f"{op}: offsets must not decrease")


def _ctc_targets(a: dict) -> None:
    """The targets the loss reads (each row's first ``target_lengths``; padding may hold
    anything) must be classes of ``log_probs``."""
    log_probs, targets = a["log_probs"], a["targets"]
    classes = log_probs.shape[-1] if log_probs.dim() else 0
    lengths = _lengths(a["target_lengths"])
    if not isinstance(targets, torch.Tensor) or not lengths or min(lengths) < 0:
        return
    if targets.dim() == 2 and len(lengths) == targets.shape[0]:
        used = torch.arange(targets.shape[1], device=targets.device) < torch.tensor(lengths, device=targets.device)[:, None]
        targets = targets[used]
    else:
        targets = targets.reshape(-1)[:sum(lengths)]
    _in_range("ctc_loss", "targets", targets, 0, classes)


def _ctc_loss(op: str, a: dict) -> None:
    _ctc_targets(a)


def _ctc_loss_backward(op: str, a: dict) -> None:
    _ctc_targets(a)
    log_probs, targets = a["log_probs"], a["targets"]
    input_lengths, target_lengths = _lengths(a["input_lengths"]), _lengths(a["target_lengths"])
    if log_probs.dim() != 3:
        raise RuntimeError(f"{op}: expected log_probs of 3 dimensions (time, batch, classes), got {log_probs.dim()}")
    steps, batch = log_probs.shape[0], log_probs.shape[1]
    if len(input_lengths) != batch or len(target_lengths) != batch:
        raise RuntimeError(f"{op}: expected input_lengths and target_lengths of {batch} entries (the batch)")
    if any(n < 0 or n > steps for n in input_lengths):
        raise RuntimeError(f"{op}: input_lengths must be in [0, {steps}] (log_probs' time steps), got {input_lengths}")
    longest = max(target_lengths, default=0)
    if any(n < 0 for n in target_lengths):
        raise RuntimeError(f"{op}: target_lengths must not be negative, got {target_lengths}")
    if targets.dim() == 2:
        if longest > targets.shape[1]:
            raise RuntimeError(f"{op}: a target length of {longest} exceeds targets' {targets.shape[1]} columns")
    elif sum(target_lengths) > targets.numel():
        raise RuntimeError(f"{op}: target_lengths add up to {sum(target_lengths)}, more than the "
                           f"{targets.numel()} targets")
    _shape_is(op, "log_alpha", a["log_alpha"], (batch, steps, 2 * longest + 1))
    _numel_is(op, "neg_log_likelihood", a["neg_log_likelihood"], batch)


def _lengths(value) -> list:
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def _segments(op: str, a: dict) -> None:
    """``segment_reduce`` (``unsafe=True`` skips its own checks) and its backward: lengths or
    offsets must cover the data along ``axis`` exactly, in order."""
    data = a["data"]
    axis = int(a.get("axis") or 0)
    size = data.shape[axis] if data.dim() else 1
    lengths, offsets = a.get("lengths"), a.get("offsets")
    if isinstance(lengths, torch.Tensor) and lengths.numel():
        rows = lengths.reshape(-1, lengths.shape[-1]) if lengths.dim() else lengths.reshape(1, 1)
        if bool((rows < 0).any()) or bool((rows.sum(-1) > size).any()):
            raise RuntimeError(f"{op}: lengths must be non-negative and add up to at most {size} (data's size "
                               f"along axis {axis})")
    if isinstance(offsets, torch.Tensor) and offsets.numel():
        rows = offsets.reshape(-1, offsets.shape[-1]) if offsets.dim() else offsets.reshape(1, 1)
        if bool((rows < 0).any()) or bool((rows > size).any()) \
                or (rows.shape[-1] > 1 and bool((rows.diff(dim=-1) < 0).any())):
            raise RuntimeError(f"{op}: offsets must not decrease and must stay within [0, {size}] (data's size "
                               f"along axis {axis})")
    grad = a.get("grad")
    if isinstance(grad, torch.Tensor):
        _shape_is(op, "output", a["output"], grad.shape)
        segments = lengths.shape[-1] if isinstance(lengths, torch.Tensor) and lengths.dim() else \
            offsets.shape[-1] - 1 if isinstance(offsets, torch.Tensor) and offsets.dim() else None
        if segments is not None and grad.dim() > axis and grad.shape[axis] != segments:
            raise RuntimeError(f"{op}: grad has {grad.shape[axis]} segments along axis {axis}, the lengths or "
                               f"offsets {segments}")


def _fused_optimizer(op: str, a: dict) -> None:
    """``_fused_adam(w)_`` / ``_fused_sgd_`` / ``_fused_adagrad_``: every list as long as
    ``self`` and each tensor shaped as its parameter (the kernel walks the parameter's size)."""
    params = a["self"]
    for name, value in a.items():
        if name == "self" or not isinstance(value, (list, tuple)) or not value:
            continue
        if not all(isinstance(t, torch.Tensor) for t in value):
            continue
        if len(value) != len(params):
            raise RuntimeError(f"{op}: {name} has {len(value)} tensors, self has {len(params)}")
        if name == "state_steps":
            continue
        for index, (param, tensor) in enumerate(zip(params, value)):
            if tensor.shape != param.shape:
                raise RuntimeError(f"{op}: {name}[{index}] has shape {list(tensor.shape)}, its parameter "
                                   f"{list(param.shape)}")


def _per_channel(*names: str):
    """Batch norm's per-channel tensors must have one element per channel (input's dim 1). The
    backward's saved statistics are empty where the forward ran in eval mode (``train`` False:
    the kernel reads the running statistics instead)."""
    def check(op: str, a: dict) -> None:
        source = a.get("input")
        if not isinstance(source, torch.Tensor) or source.dim() < 2:
            return
        channels = source.shape[1]
        for name in names:
            value = a.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if name.startswith("save_") and not a.get("train") and value.numel() == 0:
                continue
            _numel_is(op, name, value, channels)
    return check


def _finite_eig_input(op: str, a: dict) -> None:
    """``linalg.eig``'s own check (its CPU kernel raises this; ``eigvals`` of float32 or
    complex64 with a NaN or inf crashed in MKL's ``?gebal``)."""
    source = a["self"]
    if isinstance(source, torch.Tensor) and source.numel() and not bool(torch.isfinite(source).all()):
        public = "linalg.eigvals" if "eigvals" in op else "linalg.eig"
        raise RuntimeError(f"torch.{public}: input tensor should not contain infs or NaNs.")


def _coo_to_csr(op: str, a: dict) -> None:
    _in_range(op, "the row indices", a["self"], 0, int(a["size"]))


def _csr_to_coo(op: str, a: dict) -> None:
    crow, col = a["crow_indices"], a["col_indices"]
    if not isinstance(crow, torch.Tensor) or crow.numel() == 0:
        return
    rows = crow.reshape(-1, crow.shape[-1]) if crow.dim() else crow.reshape(1, 1)
    limit = col.shape[-1] if col.dim() else col.numel()
    if bool((rows < 0).any()) or bool((rows > limit).any()) \
            or (rows.shape[-1] > 1 and bool((rows.diff(dim=-1) < 0).any())):
        raise RuntimeError(f"{op}: crow_indices must not decrease and must stay within [0, {limit}] (the number "
                           "of col_indices)")


def _cumulative_helper(op: str, a: dict) -> None:
    source = a["self"]
    _shape_is(op, "values", a["values"], source.shape)
    _shape_is(op, "indices", a["indices"], source.shape)


def _recurrent(gates: int):
    """``lstm``/``gru``/``rnn_*`` given their flat parameter list: each layer's weights must
    match the hidden size and the layer's input (the kernels multiply by them as if they did)."""
    def check(op: str, a: dict) -> None:
        params, hx = a.get("params"), a.get("hx")
        source = a.get("input", a.get("data"))
        first = hx[0] if isinstance(hx, (list, tuple)) and hx else hx
        if not isinstance(params, (list, tuple)) or not isinstance(source, torch.Tensor) \
                or not isinstance(first, torch.Tensor) or first.dim() == 0:
            return
        hidden = first.shape[-1]
        per_layer = 4 if a.get("has_biases") else 2
        directions = 2 if a.get("bidirectional") else 1
        layers = int(a.get("num_layers") or 1)
        expected = layers * directions * per_layer
        if len(params) != expected:
            if len(params) == expected + layers * directions:
                return  # (a projected LSTM: hidden differs from the weights' width; its own checks)
            raise RuntimeError(f"{op}: expected {expected} parameter tensors ({layers} layers, {directions} "
                               f"directions), got {len(params)}")
        for layer in range(layers):
            width = source.shape[-1] if layer == 0 else hidden * directions
            for direction in range(directions):
                at = (layer * directions + direction) * per_layer
                w_ih, w_hh = params[at], params[at + 1]
                if tuple(w_ih.shape) != (gates * hidden, width) or tuple(w_hh.shape) != (gates * hidden, hidden):
                    raise RuntimeError(f"{op}: layer {layer}'s weights must be {[gates * hidden, width]} and "
                                       f"{[gates * hidden, hidden]}, got {list(w_ih.shape)} and {list(w_hh.shape)}")
                for bias in params[at + 2:at + per_layer]:
                    _numel_is(op, f"layer {layer}'s bias", bias, gates * hidden)
    return check


def _recurrent_state(op: str, a: dict) -> None:
    """The hidden state of a batched ``.input`` call must have the input's batch size."""
    hx, source = a.get("hx"), a.get("input")
    if not isinstance(source, torch.Tensor) or source.dim() != 3:
        return
    batch = source.shape[0 if a.get("batch_first") else 1]
    for state in (hx if isinstance(hx, (list, tuple)) else [hx]):
        if isinstance(state, torch.Tensor) and (state.dim() != 3 or state.shape[1] != batch):
            raise RuntimeError(f"{op}: expected hidden state of shape (layers * directions, {batch}, hidden), "
                               f"got {list(state.shape)}")


def _batch_sizes(op: str, a: dict) -> None:
    """A packed sequence's batch sizes: positive, not increasing, adding up to its rows."""
    sizes, data = a.get("batch_sizes"), a.get("data")
    if not isinstance(sizes, torch.Tensor) or not isinstance(data, torch.Tensor):
        return
    values = [int(v) for v in sizes.reshape(-1).tolist()]
    if any(v < 1 for v in values) or any(b > c for c, b in zip(values, values[1:])) \
            or sum(values) != (data.shape[0] if data.dim() else 1):
        raise RuntimeError(f"{op}: batch_sizes must be positive, not increasing, and add up to the "
                           f"{data.shape[0] if data.dim() else 1} rows of the packed data, got {values[:8]}")


def _recurrent_call(gates: int):
    parameters = _recurrent(gates)

    def check(op: str, a: dict) -> None:
        parameters(op, a)
        _recurrent_state(op, a)
        _batch_sizes(op, a)
    return check


def _view_in_bounds(op: str, a: dict) -> None:
    """``_reshape_alias`` makes a view of any sizes and strides without checking that it stays
    inside its storage (``as_strided`` checks): a view past the end read other memory of the
    node, another tenant's tensors among it."""
    source, sizes, strides = a["self"], list(a["size"]), list(a["stride"])
    if len(sizes) != len(strides) or any(int(v) < 0 for v in (*sizes, *strides)):
        raise RuntimeError(f"{op}: sizes {sizes} and strides {strides} must be as many and not negative")
    if 0 in sizes:
        return
    last = source.storage_offset() + sum((int(n) - 1) * int(st) for n, st in zip(sizes, strides))
    available = source.untyped_storage().nbytes() // source.element_size()
    if last >= available:
        raise RuntimeError(f"{op}: a view of sizes {sizes} and strides {strides} at offset "
                           f"{source.storage_offset()} reaches element {last}, past the storage's {available}")


def _cdist_backward(op: str, a: dict) -> None:
    x1, x2 = a["x1"], a["x2"]
    if x1.dim() >= 2 and x2.dim() >= 2:
        try:
            batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        except RuntimeError:
            raise RuntimeError(f"{op}: x1's and x2's batch shapes {list(x1.shape[:-2])} and {list(x2.shape[:-2])} "
                               "do not broadcast") from None
        expected = (*batch, x1.shape[-2], x2.shape[-2])
        _shape_is(op, "grad", a["grad"], expected)
        _shape_is(op, "cdist", a["cdist"], expected)


def _pdist_backward(op: str, a: dict) -> None:
    source = a["self"]
    rows = source.shape[0] if source.dim() else 0
    _numel_is(op, "grad", a["grad"], rows * (rows - 1) // 2)
    _numel_is(op, "pdist", a["pdist"], rows * (rows - 1) // 2)


def _linear_combination(op: str, a: dict) -> None:
    source, coefficients = a["input"], a["coefficients"]
    if coefficients.dim() != 2 or coefficients.shape[1] != (source.shape[0] if source.dim() else 1):
        raise RuntimeError(f"{op}: expected coefficients of shape (m, {source.shape[0] if source.dim() else 1}), "
                           f"got {list(coefficients.shape)}")


def _fft_dims(op: str, a: dict) -> None:
    source, dims = a["self"], [int(d) for d in a["dim"]]
    rank = source.dim()
    wrapped = [d + rank if d < 0 else d for d in dims]
    if any(not 0 <= d < rank for d in wrapped) or len(set(wrapped)) != len(wrapped):
        raise IndexError(f"{op}: dims {dims} must be distinct dimensions of a {rank}-d input")


def _transform_bias_rescale_qkv(op: str, a: dict) -> None:
    qkv, bias, heads = a["qkv"], a["qkv_bias"], int(a["num_heads"])
    width = qkv.shape[-1] if qkv.dim() else 0
    if qkv.dim() != 3 or heads <= 0 or width % (3 * heads):
        raise RuntimeError(f"{op}: expected qkv of shape (batch, tokens, 3 * heads * head size), got "
                           f"{list(qkv.shape)} with {heads} heads")
    _numel_is(op, "qkv_bias", bias, width)


def _weight_norm_backward(op: str, a: dict) -> None:
    v, dim = a["saved_v"], int(a["dim"])
    _shape_is(op, "grad_w", a["grad_w"], v.shape)
    kept = v.shape[dim] if 0 <= dim < v.dim() else 1  # (-1: one norm of the whole tensor)
    _numel_is(op, "saved_g", a["saved_g"], kept)
    _numel_is(op, "saved_norms", a["saved_norms"], kept)


# aten op (every overload) -> check(op name, arguments by name), run before every call
GUARDS = {
    "max_pool2d_with_indices_backward": _pooling_backward(2),
    "max_pool3d_with_indices_backward": _pooling_backward(3),
    "adaptive_max_pool2d_backward": _pooling_backward(2),
    "adaptive_max_pool3d_backward": _pooling_backward(3),
    "embedding_dense_backward": _embedding_dense_backward,
    "_embedding_bag": _embedding_bag,
    "_embedding_bag_forward_only": _embedding_bag,
    "_embedding_bag_backward": _embedding_bag_backward,
    "_embedding_bag_dense_backward": _embedding_bag_backward,
    "_embedding_bag_per_sample_weights_backward": _embedding_bag_backward,
    "_ctc_loss": _ctc_loss,
    "ctc_loss": _ctc_loss,
    "_ctc_loss_backward": _ctc_loss_backward,
    "segment_reduce": _segments,
    "_segment_reduce_backward": _segments,
    "linalg_eigvals": _finite_eig_input,
    "linalg_eig": _finite_eig_input,
    "_convert_indices_from_coo_to_csr": _coo_to_csr,
    "_convert_indices_from_csr_to_coo": _csr_to_coo,
    "_cummax_helper": _cumulative_helper,
    "_cummin_helper": _cumulative_helper,
    "_linalg_eigvals": _finite_eig_input,
    "lstm": _recurrent_call(4),
    "gru": _recurrent_call(3),
    "rnn_tanh": _recurrent_call(1),
    "rnn_relu": _recurrent_call(1),
    "_pad_packed_sequence": _batch_sizes,
    "_reshape_alias": _view_in_bounds,
    "_reshape_alias_copy": _view_in_bounds,
    "_cdist_backward": _cdist_backward,
    "_pdist_backward": _pdist_backward,
    "_compute_linear_combination": _linear_combination,
    "_fft_r2c": _fft_dims,
    "_fft_c2r": _fft_dims,
    "_fft_c2c": _fft_dims,
    "_transform_bias_rescale_qkv": _transform_bias_rescale_qkv,
    "_weight_norm_interface_backward": _weight_norm_backward,
}


# checks that read nothing but the arguments' shapes and the other values the native loop's
# signature holds, of ops on the hot path of a training step (batch norm in every CNN layer, the
# fused optimizers' one call a step): run on an argument signature's first call only, on the
# Python path, which the native loop (node/loop.py) follows for signatures that ran without error
CHECKED_PER_SIGNATURE = {
    "native_batch_norm": _per_channel("weight", "bias", "running_mean", "running_var"),
    "_native_batch_norm_legit": _per_channel("weight", "bias", "running_mean", "running_var"),
    "_native_batch_norm_legit_no_training": _per_channel("weight", "bias", "running_mean", "running_var"),
    "batch_norm_update_stats": _per_channel("running_mean", "running_var"),
    "native_batch_norm_backward": _per_channel("weight", "running_mean", "running_var", "save_mean",
                                               "save_invstd"),
    "_fused_adam_": _fused_optimizer,
    "_fused_adam": _fused_optimizer,
    "_fused_adamw_": _fused_optimizer,
    "_fused_adamw": _fused_optimizer,
    "_fused_sgd_": _fused_optimizer,
    "_fused_sgd": _fused_optimizer,
    "_fused_adagrad_": _fused_optimizer,
    "_fused_adagrad": _fused_optimizer,
}


def guarded(op, check, kernel):
    """``kernel`` (``op``'s, or the node's own for it) with ``check`` of its arguments first."""
    check_arguments = argument_check(op, check)

    def run(*args, **kwargs):
        check_arguments(args, kwargs)
        return kernel(*args, **kwargs)
    return run


def argument_check(op, check):
    """``check`` of ``op``'s arguments as a node holds them (positional, keywords)."""
    schema, name = op._schema, op._schema.name.partition("::")[2]
    return lambda args, kwargs: check(name, _bound(schema, args, kwargs))


def signature_check(qualified: str, op):
    """The per-signature check of op ``qualified`` ("aten::name.overload"), or None."""
    packet = qualified.partition("::")[2].partition(".")[0]
    check = CHECKED_PER_SIGNATURE.get(packet)
    return argument_check(op, check) if check is not None and hasattr(op, "_schema") else None
