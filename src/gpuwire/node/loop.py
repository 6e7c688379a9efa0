"""gpuwire's native op loop (``loop.cpp``): an Op frame run from its bytes, no Python between.

Sits between the node's connection (``protocol/connection.py`` offers it each Op frame's header
bytes before decoding them: ``Connection.bind(op_runner=...)``) and ``node/session.py``, whose
Python path stays the reference for everything. What crosses the boundary: a frame's bytes in;
out, either the event ``session.RanOp`` (the op ran, its results are stored under the client's
ids, or its failure is the session's pending error, exactly as ``Session.handle`` leaves them)
or None, with nothing done, and the frame is decoded and handled by Python as before.

The connection offers it the receive buffer too (``Connection.bind(op_frames_runner=...)``):
``Loop.run_frames`` runs the Op frames that follow one another there in one call, and the
session loop gets one ``RanOp`` for them (a client sends its queue in one write; a RanOp and a
pass of the session loop per frame were ~1 us of Python each).

The loop runs an op only for an argument signature (shapes, strides, dtypes and every other
value, by position in the op's schema) that the Python path has already run without error,
and only while the memory the Python guard measured for it then still fits: the allocation
guard's decisions stay Python's, measured once per signature, as its meta-cost cache already
did. Ops with random numbers, out= arguments, session state or value-dependent sizes never run
here (``session._loop_eligible``). Arguments become the dispatcher's IValues by the schema and
the kernel is called boxed with the GIL released, as ``OpOverload.__call__`` calls it.

Why: on a node, the Python between kernels (decoding, ``Session.handle``, the op's Python
binding) was ~28 us of every ~130 us event of a GPT-2 tiny step (``python -m bench.node_replay``),
and it is what a tiny model's step ratio and a GPU node's per-op cost are made of.

Built like the other helpers (``gpuwire/_native.py``; against torch's dispatcher headers: ~20 s
once per machine); ``GPUWIRE_NATIVE=0`` or ``GPUWIRE_NODE_LOOP=0`` keeps the Python path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import _native

SOURCE = Path(__file__).with_name("loop.cpp")
MODULE = "gpuwire_node_loop"
module = None  # the loaded extension, once installed
_failure: str | None = None


def status() -> str:
    """'native', or why the Python path runs every op."""
    return _native.status(module, _failure)


def wanted() -> bool:
    return os.environ.get("GPUWIRE_NODE_LOOP", "1") not in ("0", "")


def build_in_background():
    """Start this helper's build while the node's other helper builds (``node/native.py``)."""
    return _native.build_in_background(SOURCE, MODULE) if wanted() else None


def install() -> bool:
    """Build (if needed), load and configure the loop; False, with the reason kept for
    ``status()``, where the Python path stays. Idempotent."""
    global module, _failure
    if module is not None:
        return True
    if not wanted():
        _failure = "GPUWIRE_NODE_LOOP=0"
        return False
    from ..protocol import codec
    from . import native, ops, session

    def setup(loaded) -> None:
        if native.module is None:
            raise RuntimeError("the node's native helpers are not installed")
        loaded.configure(session.RanOp, ops.APPLIED_PRECISION, native.dtype_table(native.module.scalar_type),
                         (codec.EXT_TENSOR, codec.EXT_DTYPE, codec.EXT_DEVICE, codec.EXT_MEMORY_FORMAT, codec.EXT_LAYOUT),
                         session.LAYOUTS.index(torch.strided))

    module, _failure = _native.install(SOURCE, MODULE, setup)
    return module is not None
