"""Meta kernels for aten ops that PyTorch ships without one: CUDA-only ops a program written for
CUDA calls on the device, whose output shapes the client must still infer (``device.py``'s plans
run the meta kernel) instead of asking the node with a round trip per call.

Registered once by ``device.register`` (only where torch has no Meta kernel of its own). The
node computes these ops for real: on CUDA with CUDA's kernels, on a CPU node with
``node/ops.py``'s.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch._compile
from torch._prims_common import suggest_memory_format


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _channels(input) -> int:
    if input.dim() < 2:
        raise RuntimeError(f"expected an input of at least 2 dimensions (batch, channels, ...), got {input.dim()}")
    return input.shape[1]


def _like(input):
    return torch.empty_like(input, memory_format=suggest_memory_format(input))


# nn.SyncBatchNorm's five ops (CUDA's shapes and dtypes: statistics in the accumulation dtype)
def batch_norm_stats(input, eps):
    stats = input.new_empty((_channels(input),), dtype=_accumulation(input.dtype))
    return stats, torch.empty_like(stats)


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    stats = mean.new_empty((mean.shape[-1],))
    return stats, torch.empty_like(stats)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    return _like(input)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    channels = _channels(input)
    sums = mean.new_empty((channels,))
    grads = (weight if weight is not None else mean).new_empty((channels,))
    return sums, torch.empty_like(sums), grads, torch.empty_like(grads)


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    return _like(input)


KERNELS = {
    "batch_norm_stats": batch_norm_stats,
    "batch_norm_gather_stats_with_counts": batch_norm_gather_stats_with_counts,
    "batch_norm_elemt": batch_norm_elemt,
    "batch_norm_backward_reduce": batch_norm_backward_reduce,
    "batch_norm_backward_elemt": batch_norm_backward_elemt,
}


def register(aten_library) -> None:
    for name, kernel in KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            aten_library.impl(name, kernel, "Meta")


# ---------------------------------------------------------------- the first op's 1.5-2.6 s

_dynamo_deferred = False


class _DisableOnceDynamoIsLoaded:
    """What ``torch._compile._disable_dynamo`` caches on a function (``fn.__dynamo_disable``) to
    call in its place: ``torch._dynamo.disable(fn)`` once dynamo is imported, ``fn`` itself until
    then. The first call of such a function imports dynamo to build that wrapper (1.5-2.6 s on
    this VM); PyTorch's Python meta kernels (``torch._refs``, behind ``out_wrapper``) are such
    functions, so the first op a process sent to gpuwire paid it, where a local CPU op runs no
    meta kernel. Without dynamo imported no frame is being compiled, and disabling it changes
    nothing: the plain call is what the wrapper would do."""

    __slots__ = ("fn", "recursive")

    def __init__(self, fn, recursive: bool):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or not hasattr(dynamo, "disable"):
            return self.fn(*args, **kwargs)
        disabled = dynamo.disable(self.fn, self.recursive, wrapping=False)
        self.fn.__dynamo_disable = disabled  # (torch's own cache from now on)
        return disabled(*args, **kwargs)


# Only the meta kernels' functions: others (``Optimizer.zero_grad``, ``torch.utils.checkpoint``,
# DDP) may be called from a program's compiled code, where dynamo must meet its own wrapper, and
# a local run imports dynamo for them anyway
_META_KERNEL_MODULES = ("torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations")


def defer_dynamo_import() -> None:
    """Before the client's first meta kernel runs (once a process): give every meta-kernel function
    wrapped by ``_disable_dynamo`` that has not run yet a ``_DisableOnceDynamoIsLoaded``. Found by their code
    object among live functions (~0.1 s once). The first ``x + 1`` of a process: 1.94 s -> 0.44 s."""
    global _dynamo_deferred
    if _dynamo_deferred:
        return
    _dynamo_deferred = True
    if "torch._dynamo" in sys.modules:
        return
    disable = getattr(torch._compile, "_disable_dynamo", None)
    if disable is None:
        return
    code = disable(lambda: None).__code__
    function = type(defer_dynamo_import)
    for obj in gc.get_objects():
        if type(obj) is function and obj.__code__ is code and obj.__closure__:
            # (the closure's ``fn``: ``__wrapped__`` is not always it, as ``functools.wraps``
            # copies the wrapped function's own ``__dict__``, ``__wrapped__`` included)
            cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in obj.__closure__)))
            fn = cells.get("fn")
            if fn is not None and getattr(fn, "__dynamo_disable", None) is None and \
                    (getattr(fn, "__module__", None) or "").startswith(_META_KERNEL_MODULES):
                fn.__dynamo_disable = _DisableOnceDynamoIsLoaded(fn, cells.get("recursive", True))
