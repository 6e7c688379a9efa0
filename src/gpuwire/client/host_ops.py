"""Ops outside aten on gpuwire tensors: run on this machine's CPU, tensors copied there and back.

Sits beside ``client.device``'s plans: ``device._make_plan`` hands this module every op whose
namespace a node does not run (a node runs aten and gpuwire's own ops only: it imports no
third-party code, and extension kernels would be arbitrary code on a shared GPU). Libraries bring
such ops with CPU and CUDA kernels in C++ — ``torchvision::nms`` / ``roi_align`` in detection
models, ``torch_scatter``, a program's own ``torch.library`` ops — and on CUDA they just run;
here they ran into the node's refusal. Now each call reads its device tensors (one round trip),
runs the op's CPU kernel locally, writes back the arguments it mutates and uploads its results:
correct and slower, said once per op on stderr.

What crosses the boundary: the op's arguments in, gpuwire tensors out; nothing new on the wire.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_map

from . import wire

# namespaces a node runs itself; every other op on a gpuwire tensor takes a HostPlan
NODE_NAMESPACES = frozenset({"aten", "gpuwire"})

_announced: set = set()


def runs_on_node(op) -> bool:
    return op._schema.name.partition("::")[0] in NODE_NAMESPACES


class HostPlan:
    """One op outside aten: its CPU kernel on host copies of its arguments."""

    def __init__(self, op):
        schema = op._schema
        self.name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        self.written = [(i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write]
        # a result aliasing an argument it wrote is that argument (in place, out=); a view of an
        # input cannot be made from a host copy
        # why it cannot run here, decided once (raised at each call, with the call's stack)
        self.refusal = None
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            self.refusal = (f"{self.name} returns a view of its input, which gpuwire cannot make for an op "
                            f"outside aten (a node runs aten ops only, and a host copy is not a view); move its "
                            f"input to the CPU first, e.g. x.cpu()")
        elif not any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
                     for key in ("CPU", "CompositeExplicitAutograd")):
            self.refusal = (f"{self.name} has no CPU kernel here to run it with, and a gpuwire node runs aten ops "
                            f"only; run it on CPU tensors (x.cpu()) and move the result back")

    def __call__(self, op, args, kwargs):
        if self.refusal is not None:
            raise NotImplementedError(self.refusal)
        if self.name not in _announced:
            _announced.add(self.name)
            print(f"gpuwire: {self.name} is not an aten op, which a node does not run: it runs on this "
                  f"machine's CPU, its tensors copied there and back (correct, slower)", file=sys.stderr)
        device = None
        originals = {}

        def to_host(value):
            nonlocal device
            if isinstance(value, torch.Tensor) and wire.on_device(value):
                # (not ``value.device``: under CUDA compatibility it says "cuda")
                device = device or torch.device(wire.DEVICE_TYPE, value.get_device())
                host = value.cpu()
                originals[id(host)] = value
                return host
            if isinstance(value, torch.device) and value.type == wire.DEVICE_TYPE:
                return torch.device("cpu")
            return value

        host_args, host_kwargs = tree_map(to_host, (tuple(args), dict(kwargs)))
        result = op(*host_args, **host_kwargs)
        for index, name, kwarg_only in self.written:  # the op wrote host copies: write them back
            host = host_args[index] if not kwarg_only and index < len(host_args) else host_kwargs.get(name)
            for item in host if isinstance(host, (list, tuple)) else (host,):
                original = originals.get(id(item))
                if original is not None:
                    original.copy_(item)

        def to_device(value):
            if isinstance(value, torch.Tensor):
                original = originals.get(id(value))
                if original is not None:
                    return original  # an argument returned (in place / out=)
                return value.to(device) if device is not None else value
            return value

        return tree_map(to_device, result)
