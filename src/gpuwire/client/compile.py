"""``torch.compile`` on the gpuwire device: the captured graph runs op by op.

Sits beside ``client.device``. Dynamo traces a program on gpuwire tensors as on any device,
but inductor (the default backend) has no gpuwire code generator: it fails deep inside with
an internal assert. When a graph's inputs (parameters included) are gpuwire tensors, the
default backend hands the graph back to be run as it is, like ``backend="eager"``: the program
keeps ``torch.compile``'s behaviour (``OptimizedModule``, ``_orig_mod``, its state-dict keys,
guards and graph breaks) and its ops reach the node as they would without compiling. Graphs
on other devices still go to inductor. Said once on stderr. Nothing is imported from inductor
until a graph is compiled: ``import gpuwire`` stays cheap.

gpuwire's own code is on dynamo's skip list from the first ``torch.compile``: its kernels run
when PyTorch calls them, inside a compiled program's eager parts too, and dynamo's frame hook
would otherwise try to compile each of their frames (the msgpack encoder's hook among them,
where dynamo's reset of global flags made an op mid-encoding: the stream broke, session 21).
"""

from __future__ import annotations

import functools
import sys

import torch

from .wire import on_device

_noted = False
_skipping = False


def _on_gpuwire(graph_module, example_inputs) -> bool:
    if any(isinstance(value, torch.Tensor) and on_device(value) for value in example_inputs):
        return True
    return any(on_device(t) for t in (*graph_module.parameters(), *graph_module.buffers()))


def _note() -> None:
    global _noted
    if not _noted:
        _noted = True
        print("gpuwire: torch.compile runs its graphs op by op on the gpuwire device (inductor has no gpuwire "
              "code generator; ops are already batched into few messages)", file=sys.stderr)


def skip_in_dynamo() -> None:
    """Put gpuwire's package on dynamo's skip list (once; dynamo is imported by then)."""
    global _skipping
    if _skipping:
        return
    _skipping = True
    try:
        from torch._dynamo import trace_rules
        trace_rules.add(__name__.split(".")[0])
    except (ImportError, AttributeError):  # (a torch without this API: frames are traced as before)
        pass


def register() -> None:
    """Divert the default (inductor) backend for graphs on the gpuwire device and keep dynamo
    out of gpuwire's frames (idempotent)."""
    if "torch._dynamo" in sys.modules:
        skip_in_dynamo()
    compile_ = torch.compile
    if not getattr(compile_, "_gpuwire", False):
        @functools.wraps(compile_)
        def compile_and_skip(*args, **kwargs):
            skip_in_dynamo()
            return compile_(*args, **kwargs)
        compile_and_skip._gpuwire = True
        torch.compile = compile_and_skip
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "_gpuwire", False):
        return
    inductor = wrapper.__call__

    def call(self, model_, inputs_, **kwargs):
        skip_in_dynamo()
        if _on_gpuwire(model_, inputs_):
            _note()
            return model_.forward
        return inductor(self, model_, inputs_, **kwargs)

    call._gpuwire = True
    wrapper.__call__ = call
