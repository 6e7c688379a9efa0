"""Host copies of small integer and boolean device tensors whose values the client knows.

Sits in the client between the device's op paths (``client/device.py``) and the runtime's
mirror table (``Runtime.mirror``: storage id -> a CPU storage with the same bytes). Nothing
here crosses the wire: it lets a data-dependent read (``bool(t)``, ``t.item()``, ``t.tolist()``,
``t.cpu()``) of a tensor computed from host data be answered without a round trip.

Why: every transformers model that gets an ``attention_mask`` runs ``padding_mask.all()`` and
branches on it (to drop an all-ones mask and take the fused attention kernel), a second round
trip in each training step besides reading the loss; at 10 ms of network latency that is
10 ms a step. The mask was uploaded from the host a few ops earlier, so its values are known.

What is mirrored: a storage filled whole by an upload of integer/boolean host data, by an op
of ``OPS`` (exact on every device: comparisons, ``all``/``any``, logical ops, NaN/inf tests,
integer sums, dtype copies between integer/boolean types) whose every tensor argument is
mirrored, or by what a read brought back from the node (exact bytes, any dtype); at most
``MAX_BYTES`` a storage, ``MAX_ENTRIES`` in all (the oldest go first; a freed storage's at
once). The mirrored op still runs on the node. A read of a tiny test's result
(``torch.isnan(loss)``) brings its tiny argument along in the same round trip, so the next
test of it (``torch.isinf(loss)``) is answered here.

Why it stays true: an op can only write what it is given, so queuing an op drops the entries
of every storage among its arguments (``forget_args``; schemas are not trusted for this:
``native_batch_norm`` writes its running statistics unannounced) — except structured ops
(``DirectPlan``), whose generated schemas list every write, when they are functional; a
write of bytes (``Runtime.write``) or a device copy drops its target; anything else
(``Runtime.submit``: resizes, generator commands; ``call_sync``) empties the table. Those
that accounted for their writes queue with ``submit_fresh``. Storage ids
are never reused within a session, so an entry cannot outlive its storage's identity. A
storage shared with another process (``Runtime.shared_storages``, client/sharing.py) is never
mirrored: that process's writes are not seen here.
"""

from __future__ import annotations

import itertools
import os

import torch

from . import wire

# GPUWIRE_KNOWN_VALUES=0 turns it off: every read is a round trip (the conformance tests read
# what the node computed, not the client's copy)
ENABLED = os.environ.get("GPUWIRE_KNOWN_VALUES", "1") not in ("0", "")
MAX_BYTES = 64 << 10
MAX_ENTRIES = 256

_EXACT = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

# exact on every device whatever the dtype (comparisons and tests give the same booleans)
_ANY_DTYPE = frozenset({
    "aten::eq.Scalar", "aten::ne.Scalar", "aten::lt.Scalar", "aten::le.Scalar", "aten::gt.Scalar",
    "aten::ge.Scalar", "aten::eq.Tensor", "aten::ne.Tensor", "aten::lt.Tensor", "aten::le.Tensor",
    "aten::gt.Tensor", "aten::ge.Tensor", "aten::all", "aten::all.dim", "aten::all.dims", "aten::any",
    "aten::any.dim", "aten::any.dims", "aten::logical_not", "aten::logical_and", "aten::logical_or",
    "aten::logical_xor", "aten::isnan", "aten::isinf", "aten::isposinf", "aten::isneginf", "aten::signbit",
    "aten::abs", "aten::neg",  # (``isinf`` is ``abs(x) == inf``)
})
# exact for integer/boolean arguments only (a float sum depends on the order of additions)
EXACT_ARGS_ONLY = frozenset({"aten::bitwise_not", "aten::sum", "aten::sum.dim_IntList"})
OPS = _ANY_DTYPE | EXACT_ARGS_ONLY
# one-argument tests whose tiny argument is worth reading along with the result: Trainer's
# ``torch.isnan(loss) or torch.isinf(loss)`` then costs one round trip, not two
PREDICATES = frozenset({"aten::isnan", "aten::isinf", "aten::isposinf", "aten::isneginf", "aten::signbit",
                         "aten::logical_not", "aten::eq.Scalar", "aten::ne.Scalar", "aten::lt.Scalar",
                         "aten::le.Scalar", "aten::gt.Scalar", "aten::ge.Scalar"})
