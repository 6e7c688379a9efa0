"""Ops that travel as one remote op instead of their decomposition.

Sits beside ``client.device``: PyTorch picks SDPA's fused kernel through a C++ stub that
ignores PrivateUse1, so on our device attention would decompose into ~15 ops (and differ
numerically from a local run that uses a fused kernel). We override the autograd kernel of
``aten::scaled_dot_product_attention`` for our device: the forward is one remote op running
PyTorch's own SDPA on the node (its fused kernels where a local run would use them, dropout
included); when a backward is to come the node runs it under autograd and keeps the graph, so
the backward is one remote op costing what a local run's does (no recomputation), and the
results match a local run bit for bit. Should the graph be gone (a migration to another node,
a second backward) the node recomputes the forward from the generator state it started at,
which draws the same dropout mask.

``dropout`` on a CPU-backend node is one remote op too (the bernoulli, scale and multiply a
local CPU run does, returning the scaled mask for the backward): 1 message instead of 4.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from . import device as _device
from . import recompute


def _specs_like(*tensors):
    return [_device.output_spec(t.shape, _device._contiguous_strides(tuple(t.shape)), t.dtype) for t in tensors]


def _sdpa_out_shape(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The output layout, from PyTorch's own SDPA on fake tensors of the node's device type (its
    errors for bad shapes included), cached per argument layout: it runs SDPA's shape logic in
    Python (~2 ms a call, ~20 ms with dropout). On a CPU node it is CPU's: the flash kernel
    returns the layout of its inputs, the math path (dropout) a contiguous one; elsewhere the
    meta device's (the node copies the result into it if its kernel chose another)."""
    key = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
           None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.dtype),
           dropout_p > 0.0, is_causal, enable_gqa, _allowed_kernels())
    spec = _SDPA_SPECS.get(key)
    if spec is not None:
        return spec
    # Sequences whose length changes every call (generation with a KV cache, batches padded to
    # their longest) make every call a new layout. The output's shape is the query's with the
    # values' head size, and its strides follow from the kernel chosen (CPU's flash kernel: its
    # query's layout, contiguous or (B, L, H, E) memory seen as (B, H, L, E); the math path:
    # contiguous); that choice does not depend on the lengths, so it is learned once per family
    # of calls that differ in lengths only. A wrong guess would only cost a copy on the node
    # (into the declared layout); a bad shape is then reported by the node, at the next sync.
    shape = (*q.shape[:-1], v.shape[-1])
    family = (q.dim(), q.shape[:-2], q.dtype, q.stride(-1) == 1, q.dim() == 4 and q.stride(1) < q.stride(2),
              k.shape[:-2], k.dtype, k.stride(-1) == 1, v.shape[-1], v.dtype, v.stride(-1) == 1,
              q.shape[-2] > 0, k.shape[-2] > 0, q.shape[-1],
              None if attn_mask is None else (attn_mask.dtype, tuple(size == 1 for size in attn_mask.shape)),
              dropout_p > 0.0, is_causal, enable_gqa, key[-1])
    kind = _SDPA_FAMILIES.get(family)
    if kind is not None:
        spec = _device.output_spec(shape, _sdpa_layout(kind, shape), q.dtype)
    else:
        tensors = (q, k, v, attn_mask)
        if _device._infer_as_cpu:
            mode = _device._fake_cpu_mode()
            fake = [_device._to_fake_cpu(t, mode) for t in tensors]
            with mode:
                out = torch.nn.functional.scaled_dot_product_attention(
                    fake[0], fake[1], fake[2], attn_mask=fake[3], dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
        else:
            meta = [_device._to_meta(t) for t in tensors]
            out = torch.nn.functional.scaled_dot_product_attention(
                meta[0], meta[1], meta[2], attn_mask=meta[3], dropout_p=0.0, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
        strides = tuple(out.stride())
        if (not _device._infer_as_cpu and tuple(out.shape) == shape and strides == _sdpa_layout("contiguous", shape)
                and (_cuda_takes_efficient_attention(q, k, v) or _cuda_keeps_sequence_major(q, k, v))):
            strides = _sdpa_layout("flash", shape)
        spec = _device.output_spec(out.shape, strides, out.dtype)
        if out.dtype == q.dtype and tuple(out.shape) == shape and len(_SDPA_FAMILIES) < 4096:
            for kind in ("contiguous", "flash"):
                if strides == _sdpa_layout(kind, shape):
                    _SDPA_FAMILIES[family] = kind
                    break
    if len(_SDPA_SPECS) < 4096:
        _SDPA_SPECS[key] = spec
    return spec


def _allowed_kernels() -> tuple:
    """The attention kernels SDPA may pick (``sdpa_kernel``; the node gets the same flags,
    ``client/precision.py``): they decide the output's layout."""
    c = torch._C
    return (c._get_flash_sdp_enabled(), c._get_mem_efficient_sdp_enabled(), c._get_math_sdp_enabled(),
            c._get_cudnn_sdp_enabled())


def _cuda_takes_efficient_attention(q, k, v) -> bool:
    """Whether a CUDA node's SDPA would run the memory-efficient kernel on a float32 call, which
    the meta device sends down the math path. Its output has (B, L, H, E) memory; declared
    contiguous, a float32 GPT-2 on an H200 went on in another layout than a local run's and
    rounded differently a few steps later (with this, its losses equal a local run's). Half and
    bfloat16 calls keep the meta device's answer, which matched the H200's (cuDNN attention,
    contiguous). A call this misjudges costs a copy on the node, as before."""
    return (q.dtype == torch.float32 and _fused_kernel_shapes(q, k, v) and q.shape[-2] > 0
            and torch.backends.cuda.mem_efficient_sdp_enabled())


def _fused_kernel_shapes(q, k, v) -> bool:
    """Shapes CUDA's fused attention kernels take: (B, H, L, E) of one batch and head count, one
    dtype, head sizes a multiple of 8 (query's and key's equal), last dimension contiguous, keys."""
    return (k.dtype == v.dtype == q.dtype and q.dim() == k.dim() == v.dim() == 4
            and q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[-1] == k.shape[-1]
            and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.shape[-2] > 0)


def _cuda_keeps_sequence_major(q, k, v) -> bool:
    """Whether a CUDA node's half or bfloat16 SDPA returns (B, L, H, E) memory for this query:
    cuDNN attention matches the query's memory order, and flash and memory-efficient attention
    always return that layout, so a query that is itself a (B, L, H, E) tensor seen as
    (B, H, L, E) — a Hugging Face model's heads, split from one projection and transposed —
    gets it from all three (an H100, torch 2.11: cuDNN and efficient attention both did). Declared
    contiguous, the node copied each output into that layout and the model's ``transpose(1, 2)
    .reshape`` copied it back: two copies a layer that a local run does not make. A contiguous
    query keeps the meta device's answer (cuDNN on an H200 returned contiguous memory for it)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and _fused_kernel_shapes(q, k, v)
            and q.stride(1) < q.stride(2) and q.shape[-1] <= 256 and q.shape[1] > 1 and q.shape[-2] > 1)


def _cuda_grad_layout(t, efficient: bool) -> tuple:
    """The layout CUDA's fused attention backward gives the gradient of ``t`` (q, k or v).
    Memory-efficient attention (float32) allocates every gradient as dense (B, L, H, E) memory
    whatever its input's layout (``_efficient_attention_backward``'s ``at::empty`` of the
    (B, L, H, E) sizes): a key or value made contiguous by a ``cat`` (Hugging Face's cache)
    gets that layout too. cuDNN and flash attention (half precision) allocate an ``empty_like``
    of the input: ``t``'s own strides where ``t`` is dense, else dense memory in ``t``'s order,
    (B, L, H, E) for heads split from one projection (strides with gaps)."""
    if not efficient and is_non_overlapping_and_dense_or_false(t):
        return tuple(t.stride())
    return _sdpa_layout("flash", tuple(t.shape))


def _sdpa_layout(kind: str, shape: tuple) -> tuple:
    if kind == "flash" and len(shape) == 4:  # (B, H, L, E) viewing (B, L, H, E) memory
        batch, heads, length, size = (max(n, 1) for n in shape)
        return (length * heads * size, size, heads * size, 1)
    return _device._contiguous_strides(shape)


_SDPA_FAMILIES: dict = {}  # argument layouts up to the sequence lengths -> "contiguous" or "flash"
_SDPA_SPECS: dict = {}
_device.INFERENCE_CACHES += [_SDPA_SPECS, _SDPA_FAMILIES]
_HANDLE_SPEC = _device.output_spec((1,), (1,), torch.uint8)  # the 1-byte storage a kept graph is held by
_NO_STATE_SPEC = _device.output_spec((0,), (1,), torch.uint8)  # no dropout: no generator state to keep


class _RemoteSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        spec = _sdpa_out_shape(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        ctx.mask_requires_grad = attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
        args = (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if not any(ctx.needs_input_grad[:4]):
            (out,) = _device.submit_with_outputs("gpuwire::sdpa", args, {}, [spec])
            return out
        # the node keeps the graph for the backward (no recomputation); the generator state and
        # the inputs let it recompute should the graph be gone (a migration, a second backward)
        state_spec = recompute._rng_spec() if dropout_p > 0.0 else _NO_STATE_SPEC
        out, rng_state, handle = _device.submit_with_outputs(
            "gpuwire::sdpa_keep", (*args, ctx.mask_requires_grad), {}, [spec, state_spec, _HANDLE_SPEC])
        ctx.save_for_backward(q, k, v, attn_mask, rng_state, handle)
        ctx.options = (dropout_p, is_causal, scale, enable_gqa)
        # a CUDA kernel that returns (B, L, H, E) memory gives its gradients that layout too
        # (efficient and cuDNN attention on an H100): declared contiguous, the node copied the
        # three of them and the heads' view backward copied them again, six copies a layer
        ctx.sequence_major = not _device._infer_as_cpu and out.dim() == 4 and \
            spec[1] == _sdpa_layout("flash", spec[0]) != _sdpa_layout("contiguous", spec[0])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_mask, rng_state, handle = ctx.saved_tensors
        dropout_p, is_causal, scale, enable_gqa = ctx.options
        wanted = [q, k, v] + ([attn_mask] if ctx.mask_requires_grad else [])
        if torch.is_grad_enabled() or recompute.batched((grad_out,)):
            return _differentiable_backward(ctx, grad_out, wanted, rng_state)
        specs = _specs_like(*wanted)
        if ctx.sequence_major:
            efficient = q.dtype == torch.float32  # (the kernel a sequence-major float32 result came from)
            specs[:3] = [_device.output_spec(t.shape, _cuda_grad_layout(t, efficient), t.dtype) for t in wanted[:3]]
        else:
            grad_out = grad_out.contiguous()  # (a CPU node's kernels: what its layouts were measured with)
        grads = _device.submit_with_outputs(
            "gpuwire::sdpa_backward_kept",
            (handle, rng_state, grad_out, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
             ctx.mask_requires_grad),
            {}, specs)
        grads = list(grads) + [None] * (4 - len(grads))
        return grads[0], grads[1], grads[2], grads[3], None, None, None, None


def _differentiable_backward(ctx, grad_out, wanted, rng_state):
    """The backward as ops autograd can differentiate again: ``create_graph=True`` (a gradient
    penalty, a Hessian-vector product, MAML) with attention in the model. The node's kept graph
    gives gradients that carry no graph of their own (the second backward raised "element 0 of
    tensors does not require grad"), so the attention is recomputed here through SDPA's math
    decomposition, as a local run under ``sdpa_kernel(SDPBackend.MATH)`` computes it (the math
    path is the one with a double backward on CPU and CUDA alike), with the node's generator put
    back where the forward started so dropout draws the forward's mask."""
    dropout_p, is_causal, scale, enable_gqa = ctx.options

    def attention(views):
        q, k, v, attn_mask = (*views[:3], views[3] if len(views) > 3 else ctx.saved_tensors[3])
        with _generator_at(rng_state) if dropout_p > 0.0 else contextlib.nullcontext():
            return torch.ops.aten.scaled_dot_product_attention.default.decompose(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    grads = recompute.differentiable_grads(attention, wanted, ctx.needs_input_grad[:4], (grad_out,))
    grads += [None] * (4 - len(grads))
    return grads[0], grads[1], grads[2], grads[3], None, None, None, None


@contextlib.contextmanager
def _generator_at(state: torch.Tensor):
    """The node's generator at ``state`` (a device tensor) for the block, then back where it was."""
    from . import torch_module
    restore = torch_module.get_rng_state()
    torch_module.set_rng_state(state.cpu())
    try:
        yield
    finally:
        torch_module.set_rng_state(restore)


_PYTHON_KEY = torch._C.DispatchKey.Python


def _has_subclass(*tensors) -> bool:
    """Whether a tensor subclass with its own ``__torch_dispatch__`` (the Python key) is among
    ``tensors``: such a wrapper has no storage of its own to name on the wire, so the kernels
    here, which encode their arguments directly, leave it to the op's composite decomposition,
    whose ops reach the subclass one by one (PyTorch's composite-compliance tests do this)."""
    return any(isinstance(t, torch.Tensor) and torch._C._dispatch_keys(t).has(_PYTHON_KEY) for t in tensors)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if _has_subclass(query, key, value, attn_mask):
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:  # (ATen's words; the shapes below need two)
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    forward_ad = torch.autograd.forward_ad._current_level >= 0
    if not forward_ad and (not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in args[:4])):
        # no graph to keep (inference, ``generate``; a JVP has a tangent to carry: below): the one
        # message, without the autograd Function around it (~10 us a call: 20.1 -> 10.5 us in a loop)
        (out,) = _device.submit_with_outputs("gpuwire::sdpa", args, {}, [_sdpa_out_shape(*args)])
        return out
    if recompute.under_transforms():  # (the composite: the math path's rounding)
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _RemoteSDPA.apply(*args)


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


def _dropout(input, p: float, train: bool):
    """``dropout`` as the node's device type runs it locally, so a seeded run draws the same
    random numbers: the CPU path is bernoulli + scale + multiply (ATen's ``_dropout_impl``),
    the CUDA path is the fused ``native_dropout``."""
    if not train or p == 0.0 or input.numel() == 0:
        return input.clone() if train else input
    if _has_subclass(input):
        return torch.ops.aten.dropout.default.decompose(input, p, train)
    if p == 1.0:
        return input * torch.zeros_like(input)
    if _device.runtime().device_info.get("backend") == "cpu":
        if input.is_floating_point() and not input.is_complex() and not recompute.under_transforms():
            # (under torch.func transforms and forward-mode AD, which an autograd.Function
            # without a jvp refuses: the plain ops below, which draw the same mask)
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


class _EvenlyDistributed(torch.autograd.Function):
    """``max()``/``min()``/``median()``/``nanmedian()`` without a dim: the gradient goes evenly to
    every element equal to the result. PyTorch's backward (``evenly_distribute_backward``) reads
    ``value.isnan()`` with ``.item()`` on every device but CUDA, which on this device is a round
    trip every backward; this is CUDA's sync-free form of it, giving the CPU formula's values."""

    @staticmethod
    def forward(ctx, op, input):
        with torch._C._AutoDispatchBelowAutograd():
            value = op(input)
        ctx.save_for_backward(input, value)
        ctx.save_for_forward(input, value)
        return value

    @staticmethod
    def backward(ctx, grad):
        input, value = ctx.saved_tensors
        mask = (input == value).logical_or_(input.isnan().logical_and_(value.isnan()))
        return None, torch.where(mask, grad / mask.sum(), 0)

    @staticmethod
    def jvp(ctx, _op, tangent):  # forward mode: PyTorch's ``evenly_read_jvp``
        input, value = ctx.saved_tensors
        mask = input == value
        return tangent.mul(mask).sum() / mask.sum()


def _evenly_distributed_ops(op, input):
    """The value of ``op(input)`` with the gradient ``_EvenlyDistributed`` gives it, in plain
    differentiable ops: under torch.func's transforms, which refuse an autograd.Function that
    is not written for them (and a PrivateUse1 device has no kernel for the form that is)."""
    with torch._C._AutoDispatchBelowAutograd():
        value = op(input)
    mask = (input == value).logical_or_(input.isnan().logical_and_(value.isnan()))
    count = mask.sum()
    # both have ``mask / count`` as their gradient; ``value + 0.0`` is exactly the value unless it
    # is a zero (-0.0 would turn 0.0), the sum of the equal elements divided by their count is
    # exact for zeros, infinities and NaN (-0.0 fills: it keeps a sum of -0.0s negative)
    shifted = value + torch.where(mask, input - value, 0.0).sum() / count
    summed = torch.where(mask, input, -0.0).sum() / count
    return torch.where(value.isfinite() & (value != 0), shifted, summed)


def _evenly_distributed(op):
    from torch.autograd import forward_ad

    def kernel(input):
        if (input.requires_grad and torch.is_grad_enabled()) or forward_ad._current_level >= 0:
            if torch._C._are_functorch_transforms_active():
                return _evenly_distributed_ops(op, input)
            return _EvenlyDistributed.apply(op, input)
        with torch._C._AutoDispatchBelowAutograd():
            return op(input)
    return kernel


# Ops whose CompositeExplicitAutograd kernel cannot run on the client: ``conj_physical_`` calls
# a DispatchStub itself (``unary_op_impl_out(self, self, conj_physical_stub)``), which has no
# kernel for a Python backend ("DispatchStub: missing kernel for gpuwire"); ``mode.values``
# checks the device type itself ("mode only supports CPU, CUDA and XPU device type"). Sent whole,
# the node runs them as a local run on its device would. Found by PyTorch's test_ops.py
# (TestMathBits with complex inputs, test_out); no dispatcher query tells such kernels.
STUB_COMPOSITES = ("conj_physical_", "mode.values")

# Ops whose kernel on every device is a CompositeExplicitAutograd one that allocates ``empty(0)``
# and calls the op's out= overload (``abs`` -> ``abs.out``) or a chain of such ops: on this
# device each call was four Python dispatches (``empty``, ``resize_``, ``as_strided_``, the out=
# op with its resize and checks) and the ops it chains, 20-150 us a call against 3-4 for a
# structured op (``x.abs()`` 39 us, ``isinf`` 52, ``logsumexp`` 145, ``F.l1_loss`` 59,
# ``F.soft_margin_loss`` 70, ``F.pad`` 17). Sent whole, the node runs the same composite a
# local run on its device runs (the same arithmetic: these are composites on CUDA too), and the
# client infers the result from the same composite on the meta device: one message. Measured
# with ``bench``'s per-op loop (session 35); ops at 3-6 us this way are left as they are.
COMPOSITES_SENT_WHOLE = (
    "abs", "logical_not", "logical_and", "logical_or", "logical_xor", "isinf", "nan_to_num", "deg2rad", "rad2deg",
    "logsumexp", "logcumsumexp", "cummax", "cummin", "kthvalue", "median.dim", "nanmedian.dim", "repeat",
    "constant_pad_nd", "binary_cross_entropy_with_logits", "soft_margin_loss", "masked_fill.Scalar",
    "masked_fill.Tensor", "index_fill.int_Scalar", "index_fill.int_Tensor", "block_diag", "mv",
)
# (not ``complex``/``polar``: their meta kernels take a float and a double argument that their
# composites refuse, so the refusal came at the next sync point; tests/conformance/test_error_inputs.py)


# Composite ops sent whole are registered at the autograd key and at the backend key: under
# ``torch.inference_mode()`` the autograd key is skipped, and the op would decompose into the
# generic path PrivateUse1 gets (SDPA's math kernel, RNN cells without oneDNN: other rounding
# than the node's kernel, and several messages instead of one)
WHOLE_KEYS = ("AutogradPrivateUse1", "PrivateUse1")


def register(aten_library: torch.library.Library) -> None:
    for key in WHOLE_KEYS:
        aten_library.impl("scaled_dot_product_attention", _sdpa, key)
        aten_library.impl("dropout", _dropout, key)
    for name in ("max", "min", "median", "nanmedian"):
        aten_library.impl(name, _evenly_distributed(getattr(torch.ops.aten, name).default), "AutogradPrivateUse1")
    _register_small_composites(aten_library)
    recompute.register(aten_library, WHOLE_KEYS)
    for qualified in (*_kernels_that_decompose_only_here(), *("aten::" + name for name in COMPOSITES_SENT_WHOLE)):
        _device.register_kernel(aten_library, qualified[len("aten::"):], _whole(_device._aten_op(qualified)))
    for name in STUB_COMPOSITES:
        packet, _, overload = name.partition(".")
        aten_library.impl(name, _whole(getattr(getattr(torch.ops.aten, packet), overload or "default")), "PrivateUse1")


# Composites that reach a PrivateUse1 backend as ``empty`` + a fill or copy: two messages, an
# Alloc and the op (``arange``: three dispatches, ``empty(0)``, ``resize_`` and ``arange.out``).
# Sent whole they are one, and the node's own kernel makes the result (the random factories
# run the same ``empty`` + draw there, so they draw what a local run draws). Only below the size
# from which the CPU backend's node reuses freed blocks for an Alloc (``_memory``: 1 MiB):
# above it the Alloc lands in a warm block, where a fresh kernel output would be faulted in
# page by page.
WHOLE_BELOW = 1 << 20
_WIDEST = 16  # bytes an element may take when a factory's dtype is left to its fill value


def _count(sizes) -> int:
    n = 1
    for size in sizes:
        n *= int(size)
    return n


def _like(a, k):
    return a[0].numel() * (k.get("dtype") or a[0].dtype).itemsize


def _sized(size_index: int):
    def nbytes(a, k):
        dtype = k.get("dtype")
        return _count(a[size_index]) * (dtype.itemsize if dtype is not None else _WIDEST)
    return nbytes


def _new_sized(a, k):
    return _count(a[1]) * (k.get("dtype") or a[0].dtype).itemsize


def _arange_bytes(start, end, step, k) -> int:
    dtype = k.get("dtype")
    return max(math.ceil((float(end) - float(start)) / float(step)), 0) * (dtype.itemsize if dtype else _WIDEST)


_SMALL_COMPOSITES = {
    # op overload -> the bytes of its result from (args, kwargs), an upper bound where the
    # dtype follows a fill value
    "clone": lambda a, k: a[0].numel() * a[0].dtype.itemsize,
    "zeros_like": _like,
    "ones_like": _like,
    "full_like": _like,
    "rand_like": _like,
    "randn_like": _like,
    "randint_like": _like,
    "new_zeros": _new_sized,
    "new_ones": _new_sized,
    "new_full": _new_sized,
    "zeros": _sized(0),
    "ones": _sized(0),
    "full": _sized(0),
    "rand": _sized(0),
    "rand.generator": _sized(0),
    "randn": _sized(0),
    "randn.generator": _sized(0),
    "randint": _sized(1),
    "randint.generator": _sized(1),
    "randint.low": _sized(2),
    "randint.low_generator": _sized(2),
    "randperm": lambda a, k: int(a[0]) * 8,
    "randperm.generator": lambda a, k: int(a[0]) * 8,
    "scalar_tensor": lambda a, k: _WIDEST,
    "arange": lambda a, k: _arange_bytes(0, a[0], 1, k),
    "arange.start": lambda a, k: _arange_bytes(a[0], a[1], 1, k),
    "arange.start_step": lambda a, k: _arange_bytes(a[0], a[1], a[2] if len(a) > 2 else 1, k),
    "linspace": lambda a, k: int(a[2]) * _WIDEST,
    "eye": lambda a, k: int(a[0]) ** 2 * _WIDEST,
    "eye.m": lambda a, k: int(a[0]) * int(a[1]) * _WIDEST,
}


def _whole_when_small(op, composite, result_bytes):
    def kernel(keyset, *args, **kwargs):
        device = kwargs.get("device")
        try:
            # ``x.new_ones(n, device="cpu")``, ``torch.zeros_like(x, device="meta")`` reach us by
            # ``x``'s key but make their result elsewhere: PyTorch's composite allocates it on
            # the device asked for (sent whole, the result stayed on gpuwire)
            small = ((device is None or torch.device(device).type == _device.DEVICE_TYPE)
                     and result_bytes(args, kwargs) < WHOLE_BELOW)
        except Exception:  # noqa: BLE001 - odd arguments: PyTorch's own path raises its own error
            small = False
        if small:
            return _device._fallback(op, *args, **kwargs)
        return composite.call_boxed(keyset, *args, **kwargs)
    return kernel


def _register_small_composites(aten_library: torch.library.Library) -> None:
    for name, result_bytes in _SMALL_COMPOSITES.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        composite = torch._C._dispatch_get_computed_kernel_for_dispatch_key(
            f"aten::{name}", torch._C.DispatchKey.PrivateUse1)
        _device.register_kernel(aten_library, name, _whole_when_small(op, composite, result_bytes), with_keyset=True)


def _whole(op):
    def kernel(*args, **kwargs):
        return _device._fallback(op, *args, **kwargs)
    return kernel
