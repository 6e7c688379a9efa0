"""Which ops a node will run, and how an op name from the wire becomes a callable.

Sits between a session and torch: names arrive as strings (``"aten::add.out"``); only the
``aten`` namespace and gpuwire's own fused ops (``gpuwire::…``, defined here) resolve. Ops with
host side effects are refused by name, whatever the namespace says.
"""

from __future__ import annotations

import functools
import re
import threading

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from .._aten import check_lu_unpack_pivots
from .guards import GUARDS, guarded, signature_check
from .composite import COMPOSITE_OPS, _generator_for, generator_state_on


class OpRefused(Exception):
    """The op is not allowed on a gpuwire node (unknown namespace or host side effects)."""


# Ops in the aten namespace that touch the node's filesystem, processes or stdout, or that
# let a client reach memory by raw pointer. Refused regardless of arguments.
DENIED_ATEN = frozenset({
    "from_file", "_print", "save", "_assert_async", "_assert_scalar", "_async_error",
    "set_.source_Storage", "set_.source_Storage_storage_offset", "set_.source_Tensor", "set_",
    "_make_per_tensor_quantized_tensor", "_make_per_channel_quantized_tensor",
    "record_stream", "_pin_memory", "pin_memory", "to_mkldnn", "mkldnn_reorder_conv2d_weight",
    "_nested_from_padded", "_nested_tensor_from_mask", "lift_fresh", "_cudnn_rnn_flatten_weight",
    "_debug_has_internal_overlap", "_unsafe_set_version_counter", "_copy_from", "_copy_from_and_resize",
    "resize_", "resize_as_", "_resize_output_", "_unsafe_index_put",
    # called inside the CPU kernel of grid_sampler_2d, never by a program; a NaN grid read past
    # its input
    "_grid_sampler_2d_cpu_fallback", "_grid_sampler_2d_cpu_fallback_backward",
})
# families refused by the start of their names: fbgemm's packed weights are a raw host pointer
# kept in a tensor (a forged one is read and written through; packing returns a heap address),
# and the Sobol engine's kernels index its direction numbers by unchecked arguments (a local
# ``torch.quasirandom.SobolEngine`` keeps its state on the host, never on a device)
DENIED_ATEN_PREFIXES = ("fbgemm_", "_sobol_engine_")


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _sdpa_backward(grad_out, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, mask_requires_grad=False, rng_state=None):
    """Gradients of SDPA by recomputing the forward under autograd on the node (same kernels
    as a local run, so results match bit for bit); with dropout, from the generator state the
    forward started at (``_sdpa_keep`` returns it), put back afterwards."""
    generator = saved = None
    if dropout_p and rng_state is not None:
        generator = _generator_for(query.device)
        saved = generator.get_state()
        generator.set_state(rng_state.cpu().contiguous())
    elif dropout_p:
        raise ValueError("gpuwire::sdpa_backward with dropout needs the forward's generator state")
    try:
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
            inputs = [q, k, v]
            mask = attn_mask
            if mask is not None and mask_requires_grad:
                mask = attn_mask.detach().requires_grad_(True)
                inputs.append(mask)
            out = _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    finally:
        if generator is not None:
            generator.set_state(saved)
    grads = list(grads) + [None] * (4 - len(grads))
    return tuple(g if g is not None else None for g in grads)


# The session whose command is running on this thread, for the ops that keep state in it
# (``SESSION_OPS``); set by ``Session._run_op`` around the call only, so a meta run (the
# allocation guard) sees None.
CURRENT = threading.local()


def _sdpa_keep(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               mask_requires_grad=False):
    """SDPA run under autograd on the node, its graph kept for ``_sdpa_backward_kept``: the
    backward then costs what a local run's does (no recomputation). Returns the output, the
    generator state from before (for a recomputing backward should the graph be gone: after a
    migration or a second backward), and the handle."""
    device = query.device
    state = generator_state_on(device) if dropout_p else torch.empty(0, dtype=torch.uint8, device=device)
    inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
    mask = attn_mask
    if mask is not None and mask_requires_grad:
        mask = attn_mask.detach().requires_grad_(True)
        inputs.append(mask)
    known = {t.untyped_storage().data_ptr() for t in (query, key, value, attn_mask) if t is not None}
    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in known:
            saved[ptr] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _sdpa(inputs[0], inputs[1], inputs[2], mask, dropout_p, is_causal, scale, enable_gqa)
    handle = torch.empty(1, dtype=torch.uint8, device=device)
    session = getattr(CURRENT, "session", None)
    if session is not None and device.type != "meta":
        session.keep_graph(handle.untyped_storage(), out, inputs, sum(saved.values()))
    return out.detach(), state, handle


