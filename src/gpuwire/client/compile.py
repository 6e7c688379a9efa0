"""``torch.compile`` on the gpuwire device: the captured graph runs op by op.

Sits beside ``client.device``. Dynamo traces a program on gpuwire tensors as on any device,
but inductor (the default backend) has no gpuwire code generator: it fails deep inside with
an internal assert. When a graph's inputs (parameters included) are gpuwire tensors, the
default backend hands the graph back to be run as it is, like ``backend="eager"``: the program
keeps ``torch.compile``'s behaviour (``OptimizedModule``, ``_orig_mod``, its state-dict keys,
guards and graph breaks) and its ops reach the node as they would without compiling. Graphs
on other devices still go to inductor. Said once on stderr. Nothing is imported from inductor
until a graph is compiled: ``import gpuwire`` stays cheap.
"""

from __future__ import annotations

import sys

import torch

from .wire import on_device

_noted = False


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


def register() -> None:
    """Divert the default (inductor) backend for graphs on the gpuwire device (idempotent)."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "_gpuwire", False):
        return
    inductor = wrapper.__call__

    def call(self, model_, inputs_, **kwargs):
        if _on_gpuwire(model_, inputs_):
            _note()
            return model_.forward
        return inductor(self, model_, inputs_, **kwargs)

    call._gpuwire = True
    wrapper.__call__ = call
