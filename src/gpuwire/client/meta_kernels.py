"""Meta kernels for aten ops that PyTorch ships without one: CUDA-only ops a program written for
CUDA calls on the device, whose output shapes the client must still infer (``device.py``'s plans
run the meta kernel) instead of asking the node with a round trip per call.

Registered once by ``device.register`` (only where torch has no Meta kernel of its own). The
node computes these ops for real: on CUDA with CUDA's kernels, on a CPU node with
``node/ops.py``'s.
"""

from __future__ import annotations

import torch
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
