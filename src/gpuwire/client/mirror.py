"""Host copies of small integer and boolean device tensors whose values the client knows.

Sits in the client between the device's op paths (``client/device.py``) and the runtime's
mirror table (``Runtime.mirror``: storage id -> a CPU storage with the same bytes). Nothing
here crosses the wire: it lets a data-dependent read (``bool(t)``, ``t.item()``, ``t.tolist()``,
``t.cpu()``) of a tensor computed from host data be answered without a round trip.

Why: every transformers model that gets an ``attention_mask`` runs ``padding_mask.all()`` and
branches on it (to drop an all-ones mask and take the fused attention kernel), a second round
trip in each training step besides reading the loss; at 10 ms of network latency that is
10 ms a step. The mask was uploaded from the host a few ops earlier, so its values are known.

What is mirrored: a storage filled whole by an upload of integer/boolean host data, or by an
op of ``OPS`` (exact on every device: comparisons, ``all``/``any``, logical ops, integer
sums, dtype copies between integer/boolean types) whose every tensor argument is mirrored; at
most ``MAX_BYTES`` a storage, ``MAX_ENTRIES`` in all. The mirrored op still runs on the node.

Why it stays true: the runtime empties the table whenever it queues a command that may write
into an existing storage (``Runtime.submit``: in-place, out=, resizes; ``call_sync``), and
drops a storage's entry when bytes are written into it (``Runtime.write``) or a device copy
writes into it; only ops that write nothing but their declared fresh outputs (and those
copies) are queued with ``submit_fresh``. Storage ids
are never reused within a session, so an entry cannot outlive its storage's identity.
"""

from __future__ import annotations

import os

import torch

from . import wire

# GPUWIRE_KNOWN_VALUES=0 turns it off: every read is a round trip (the conformance tests read
# what the node computed, not the client's copy)
ENABLED = os.environ.get("GPUWIRE_KNOWN_VALUES", "1") not in ("0", "")
MAX_BYTES = 64 << 10
MAX_ENTRIES = 256

_EXACT = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

# results exact on every device for integer/boolean arguments
OPS = frozenset({
    "aten::eq.Scalar", "aten::ne.Scalar", "aten::lt.Scalar", "aten::le.Scalar", "aten::gt.Scalar",
    "aten::ge.Scalar", "aten::eq.Tensor", "aten::ne.Tensor", "aten::lt.Tensor", "aten::le.Tensor",
    "aten::gt.Tensor", "aten::ge.Tensor", "aten::all", "aten::all.dim", "aten::all.dims", "aten::any",
    "aten::any.dim", "aten::any.dims", "aten::logical_not", "aten::logical_and", "aten::logical_or",
    "aten::logical_xor", "aten::bitwise_not", "aten::sum", "aten::sum.dim_IntList",
})


def host_view(rt, t: torch.Tensor) -> torch.Tensor | None:
    """A CPU tensor with the values of device tensor ``t``, or None when they are not known."""
    storage = rt.mirror.get(t.untyped_storage().data_ptr())
    if storage is None or t.is_conj() or t.is_neg():
        return None
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def remember(rt, t: torch.Tensor, values: torch.Tensor) -> None:
    """Record ``values`` (a CPU tensor, converted as ``copy_`` converts) as the contents of
    device tensor ``t``, when ``t`` fills its whole storage and both dtypes are exact."""
    if (not ENABLED or t.dtype not in _EXACT or values.dtype not in _EXACT or t.storage_offset() or not t.is_contiguous()
            or t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.numel() * t.element_size() > MAX_BYTES):
        return
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    host.copy_(values)
    mirror = rt.mirror
    if len(mirror) >= MAX_ENTRIES:
        mirror.clear()
    mirror[t.untyped_storage().data_ptr()] = host.untyped_storage()


def propagate(rt, op, args, kwargs, result: torch.Tensor) -> None:
    """After a functional op of ``OPS`` was queued: when every device tensor among its
    arguments is mirrored, run it on the host copies and mirror ``result`` too."""
    host_args = []
    for value in args:
        if isinstance(value, torch.Tensor) and wire.on_device(value):
            value = host_view(rt, value)
            if value is None:
                return
        host_args.append(value)
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and wire.on_device(value):
            return
    try:
        values = op(*host_args, **kwargs)
    except Exception:  # noqa: BLE001 - the node's run decides; nothing is mirrored
        return
    if isinstance(values, torch.Tensor) and values.shape == result.shape and values.dtype == result.dtype:
        remember(rt, result, values)
