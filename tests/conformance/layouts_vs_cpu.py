#!/usr/bin/env python
"""Which aten calls get another output layout from their meta kernel than from the real CPU kernel?

``meta_vs_cpu.py`` compares meta kernels with *fake* CPU tensors, which run the same meta
kernels for most ops and so cannot see a CPU kernel that restrides its result (channels-last
pads, pixel shuffle, batch norm at batch 1 ...). This script runs layers forward and backward on
real CPU tensors in channels-last layouts (batch 2 and batch 1), records every aten call, reruns
each on meta tensors and prints the calls whose output strides differ. A call listed here gets a
wrong layout on a CPU node unless ``gpuwire.client.device._CPU_KERNEL_FIXES`` (or
``_PRESERVE_LAYOUT``) corrects it; tests/client/test_memory_formats.py checks the corrected ones
end to end. Rerun it after a PyTorch upgrade::

    python tests/conformance/layouts_vs_cpu.py
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

warnings.filterwarnings("ignore")


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _volume(layer):
    """``layer`` applied to a 5-D channels-last-3d copy of its 4-D input."""
    def apply(x):
        return layer(x.unsqueeze(2).expand(-1, -1, 3, -1, -1).contiguous(memory_format=torch.channels_last_3d))
    return apply


LAYERS = {
    "reflection pad": nn.ReflectionPad2d((1, 2, 1, 2)), "replication pad": nn.ReplicationPad2d(1),
    "zero pad": nn.ZeroPad2d(1), "circular pad": lambda x: F.pad(x, (1, 1, 1, 1), mode="circular"),
    "pixel shuffle": nn.PixelShuffle(2), "pixel unshuffle": nn.PixelUnshuffle(2), "channel shuffle": nn.ChannelShuffle(2),
    "nearest upsample": nn.Upsample(scale_factor=2), "bilinear upsample": nn.Upsample(scale_factor=2, mode="bilinear"),
    "max pool": nn.MaxPool2d(2), "avg pool": nn.AvgPool2d(2), "adaptive avg pool": nn.AdaptiveAvgPool2d(3),
    "adaptive max pool": nn.AdaptiveMaxPool2d(3), "max unpool": lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2),
    "group norm": nn.GroupNorm(2, 4), "batch norm": nn.BatchNorm2d(4), "instance norm": nn.InstanceNorm2d(4, affine=True),
    "convolution": nn.Conv2d(4, 4, 3, padding=1), "transposed convolution": nn.ConvTranspose2d(4, 4, 3, stride=2),
    "roll": lambda x: torch.roll(x, (1, 2), (2, 3)), "flip": lambda x: torch.flip(x, (3,)),
    "glu": lambda x: F.glu(x, 1), "log sigmoid": F.logsigmoid, "hardtanh": F.hardtanh, "number operand": lambda x: x * 2.0,
    "mse loss": lambda x: F.mse_loss(x, torch.zeros(x.shape)), "smooth l1 loss": lambda x: F.smooth_l1_loss(x, torch.zeros(x.shape)),
    "cross entropy 2d": lambda x: F.cross_entropy(x, torch.zeros(x.shape[0], 6, 6, dtype=torch.long)),
    "reflection pad 3d": _volume(lambda v: F.pad(v, (1,) * 6, mode="reflect")),
    "replication pad 3d": _volume(lambda v: F.pad(v, (1,) * 6, mode="replicate")),
    "max pool 3d": _volume(lambda v: F.max_pool3d(v, 2)),
}


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return torch.device("meta") if isinstance(x, torch.device) else x


def main() -> None:
    differing = {}
    for batch in (2, 1):
        for name, layer in LAYERS.items():
            torch.manual_seed(0)
            x = torch.randn(batch, 4, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
            if isinstance(layer, nn.Module):
                layer = layer.to(memory_format=torch.channels_last)
            with Recorder() as recorder:
                y = layer(x)
                y.backward(torch.ones_like(y))
            for func, args, kwargs, out in recorder.calls:
                real = [o.stride() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.numel() > 1]
                try:
                    meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
                except Exception:  # noqa: BLE001 - no meta kernel: the client asks the node
                    continue
                meta = [o.stride() for o in tree_flatten(meta_out)[0] if isinstance(o, torch.Tensor) and o.numel() > 1]
                if real != meta:
                    differing.setdefault(str(func), (batch, name, real, meta))
    for func, (batch, name, real, meta) in sorted(differing.items()):
        print(f"{func}: batch {batch}, {name}: CPU {real}, meta {meta}")
    print(f"{len(differing)} aten calls whose meta layout differs from the CPU kernel's")


if __name__ == "__main__":
    main()