def _sdpa_backward_kept(handle, rng_state, grad_out, query, key, value, attn_mask=None, dropout_p=0.0,
                        is_causal=False, scale=None, enable_gqa=False, mask_requires_grad=False):
    """Gradients of a ``_sdpa_keep`` forward from its kept graph; by recomputation (with the
    generator rewound) when the graph is gone."""
    session = getattr(CURRENT, "session", None)
    kept = session.kept_graph(handle) if session is not None else None
    if kept is not None:
        out, inputs = kept
        if out.shape == grad_out.shape:
            try:
                grads = list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))
                return tuple(grads + [None] * (4 - len(grads)))
            except RuntimeError:  # its buffers were freed by an earlier backward: recompute
                pass
    return _sdpa_backward(grad_out, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          mask_requires_grad, rng_state if dropout_p else None)


def _dropout(input, p):
    """A local CPU run's dropout (ATen ``_dropout_impl``): the output and the scaled mask."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1 (exclusive here), but got {p}")
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise, noise


# The math-mode setters a client may replay here (``client/precision.py``): process-global
# flags deciding how kernels compute (TF32, float32 matmul precision, reduced-precision
# reductions, deterministic algorithms, cuDNN's benchmark/deterministic/enabled), applied only
# while the session's own ops run (``Session._run_op``)
PRECISION_SETTERS = frozenset({
    "_set_float32_matmul_precision", "_set_cublas_allow_tf32", "_set_cudnn_allow_tf32",
    "_set_cublas_allow_fp16_reduced_precision_reduction", "_set_cublas_allow_bf16_reduced_precision_reduction",
    "_set_cpu_allow_fp16_reduced_precision_reduction", "_set_fp32_precision_setter",
    "_set_cudnn_benchmark", "_set_cudnn_deterministic", "_set_cudnn_enabled",
    "_set_deterministic_algorithms", "_set_deterministic_fill_uninitialized_memory",
    "_set_default_dtype",  # (by name: the dtype of factories given none)
    "_set_sdp_use_flash", "_set_sdp_use_mem_efficient", "_set_sdp_use_math", "_set_sdp_use_cudnn",
    "_set_sdp_use_overrideable", "_set_sdp_use_fa3", "_set_math_sdp_allow_fp16_bf16_reduction",
    "_set_sdp_priority_order",  # (a list of ints)
} & set(dir(torch._C)))
DEFAULT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                  "float64": torch.float64}


def _setter(name: str):
    """torch's own setter: in a process that is also a client (a node inside a test), the client
    wraps these to send them to its node (``client/precision.py``), and calling the wrapper here
    sent them again, in a loop (an out-of-memory kill of a CI worker)."""
    setter = getattr(torch._C, name)
    return getattr(setter, "__wrapped__", setter)


def _call_setter(name: str, args) -> None:
    if name == "_set_deterministic_algorithms":  # (mode, warn_only): its second is keyword-only
        _setter(name)(args[0], warn_only=bool(args[1]) if len(args) > 1 else False)
    elif name == "_set_default_dtype":
        if not args or args[0] not in DEFAULT_DTYPES:
            raise ValueError(f"gpuwire::precision: the default dtype must be one of {', '.join(DEFAULT_DTYPES)}")
        _setter(name)(DEFAULT_DTYPES[args[0]])
    else:
        _setter(name)(*args)


def _precision_defaults() -> tuple:
    """Setter calls that put this process's math-mode flags back as they were at start-up
    (legacy flags first; the per-backend precisions, which the legacy ones also move, last)."""
    c = torch._C
    calls = [("_set_float32_matmul_precision", c._get_float32_matmul_precision()),
             ("_set_cublas_allow_tf32", c._get_cublas_allow_tf32()),
             ("_set_cudnn_allow_tf32", c._get_cudnn_allow_tf32()),
             ("_set_cpu_allow_fp16_reduced_precision_reduction", c._get_cpu_allow_fp16_reduced_precision_reduction())]
    for name in ("_cublas_allow_fp16_reduced_precision_reduction", "_cublas_allow_bf16_reduced_precision_reduction"):
        value = getattr(c, "_get" + name)()
        calls.append(("_set" + name, *(value if isinstance(value, tuple) else (value,))))
    calls += [("_set_cudnn_benchmark", c._get_cudnn_benchmark()), ("_set_cudnn_deterministic", c._get_cudnn_deterministic()),
              ("_set_cudnn_enabled", c._get_cudnn_enabled()),
              ("_set_deterministic_algorithms", c._get_deterministic_algorithms(), c._get_deterministic_algorithms_warn_only()),
              ("_set_deterministic_fill_uninitialized_memory", c._get_deterministic_fill_uninitialized_memory()),
              ("_set_default_dtype", str(torch.get_default_dtype()).removeprefix("torch."))]
    for flag in ("flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3"):
        if hasattr(c, f"_set_sdp_use_{flag}"):
            calls.append((f"_set_sdp_use_{flag}", getattr(c, f"_get_{flag}_sdp_enabled")()))
    if hasattr(c, "_set_math_sdp_allow_fp16_bf16_reduction"):
        calls.append(("_set_math_sdp_allow_fp16_bf16_reduction", c._get_math_sdp_allow_fp16_bf16_reduction()))
    if hasattr(c, "_set_sdp_priority_order"):
        calls.append(("_set_sdp_priority_order", [int(b) for b in c._get_sdp_priority_order()]))
    if hasattr(c, "_get_fp32_precision_getter"):
        for backend in ("generic", "cuda", "mkldnn"):
            for op in ("all", "matmul", "conv", "rnn"):
                try:
                    calls.append(("_set_fp32_precision_setter", backend, op, c._get_fp32_precision_getter(backend, op)))
                except RuntimeError:  # (a pair this torch does not have)
                    pass
    return tuple(calls)


PRECISION_DEFAULTS = _precision_defaults()
APPLIED_PRECISION = [()]  # the session calls now in force ((): the defaults)


def apply_precision(calls: tuple) -> None:
    """Put the flags as the defaults followed by ``calls`` (validated by ``_precision``)."""
    try:
        for name, *args in PRECISION_DEFAULTS:
            _call_setter(name, args)
        for name, *args in calls:
            _call_setter(name, args)
    finally:
        APPLIED_PRECISION[0] = calls


def math_mode() -> dict:
    """The flags in force, as their Python-level names read them."""
    c = torch._C
    getters = {"float32_matmul_precision": c._get_float32_matmul_precision,
               "cuda.matmul.allow_tf32": c._get_cublas_allow_tf32, "cudnn.allow_tf32": c._get_cudnn_allow_tf32,
               "cudnn.benchmark": c._get_cudnn_benchmark, "cudnn.deterministic": c._get_cudnn_deterministic,
               "cudnn.enabled": c._get_cudnn_enabled, "deterministic_algorithms": c._get_deterministic_algorithms,
               "deterministic_algorithms_warn_only": c._get_deterministic_algorithms_warn_only,
               "fill_uninitialized_memory": c._get_deterministic_fill_uninitialized_memory,
               "default_dtype": lambda: str(torch.get_default_dtype()).removeprefix("torch."),
               "sdp.flash": c._get_flash_sdp_enabled, "sdp.mem_efficient": c._get_mem_efficient_sdp_enabled,
               "sdp.math": c._get_math_sdp_enabled, "sdp.cudnn": c._get_cudnn_sdp_enabled,
               "sdp.priority_order": lambda: [int(b) for b in c._get_sdp_priority_order()]}
    if hasattr(c, "_get_fp32_precision_getter"):
        for backend, op in (("cuda", "matmul"), ("cuda", "conv"), ("mkldnn", "matmul"), ("mkldnn", "conv")):
            getters[f"{backend}.{op}.fp32_precision"] = functools.partial(c._get_fp32_precision_getter, backend, op)
    mode = {}
    for name, getter in getters.items():
        try:
            mode[name] = getter()
        except RuntimeError:  # a legacy getter after the new API was used (torch refuses to answer)
            mode[name] = "mixed"
    return mode


def _setter_argument(value) -> bool:
    """A bool, a short string, or a short list of small ints (SDPA's backend priority order)."""
    if type(value) is list:
        return len(value) <= 16 and all(type(v) is int and 0 <= v < 64 for v in value)
    return type(value) is bool or (type(value) is str and len(value) <= 32)


def _precision(calls):
    """``gpuwire::precision``: the session's math-mode setter calls (``client/precision.py``),
    checked, tried, and kept for the session's later ops. A meta run (the allocation guard)
    only checks them."""
    if type(calls) is not list or len(calls) > 64:
        raise ValueError("gpuwire::precision takes a list of at most 64 setter calls")
    checked = []
    for call in calls:
        if (type(call) is not list or not call or call[0] not in PRECISION_SETTERS or len(call) > 4
                or any(not _setter_argument(a) for a in call[1:])):
            raise ValueError(f"gpuwire::precision: {call!r} is not a math-mode setter call this node accepts")
        checked.append(tuple(call))
    session = getattr(CURRENT, "session", None)
    if session is None:
        return None
    before = session.precision
    try:
        apply_precision(tuple(checked))  # torch checks the values; a bad one raises here
    except Exception:
        apply_precision(before)
        raise
    session.precision = tuple(checked)
    return None


def _histc_like_cuda(self, bins=100, min=0, max=0, *, out=None):
    """``aten::histc`` of an integer tensor on a CPU node, as CUDA computes it (the CPU kernel
    supports floating types only): bins counted in int64 arithmetic, the result in the input's
    dtype. Programs written for CUDA rely on it: Hugging Face's MoE layers (Mixtral, Qwen-MoE)
    count tokens per expert with ``histc`` of int32 expert ids on any non-CPU device."""
    if self.device.type != "cpu" or self.is_floating_point() or self.is_complex() or self.dtype is torch.bool:
        return torch.ops.aten.histc(self, bins, min, max) if out is None else torch.ops.aten.histc.out(
            self, bins, min, max, out=out)
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    values = self.reshape(-1).to(torch.int64)
    low, high = int(min), int(max)
    if low == high and values.numel():
        low, high = int(values.min()), int(values.max())
    if low == high:
        low, high = low - 1, high + 1
    if low > high:
        raise RuntimeError("max must be larger than min")
    inside = values[(values >= low) & (values <= high)]
    index = torch.div((inside - low) * bins, high - low, rounding_mode="floor").clamp_(max=bins - 1)
    counts = torch.bincount(index, minlength=bins).to(self.dtype)
    if out is None:
        return counts
    out.copy_(counts)
    return out


def _modulo_by_zero_like_cuda(op):
    """``fmod``/``remainder`` of integers by zero on a CPU node, as CUDA gives them: the CPU kernel
    raises "ZeroDivisionError" where CUDA's leaves a bit pattern (all ones; for int64, all ones
    for a negative dividend and the low 32 bits for the others), which programs and PyTorch's own
    tests written for a GPU take. Any other call is the op's own, at the cost of one comparison
    of an integer divisor with zero."""
    def kernel(*args, **kwargs):
        dividend, divisor = args[0], args[1]
        tensors = [a for a in (dividend, divisor) if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].device.type != "cpu":
            return op(*args, **kwargs)
        dtype = torch.result_type(dividend, divisor)
        if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
            return op(*args, **kwargs)
        zero = divisor == 0
        if not (bool(zero.any()) if isinstance(zero, torch.Tensor) else zero):
            return op(*args, **kwargs)
        before = dividend.clone() if isinstance(dividend, torch.Tensor) else dividend  # (in place, it is overwritten)
        safe = divisor.masked_fill(zero, 1) if isinstance(divisor, torch.Tensor) else 1
        result = op(dividend, safe, *args[2:], **kwargs)
        if dtype == torch.int64:
            pattern = torch.where(torch.as_tensor(before) >= 0, 4294967295, -1)
        else:
            pattern = torch.tensor(-1).to(dtype) if dtype.is_signed else torch.tensor(torch.iinfo(dtype).max, dtype=dtype)
        zero = torch.as_tensor(zero)
        result.copy_(torch.where(zero, pattern.to(result.dtype), result))
        return result
    return kernel


def _truncated_division_like_cuda(op):
    """``div(..., rounding_mode="trunc")`` of signed integers on a CPU node: the one quotient that
    overflows, the type's minimum divided by -1, traps on x86 (SIGFPE: the node process died, and
    every tenant's session with it; a local CPU run dies too) where a GPU wraps to the minimum, as
    ``floor`` rounding and ``//`` give it on CPU too. Divisors of -1 are computed as a negation;
    any other call is the op's own, at the cost of one comparison of the divisor with -1. Run only
    for the signatures ``_truncated_division_chooser`` picks (trunc, signed integers)."""
    def kernel(*args, **kwargs):
        dividend, divisor = args[0], args[1]
        minus_one = divisor == -1
        if not (bool(minus_one.any()) if isinstance(minus_one, torch.Tensor) else minus_one):
            return op(*args, **kwargs)
        # (computed before the call: in place, the dividend is overwritten)
        negated = torch.neg(torch.as_tensor(dividend).to(torch.result_type(dividend, divisor)))
        safe = divisor.masked_fill(minus_one, 1) if isinstance(divisor, torch.Tensor) else 1
        result = op(dividend, safe, *args[2:], **kwargs)
        result.copy_(torch.where(torch.as_tensor(minus_one), negated.to(result.dtype), result))
        return result
    return kernel


def _truncated_division_chooser(op):
    """A CPU node's per-signature choice for ``div``/``div_`` with a rounding mode: the kernel
    above for a signed integer ``trunc`` division (on every call: its values decide), None (the
    op itself, which the native loop may run) for the rest (``floor`` is common in models)."""
    checked = _truncated_division_like_cuda(op)

    def choose(args, kwargs):
        if kwargs.get("rounding_mode", args[2] if len(args) > 2 else None) != "trunc" or len(args) < 2:
            return None
        dtype = torch.result_type(args[0], args[1])
        return None if dtype.is_floating_point or dtype.is_complex or not dtype.is_signed else checked
    return choose


TRUNCATED_DIVISIONS = frozenset({"aten::div.Tensor_mode", "aten::div.Scalar_mode", "aten::div.out_mode",
                                 "aten::div.Scalar_mode_out", "aten::div_.Tensor_mode", "aten::div_.Scalar_mode"})


def _pivots_checked(op):
    """``lu_unpack`` whose pivots' shape is checked first (``_aten.check_lu_unpack_pivots``: a
    wrong one crashed the node process, every tenant's session with it)."""
    def kernel(lu_data, lu_pivots, *args, **kwargs):
        check_lu_unpack_pivots(lu_data, lu_pivots)
        return op(lu_data, lu_pivots, *args, **kwargs)
    return kernel


# CPU kernels of LU factorisations that are wrong when ATen runs them on more than one thread
# (torch 2.13.0+cpu, MKL 2024.2: a batch of two or more matrices of ~180 rows or more gets
# garbage pivots: "Intel oneMKL ERROR: Parameter 6 was incorrect on entry to SLASWP", then
# ``linalg.inv``/``solve`` raise "Pivots given to lu_solve must all be greater or equal to 1",
# ``det``/``slogdet`` return wrong values; some sizes hang). A local CPU run with 2 threads
# has the same bug; a GPU's kernels do not, so a CPU-backend node runs these on one thread.
BATCHED_LU_OPS = ("linalg_lu_factor_ex", "linalg_lu_factor", "linalg_lu", "_linalg_solve_ex", "linalg_solve_ex",
                  "linalg_solve", "linalg_inv_ex", "linalg_inv", "_linalg_det", "linalg_det", "det", "_linalg_slogdet",
                  "linalg_slogdet", "slogdet", "logdet", "linalg_lu_solve", "lu_solve", "linalg_ldl_factor_ex",
                  "linalg_ldl_solve", "_lu_with_info", "inverse")


def _on_one_thread(op):
    """``op`` with ATen's intra-op threads set to one while it runs (``BATCHED_LU_OPS``)."""
    def serially(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return op(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return op(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return serially


def _each_overload(names, kernel_for) -> dict:
    """{qualified name: factory of a ``_NodeKernel``} for every overload of the aten ops ``names``,
    its kernel ``kernel_for(overload)``."""
    table = {}
    for name in names:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            table[f"aten::{name}" if overload == "default" else f"aten::{name}.{overload}"] = \
                lambda op=op: _NodeKernel(op, kernel_for(op))
    return table


class _NodeKernel:
    """An aten op with a different kernel on one kind of node (same schema, so the node's
    allocation guard treats it as the op itself; on meta tensors it is the op itself)."""

    def __init__(self, op, kernel):
        self._schema = op._schema
        self._kernel = kernel

    def __call__(self, *args, **kwargs):
        return self._kernel(*args, **kwargs)


def _zeros_for_zero_tensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``_efficientzerotensor`` (what autograd gives for a gradient known to be zero, e.g. the
    backward of ``sgn`` of a real tensor) as a real tensor of zeros: a ZeroTensor has no storage
    to keep under the client's id."""
    return torch.zeros(size, dtype=dtype, device=device)


# ``nn.SyncBatchNorm``'s ops (DDP with SyncBatchNorm): CUDA kernels only, written here for a
# CPU node after CUDA's arithmetic (per-channel statistics in the accumulation dtype, float32
# for half inputs; ranks' statistics combined by their counts); a CUDA node runs its own.

def _channel_dims(t) -> list:
    return [0, *range(2, t.dim())]


def _per_channel(v, t):
    """A (C,) vector shaped to broadcast over ``t``'s channel dimension."""
    return v.reshape([1, -1] + [1] * (t.dim() - 2))


def _acc(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _inv_std(var, eps):
    return torch.where((var == 0) & (eps == 0), torch.zeros_like(var), (var + eps).rsqrt())


def _batch_norm_stats(input, eps):
    if input.device.type != "cpu":
        return torch.ops.aten.batch_norm_stats(input, eps)
    var, mean = torch.var_mean(_acc(input), dim=_channel_dims(input), correction=0)
    return mean, _inv_std(var, eps)


def _batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    if input.device.type != "cpu":
        return torch.ops.aten.batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var,
                                                                  momentum, eps, counts)
    counts = counts.to(mean.dtype).reshape(-1, 1)
    total = counts.sum(0)
    global_mean = (counts * mean).sum(0) / total
    var_each = invstd.reciprocal().square() - eps  # each rank's biased variance
    m2 = (counts * (var_each + (mean - global_mean).square())).sum(0)
    global_invstd = _inv_std(m2 / total, eps)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_((1 - momentum) * running_mean + momentum * global_mean)
        if running_var is not None:
            running_var.copy_((1 - momentum) * running_var + momentum * (m2 / (total - 1)))
    return global_mean, global_invstd


def _batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    if input.device.type != "cpu":
        return torch.ops.aten.batch_norm_elemt(input, weight, bias, mean, invstd, eps)
    x = _acc(input)
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return out.to(input.dtype).contiguous(memory_format=suggest_memory_format(input))


def _batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    if input.device.type != "cpu":
        return torch.ops.aten.batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g,
                                                         bias_g)
    dims, dy, x = _channel_dims(input), _acc(grad_out), _acc(input)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    dtype = weight.dtype if weight is not None else mean.dtype
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(dtype), sum_dy.to(dtype)


def _batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    if input.device.type != "cpu":
        return torch.ops.aten.batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
                                                        count)
    dy, x = _acc(grad_out), _acc(input)
    norm = 1.0 / count.sum().to(mean.dtype)
    mean_dy, mean_dy_xmu = sum_dy * norm, sum_dy_xmu * norm
    scale = invstd if weight is None else invstd * weight.to(mean.dtype)
    grad = (dy - _per_channel(mean_dy, x) - (x - _per_channel(mean, x)) * _per_channel(invstd.square() * mean_dy_xmu, x)) \
        * _per_channel(scale, x)
    return grad.to(input.dtype).contiguous(memory_format=suggest_memory_format(input))


_SYNC_BATCH_NORM = {
    "batch_norm_stats": _batch_norm_stats,
    "batch_norm_gather_stats_with_counts": _batch_norm_gather_stats_with_counts,
    "batch_norm_elemt": _batch_norm_elemt,
    "batch_norm_backward_reduce": _batch_norm_backward_reduce,
    "batch_norm_backward_elemt": _batch_norm_backward_elemt,
}


# aten ops a node runs with a kernel of its own: CPU kernels that refuse what CUDA's accept
# (which programs written for CUDA use), results a node cannot store as they are
CPU_NODE_KERNELS = {
    **{f"aten::{name}": (lambda name=name, kernel=kernel: _NodeKernel(getattr(torch.ops.aten, name).default, kernel))
       for name, kernel in _SYNC_BATCH_NORM.items()},
    **{f"aten::{name}.{overload}": (lambda name=name, overload=overload: _NodeKernel(
        getattr(getattr(torch.ops.aten, name), overload),
        _modulo_by_zero_like_cuda(getattr(getattr(torch.ops.aten, name), overload))))
       for name, overloads in (("fmod", ("Tensor", "Scalar", "Tensor_out", "Scalar_out")),
                               ("fmod_", ("Tensor", "Scalar")),
                               ("remainder", ("Tensor", "Scalar", "Tensor_out", "Scalar_out")),
                               ("remainder_", ("Tensor", "Scalar")))
       for overload in overloads},
    **_each_overload(("lu_unpack",), _pivots_checked),
    **_each_overload(BATCHED_LU_OPS, _on_one_thread),

    "aten::histc": lambda: _NodeKernel(torch.ops.aten.histc.default, _histc_like_cuda),
    "aten::histc.out": lambda: _NodeKernel(torch.ops.aten.histc.out, _histc_like_cuda),
    "aten::_efficientzerotensor": lambda: _NodeKernel(torch.ops.aten._efficientzerotensor.default,
                                                         _zeros_for_zero_tensor),
}


def _group_norm_contiguous(input, weight, bias, n, c, hxw, group, eps):
    """CUDA's group norm takes a contiguous input only (``native_group_norm`` checks it). A CUDA
    program's ``group_norm`` makes its input contiguous before the call; a PrivateUse1 device's
    keeps the suggested (channels-last) layout, as on CPU, and the node refused the op."""
    return torch.ops.aten.native_group_norm.default(input.contiguous(), weight, bias, n, c, hxw, group, eps)


def _group_norm_backward_contiguous(grad_out, input, mean, rstd, weight, n, c, hxw, group, output_mask):
    return torch.ops.aten.native_group_norm_backward.default(grad_out.contiguous(), input.contiguous(), mean, rstd,
                                                             weight, n, c, hxw, group, output_mask)


# Batch norm in training, as a CUDA program runs it: ``_batch_norm_impl_index`` picks cuDNN's
# kernels for CUDA tensors and ``native_batch_norm`` for a PrivateUse1 device's, and the two round
# differently (an H200's channels-last CNN: gradients 1e-8 off a local run's). A CUDA node runs
# cuDNN's where CUDA's composite would, and keeps each forward's reserve space for its backward,
# found by the saved mean the backward is handed (held, so its address cannot be reused while
# kept); a backward whose forward is not kept runs the native kernel, as before.
_CUDNN_BN_RESERVES: dict = {}  # data_ptr of save_mean -> (save_mean, reserve), oldest first
_CUDNN_BN_KEPT = 4096
_CUDNN_BN_MIN_EPS = 1e-5  # CUDNN_BN_MIN_EPSILON


def _cudnn_takes_batch_norm(input, weight, bias, running_mean, running_var, training, eps) -> bool:
    """``_batch_norm_impl_index``'s test for cuDNN in training, for the dtypes it is sure of."""
    return (training and torch.backends.cudnn.enabled and input.dim() >= 3 and 0 < input.numel() < 2 ** 31 - 1
            and input.size(0) <= 880801 and eps >= _CUDNN_BN_MIN_EPS
            and isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
            and weight.dtype == torch.float32 and input.dtype in (torch.float32, torch.float16)
            and (isinstance(running_mean, torch.Tensor) == isinstance(running_var, torch.Tensor)))


def _batch_norm_as_cuda(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if _cudnn_takes_batch_norm(input, weight, bias, running_mean, running_var, training, eps):
        try:
            out, save_mean, save_invstd, reserve = torch.ops.aten.cudnn_batch_norm.default(
                input, weight, bias, running_mean, running_var, training, momentum, eps)
        except RuntimeError:  # (not a CUDA build, a cuDNN that refuses the call): the native kernel
            pass
        else:
            _CUDNN_BN_RESERVES[save_mean.data_ptr()] = (save_mean, reserve)
            while len(_CUDNN_BN_RESERVES) > _CUDNN_BN_KEPT:
                del _CUDNN_BN_RESERVES[next(iter(_CUDNN_BN_RESERVES))]
            return out, save_mean, save_invstd
    return torch.ops.aten.native_batch_norm.default(input, weight, bias, running_mean, running_var, training,
                                                    momentum, eps)


def _batch_norm_backward_as_cuda(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                                 eps, output_mask):
    kept = _CUDNN_BN_RESERVES.get(save_mean.data_ptr()) if isinstance(save_mean, torch.Tensor) else None
    if kept is not None and train and list(output_mask) == [True, True, True] and isinstance(weight, torch.Tensor):
        from torch._prims_common import suggest_memory_format
        # (as CUDA's autograd formula hands cuDNN the gradient: in the input's memory format)
        grad = grad_out.contiguous(memory_format=suggest_memory_format(input))
        return torch.ops.aten.cudnn_batch_norm_backward.default(input, grad, weight, running_mean, running_var,
                                                                save_mean, save_invstd, eps, kept[1])
    return torch.ops.aten.native_batch_norm_backward.default(grad_out, input, weight, running_mean, running_var,
                                                             save_mean, save_invstd, train, eps, output_mask)


# aten ops a CUDA node runs with a kernel of its own: calls that a PrivateUse1 device's composite
# kernels make otherwise than CUDA's
CUDA_NODE_KERNELS = {
    "aten::native_batch_norm": lambda: _NodeKernel(torch.ops.aten.native_batch_norm.default, _batch_norm_as_cuda),
    "aten::native_batch_norm_backward": lambda: _NodeKernel(torch.ops.aten.native_batch_norm_backward.default,
                                                            _batch_norm_backward_as_cuda),
    "aten::native_group_norm": lambda: _NodeKernel(torch.ops.aten.native_group_norm.default,
                                                   _group_norm_contiguous),
    "aten::native_group_norm_backward": lambda: _NodeKernel(torch.ops.aten.native_group_norm_backward.default,
                                                            _group_norm_backward_contiguous),
    "aten::_efficientzerotensor": CPU_NODE_KERNELS["aten::_efficientzerotensor"],
    "aten::lu_unpack": CPU_NODE_KERNELS["aten::lu_unpack"],  # (a read past the pivots: a device fault)
    "aten::lu_unpack.out": CPU_NODE_KERNELS["aten::lu_unpack.out"],
}


# A CPU kernel's refusal of a half-precision dtype that CUDA's kernel takes (avg_pool3d, the
# antialiased upsampling, FFTs, rrelu ... in float16/bfloat16: what a CUDA program under AMP runs)
LOW_PRECISION_REFUSED = re.compile(r"not implemented for '(Half|BFloat16|ComplexHalf)'|Unsupported dtype (Half|BFloat16)")
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
_WRITTEN: dict = {}


def run_upcast(fn, args, kwargs):
    """Run ``fn`` with its half-precision tensors in float32 (complex32 in complex64), the way
    CUDA's half kernels compute internally; written arguments get the values back in their own
    dtype, fresh float32/complex64 results are given in the inputs' precision (and the node's
    ``_adopt`` stores them in the dtype the client declared)."""
    written = _WRITTEN.get(fn)
    if written is None:
        schema = getattr(fn, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        written = _WRITTEN[fn] = frozenset(
            key for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
            for key in (i, a.name))
    copies = []  # (original, its float32 copy) of written arguments
    low = []  # the half-precision dtypes met

    def up(value, is_written):
        if type(value) is torch.Tensor and value.dtype in _UPCAST:
            low.append(value.dtype)
            copy = value.to(_UPCAST[value.dtype])
            if is_written:
                copies.append((value, copy))
            return copy
        if type(value) is list:
            return [up(v, is_written) for v in value]
        return value

    result = fn(*[up(a, i in written) for i, a in enumerate(args)],
                **{k: up(v, k in written) for k, v in kwargs.items()})
    originals = {}
    for original, copy in copies:
        original.copy_(copy)
        originals[id(copy)] = original

    # fresh results in the precision CUDA's kernel gives them: that of the inputs
    half = torch.bfloat16 if low and all(d is torch.bfloat16 for d in low) else torch.float16
    downcast = {torch.float32: half, torch.complex64: torch.complex32 if half is torch.float16 else torch.complex64}

    def back(value):
        if type(value) is torch.Tensor:
            original = originals.get(id(value))
            if original is not None:
                return original
            return value.to(downcast[value.dtype]) if value.dtype in downcast else value
        if type(value) in (tuple, list):
            return type(value)(back(v) for v in value)
        return value
    return back(result)


def _assert_nonzero(condition, assert_msg=None):
    """``torch._assert_async`` (``torch._check`` in exported programs, jagged nested tensors):
    on a CUDA device a failed one is a device-side assert, which ends every session's use of
    the GPU, so the node checks the value itself (a sync of this session's stream) and raises
    the CPU kernel's error, which the client gets at its next sync point as a GPU's would."""
    if not torch.is_nonzero(condition):  # (raises "Boolean value of Tensor with no values is ambiguous" ...)
        raise RuntimeError(assert_msg or ("Assertion is failed" if assert_msg is not None
                                          else "Expected Tensor with single nonzero value, but got zero"))


SESSION_OPS = frozenset({"gpuwire::sdpa_keep", "gpuwire::sdpa_backward_kept", "gpuwire::precision"})
GPUWIRE_OPS = {
    "gpuwire::sdpa": _sdpa,
    "gpuwire::sdpa_backward": _sdpa_backward,
    "gpuwire::sdpa_keep": _sdpa_keep,
    "gpuwire::sdpa_backward_kept": _sdpa_backward_kept,
    "gpuwire::dropout": _dropout,
    "gpuwire::precision": _precision,
    "aten::_assert_async": _assert_nonzero,
    "aten::_assert_async.msg": _assert_nonzero,
    **COMPOSITE_OPS,
}


def _with_guards(kernels: dict) -> dict:
    """``kernels`` plus every overload of the ops ``guards.GUARDS`` checks, each checked before
    its kernel (the node's own where it has one)."""
    table = dict(kernels)
    for name, check in GUARDS.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:  # (an op of another torch version)
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            qualified = f"aten::{name}" if overload == "default" else f"aten::{name}.{overload}"
            own = table.get(qualified)
            table[qualified] = lambda op=op, own=own, check=check: _NodeKernel(
                op, guarded(op, check, own()._kernel if own is not None else op))
    return table


CPU_NODE_KERNELS = _with_guards(CPU_NODE_KERNELS)
CUDA_NODE_KERNELS = _with_guards(CUDA_NODE_KERNELS)


class OpTable:
    """Resolves op names to callables, with a cache (one dict lookup on the hot path)."""

    def __init__(self, backend_kind: str = "cpu"):
        self._cache: dict[str, object] = {}
        self._own_kernels = CUDA_NODE_KERNELS if backend_kind == "cuda" else CPU_NODE_KERNELS
        self._backend_kind = backend_kind
        self._signature_checks: dict = {}  # op name -> ``signature_check``'s answer

    def resolve(self, name: str):
        fn = self._cache.get(name)
        if fn is None:
            fn = self._cache[name] = _resolve(name, self._own_kernels)
        return fn

    def signature_check(self, name: str, fn):
        """What to check of op ``name``'s arguments on the Python path, which the native loop
        follows per signature (``guards.CHECKED_PER_SIGNATURE``), or None. A check raises, or
        returns None, or a kernel to run instead, on every call of that signature (the loop
        never learns it)."""
        try:
            return self._signature_checks[name]
        except KeyError:
            check = _truncated_division_chooser(fn) if self._backend_kind == "cpu" and name in TRUNCATED_DIVISIONS \
                else signature_check(name, fn)
            self._signature_checks[name] = check
            return check


def _resolve(name: str, own_kernels: dict):
    if name in GPUWIRE_OPS:
        return GPUWIRE_OPS[name]
    if name in own_kernels:
        return own_kernels[name]()
    namespace, sep, qualified = name.partition("::")
    if not sep or namespace != "aten":
        raise OpRefused(f"op {name!r} is refused: a gpuwire node runs only ops of the aten namespace")
    packet_name, _, overload = qualified.partition(".")
    if qualified in DENIED_ATEN or packet_name in DENIED_ATEN or packet_name.startswith(DENIED_ATEN_PREFIXES):
        raise OpRefused(f"op {name!r} is refused: it has host side effects or raw memory access")
    if not packet_name.isidentifier() or (overload and not overload.isidentifier()):
        raise OpRefused(f"op name {name!r} is malformed")
    try:
        packet = getattr(torch.ops.aten, packet_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        raise OpRefused(f"op {name!r} does not exist in this node's torch {torch.__version__}") from None