TINY = 64  # bytes: a loss, a norm, a few flags


def forget_args(rt, args, kwargs) -> None:
    """Drop the mirrors of every storage an op is given, before it is queued: whatever its
    schema says (``native_batch_norm`` writes its running statistics unannounced), an op can
    only write what it is given."""
    mirror = rt.mirror
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            mirror.pop(value.untyped_storage().data_ptr(), None)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    mirror.pop(item.untyped_storage().data_ptr(), None)


def forget_storages(rt, storage_ids) -> None:
    """``forget_args`` for storages already known by id (``wire.encode_device_tensors``)."""
    pop = rt.mirror.pop
    for storage_id in storage_ids:
        pop(storage_id, None)


def functional_overload(schema):
    """(qualified name, OpOverload) of the functional op an aten out= overload computes
    (``abs.out`` -> ``abs``, ``add.out`` -> ``add.Tensor``, ``add.Scalar_out`` -> ``add.Scalar``),
    or None."""
    key = (schema.name, schema.overload_name)
    found = _FUNCTIONAL.get(key, _FUNCTIONAL)
    if found is _FUNCTIONAL:
        found = _FUNCTIONAL[key] = _find_functional(schema)
    return found


_FUNCTIONAL: dict = {}  # (name, out overload) -> functional_overload's answer


def _find_functional(schema):
    """The overload of the same op whose arguments are the out= overload's but its outs: by
    name first (``X.Y_out`` -> ``X.Y``, ``X.out`` -> ``X``), else any (``add.out`` computes
    ``add.Tensor``; ``add.default`` is the add of two numbers)."""
    name, overload = schema.name, schema.overload_name
    if not name.startswith("aten::") or not (overload == "out" or overload.endswith("_out")):
        return None
    packet = getattr(torch.ops.aten, name[len("aten::"):], None)
    if packet is None:
        return None
    named = "default" if overload in ("out", "all_out") else overload[:-4]
    wanted = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    for candidate in (named, *(o for o in packet.overloads() if o != named)):
        functional = getattr(packet, candidate, None)
        if functional is None or any(a.is_out for a in functional._schema.arguments):
            continue
        if [(a.name, str(a.type)) for a in functional._schema.arguments] == wanted:
            return (name if candidate == "default" else f"{name}.{candidate}"), functional
    return None


def functional_for(schema):
    """The functional op of ``OPS`` an out= overload computes (``abs.out`` -> ``abs``), or None."""
    found = functional_overload(schema)
    return found if found is not None and found[0] in OPS else None


def host_out_values(rt, functional, args, kwargs):
    """Before an out= op of ``functional_for`` is queued: its result computed on the host
    copies of its inputs, or None (an input not mirrored)."""
    name, op = functional
    written = kwargs["out"].untyped_storage().data_ptr()
    if any(isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == written for value in args):
        # out= shares a storage with an input (``torch.logical_not(x.t(), out=x)``): the kernel
        # refuses a partial overlap ("some elements of the input tensor and the written-to
        # tensor refer to a single memory location"), so the node wrote nothing; mirrored, the
        # refused result would be read back, with no error, long after the node's was raised
        return None
    return host_values(rt, name, op, args, {k: v for k, v in kwargs.items() if k != "out"})


def host_view(rt, t: torch.Tensor) -> torch.Tensor | None:
    """A CPU tensor with the values of device tensor ``t``, or None when they are not known."""
    device_storage = t.untyped_storage()
    storage = rt.mirror.get(device_storage.data_ptr())
    if storage is None or t.is_conj() or t.is_neg() or storage.nbytes() != device_storage.nbytes():
        return None  # (a storage resized in place is not the one mirrored)
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def _whole(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    return (not t.storage_offset() and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes
            and nbytes <= MAX_BYTES)


def _store(rt, t: torch.Tensor, host: torch.Tensor) -> None:
    storage_id = t.untyped_storage().data_ptr()
    if storage_id in rt.shared_storages:  # (another process writes it: nothing here sees those writes)
        return
    mirror = rt.mirror
    if len(mirror) >= MAX_ENTRIES:
        evict_oldest(mirror)
    mirror[storage_id] = host.untyped_storage()


def evict_oldest(table: dict) -> None:
    """Make room in a full table by dropping its oldest quarter (a dict keeps insertion order).
    Emptying it whole, as before, dropped a mask uploaded a moment ago between its upload and
    its ``padding_mask.all()``: one training step in ~230 of a masked BERT read it from the node."""
    for key in list(itertools.islice(table, max(len(table) // 4, 1))):
        del table[key]


def forget_freed(rt, storage_ids) -> None:
    """Drop what is known of storages the program freed (their ids are never reused, so an
    entry of theirs could only fill the table)."""
    mirror, along = rt.mirror, rt.read_along
    for storage_id in storage_ids:
        mirror.pop(storage_id, None)
        along.pop(storage_id, None)


def remember(rt, t: torch.Tensor, values: torch.Tensor, bit_exact: bool = False) -> None:
    """Record ``values`` (a CPU tensor, converted as ``copy_`` converts) as the contents of
    device tensor ``t``, when ``t`` fills its whole storage and both dtypes are exact (or the
    caller knows ``values`` are what any device computes: ``bit_exact``, real dtypes)."""
    if not ENABLED or not _whole(t):
        return
    if not (t.dtype in _EXACT and values.dtype in _EXACT) and not (
            bit_exact and not t.dtype.is_complex and t.dtype == values.dtype):
        return
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    host.copy_(values)
    _store(rt, t, host)


READ_WHOLE_MAX = 1 << 20  # bytes


def read_whole(rt, t: torch.Tensor) -> None:
    """Before a second ``.item()`` of an element of the same storage in a row: read the whole
    storage (at most ``READ_WHOLE_MAX`` bytes) and mirror it, so the reads of the elements after
    it are answered here. Iterating a device tensor (``for token in ids[0]: ...``, ``all(t ==
    x)``) read one element a round trip: a 1M-element loop of PyTorch's own tests took 100 s,
    a generation loop decoding tokens one by one N round trips."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if not ENABLED or not 0 < nbytes <= READ_WHOLE_MAX:
        return
    host = torch.empty(nbytes, dtype=torch.uint8)
    rt.read(storage.data_ptr(), 0, nbytes, into=memoryview(host.numpy()))
    _store(rt, t, host)


def remember_read(rt, t: torch.Tensor, host: torch.Tensor) -> None:
    """Record what was just read of device tensor ``t`` (its exact bytes, any dtype) in the
    contiguous CPU tensor ``host``, when ``t`` fills its whole storage."""
    if ENABLED and _whole(t) and not t.is_conj() and not t.is_neg():
        _store(rt, t, host.clone())


def after_op(rt, name: str, args, result: torch.Tensor, values) -> None:
    """After a functional op of ``OPS`` was queued: mirror ``result`` from ``values`` (what
    ``host_values`` computed before), else note a tiny predicate's argument to read along
    with the result."""
    if values is not None:
        if values.shape == result.shape and values.dtype == result.dtype:
            remember(rt, result, values, bit_exact=name in _ANY_DTYPE)
        return
    if ENABLED and name in PREDICATES and args and isinstance(args[0], torch.Tensor):
        first = args[0]
        if wire.on_device(first) and first.numel() * first.element_size() <= TINY and _whole(first):
            along = rt.read_along
            if len(along) >= MAX_ENTRIES:
                evict_oldest(along)
            along[result.untyped_storage().data_ptr()] = first


def host_values(rt, name: str, op, args, kwargs):
    """``op`` (of ``OPS``) run on the host copies of its device arguments, or None if one is
    unknown (or of a dtype for which the op is not exact on every device)."""
    any_dtype = name in _ANY_DTYPE
    host_args = []
    for value in args:
        if isinstance(value, torch.Tensor) and wire.on_device(value):
            value = host_view(rt, value)
            if value is None or value.dtype.is_complex or (not any_dtype and value.dtype not in _EXACT):
                return None
        host_args.append(value)
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and wire.on_device(value):
            return None
    try:
        values = op(*host_args, **kwargs)
    except Exception:  # noqa: BLE001 - the node's run decides; nothing is mirrored
        return None
    return values if isinstance(values, torch.Tensor) else None
