"""The ``gpuwire`` PyTorch device: PrivateUse1, renamed, implemented in Python.

Sits between PyTorch's dispatcher and ``client.runtime``. Every ATen op on a gpuwire tensor
reaches ``_fallback`` (one boxed fallback for the PrivateUse1 key) and takes one of four
paths, chosen once per op from its schema and cached:

* views (schema returns an alias, nothing written): run the CPU kernel locally on the
  tensor's metadata; the storage is shared, no message is sent;
* mutating ops (in-place and ``out=``): encode and queue, return the mutated arguments;
* functional ops: output metadata from the meta kernel, cached per argument signature;
  output tensors get client-chosen storage ids, the op is queued, nothing waits;
* sync ops (data-dependent shapes, non-tensor results): one round trip; the node reports
  the results and the ids it stored them under.

A client tensor is an ordinary ``torch.Tensor`` whose storage's data pointer is a virtual
address that names the remote allocation; it is never dereferenced on the client.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys
import threading
import warnings
import weakref
from itertools import chain
from math import prod

import msgpack
import torch
from torch._C import DispatchKey, DispatchKeySet

from .._aten import RESIZED_ONLY_BY_NUMEL
from .._memory import RecyclingHostTensors, StorageCache
from ..protocol import codec
from ..protocol.codec import dense_layout
from . import checks, host_ops, meta_kernels, mirror, native, precision, wire
from .errors import ConnectionLost
from .runtime import LOST_SESSION, Runtime
from .wire import CODE_DTYPE, DTYPE_CODE

DEVICE_TYPE = wire.DEVICE_TYPE
DEVICE: torch.device | None = None  # torch.device("gpuwire", 0), once registered
CPU_KEYSET = DispatchKeySet(DispatchKey.CPU)
# under CUDA compatibility ``Tensor.device`` reports "cuda": test devices with these instead
on_device = wire.on_device
aten = torch.ops.aten

_state = threading.local()
_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_registered = False
_pending_seed: int | None = None
_PLANS: dict = {}


# ---------------------------------------------------------------- connection management


def runtime() -> Runtime:
    rt = _runtime
    if rt is None or rt._dead is not None:
        rt = _connect_default()
    return rt


def default_node() -> tuple:
    """(address, token) of this process's node: ``GPUWIRE_NODE`` / ``GPUWIRE_TOKEN``; in a rank a
    launcher started (``LOCAL_RANK`` i) under a lease of several GPUs (``GPUWIRE_NODES``, set by
    ``gpuwire run --pool --gpus N``), GPU i mod N of the lease, with its own token file
    (``GPUWIRE_TOKEN_FILE``.i, renewed by the launcher). The choice is written back to the
    environment, so the rank's recovery, token refreshes and child processes agree with it."""
    nodes = [n for n in os.environ.get("GPUWIRE_NODES", "").split(",") if n]
    rank = os.environ.get("LOCAL_RANK", "")
    if len(nodes) > 1 and rank.isdigit():
        index = int(rank) % len(nodes)
        os.environ["GPUWIRE_NODE"] = nodes[index]
        token_file = os.environ.get("GPUWIRE_TOKEN_FILE")
        if token_file and os.path.exists(f"{token_file}.{index}"):
            os.environ["GPUWIRE_TOKEN_FILE"] = f"{token_file}.{index}"
            with open(os.environ["GPUWIRE_TOKEN_FILE"]) as f:
                os.environ["GPUWIRE_TOKEN"] = f.read().strip()
        os.environ.pop("GPUWIRE_NODES")  # (chosen once: a second call keeps this choice)
    return os.environ.get("GPUWIRE_NODE"), os.environ.get("GPUWIRE_TOKEN")


def _connect_default() -> Runtime:
    """The session ops go to: the current one, else a new one with this process's node (the
    same node again where the last session was lost)."""
    with _runtime_lock:  # (``_set_runtime`` assigns the global)
        lost = _runtime
        if lost is not None:
            if lost._dead is None or lost.recovery.busy:
                return lost
            address, token = _after_loss(lost)
        else:
            address, token = default_node()
        if not address:
            from .embedded import start_embedded_node
            address, token = start_embedded_node()
        native.install()  # (once, before the first connection: its encoders; else Python's)
        _set_runtime(Runtime(address, token=token))
        return _runtime


def _after_loss(lost: Runtime) -> tuple:
    """(address, token) for the session after ``lost``, which ended with the loss of its
    connection: the program heard why from the call that found it, and carries on (a test suite's
    next test, a notebook's next cell) on a new session with the same node, which its supervisor
    may have restarted (the embedded node's parent does: ``embedded.py``). Tensors of the lost
    session say so where they are used (``runtime.ENDED_SESSIONS``)."""
    if lost._first_address is not None:  # (once: a failed connection below is tried again next call)
        lost.close(ended=LOST_SESSION)
        print(f"gpuwire: starting a new session on node {lost.address}; the previous one was lost, and every "
              "device tensor made in it with it", file=sys.stderr, flush=True)
    return lost.address, lost.token


def _forget_runtime_in_child() -> None:
    """After fork (DataLoader workers, multiprocessing) the child must not write into the
    parent's connection: it drops it and connects a session of its own if it uses the device."""
    global _runtime
    rt = _runtime
    if rt is not None:
        from . import runtime as _runtime_module
        _runtime_module.INHERITED_BELOW[0] = max(_runtime_module.INHERITED_BELOW[0], rt._next_address)
        rt._queue = []
        rt._dead = ConnectionLost("this process was forked from the one that owned the gpuwire connection")
        _runtime = None


os.register_at_fork(after_in_child=_forget_runtime_in_child)


INFERENCE_CACHES: list[dict] = []  # other modules' output-metadata caches, cleared with the plans'


def infer_as_cpu(as_cpu: bool) -> None:
    """Infer results' layouts as the node's device type gives them: a CPU node's kernels (fake
    CPU tensors) or another device's (the meta device, CUDA's rules). Switching forgets every
    layout learned for the other type: the generic and direct plans', the C++ helper's, the
    fused ops' and the device-to-device copies' (the direct plans and copies were kept before
    session 22: a process that moved from a CPU node to a CUDA one declared CPU's layouts)."""
    global _infer_as_cpu
    if as_cpu == _infer_as_cpu:
        return
    _infer_as_cpu = as_cpu
    forget_learned_layouts()


def forget_learned_layouts() -> None:
    """Forget every result layout learned so far (the device type changed, or the default
    dtype, which a factory without a dtype answers with)."""
    _PLANS.clear()
    if native.module is not None:
        native.module.clear_op_caches()
    for plan in (_conv_plan, _conv_backward_plan, *_direct_plans):
        if plan is not None:
            plan.cache.clear()
    for cache in INFERENCE_CACHES:
        cache.clear()


def _set_runtime(rt: Runtime) -> None:
    global _runtime
    _runtime = rt
    infer_as_cpu(rt.device_info.get("backend") == "cpu")
    meta_kernels.defer_dynamo_import()  # (before the first meta kernel: a factory's, an op's)
    rt.seed(_pending_seed if _pending_seed is not None else torch.initial_seed())
    precision.send(rt)  # TF32 / matmul-precision flags set before the session existed


def attach(node: str | None = None, *, token: str | None = None) -> Runtime:
    """Connect this process to a node (``HOST:PORT``); with no node, start an embedded one."""
    global _runtime
    register()
    with _runtime_lock:
        if _runtime is not None:
            _runtime.close()
            _runtime = None
        if node is None:
            node, default_token = default_node()
            token = token or default_token
        if not node:
            from .embedded import start_embedded_node
            node, token = start_embedded_node()
        native.install()  # (once, before the first connection: its encoders; else Python's)
        _set_runtime(Runtime(node, token=token))
        return _runtime


def detach() -> None:
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            _runtime.close()
            _runtime = None


def current_runtime() -> Runtime | None:
    """This process's session, or None before the first use and once it was lost (the next
    use starts another: ``runtime``)."""
    rt = _runtime
    return rt if rt is not None and rt._dead is None else None


# ---------------------------------------------------------------- tensors on the device


def _storage_nbytes(sizes, strides, itemsize: int, offset: int = 0) -> int:
    if 0 in sizes:
        return offset * itemsize
    extent = offset
    for size, stride in zip(sizes, strides):
        extent += (size - 1) * stride
    return (extent + 1) * itemsize


def _contiguous_strides(sizes) -> tuple:
    strides = []
    acc = 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


# the dispatcher handle itself, not OpOverload.redispatch: one Python frame less on every new tensor
_set_storage = functools.partial(aten.set_.source_Storage_storage_offset._handle.redispatch_boxed, CPU_KEYSET)
_create_empty = torch._C._acc.create_empty_tensor
_storage_at = torch._C._construct_storage_from_data_pointer


# ``create_empty_tensor`` gives a contiguous tensor on an empty storage of its own; for a
# contiguous result, moving the remote address into that storage (``_swap_data_ptr_``, which
# moves the size with it) is a third of the cost of ``set_`` through the dispatcher
_swap_data_ptr = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def wrap_storage(rt: Runtime, storage_id: int, nbytes: int, sizes, strides, dtype, offset: int = 0) -> torch.Tensor:
    """A client tensor on the remote storage ``storage_id`` (tracked for freeing)."""
    t = _create_empty(sizes, dtype)
    if offset == 0 and _swap_data_ptr is not None and t.stride() == strides:
        storage = t.untyped_storage()
        _swap_data_ptr(storage, _storage_at(storage_id, DEVICE, nbytes))
    else:
        storage = _storage_at(storage_id, DEVICE, nbytes)
        _set_storage(t, storage, offset, sizes, strides)
    rt.track(storage_id, storage, nbytes)
    return t


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """``storage.resize_(nbytes)`` for a remote storage: a fresh remote allocation of ``nbytes``
    takes the leading bytes of the old one, the storage object (and every tensor on it) moves
    onto it, and the old one is freed. FSDP frees a flat parameter's memory with ``resize_(0)``
    between uses and brings it back with ``resize_(n)``."""
    if nbytes < 0:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={[nbytes]}")
    rt = runtime()
    with rt.lock:
        old_id, old_nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == old_nbytes:
            return
        new_id = rt.allocate(nbytes)
        kept = min(old_nbytes, nbytes)
        if kept:
            def leading_bytes(storage_id, size):  # (an untracked view: neither storage is freed by it)
                view = _create_empty((0,), torch.uint8)
                _set_storage(view, _storage_at(storage_id, DEVICE, size), 0, (kept,), (1,))
                return view
            leading_bytes(new_id, nbytes).copy_(leading_bytes(old_id, old_nbytes))
        if old_nbytes and nbytes:  # (the swap takes equal sizes or an empty side: go through empty)
            _swap_data_ptr(storage, _storage_at(0, DEVICE, 0))
        _swap_data_ptr(storage, _storage_at(new_id, DEVICE, nbytes))
        rt.retrack(old_id, new_id, storage, nbytes)


def new_empty(rt: Runtime, sizes, strides, dtype) -> torch.Tensor:
    """A fresh remote allocation (queued Alloc) and the client tensor on it."""
    nbytes = _storage_nbytes(sizes, strides, dtype.itemsize)
    return wrap_storage(rt, rt.allocate(nbytes), nbytes, sizes, strides, dtype)


def storage_id_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------- the fallback


def _fallback(op, *args, **kwargs):
    # keyed by the overload's C function object (one per OpOverload, kept alive by it): its
    # hash is computed in C, OpOverload.__hash__ is a Python method
    plan = _PLANS.get(op._op)
    if plan is None:
        plan = _PLANS[op._op] = _make_plan(op)
    return plan(op, args, kwargs)


def _traced_fallback(op, *args, **kwargs):
    """GPUWIRE_TRACE=1: print each op reaching the device, its path and result shapes."""
    plan = _PLANS.get(op._op)
    if plan is None:
        plan = _PLANS[op._op] = _make_plan(op)
    result = plan(op, args, kwargs)
    kind = getattr(plan, "__name__", type(plan).__name__)
    _debug(f"{op} [{kind}]", [_shape(a) for a in args], {k: _shape(v) for k, v in kwargs.items()}, "->", _shape(result))
    return result


def _shape(value):
    if isinstance(value, torch.Tensor):
        return f"{'gpuwire' if on_device(value) else 'cpu'}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return value


class _KernelWarningsQuiet:
    """``with _QUIET:``: c10 warnings (TORCH_WARN) raised on this thread in between are dropped
    (the client helper's ``quiet_warnings``; without the helper, nothing changes). Around the
    client's shape inference (meta and fake kernels) and a structured op's first call, which
    run the op's checks without being its kernel: the node's kernel says its warnings to the
    program (``Runtime.say_node_warnings``), once, as a local run does."""

    __slots__ = ()

    def __enter__(self):
        if native.module is not None:
            native.module.quiet_warnings(True)

    def __exit__(self, *exc):
        if native.module is not None:
            native.module.quiet_warnings(False)


_QUIET = _KernelWarningsQuiet()


class _PythonWarningsIgnored:
    """``with _PythonWarningsIgnored(filter):``: Python warnings (all, or those ``filter``, a
    ``warnings.filters`` entry, ignores) raised in between are dropped, as ``warnings.catch_warnings()``
    with an "ignore" filter drops them, but without telling the warnings machinery that its
    filters changed: that clears every module's record of warnings already shown, so a
    program's once-a-line warning (a deprecation in ``torch.nn.functional``) was shown again
    after each first call of an op signature here, where a local run shows it once. Warnings
    reads ``warnings.filters`` at each call, so a filter put in front of the list takes effect;
    it is taken out of the list it was put in (another thread's ``catch_warnings`` swaps lists)."""

    __slots__ = ("_filter", "_filters")

    def __init__(self, ignore_filter: tuple = ("ignore", None, Warning, None, 0)):
        self._filter = ignore_filter

    def __enter__(self):
        self._filters = warnings.filters
        self._filters.insert(0, self._filter)

    def __exit__(self, *exc):
        try:
            self._filters.remove(self._filter)
        except ValueError:  # (a program that reset the list in between)
            pass


def _make_plan(op):
    special = SPECIAL.get(op)
    if special is not None:
        return special
    if not host_ops.runs_on_node(op):
        return host_ops.HostPlan(op)
    schema = op._schema
    returns = schema.returns
    writes_args = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) and not writes_args:
        return _view_plan(op)
    if not all(_is_tensor_type(r.type) for r in returns):
        return SyncPlan(op)
    if all(r.alias_info is not None and r.alias_info.is_write for r in returns) and (returns or writes_args):
        return MutatingPlan(op)
    return FunctionalPlan(op)


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch.TensorType):
        return True
    if isinstance(t, (torch.OptionalType, torch.ListType)):
        return _is_tensor_type(t.getElementType())
    return False


def _op_name(op) -> str:
    name = op._schema.name
    overload = op._schema.overload_name
    return f"{name}.{overload}" if overload else name


def _run_view(op, args, kwargs):
    return op.redispatch(CPU_KEYSET, *args, **kwargs)


def _view_plan(op):
    """``_run_view`` for one op, calling its dispatcher handle directly (a view is the most
    frequent op of all, and OpOverload.redispatch adds a Python frame)."""
    redispatch = functools.partial(op._handle.redispatch_boxed, CPU_KEYSET)

    def _run_view(op, args, kwargs):
        return redispatch(*args, **kwargs)
    return _run_view


def _argument_getters(op):
    """For each schema argument, where it sits in a boxed call: ('pos', i) or ('kw', name)."""
    getters = {}
    for index, arg in enumerate(op._schema.arguments):
        getters[arg.name] = (index, arg.name, arg.kwarg_only)
    return getters


def _get_arg(args, kwargs, index: int, name: str, kwarg_only: bool):
    if not kwarg_only and index < len(args):
        return args[index]
    return kwargs.get(name)


def _alias_sources(op) -> list:
    """For each return: the argument it aliases (index, name, kwarg_only) or None if fresh."""
    sources = []
    for ret in op._schema.returns:
        found = None
        if ret.alias_info is not None:
            for index, arg in enumerate(op._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.before_set & ret.alias_info.before_set:
                    found = (index, arg.name, arg.kwarg_only)
                    break
        sources.append(found)
    return sources


def _number_slots(op) -> tuple:
    """The Tensor arguments of ``op`` that can arrive here as Python numbers. A scalar passed
    for a Tensor argument (``torch.copysign(x, 2.0)``, or a composite kernel's
    ``at::remainder(t, 3)``) is a 0-dim "wrapped number" tensor, which the dispatcher hands to a
    Python kernel as a plain number; but calling the op again with a number, as the meta kernel
    and the node do, fails ("Expected a value of type 'Tensor'") except for the few ops
    (add, mul, ...) that accept numbers as tensors."""
    if torch._C._should_allow_numbers_as_tensors(op._schema.name.split("::")[-1]):
        return ()
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(op._schema.arguments)
                 if isinstance(a.type, torch.TensorType) or (isinstance(a.type, torch.OptionalType)
                                                             and isinstance(a.type.getElementType(), torch.TensorType)))


_NUMBER_TYPES = frozenset((float, int, bool, complex))
_NUMBER_CATEGORY = {bool: 0, int: 1, float: 2, complex: 3}


def _numbers_as_tensors(slots, args, kwargs):
    """``args, kwargs`` with each number in a Tensor slot replaced by a 0-dim CPU tensor (sent
    inline); unchanged, and no copy made, when there is none (the common case)."""
    for index, name, kwarg_only in slots:
        value = args[index] if not kwarg_only and index < len(args) else kwargs.get(name)
        if type(value) in _NUMBER_TYPES:
            break
    else:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    tensors = [v for v in (args[i] if not k and i < len(args) else kwargs.get(n) for i, n, k in slots)
               if isinstance(v, torch.Tensor)]
    for index, name, kwarg_only in slots:
        positional = not kwarg_only and index < len(args)
        value = args[index] if positional else kwargs.get(name)
        if type(value) in _NUMBER_TYPES:
            value = _wrapped_number_tensor(value, tensors)
            if positional:
                args[index] = value
            else:
                kwargs[name] = value
    return tuple(args), kwargs


def _wrapped_number_tensor(value, tensors) -> torch.Tensor:
    """A 0-dim tensor that promotes like the wrapped number ``value`` would. A wrapped number
    ranks below 0-dim tensors in type promotion; giving it the promoted dtype of the op's other
    tensors (when its kind, bool < int < float < complex, does not exceed theirs) leaves the
    result dtype unchanged, as the wrapped number would; otherwise the default dtype of its kind."""
    dtype = None
    for t in tensors:
        dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    category = _NUMBER_CATEGORY[type(value)]
    if dtype is not None:
        have = 3 if dtype.is_complex else 2 if dtype.is_floating_point else 0 if dtype is torch.bool else 1
        if category <= have:
            try:
                return torch.tensor(value, dtype=dtype)
            except (RuntimeError, OverflowError):
                # does not fit (300 for uint8, 1e10 for float16): still of the promoted dtype,
                # converted unchecked as TensorIterator converts a wrapped number to the common
                # dtype (300 -> 44, 1e10 -> inf). An int64 0-dim tensor would promote a 0-dim
                # uint8 ``self`` to int64 (``torch.remainder(t, 300)``: wrong dtype and values).
                return torch.tensor(value, dtype=_WRAPPED_DTYPE[category]).to(dtype)
        elif category == 3 and have == 2:
            return torch.tensor(value, dtype=wire.COMPLEX_OF.get(dtype, torch.complex64))
    if category == 2:
        return torch.tensor(value, dtype=torch.get_default_dtype())
    if category == 3:
        return torch.tensor(value, dtype=wire.COMPLEX_OF.get(torch.get_default_dtype(), torch.complex64))
    return torch.tensor(value, dtype=torch.int64 if category == 1 else torch.bool)


# the dtype of a wrapped number (``c10::scalar_to_tensor``) by its kind
_WRAPPED_DTYPE = {0: torch.bool, 1: torch.int64, 2: torch.float64, 3: torch.complex128}


def _written_slots(op) -> tuple:
    """The arguments ``op`` writes (``Tensor(a!)``, ``Tensor(a!)[]``): out= and in-place ``self``."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(op._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write and _is_tensor_type(a.type))


def _check_written_on_device(op_name: str, slots, args, kwargs) -> None:
    """A tensor an op writes must live on the device. A host tensor there would be sent by value
    (``inline_ext``): the node would write a copy and the caller's tensor would keep its old
    bytes, silently. Raise as CUDA's TensorIterator does for ``out=`` on another device."""
    for index, name, kwarg_only in slots:
        value = _get_arg(args, kwargs, index, name, kwarg_only)
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and not on_device(t):
                # (``host @ device``: PyTorch's composite made a host ``out`` for the host operand;
                # CUDA names that operand, and so does this)
                wire.refuse_host_tensors(op_name, args, kwargs)
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {wire.shown_device()} and {t.device}! (argument '{name}' of {op_name}"
                                   f" is written by the op and must be on the device)")


# out= kernels whose TensorIterator does not check memory overlap: writing an element twice
# gives the same value (``threshold_`` of an expanded tensor is allowed, and its structured
# in-place call reaches the client as ``threshold.out`` into ``self``)
_IDEMPOTENT_OUTS = frozenset({"aten::threshold.out"})


class MutatingPlan:
    """In-place and out= ops: queue the op; the results are the mutated arguments."""

    def __init__(self, op):
        self.name = _op_name(op)
        self.sources = _alias_sources(op)
        self.written = _written_slots(op)
        self.single = len(self.sources) == 1
        self.out_args = [(i, a.name, a.kwarg_only) for i, a in enumerate(op._schema.arguments)
                         if a.is_out and _is_tensor_type(a.type)]
        self.checker = FunctionalPlan(op)
        # in-place calls (no out=) whose argument signature was checked: a dict lookup a call
        self.checked: dict | None = None if self.out_args else {}
        self.numbers = _number_slots(op)
        self.mirrored_as = mirror.functional_for(op._schema)  # (client/mirror.py)
        self.functional = None  # (FunctionalPlan of the functional op, False if none; on first use)
        self.value_check = checks.MISSED_BY_META.get(self.name)

    def __call__(self, op, args, kwargs):
        rt = runtime()
        _check_written_on_device(self.name, self.written, args, kwargs)
        if self.value_check is not None:
            self.value_check(args, kwargs)
        if self.numbers:
            args, kwargs = _numbers_as_tensors(self.numbers, args, kwargs)
        if self.out_args:
            for index, name, kwarg_only in self.out_args:
                out = _get_arg(args, kwargs, index, name, kwarg_only)
                if isinstance(out, torch.Tensor) and checks.internal_overlap(out) and self.name not in _IDEMPOTENT_OUTS:
                    # (as every ATen out= kernel refuses it; in place, ``fill_`` and others allow it)
                    raise RuntimeError(checks.INTERNAL_OVERLAP_MESSAGE)
            if not self._resize_outs(op, args, kwargs) or _dtypes_unproven(self.name, args, kwargs):
                return self._call_sync_outs(op, args, kwargs)
        else:
            try:
                key = _call_key(args, kwargs, self.checker.by_class, self.checker.by_kind)
                if _DETERMINISTIC():  # (a signature checked before is checked again under it: ``_dtypes_unproven``)
                    key = (key, _deterministic_mode())
                seen = key in self.checked
            except TypeError:  # an unhashable argument: checked every call
                key, seen = None, False
            if not seen and not self._check_inplace(op, key, args, kwargs):
                return self._call_sync_inplace(op, key, args, kwargs)
        with rt.lock:
            known = None
            if rt.mirror and self.mirrored_as is not None:
                known = mirror.host_out_values(rt, self.mirrored_as, args, kwargs)
            queue_op(rt, self.name, args, kwargs)
            if known is not None:
                mirror.remember(rt, kwargs["out"], known, bit_exact=True)
        if self.single:
            source = self.sources[0]
            return _get_arg(args, kwargs, *source) if source else None
        if not self.sources:  # ``-> ()`` (e.g. _cummax_helper): the kernel must return None
            return None
        return tuple(_get_arg(args, kwargs, *s) if s else None for s in self.sources)

    def served_natively(self, args, kwargs):
        """() where the client's C++ op kernel may send this in-place call's signature itself
        from now on (nothing fresh to declare: the op writes its first argument), else None.
        What a later call does here is the same: the signature was checked, the op is queued
        and the written tensor's mirrored values dropped (the C++ kernel's ``forget``). Not for
        out= calls (resized and checked every call), number arguments sent as tensors, or under
        deterministic mode (its key holds the mode)."""
        if self.out_args or self.checked is None or _DETERMINISTIC() or \
                self.numbers and _numbers_in(self.numbers, args, kwargs):
            return None
        try:
            key = _call_key(args, kwargs, self.checker.by_class, self.checker.by_kind)
        except TypeError:
            return None
        return () if key in self.checked else None

    def _check_inplace(self, op, key, args, kwargs) -> bool:
        """First call of an in-place op with this argument signature: does its meta kernel
        accept it? An in-place op has no fresh output whose metadata must be inferred, so
        nothing checked it here, and its error (``x.floor_divide_(y)`` where ``y`` would
        broadcast ``x`` larger, a mask of the wrong shape ...) was raised by the node at the next
        sync point, charged to an unrelated line. False when the meta kernel (on a CPU node, the
        fake CPU kernel too) refuses the call: it then runs with a reply, which raises the
        node's own error here. Accepted signatures are remembered (a dict lookup a call)."""
        with _PythonWarningsIgnored():  # a meta kernel that resizes ``self`` warns: that is an error here
            entry = self.checker._compute(args, kwargs)
        if entry is None or _dtypes_unproven(self.name, args, kwargs):
            return False
        if isinstance(entry, _MetaEntry):
            _check_not_resized(self.sources, entry.out_shapes, args, kwargs)
        if key is not None and not _has_host_mask(args, kwargs):
            if len(self.checked) >= _CACHE_MAX:
                self.checked.clear()
            self.checked[key] = True
        return True

    def _call_sync_inplace(self, op, key, args, kwargs):
        """An in-place call the meta kernel refused, run with a reply: the node raises its own
        error at this line; if the node's kernel accepts it after all, the signature is remembered
        and later calls are queued. The reply's copy of the result is dropped: the op wrote the
        arguments the client already holds."""
        _call_sync(op, self.name, args, kwargs)
        if key is not None:
            self.checked[key] = True
        if self.single:
            source = self.sources[0]
            return _get_arg(args, kwargs, *source) if source else None
        if not self.sources:
            return None
        return tuple(_get_arg(args, kwargs, *s) if s else None for s in self.sources)

    def _resize_outs(self, op, args, kwargs):
        """``_resize_each_out``, its resize warnings said once it is done: the shape inference
        between two outs runs with the warning filters changed, which makes Python forget the
        warnings it has shown, so the same message for a second out was said twice where a
        local run says it once (test_linalg.py ``test_slogdet_errors_and_warnings``)."""
        pending: list = []
        try:
            return self._resize_each_out(op, args, kwargs, pending)
        finally:
            for message in pending:
                warnings.warn(message, UserWarning, stacklevel=checks.caller_stacklevel())

    def _resize_each_out(self, op, args, kwargs, pending: list):
        """An out= tensor may have the wrong size (composite kernels pass ``empty(0)``, users
        pass anything); aten resizes it, so we do too, from the cached meta result. Skipped for
        in-place calls and for a fresh non-empty tensor from the structured-kernel path, whose
        size C++ already computed. False when the sizes cannot be inferred (no meta kernel,
        data-dependent sizes): the op must then run as a sync op."""
        fresh_ref = getattr(_state, "fresh", None)
        # fresh only while nothing was sent since its Alloc: C++'s structured path allocates the
        # out tensor and calls X.out right away; a program's ``empty`` + fill + ``out=`` is not
        # (its out tensor may have any size and dtype: it must be checked and resized)
        fresh = fresh_ref[0]() if fresh_ref is not None and fresh_ref[1] == runtime().seq else None
        for position, (index, name, kwarg_only) in enumerate(self.out_args):
            out = _get_arg(args, kwargs, index, name, kwarg_only)
            if not isinstance(out, torch.Tensor):
                continue
            if out is fresh and out.numel():
                # (a program's ``empty`` passed straight to out= is fresh too: ``nonzero(x,
                # out=torch.empty(()))`` must still run with a reply, its size is data, and
                # ``torch.all(x, 0, out=torch.empty_like(x))`` must be resized)
                entry = self.checker.outputs(op, args, kwargs)
                if entry is SYNC or entry is None:
                    return False
                if entry.meta_failed or position >= len(entry.out_shapes) or \
                        tuple(out.shape) == entry.out_shapes[position]:
                    continue
            if any(out is a for a in args):
                if self._cannot_take_result(op, args, kwargs, out):
                    return False  # also read by the op: it may not be resized
                with _PythonWarningsIgnored():  # (the meta kernel warns that it resized it)
                    entry = self.checker.outputs(op, args, kwargs)
                if isinstance(entry, _MetaEntry) and position < len(entry.out_shapes):
                    expected = entry.out_shapes[position]
                    if expected is not None and tuple(out.shape) != expected:
                        raise RuntimeError(f"output with shape {list(out.shape)} doesn't match the broadcast "
                                           f"shape {list(expected)}")
                continue
            entry = self.checker.outputs(op, args, kwargs)
            if entry is SYNC or entry is None or entry.meta_failed:
                return False  # (meta_failed: the node's kernel decides, and raises here if it must)
            expected = entry.out_shapes
            if position < len(expected) and tuple(out.shape) != expected[position] and not (
                    self.name in RESIZED_ONLY_BY_NUMEL and out.numel() == prod(expected[position])):
                shape = expected[position]
                message = _resized_warning(self.name, out, shape)
                if message is not None:
                    pending.append(message)
                out.resize_(shape)
                # and restrided as TensorIterator restrides an out it resized, to the layout of
                # the functional op's result: ``abs``, ``logical_and``, ``complex`` ... pass
                # ``empty(0)`` to their out= kernel, and their result of a channels-last input
                # is channels-last on CPU and CUDA (meta out= kernels resize it contiguous)
                strides = self._functional_result(op, args, kwargs)
                if strides is not None and strides != out.stride() and tuple(shape) == strides[0] \
                        and dense_layout(shape, strides[1]):
                    out.as_strided_(shape, strides[1])
            if self._cannot_take_result(op, args, kwargs, out):  # (resized first: a node never resizes)
                return False
        return True

    def _cannot_take_result(self, op, args, kwargs, out) -> bool:
        """An integral out= tensor for a floating result (``torch.angle(x, out=long_tensor)``):
        ATen refuses the cast at the call; a meta kernel that does not check it let the call be
        queued, and the node's error came at the next sync point. Such a call then runs with a
        reply (the node's own error, at this line)."""
        if out.is_floating_point() or out.is_complex() or len(self.out_args) != 1 or not any(
                isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args):
            return False
        entry = self._functional_entry(op, args, kwargs)
        if entry is None:  # (the functional call refused by its meta kernel: ``mv`` of a long ``self``)
            return self.functional is not False
        return isinstance(entry, _MetaEntry) and len(entry.specs) == 1 and not torch.can_cast(entry.specs[0][2], out.dtype)

    def _functional_entry(self, op, args, kwargs):
        """The functional op's (``abs.out`` -> ``abs``) metadata entry for this call; None where
        its meta kernel cannot say (``self.functional`` is False where there is no such op)."""
        if self.functional is None:
            found = mirror.functional_overload(op._schema) if len(self.out_args) == 1 else None
            self.functional = (FunctionalPlan(found[1]) if found is not None
                               and not any(a.is_out for a in found[1]._schema.arguments) else False)
        if not self.functional:
            return None
        out_names = {name for _, name, _ in self.out_args}
        return self.functional.outputs(op, args, {k: v for k, v in kwargs.items() if k not in out_names})

    def _functional_result(self, op, args, kwargs):
        """(shape, strides, dtype) of the result of the functional op this single-out= op
        computes, or None."""
        entry = self._functional_entry(op, args, kwargs)
        if not isinstance(entry, _MetaEntry) or len(entry.specs) != 1:
            return None
        return entry.specs[0][0], entry.specs[0][1], entry.specs[0][2]

    def _call_sync_outs(self, op, args, kwargs):
        """Run an out= op whose out sizes are unknown here with a reply. Where the node's kernel
        resized an out tensor, that resized buffer is not the storage the client knows: resize
        the client's out tensor and copy the reported result into it."""
        result = _call_sync(op, self.name, args, kwargs)
        values = result if isinstance(result, (tuple, list)) else (result,)
        outs = tuple(_get_arg(args, kwargs, *s) if s else None for s in self.sources)
        for out, value in zip(outs, values):
            if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor) and out.shape != value.shape:
                _warn_resized(self.name, out, value.shape)
                out.resize_(value.shape)
                out.copy_(value)
        if self.single:
            return outs[0]
        return outs if outs else None


_RESIZED_WARNING = "An output with one or more elements was resized"
_RESIZE_WARNINGS = ("ignore", re.compile(re.escape(_RESIZED_WARNING), re.I), Warning, None, 0)


# out= kernels whose CPU and CUDA kernels resize with ``resize_`` (silently), where their meta
# kernels warn: PyTorch's OpInfos mark their test_out_warning an expected failure
_RESIZED_SILENTLY = frozenset({
    "aten::addbmm.out", "aten::eye.out", "aten::eye.m_out", "aten::narrow_copy.out", "aten::bernoulli.out",
    "aten::normal.Tensor_float_out", "aten::normal.float_Tensor_out", "aten::normal.Tensor_Tensor_out",
    "aten::normal.float_float_out", "aten::multinomial.out",
}) | (RESIZED_ONLY_BY_NUMEL - {"aten::arange.out", "aten::arange.start_out"})
_ARANGE_OUTS = frozenset({"aten::arange.out", "aten::arange.start_out"})  # (they warn in their own words)


def _warn_resized(name: str, out: torch.Tensor, shape) -> None:
    """ATen's warning for an out= tensor it resizes (``resize_output``), said on every such call
    as a local run says it; the meta kernel said it only while the call's layout was inferred."""
    message = _resized_warning(name, out, shape)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=checks.caller_stacklevel())


def _resized_warning(name: str, out: torch.Tensor, shape) -> str | None:
    """What ``_warn_resized`` says, or None (an empty out, an op whose kernel resizes silently)."""
    if not out.numel():
        return None
    if name in _ARANGE_OUTS:
        return (f"The number of elements in the out tensor of shape {list(out.shape)} is {out.numel()} which "
                f"does not match the computed number of elements {prod(shape)}. Note that this may occur as a "
                "result of rounding error. The out tensor will be resized to a tensor of shape "
                f"({prod(shape)},).")
    if name in _RESIZED_SILENTLY:
        return None
    return (f"{_RESIZED_WARNING} since it had shape {list(out.shape)}, which does not match the required "
            f"output shape {list(shape)}. This behavior is deprecated, and in a future PyTorch release "
            "outputs will not be resized unless they have zero elements. You can explicitly reuse an out "
            "tensor t by resizing it, inplace, to zero elements with t.resize_(0).")


def _check_not_resized(sources, out_shapes, args, kwargs) -> None:
    """An in-place op writes tensors it was given, which it may not resize: where its meta
    kernel resized one (``x.floor_divide_(y)`` with ``y`` broadcasting ``x`` larger), raise
    TensorIterator's error, as a local run does at this call."""
    for source, shape in zip(sources, out_shapes):
        if source is None or shape is None:
            continue
        written = _get_arg(args, kwargs, *source)
        if isinstance(written, torch.Tensor) and tuple(written.shape) != shape:
            raise RuntimeError(f"output with shape {list(written.shape)} doesn't match the broadcast shape "
                               f"{list(shape)}")


class _MetaEntry:
    __slots__ = ("specs", "template", "out_shapes", "meta_failed")

    def __init__(self, specs, template, out_shapes):
        self.specs = specs  # per fresh output: (sizes, strides, dtype, dtype_code, nbytes)
        self.template = template
        self.out_shapes = out_shapes
        # the meta kernel raised and fake CPU tensors answered instead: either the op is one
        # whose meta kernel is wrong for a CPU node, or the call is an error that the fake
        # kernel does not check (an out= of a dtype the result cannot be cast to)
        self.meta_failed = False


SYNC = object()

# Whether a kernel takes a dtype is decided on the node (ATen's dispatch: '"addmm" not implemented
# for 'Int'', '"bitwise_and_cpu" not implemented for 'Float''); meta kernels do not check it, so
# a queued call raised at the next sync point and failed the lines after it, where CUDA raises
# at the call. An op's first call with a combination of dtypes runs with a reply, and the
# combination is remembered once the node ran it. Calls on float32/float64 tensors alone skip
# this (every backend's kernels take them; a training step pays no round trip for it), except
# for the ops that take integers only.
_EVERY_KERNEL_DTYPES = frozenset({torch.float32, torch.float64})
_INTEGER_ONLY_OPS = ("aten::bitwise_", "aten::__and__", "aten::__or__", "aten::__xor__", "aten::__lshift__",
                     "aten::__rshift__", "aten::__iand__", "aten::__ior__", "aten::__ixor__", "aten::__ilshift__",
                     "aten::__irshift__", "aten::gcd", "aten::lcm")
_PROVEN_DTYPES: set = set()
_DETERMINISTIC = torch._C._get_deterministic_algorithms
_FILL_UNINITIALIZED = torch._C._get_deterministic_fill_uninitialized_memory


def _deterministic_mode() -> int:
    """0: ``torch.use_deterministic_algorithms`` off; 1: on with ``warn_only``; 2: on."""
    if not _DETERMINISTIC():
        return 0
    return 1 if torch._C._get_deterministic_algorithms_warn_only() else 2
# GPUWIRE_CHECK_DTYPES=0 queues first calls too (their dtype errors then come at the next sync point)
_CHECK_DTYPES = os.environ.get("GPUWIRE_CHECK_DTYPES", "1") not in ("", "0")


# a Python number's kind, as type promotion ranks it
_NUMBER_CATEGORY = {bool: 0, int: 1, float: 2, complex: 3}


def _dtypes_unproven(name: str, args, kwargs) -> bool:
    """Whether ``name`` has not yet run on the node with these arguments' dtypes; if so, the
    combination is noted for ``_call_sync`` to remember once the node ran the call."""
    dtypes, empty, number = [], False, -1
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            dtypes.append(value.dtype)
            empty = empty or not value.numel()
        elif isinstance(value, torch.dtype):
            dtypes.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    dtypes.append(v.dtype)
                    empty = empty or not v.numel()
                else:
                    number = max(number, _NUMBER_CATEGORY.get(type(v), -1))
        else:
            number = max(number, _NUMBER_CATEGORY.get(type(value), -1))
    # under torch.use_deterministic_algorithms(True) a kernel may refuse to run at all (ATen's
    # nondeterministic alert, raised by the node's kernel; with warn_only, its warning): each
    # op's first call under it has a reply too, whatever its dtypes, so either comes at the call
    deterministic = _deterministic_mode()
    # an out= of another dtype than an input's: which casts a kernel accepts is its own (``neg``
    # and ``abs`` none: "Found dtype Double but expected Float"; ``sin`` any), and the meta
    # kernels (PyTorch's Python references for many) accept them all
    out = kwargs.get("out")
    cast_out = type(out) is torch.Tensor and any(dtype != out.dtype for dtype in dtypes)
    if not _CHECK_DTYPES or all(dtype in _EVERY_KERNEL_DTYPES for dtype in dtypes) and not name.startswith(
            _INTEGER_ONLY_OPS) and not deterministic and not cast_out and number < 3:
        return False
    # (and the alert may depend on a flag: ``put_``'s ``accumulate``; the result type on a number's
    # kind: ``_foreach_mul_`` of bool tensors by an int cannot cast its result back, by a bool can)
    combination = (name, tuple(dtypes), number, deterministic, deterministic and tuple(
        value for value in (*args, *kwargs.values()) if isinstance(value, bool)))
    if combination in _PROVEN_DTYPES:
        return False
    # (a call on an empty tensor proves nothing: TensorIterator runs no kernel for it)
    _state.proving = None if empty else combination
    return True


def _data_dependent(op) -> bool:
    """PyTorch's tags for an op (or, for an ``out=`` overload, its functional one: ``index.Tensor_out``)."""
    tags = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
    if tags & set(getattr(op, "tags", ())):
        return True
    overload = getattr(op, "_overloadname", "")
    if not overload.endswith("out"):
        return False
    functional = getattr(op.overloadpacket, overload[:-len("out")].rstrip("_") or "default", None)
    return functional is not None and bool(tags & set(functional.tags))


class FunctionalPlan:
    """Ops that return fresh tensors: metadata from the meta kernel, cached by signature."""

    def __init__(self, op):
        self.name = _op_name(op)
        self.meta_op = op
        self.cache: dict = {}
        # ops whose result's shape or value only the data gives (``nonzero``, ``masked_select``,
        # ``unique``, ``x[mask]``): where their meta kernel gives up, fake tensors would too
        self.data_dependent = _data_dependent(op)
        self.sources = _alias_sources(op)
        self.numbers = _number_slots(op)
        # a number in a Tensor slot counts by its kind; a Scalar argument by kind and value
        # (``arange``'s sizes come from its Scalars)
        tensors, scalars = _slot_kinds(op)
        self.by_class, self.by_kind = tensors, scalars
        self.known_values = self.name in mirror.OPS  # (client/mirror.py)
        self.value_check = checks.MISSED_BY_META.get(self.name)

    def outputs(self, op, args, kwargs):
        try:
            key = _call_key(args, kwargs, self.by_class, self.by_kind)
            entry = self.cache.get(key)
        except TypeError:  # an unhashable argument: no caching
            key = entry = None
        if entry is None:
            with _PythonWarningsIgnored(_RESIZE_WARNINGS):  # (a meta out= kernel's resize warning: ``_warn_resized`` says it)
                entry = self._compute(args, kwargs)
            if key is not None and entry is not None and not _has_host_mask(args, kwargs):
                if len(self.cache) >= _CACHE_MAX:
                    self.cache.clear()
                self.cache[key] = entry
        return entry

    def _compute(self, args, kwargs):
        with _QUIET:
            return self._infer(args, kwargs)

    def _infer(self, args, kwargs):
        # On a CPU node, meta kernels answer for every op whose meta and CPU kernels agree: fake
        # CPU tensors give the same answer 5-40x slower (0.5-0.8 ms an op), which every new
        # shape pays: each step of a model fed variable-length batches, each generated token.
        as_cpu = _infer_as_cpu
        if as_cpu and self.name in _CPU_DIFFERS_FROM_META:
            return self._compute_as_cpu(args, kwargs)
        meta_args, meta_kwargs = _to_meta(args), {k: _to_meta(v) for k, v in kwargs.items()}
        try:
            result = self.meta_op(*meta_args, **meta_kwargs)
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException, NotImplementedError):
            # (a fake mode's first use imports torch._dynamo: ~1 s the first time a program
            # prints a tensor or selects by a mask, to learn that the node must answer)
            return self._compute_as_cpu(args, kwargs) if as_cpu and not self.data_dependent else SYNC
        except Exception:  # noqa: BLE001 - let the node raise the real error (same message as local)
            if not as_cpu:
                return None
            entry = self._compute_as_cpu(args, kwargs)
            if isinstance(entry, _MetaEntry):
                entry.meta_failed = True
            return entry
        return self._entry(self._as_the_kernel_gives(args, kwargs, result, as_cpu))

    def _compute_as_cpu(self, args, kwargs):
        """Shape inference for a CPU node where meta kernels branch on the device type (eval-mode
        batch norm returns empty save_mean/invstd on CPU, embedding_bag's auxiliary outputs
        differ ...): run them on fake CPU tensors, not on meta ones (which model CUDA)."""
        from torch._subclasses import fake_tensor as ft
        if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python):
            # under ``no_dispatch()`` (FakeTensorMode's fallback runs real kernels so) a fake
            # tensor's op reaches the CPU kernel with no data: it crashed the process. The node
            # answers instead.
            return SYNC
        mode = _fake_cpu_mode()
        fake_args, fake_kwargs = _to_fake_cpu(args, mode), {k: _to_fake_cpu(v, mode) for k, v in kwargs.items()}
        quiet = _FAKE_LOG.level
        _FAKE_LOG.setLevel(logging.CRITICAL)  # a meta kernel that raises is an answer here, not an error to log
        try:
            with mode:
                result = self.meta_op(*fake_args, **fake_kwargs)
        except (ft.DynamicOutputShapeException, ft.DataDependentOutputException, ft.UnsupportedOperatorException,
                NotImplementedError):
            return SYNC
        except Exception:  # noqa: BLE001 - let the node raise the real error (same message as local)
            return None
        finally:
            _FAKE_LOG.setLevel(quiet)
        with mode:
            return self._entry(self._as_the_kernel_gives(args, kwargs, result, True))

    def _as_the_kernel_gives(self, args, kwargs, result, as_cpu: bool):
        """``result`` (meta or fake) corrected where the inferring kernel and the real one
        disagree: the CPU kernel's dtypes and layouts on a CPU node, cuDNN's layouts on a CUDA
        node, ``empty_like``'s exact strides on every node."""
        fix = (_CPU_KERNEL_FIXES if as_cpu else _CUDA_KERNEL_FIXES).get(self.name)
        if fix is not None:
            result = fix(args, kwargs, result)
        if self.name in _PRESERVE_LAYOUT:
            result = _preserved_layout(args, kwargs, result)
        return result

    def _entry(self, result):
        specs = []
        template = _template(result, specs, self.sources)
        out_shapes = [tuple(r.shape) if isinstance(r, torch.Tensor) else None
                      for r in (result if isinstance(result, tuple) else (result,))]
        return _MetaEntry(specs, template, out_shapes)

    def __call__(self, op, args, kwargs):
        if args and type(args[0]) is not torch.Tensor and self.name in _LIKE_FACTORIES:
            args = (_real_stand_in(args[0]),) + tuple(args[1:])
        if self.value_check is not None:
            self.value_check(args, kwargs)
        if self.numbers:
            args, kwargs = _numbers_as_tensors(self.numbers, args, kwargs)
        entry = self.outputs(op, args, kwargs)
        # (checked first: a call run with a reply for another reason proves its dtypes too)
        if _dtypes_unproven(self.name, args, kwargs) or entry is SYNC or entry is None:
            return _call_sync(op, self.name, args, kwargs)
        template = entry.template
        values = None
        if self.known_values and template == 0:  # (before the args' mirrors are dropped)
            rt = runtime()
            values = mirror.host_values(rt, self.name, op, args, kwargs) if rt.mirror else None
        tensors = submit_with_outputs(self.name, args, kwargs, entry.specs)
        if template == 0:
            if self.known_values:
                mirror.after_op(runtime(), self.name, args, tensors[0], values)
            return tensors[0]
        return _build(template, tensors, args, kwargs)


def output_spec(sizes, strides, dtype) -> tuple:
    sizes, strides = tuple(sizes), tuple(strides)
    return sizes, strides, dtype, DTYPE_CODE[dtype], _storage_nbytes(sizes, strides, dtype.itemsize)


def submit_with_outputs(name: str, args, kwargs, specs) -> list:
    """Queue op ``name`` whose fresh results have the layouts ``specs`` (see ``output_spec``);
    return the client tensors for them at once, without waiting for the node."""
    rt = runtime()
    with rt.lock:
        tensors, outs = _fresh_outputs(rt, specs)
        queue_op(rt, name, args, kwargs, outs)
    return tensors


def _fresh_outputs(rt: Runtime, specs) -> tuple[list, list]:
    """(client tensors, wire declarations) of fresh results with the layouts ``specs``."""
    tensors, outs = [], []
    for sizes, strides, dtype, code, nbytes in specs:
        sid = rt.reserve(nbytes)
        tensors.append(wrap_storage(rt, sid, nbytes, sizes, strides, dtype))
        outs.append((sid, nbytes, sizes, strides, code))
    return tensors, outs


def queue_op(rt: Runtime, name: str, args, kwargs, outs=()) -> None:
    """Queue op ``name`` (results declared in ``outs``). An op can write only what it is
    given: the client forgets the values it knew of every storage among the arguments
    (``client/mirror.py``; schemas are not trusted for this), except for the functional ops
    whose results it mirrors (``abs(mask)`` made the next ``mask.sum()`` a round trip)."""
    if rt.mirror and name not in mirror.OPS:
        mirror.forget_args(rt, args, kwargs)
    rt.submit_fresh(rt.encode_op(name, args, kwargs, outs))


# A host tensor of these dtypes may be a mask (``x[mask]``, ``index_put_`` with a boolean
# index): the op's result size depends on its values, which the meta kernel reads (it is a real
# CPU tensor), so an output layout cached by metadata alone was reused for the next mask.
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8)


def _host_mask_key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.stride(), True, t.detach().contiguous().numpy().tobytes())


def _signature(values):
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append((v.dtype, v.shape, v.stride(), v.is_cpu, v.is_conj() or v.is_neg())
                       if not (v.is_cpu and v.dtype in _MASK_DTYPES) else _host_mask_key(v))
        elif isinstance(v, (list, tuple)):
            out.append(_signature(v))
        elif isinstance(v, _Generator):
            out.append(_Generator)  # a fresh wrapper per call: its identity means nothing
        else:
            out.append((v.__class__, v))
    return tuple(out)


# ---------------------------------------------------------------- structured ops: one message each


_Tensor = torch.Tensor
# the C class, not ``torch.Generator``: gpuwire's shim replaces that with a class whose
# metaclass answers isinstance in Python (same answer, ten times the cost)
_Generator = torch._C.Generator
_CACHE_MAX = 4096  # signatures cached per op; past it the cache starts over
_NOTHING = frozenset()
_LISTS = object()  # tags the keys of ``DirectPlan._list_key``: they never equal ``_call_key``'s


def _slot_kinds(op) -> tuple[frozenset, frozenset]:
    """The argument slots (positions and names) of ``op`` typed Tensor, and Scalar or Scalar[]."""
    tensors, scalars = set(), set()
    for index, arg in enumerate(op._schema.arguments):
        t = arg.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.NumberType):
            t = t.getElementType()  # Scalar[]: each number by its kind
        kind = tensors if isinstance(t, torch.TensorType) else scalars if isinstance(t, torch.NumberType) else None
        if kind is not None:
            kind.add(arg.name)  # a positional argument may also arrive by keyword
            if not arg.kwarg_only:
                kind.add(index)
    return frozenset(tensors), frozenset(scalars)


def _call_key(args, kwargs, by_class, by_kind) -> tuple:
    """What decides an op's output metadata, hashable: each tensor's dtype, shape, strides and
    device kind (not its conj/neg bits: results are fresh either way); a non-tensor in
    ``by_class`` by its class (a list by its items' classes), in ``by_kind`` by class and value,
    any other by value (its type is fixed by the schema). No pytree walk: only lists
    (``Tensor[]``, ``int[]``) are looked into. Raises TypeError if a value is unhashable."""
    key = []
    append = key.append
    for slot, v in chain(enumerate(args), kwargs.items()) if kwargs else enumerate(args):
        if slot.__class__ is str:
            append(slot)  # a keyword argument: its name, then its value's key
        if isinstance(v, _Tensor):
            append((v.dtype, v.shape, v.stride(), v.is_cpu) if not (v.is_cpu and v.dtype in _MASK_DTYPES)
                   else _host_mask_key(v))
        elif slot in by_class:
            append(tuple(x.__class__ for x in v) if v.__class__ is list else v.__class__)
        elif slot in by_kind:
            append((v.__class__, tuple(v) if v.__class__ is list else v))
        elif v.__class__ is list or v.__class__ is tuple:
            append(_signature(v))
        elif isinstance(v, _Generator):
            append(_Generator)  # a fresh wrapper per call: its identity means nothing
        else:
            append(v)
    return tuple(key)


def _has_host_mask(args, kwargs) -> bool:
    """Whether a CPU tensor of a mask dtype is among the arguments. Its values, not only its
    layout, can decide the result's shape (``x[mask]``: ``index`` with a CPU boolean mask,
    allowed on an accelerator as on CUDA; the meta kernels read it), so a layout inferred from
    one call must not be cached for its signature (checked only when a layout is learned)."""
    for value in chain(args, kwargs.values()) if kwargs else args:
        if isinstance(value, _Tensor):
            if value.is_cpu and value.dtype in _MASK_DTYPES:
                return True
        elif value.__class__ is list or value.__class__ is tuple:
            for item in value:
                if isinstance(item, _Tensor) and item.is_cpu and item.dtype in _MASK_DTYPES:
                    return True
    return False


class DirectPlan:
    """A structured op (``add.Tensor``, ``addmm``, ``mul_.Tensor`` …) registered as its own
    PrivateUse1 kernel. Left to PyTorch's generic structured kernel it reaches the device as
    two calls, ``empty`` (an Alloc that the node zeroes) and ``X.out`` (an op naming that
    storage), with the C++ meta function run in between.

    Here the first call with a new argument signature still takes that path (``composite``):
    it raises C++'s own error at the user's line, and its result gives the exact output layout
    C++ computed, which is cached for the signature. Every later call is one message: the
    functional op with its outputs declared (the node stores the kernel's results under them:
    nothing to allocate first, nothing to zero), or the in-place op itself.

    The ``_foreach_*`` ops (the optimizers' multi-tensor paths) are served the same way: left
    to their generic kernel they become one message per tensor; here one message carries the
    whole list, and the node runs the same ``_foreach`` kernel a local run would.

    The signature is each tensor's dtype, shape, strides and device kind, and every other
    argument's value — except numbers in Scalar, Scalar[] or Tensor slots, whose kind alone
    (bool, int, float, complex) decides the output's metadata, so a changing learning rate
    does not grow the cache. A first call that needed a round trip (sizes that depend on data,
    e.g. a boolean mask) is never cached."""

    def __init__(self, op, composite):
        """``op``: the OpOverload, or anything with its ``_schema`` (registration runs for
        hundreds of ops at import and must not build an OpOverload for each: ``self.op``
        resolves it on first use)."""
        schema = op._schema
        self.name = _op_name(op)
        self.composite = composite
        self.cache: dict = {}
        # in place: on ``self`` (returned), or on the list ``self`` of a ``_foreach_`` op (-> ())
        self.inplace = not schema.returns or schema.returns[0].alias_info is not None
        self.source = _alias_sources(op)[0] if schema.returns and self.inplace else None
        self.returns_list = len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)
        self.numbers = _number_slots(op)
        tensors, scalars = _slot_kinds(op)
        self.typed = tensors | scalars  # numbers count by their kind alone in both
        self.tensor_slots = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                                  if isinstance(a.type, torch.TensorType) or (
                                      isinstance(a.type, torch.OptionalType)
                                      and isinstance(a.type.getElementType(), torch.TensorType)))
        self._op = op if isinstance(op, torch._ops.OpOverload) else None
        self._checker = None
        self.local = False  # set once the op is seen to run on the client alone
        self.known_values = self.name in mirror.OPS  # (client/mirror.py)
        self.value_check = checks.MISSED_BY_META.get(self.name)
        # (a check of a number's value, which the key holds by kind only: on every call)
        self.check_every_call = self.value_check is not None and self.name in checks.BY_VALUE
        # positional ``Tensor[]`` arguments (the ``_foreach_`` ops' lists, ``cat``'s): keyed and
        # encoded in one pass (``_call_with_lists``)
        self.list_positions = () if self.known_values else tuple(
            i for i, a in enumerate(schema.arguments)
            if not a.kwarg_only and isinstance(a.type, torch.ListType) and _is_tensor_type(a.type.getElementType()))

    @property
    def op(self):
        if self._op is None:
            self._op = _aten_op(self.name)
        return self._op

    @staticmethod
    def fits(schema) -> bool:
        """Ops this plan serves (by schema): one or more fresh tensor results, or in place on
        ``self`` with one result, or a ``_foreach_`` op in place on its list ``self`` or with a
        fresh list as result; at least one tensor argument; no out= arguments."""
        returns, arguments = schema.returns, schema.arguments
        if any(a.is_out for a in arguments) or not arguments:
            return False
        if not any(_is_tensor_type(a.type) for a in arguments):
            return False  # factories: their sizes come from values, not metadata
        if schema.name.startswith("aten::_foreach_"):
            first = arguments[0]
            if not returns:  # in place on the list ``self``, and on nothing else
                return (isinstance(first.type, torch.ListType) and first.alias_info is not None
                        and first.alias_info.is_write
                        and not any(a.alias_info is not None for a in arguments[1:]))
            return (len(returns) == 1 and returns[0].alias_info is None and isinstance(returns[0].type, torch.ListType)
                    and not any(a.alias_info is not None for a in arguments))
        if not returns:
            return False
        if returns[0].alias_info is not None:
            return (len(returns) == 1 and returns[0].alias_info.is_write and arguments[0].alias_info is not None
                    and arguments[0].alias_info.is_write and bool(arguments[0].alias_info.before_set
                                                                   & returns[0].alias_info.before_set))
        if any(a.alias_info is not None for a in arguments):
            return False
        return all(r.alias_info is None and isinstance(r.type, torch.TensorType) for r in returns)

    def key(self, args, kwargs):
        if self.list_positions:
            found = self._list_key(args, kwargs)
            if found is not None:
                return found[0]
        return _call_key(args, kwargs, self.typed, _NOTHING)

    def _list_key(self, args, kwargs):
        """``(key, args with each Tensor[] encoded, the storage ids in those lists, the other
        arguments)`` from one pass over the lists (``wire.encode_device_tensors``), or None
        where a list holds anything but gpuwire tensors."""
        encoded_args, others = list(args), list(args)
        keys, storage_ids = [], []
        for index in self.list_positions:
            if index >= len(args):
                break
            value = args[index]
            if value.__class__ is not list and value.__class__ is not tuple:
                return None
            found = wire.encode_device_tensors(value)
            if found is None:
                return None
            keys.append(found[0])
            encoded_args[index] = found[1]
            storage_ids.extend(found[2])
            others[index] = None
        key = (_LISTS, tuple(keys), _call_key(others, kwargs, self.typed, _NOTHING))
        return key, tuple(encoded_args), storage_ids, others

    def _call_with_lists(self, keyset, args, kwargs):
        """``__call__`` for an op with ``Tensor[]`` arguments: the lists' tensors are read once
        for both the signature and the message."""
        try:
            found = self._list_key(args, kwargs)
        except TypeError:
            found = None
        if found is None:
            if self.name.startswith("aten::_foreach_") and any(
                    isinstance(t, _Tensor) and t.is_cpu for i in self.list_positions if i < len(args)
                    for t in (args[i] if isinstance(args[i], (list, tuple)) else ())):
                # lists across devices: CUDA's foreach kernels take their slow route, each tensor
                # updated where it lives; so does the generic kernel
                return self.composite.call_boxed(keyset, *args, **kwargs)
            return NotImplemented
        key, encoded_args, storage_ids, others = found
        try:
            specs = self.cache.get(key)
        except TypeError:  # an unhashable argument: the general path, which does not cache
            return NotImplemented
        if specs is None:
            return self._learn(key, keyset, args, kwargs)
        if self.numbers:
            encoded_args, kwargs = _numbers_as_tensors(self.numbers, encoded_args, kwargs)
        rt = _runtime
        if rt is None or rt._dead is not None:
            rt = runtime()
        with rt.lock:
            if rt.mirror:  # (see ``queue_op``)
                mirror.forget_storages(rt, storage_ids)
                mirror.forget_args(rt, others, kwargs)
            tensors, outs = _fresh_outputs(rt, specs)
            rt.submit_fresh(rt.encode_op(self.name, encoded_args, kwargs, outs))
        if self.inplace:
            return self._written(args, kwargs)
        if self.returns_list:
            return tensors
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _written(self, args, kwargs):
        """What an in-place call returns: the argument it wrote (None for a ``_foreach_`` op)."""
        if self.source is None:
            return None
        return args[0] if self.source[0] == 0 and args else _get_arg(args, kwargs, *self.source)

    def __call__(self, keyset, *args, **kwargs):
        if self.local:
            return self.composite.call_boxed(keyset, *args, **kwargs)
        if self.check_every_call:
            self.value_check(args, kwargs)
        if self.list_positions:
            result = self._call_with_lists(keyset, args, kwargs)
            if result is not NotImplemented:
                return result
        try:
            key = _call_key(args, kwargs, self.typed, _NOTHING)
            specs = self.cache.get(key)
        except TypeError:  # an unhashable argument: no caching
            key = specs = None
        if specs is None:
            return self._learn(key, keyset, args, kwargs)
        if self.numbers:
            args, kwargs = _numbers_as_tensors(self.numbers, args, kwargs)
        rt = _runtime
        if rt is None or rt._dead is not None:
            rt = runtime()
        if self.inplace:
            with rt.lock:
                queue_op(rt, self.name, args, kwargs)
            return self._written(args, kwargs)
        if self.returns_list:
            return submit_with_outputs(self.name, args, kwargs, specs)
        if len(specs) == 1:  # the common case, inlined
            ((sizes, strides, dtype, code, nbytes),) = specs
            with rt.lock:
                storage_id = rt.reserve(nbytes)
                t = wrap_storage(rt, storage_id, nbytes, sizes, strides, dtype)
                rt.submit_fresh(rt.encode_op(self.name, args, kwargs,
                                                  ((storage_id, nbytes, sizes, strides, code),)))
                if self.known_values:  # (structured: writes nothing but ``t``)
                    mirror.after_op(rt, self.name, args, t,
                                    mirror.host_values(rt, self.name, self.op, args, kwargs) if rt.mirror else None)
            return t
        return tuple(submit_with_outputs(self.name, args, kwargs, specs))

    def _learn(self, key, keyset, args, kwargs):
        if self.value_check is not None:  # (it checks values a key holds: once a signature does)
            self.value_check(args, kwargs)
        if self.name in _OUT_RESIZED_BY_META or (_infer_as_cpu and self.name in _CPU_KERNEL_FIXES):
            # (the generic kernel's layout is the C++ meta function's, which these fixes correct)
            return self._learn_from_meta(key, args, kwargs)
        for index, name, kwarg_only in self.tensor_slots:
            if type(args[index] if not kwarg_only and index < len(args) else kwargs.get(name)) in _NUMBER_TYPES:
                # a Python number in a Tensor slot (``x + 1``) cannot be handed back to the C++
                # kernel from here: take the metadata from the meta kernel instead
                return self._learn_from_meta(key, args, kwargs)
        rt = runtime()
        trips, sent = rt.round_trips, rt.ops_sent
        with _QUIET:  # (its meta function's warnings: the node's kernel says them)
            result = self.composite.call_boxed(keyset, *args, **kwargs)
        if key is None or rt.round_trips != trips or rt is not _runtime:
            return result  # data-dependent sizes (or a debug mode that syncs every op): never cached
        if rt.ops_sent == sent:
            # it ran on the client alone: an in-place op on metadata (``as_strided_``,
            # ``squeeze_``), which must stay local, or nothing at all
            if self.inplace:
                self.local = True
            return result
        if self.inplace:
            specs = ()
        else:
            specs = _fresh_specs(result, args, kwargs)
            if specs is None:
                return result
        self._remember(key, args, kwargs, specs)
        return result

    def _remember(self, key, args, kwargs, specs) -> None:
        if _has_host_mask(args, kwargs):
            return  # (the layout depends on the mask's values)
        if len(self.cache) >= _CACHE_MAX:
            self.cache.clear()
        self.cache[key] = specs

    def _learn_from_meta(self, key, args, kwargs):
        if self._checker is None:
            self._checker = FunctionalPlan(self.op)
        # (judged on the Python numbers, by kind: ``mask.mul_(8)`` cannot cast its result back to
        # bool, which the meta kernel does not see; ``x + 1`` of floats proves nothing new)
        unproven = _dtypes_unproven(self.name, args, kwargs)
        if self.numbers:
            # as wrapped-number tensors: the meta kernel (like the node) refuses a plain number in
            # a Tensor slot, which made ``x % 2`` or ``torch.fmod(x, 1.5)`` a round trip every call
            args, kwargs = _numbers_as_tensors(self.numbers, args, kwargs)
        # (a number the op takes as a tensor, ``x * 2.0``, reaches the meta kernel as a meta
        # scalar too: see ``_to_meta``)
        entry = SYNC if unproven else self._checker._compute(*_numbers_as_tensors(self.tensor_slots, args, kwargs))
        if entry is SYNC or entry is None:
            # no metadata here, or the meta kernel raised: the node runs the op with a reply
            # (so its error is raised at this line)
            result = _call_sync(self.op, self.name, args, kwargs)
            if self.inplace:
                return self._written(args, kwargs)
            return result
        if self.inplace:
            specs = ()
        else:
            template = entry.template
            if not (template == 0 or (type(template) is tuple and template[0] == ("list" if self.returns_list else "tuple")
                                      and template[1] == list(range(len(entry.specs))))):
                return self._checker(self.op, args, kwargs)
            specs = tuple(entry.specs)
        if key is not None:
            self._remember(key, args, kwargs, specs)
        if self.inplace:
            rt = runtime()
            with rt.lock:
                queue_op(rt, self.name, args, kwargs)
            return self._written(args, kwargs)
        tensors = submit_with_outputs(self.name, args, kwargs, specs)
        if self.returns_list:
            return tensors
        return tensors[0] if len(tensors) == 1 else tuple(tensors)


# Structured reductions whose meta function sizes the out tensor to the elementwise result
# before the reduced one: through their generic kernel (``empty`` + ``X.out``) a CPU node's
# ``X.out`` printed PyTorch's "output ... resized" deprecation warning (the embedded node
# shares the program's terminal); their meta kernels give the layout without it.
_OUT_RESIZED_BY_META = frozenset({"aten::mse_loss", "aten::smooth_l1_loss"})


def _fresh_specs(result, args, kwargs):
    """Output specs of a structured op's result when every tensor in it is fresh (a storage
    of its own, at offset 0, no math bits); None otherwise."""
    tensors = [result] if isinstance(result, _Tensor) else list(result) if isinstance(result, (tuple, list)) else None
    if tensors is None:
        return None
    used = {storage_id_of(a) for a in (*args, *kwargs.values()) if isinstance(a, _Tensor) and on_device(a)}
    specs = []
    for t in tensors:
        if (not isinstance(t, _Tensor) or not on_device(t) or t.storage_offset() or t.is_conj() or t.is_neg()
                or storage_id_of(t) in used):
            return None
        spec = output_spec(t.shape, t.stride(), t.dtype)
        # (a larger storage is still the op's own: the reduced losses' meta functions size
        # their out to the elementwise loss, then back to 0-dim)
        if spec[4] > t.untyped_storage().nbytes():
            return None
        specs.append(spec)
    return tuple(specs)


_direct_plans: list = []


class _Schema:
    """Stands for an OpOverload where only its schema is read."""

    __slots__ = ("_schema",)

    def __init__(self, schema):
        self._schema = schema


def _register_direct(aten_library) -> None:
    """Give every structured op still served by the generic composite kernel, and every
    ``_foreach_`` op, a DirectPlan."""
    global _op_library
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    computed = torch._C._dispatch_get_computed_kernel_for_dispatch_key
    tracing = os.environ.get("GPUWIRE_TRACE", "") not in ("", "0")
    special = {_op_name(op) for op in SPECIAL}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        if not (has(qualified, "CompositeExplicitAutogradNonFunctional")
                or (qualified.startswith("aten::_foreach_") and has(qualified, "CompositeExplicitAutograd"))):
            continue
        if has(qualified, "PrivateUse1") or has(qualified, "CompositeImplicitAutograd") or qualified in special:
            continue
        name = qualified[len("aten::"):]
        packet, _, overload = name.partition(".")
        try:
            schema = torch._C._get_schema("aten::" + packet, overload)
        except RuntimeError:
            continue
        if not DirectPlan.fits(schema):
            continue
        plan = DirectPlan(_Schema(schema), computed(qualified, DispatchKey.PrivateUse1))
        _direct_plans.append(plan)
        kinds = None if tracing else _native_kinds(plan, schema)
        if kinds is not None:  # (its Python kernel until the native helper takes its place)
            if _op_library is None:
                _op_library = torch.library.Library("aten", "IMPL")
            _NATIVE_OPS.append(_native_entry(name, qualified, plan, kinds, 0 if plan.inplace else len(schema.returns),
                                             not plan.numbers, False))
            _op_library.impl(name, plan, "PrivateUse1", with_keyset=True)
            continue
        aten_library.impl(name, _traced_direct(plan) if tracing else plan, "PrivateUse1", with_keyset=True)


# Argument types the native op kernels key, encode and hand to Python (client/native.cpp
# ``Kind``); Optional[...] of each too.
_NATIVE_KINDS = {"Tensor": 0, "int": 1, "SymInt": 1, "List[int]": 2, "List[SymInt]": 2, "float": 3, "bool": 4,
                 "number": 5, "str": 6, "ScalarType": 7, "MemoryFormat": 8, "Layout": 9, "Device": 10,
                 "List[bool]": 11, "List[Tensor]": 12, "List[Optional[Tensor]]": 13}
# (name, qualified name, plan, kinds, results (0: in place on its first argument), numbers as
# numbers, results mirrored, FunctionalPlan rules: Scalars keyed by value, the inputs' mirrors
# dropped, the size of a first argument the Python path reads along) of the ops the native
# kernels serve
_NATIVE_OPS: list = []
_op_library = None  # their Python kernels until then


def _native_entry(name, qualified, plan, kinds, results, numbers_as_numbers, functional) -> tuple:
    """An ``_NATIVE_OPS`` entry. An op of ``mirror.OPS`` is served natively when the client
    mirrors none of its inputs (``Runtime.submit_native`` declines the others: the Python path
    computes their values), a predicate when its first argument is bigger than what a read of
    its result brings along (``mirror.after_op``)."""
    return (name, qualified, plan, kinds, results, numbers_as_numbers, qualified in mirror.OPS, functional,
            mirror.TINY if qualified in mirror.PREDICATES else 0)


def _native_kinds(plan, schema) -> bytes | None:
    """The native kernel's argument kinds for ``plan``'s op, or None where it does not serve
    the op: it serves functional ops with fresh tensor results whose arguments are all of
    ``_NATIVE_KINDS`` (the structured ops, ``add`` to ``addmm`` and ``native_layer_norm``, that
    make most of a step). The ops whose results the client mirrors (client/mirror.py) too: the
    runtime declines their calls whose inputs it mirrors (``Runtime.submit_native``), and the
    kernel a predicate's call on a tiny tensor (``_native_entry``), which the Python path serves."""
    if plan.returns_list:
        return None
    if plan.inplace:  # (``x.add_(y)``: writes its first argument, returns it)
        return _argument_kinds(schema, inplace=True) if plan.source is not None and plan.source[0] == 0 else None
    return _argument_kinds(schema)


def _argument_kinds(schema, inplace: bool = False) -> bytes | None:
    """``_NATIVE_KINDS`` of each argument of an op with fresh tensor results and no writes (or,
    ``inplace``, one that writes its first argument alone and returns it), or None."""
    returns, arguments = schema.returns, schema.arguments
    if inplace:
        written = arguments[0].alias_info if arguments else None
        if len(returns) != 1 or written is None or not written.is_write or returns[0].alias_info is None or \
                returns[0].alias_info.before_set != written.before_set or \
                any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:]):
            return None
    elif not returns or any(str(r.real_type) != "Tensor" or r.alias_info is not None for r in returns) or \
            any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
        return None
    kinds = []
    for argument in schema.arguments:
        text = str(argument.real_type)
        if text.startswith("Optional[") and text.endswith("]"):
            text = text[len("Optional["):-1]
        kind = _NATIVE_KINDS.get(text)
        if kind is None:
            return None
        kinds.append(kind)
    return bytes(kinds)


_PRIVATEUSE1_KEYSET = DispatchKeySet(DispatchKey.PrivateUse1)


class _KernelEntry:
    """A native op kernel's Python kernel that is not a ``DirectPlan``: one that hands its calls
    to the op's plan (``_fallback``), as the generic per-op kernels and ``fused``'s do."""

    __slots__ = ("kernel", "with_keyset", "qualified", "_op")

    def __init__(self, kernel, with_keyset: bool, qualified: str):
        self.kernel, self.with_keyset, self.qualified, self._op = kernel, with_keyset, qualified, None

    @property
    def op(self):
        if self._op is None:
            self._op = _aten_op(self.qualified)
        return self._op


def register_kernel(aten_library, name: str, kernel, with_keyset: bool = False) -> None:
    """``aten_library.impl(name, kernel, "PrivateUse1")`` for a kernel that runs ``name``'s calls
    through its plan; where the op's schema suits the native op kernels (fresh tensor results,
    arguments of ``_NATIVE_KINDS``) into ``_op_library``, which they replace."""
    global _op_library
    qualified = "aten::" + name
    kinds = None
    if os.environ.get("GPUWIRE_TRACE", "") in ("", "0") and \
            (qualified not in checks.MISSED_BY_META or qualified in checks.BY_SIGNATURE):
        packet, _, overload = qualified.partition(".")
        try:
            schema = torch._C._get_schema(packet, overload)
        except RuntimeError:
            schema = None
        if schema is not None:
            kinds, results = _argument_kinds(schema), len(schema.returns)
            if kinds is None:
                # (``relu_``, ``hardtanh_``: in-place ops that are not structured, whose MutatingPlan
                # checks a signature once; ``MutatingPlan.served_natively``)
                kinds, results = _argument_kinds(schema, inplace=True), 0
    if kinds is None:
        aten_library.impl(name, kernel, "PrivateUse1", with_keyset=with_keyset)
        return
    if _op_library is None:
        _op_library = torch.library.Library("aten", "IMPL")
    numbers_as_numbers = torch._C._should_allow_numbers_as_tensors(packet.split("::")[-1])
    _NATIVE_OPS.append(_native_entry(name, qualified, _KernelEntry(kernel, with_keyset, qualified), kinds, results,
                                     numbers_as_numbers, True))
    _op_library.impl(name, kernel, "PrivateUse1", with_keyset=with_keyset)


def _fresh_in_order(template, count: int) -> bool:
    return (template == 0 and count == 1) or template == ("tuple", list(range(count)))


def _native_learn(plan, args, kwargs):
    """A native op kernel's call that it does not serve itself: ``plan`` runs it as its Python
    kernel would. Returns (result, its output specs) when ``plan`` holds the specs for this
    call's signature now (the kernel serves the next call with it), else (result, None)."""
    if type(plan) is _KernelEntry:
        result = plan.kernel(_PRIVATEUSE1_KEYSET, *args, **kwargs) if plan.with_keyset else plan.kernel(*args, **kwargs)
        if plan.qualified == "aten::_to_copy":
            return result, _to_copy_specs(args, kwargs)
        functional = _PLANS.get(plan.op._op)
        if type(functional) is MutatingPlan:
            return result, functional.served_natively(args, kwargs)
        if type(functional) is not FunctionalPlan or functional.numbers and _numbers_in(functional.numbers, args, kwargs):
            return result, None
        try:
            entry = functional.cache.get(_call_key(args, kwargs, functional.by_class, functional.by_kind))
        except TypeError:
            return result, None
        if type(entry) is not _MetaEntry or not _fresh_in_order(entry.template, len(entry.specs)):
            return result, None
        return result, entry.specs
    result = plan(_PRIVATEUSE1_KEYSET, *args, **kwargs)
    if plan.local or plan.numbers and _numbers_in(plan.numbers, args, kwargs):
        return result, None
    if plan.check_every_call and type(args[0]) is torch.Tensor and not args[0].numel():
        # (the C++ kernels key numbers by kind, and this check reads a number's value, which can
        # only matter for an empty input: such calls stay Python's, the others are served natively)
        return result, None
    try:
        specs = plan.cache.get(plan.key(args, kwargs))
    except TypeError:
        return result, None
    return result, specs  # (an in-place op's are (): nothing fresh)


def _numbers_in(slots, args, kwargs) -> bool:
    return any(type(args[i] if not k and i < len(args) else kwargs.get(n)) in _NUMBER_TYPES for i, n, k in slots)


def _native_submit(name, nbytes, ref, body, out_tail, forget):
    """A native op kernel's message (``body``: its arguments encoded) with one fresh result of
    ``nbytes``: numbered, its result's address reserved and tracked (``ref``: the result
    storage's weak reference), queued. Returns the address, or None where the runtime cannot
    take it so (the kernel then calls the op's plan, which says why). ``forget``: the storage
    ids of its inputs, whose mirrored values it drops (a FunctionalPlan's op), or None."""
    rt = _runtime
    if rt is None:
        return None
    return rt.submit_native(name, nbytes, ref, body, out_tail, forget)


def _native_tables() -> tuple:
    """What the native op kernels need to hand memory formats, layouts and devices to Python and
    to encode them as ``wire.encode_default`` does: ({c10 enum value: (msgpack bytes, object)}
    for memory formats and layouts, torch.device, the msgpack of ``gpuwire:0`` and of ``gpuwire``)."""
    pack = functools.partial(msgpack.packb, default=wire.encode_default)
    formats = {0: torch.contiguous_format, 1: torch.preserve_format, 2: torch.channels_last, 3: torch.channels_last_3d}
    layouts = {0: torch.strided, 1: torch.sparse_coo, 2: torch.sparse_csr, 3: torch._mkldnn, 4: torch.sparse_csc,
               5: torch.sparse_bsr, 6: torch.sparse_bsc, 7: torch.jagged}
    return ({k: (pack(v), v) for k, v in formats.items()}, {k: (pack(v), v) for k, v in layouts.items()}, torch.device,
            pack(torch.device(DEVICE_TYPE, 0)), pack(torch.device(DEVICE_TYPE)))


def _native_submit_many(name, body, nbytes, refs, out_tails, forget):
    """``_native_submit`` of an op with several fresh results (a tuple of each): their addresses."""
    rt = _runtime
    if rt is None:
        return None
    return rt.submit_native_many(name, body, nbytes, refs, out_tails, forget)


def _traced_direct(plan):
    def kernel(keyset, *args, **kwargs):
        try:
            cached = plan.cache.get(plan.key(args, kwargs)) is not None
        except TypeError:
            cached = False
        result = plan(keyset, *args, **kwargs)
        _debug(f"{plan.name} [DirectPlan{'' if cached else ', learning'}]", [_shape(a) for a in args],
               {k: _shape(v) for k, v in kwargs.items()}, "->", _shape(result))
        return result
    return kernel


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        if on_device(value):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        if value.dim() == 0 and value.dtype not in _MASK_DTYPES and value.is_cpu:
            # A host scalar (``x * 2.0``'s wrapped number, a 0-dim CPU tensor) meets meta
            # tensors as a meta scalar: given a CPU one, the meta kernels of pointwise ops take
            # the Python references' path, whose output strides differ from TensorIterator's
            # (C++, on CPU and CUDA alike) on size-1 dimensions: ``(x * 2.0)`` of a batch-1
            # channels-last tensor came out channels-last by another stride than a CPU run's,
            # and the next group_norm took its channels-last kernel and rounded differently.
            # (Its dtype already promotes as the host scalar does; a mask keeps its values.)
            return torch.empty((), dtype=value.dtype, device="meta")
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value) if not isinstance(value, torch.Size) else value
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, _Generator):
        return None
    return value


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_infer_as_cpu = False  # the node runs CPU kernels: infer output metadata on fake CPU tensors
_fake_mode = None


def _norm_outputs_like_cpu(input_slot: int, param_slots: tuple, stat_outputs: tuple, grad_output: int | None = None):
    """A norm's saved statistics in the dtype its CPU kernel gives them: float32 for a half or
    bfloat16 input with float32 weights (what CUDA autocast makes of a BatchNorm after a half
    layer, a bf16 model that keeps its norms in float32), else the input's dtype. Meta and fake
    CPU kernels each get one of the two cases wrong; stored in the wrong dtype the statistics
    lost precision, and the batch-norm backward refused them (``mixed dtype (CPU)``)."""
    def fix(args, kwargs, result):
        x = args[input_slot] if len(args) > input_slot else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not isinstance(result, tuple):
            return result
        params = [args[i] for i in param_slots if i < len(args) and isinstance(args[i], torch.Tensor)]
        mixed = x.dtype in (torch.float16, torch.bfloat16) and bool(params) and params[0].dtype == torch.float32
        stats_dtype = torch.float32 if mixed else x.dtype
        fixed = list(result)
        for i in stat_outputs:
            if isinstance(fixed[i], torch.Tensor) and fixed[i].dtype != stats_dtype:
                fixed[i] = fixed[i].to(stats_dtype)
        if grad_output is not None and isinstance(fixed[grad_output], torch.Tensor) and fixed[grad_output].dtype != x.dtype:
            fixed[grad_output] = fixed[grad_output].to(x.dtype)
        return tuple(fixed)
    return fix


def _in_input_memory_format(input_slot: int, then=None, only_with_dims: bool = False):
    """Results in the memory format of the input (``suggest_memory_format``), as these CPU
    kernels make them where the meta kernels (modelled on CUDA's) give contiguous ones: the
    reflection/replication pads and their backwards, pixel (un)shuffle, channel shuffle,
    ``roll`` along dims, ``max_unpool2d``, and group norm's batch-1 stride. Channels-last
    convolutional nets on a CPU node would otherwise continue from a layout a CPU run does not
    have, and the next layout-sensitive kernel (convolution, group norm) rounds differently.
    ``then``: a fix to apply first; ``only_with_dims``: ``roll`` without dims flattens."""
    from torch._prims_common import suggest_memory_format

    def fix(args, kwargs, result):
        if then is not None:
            result = then(args, kwargs, result)
        x = args[input_slot] if len(args) > input_slot else None
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return result
        if only_with_dims and not (args[2] if len(args) > 2 else kwargs.get("dims")):
            return result
        memory_format = suggest_memory_format(x)
        if memory_format is torch.contiguous_format:
            return result

        def restride(r):
            if isinstance(r, torch.Tensor) and r.dim() == x.dim():
                return torch.empty(r.shape, dtype=r.dtype, device=r.device, memory_format=memory_format)
            return r
        return tuple(restride(r) for r in result) if isinstance(result, tuple) else restride(result)
    return fix


def _batch_norm_layout(then=None, input_slot: int = 0):
    """CPU batch norm's output layout: contiguous for a contiguous input, channels-last for a
    channels-last-contiguous one (a batch of one included, whatever its batch stride), else the
    suggested memory format. The meta kernels keep a batch-1 input's odd batch stride, which
    PyTorch's memory-format test then reads as another format than the CPU's result has."""
    from torch._prims_common import suggest_memory_format

    def fix(args, kwargs, result):
        if then is not None:
            result = then(args, kwargs, result)
        x = args[input_slot] if len(args) > input_slot else None
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5) or not isinstance(result, tuple) \
                or not isinstance(result[0], torch.Tensor) or result[0].shape != x.shape:
            return result
        channels_last = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        memory_format = (torch.contiguous_format if x.is_contiguous() else channels_last
                         if x.is_contiguous(memory_format=channels_last) else suggest_memory_format(x))
        out = result[0]
        return (torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=memory_format), *result[1:])
    return fix


def _contiguous_results(args, kwargs, result):
    """Contiguous results, as these CPU kernels allocate them (``LEGACY_CONTIGUOUS_MEMORY_FORMAT``)
    where the meta kernels keep a channels-last input's layout: the pointwise losses'
    backwards, ``glu_backward``, ``rrelu_with_noise``, ``log_sigmoid_forward``."""
    def contiguous(r):
        if isinstance(r, torch.Tensor) and not r.is_contiguous():
            return torch.empty(r.shape, dtype=r.dtype, device=r.device)
        return r
    return tuple(contiguous(r) for r in result) if isinstance(result, tuple) else contiguous(result)


# Ops whose C++ kernel (every device's) allocates the result with ``empty_like(input)``: a dense
# input's strides are kept exactly, where the meta kernels (Python references) recompute them and
# differ on size-1 dimensions: ``randn_like`` of a batch-1 channels-last tensor came out in a
# layout that PyTorch's memory-format test reads otherwise, and the next norm or convolution
# took another kernel than a local run's.
_LIKE_FACTORIES = frozenset({
    "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::rand_like",
    "aten::randn_like", "aten::randint_like", "aten::randint_like.low_dtype", "aten::randint_like.Tensor",
})
_PRESERVE_LAYOUT = _LIKE_FACTORIES | {"aten::flip", "aten::hardtanh", "aten::_prelu_kernel", "aten::huber_loss"}


def _preserved_layout(args, kwargs, result):
    x = args[0] if args else None
    if (not isinstance(x, torch.Tensor) or not isinstance(result, torch.Tensor) or result.shape != x.shape
            or kwargs.get("memory_format", torch.preserve_format) is not torch.preserve_format
            or result.stride() == x.stride() or not x.numel() or not dense_layout(x.shape, x.stride())):
        return result
    return torch.empty_strided(x.shape, x.stride(), dtype=result.dtype, device=result.device)


def _embedding_bag_cpu_outputs(forward_only: bool):
    """The auxiliary outputs of CPU ``_embedding_bag`` as its kernel makes them, where PyTorch's
    meta kernel guesses otherwise: with ``include_last_offset`` the CPU kernel sizes
    ``bag_size`` by the bags (mean, max, and sum when a backward may follow) or by the offsets
    (sum, forward only), and gives ``max_indices`` the shape of ``bag_size`` (sum, mean); and
    it takes the sum fast path (no ``offset2bag``) for bfloat16 weights too, which the meta
    kernel's test knows for float and half only."""
    return lambda args, kwargs, result: _fix_embedding_bag(args, kwargs, result, forward_only)


def _fix_embedding_bag(args, kwargs, result, forward_only: bool):
    def arg(i, name, default):
        return args[i] if len(args) > i else kwargs.get(name, default)
    weight, offsets, mode = args[0], arg(2, "offsets", None), arg(4, "mode", 0)
    scale, include_last = arg(6, "per_sample_weights", None), bool(arg(7, "include_last_offset", False))
    padding_idx = arg(8, "padding_idx", -1)
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or weight.dim() != 2 or len(result) != 4:
        return result
    output, offset2bag, bag_size, max_indices = result
    if (mode == 0 and weight.dtype == torch.bfloat16 and weight.stride(1) == 1 and output.stride(1) == 1
            and padding_idx is not None and padding_idx < 0 and (scale is None or scale.stride(0) == 1)):
        offset2bag = offset2bag.new_empty(0)
    bags = offsets.size(0) - (1 if include_last else 0)
    bag_shape = tuple(offsets.shape) if mode == 0 and forward_only else (bags,)
    if tuple(bag_size.shape) != bag_shape:
        bag_size = bag_size.new_empty(bag_shape)
    max_shape = (bags, weight.size(1)) if mode == 2 else bag_shape
    if tuple(max_indices.shape) != max_shape:
        max_indices = max_indices.new_empty(max_shape)
    return _embedding_bag_index_dtype(args, kwargs, (output, offset2bag, bag_size, max_indices))


def _embedding_bag_index_dtype(args, kwargs, result):
    """``_embedding_bag``'s auxiliary outputs in the dtype both kernels use, indices and offsets
    promoted to one (ATen ``promoteIndicesAndOffsets``): PyTorch's meta kernel takes the offsets'
    dtype on CPU and the indices' elsewhere, and int64 indices with int32 offsets (or the reverse)
    declared int32 outputs for int64 data, which the backward then refused ("expected scalar type
    Long but found Int")."""
    indices, offsets = _get_arg(args, kwargs, 1, "indices", False), _get_arg(args, kwargs, 2, "offsets", False)
    if not (isinstance(indices, torch.Tensor) and isinstance(offsets, torch.Tensor)) or len(result) != 4:
        return result
    index_dtype = torch.promote_types(indices.dtype, offsets.dtype)
    output, *auxiliary = result
    return (output, *(t if t.dtype == index_dtype else t.new_empty(t.shape, dtype=index_dtype) for t in auxiliary))


# Ops whose meta kernel gives other output metadata (shape, strides, dtype) than their CPU
# kernel: a CPU node's client infers them on fake CPU tensors. Found by comparing meta with fake
# CPU on every aten call (forward and backward) of PyTorch's OpInfo samples in float32 and
# bfloat16 and of the Hugging Face and CNN/RNN training steps in tests/ (scan script:
# tests/conformance/meta_vs_cpu.py). An op left out that disagrees on shape fails with a clear
# error from the node; on strides, the node copies its result into the declared layout.
_CPU_DIFFERS_FROM_META = frozenset({
    "aten::native_batch_norm", "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit.no_stats",
    "aten::_native_batch_norm_legit_no_training", "aten::_native_batch_norm_legit_functional",
    "aten::_batch_norm_with_update", "aten::_batch_norm_with_update_functional", "aten::_batch_norm_no_update",
    "aten::_embedding_bag", "aten::_embedding_bag_forward_only", "aten::convolution.default",
    "aten::_fft_r2c", "aten::_fft_c2r", "aten::_fft_c2c", "aten::_linalg_svd", "aten::linalg_eig",
})

def _unbatched_max_pool3d_layout(args, kwargs, result):
    """``max_pool3d_with_indices`` of an unbatched (4-d) input laid out as one channels-last-3d
    sample: CPU's kernel pools it as that sample and returns the output and indices in its layout,
    where PyTorch's meta kernel keeps channels-last to 5-d inputs."""
    source = args[0]
    if source.dim() != 4:
        return result
    as_sample = torch.empty_strided((1, *source.shape), (source.numel(), *source.stride()), device="meta")
    if torch._prims_common.suggest_memory_format(as_sample) is not torch.channels_last_3d:
        return result
    return tuple(r.unsqueeze(0).contiguous(memory_format=torch.channels_last_3d).squeeze(0) for r in result)


def _multilabel_margin_cpu_outputs(args, kwargs, result):
    """``multilabel_margin_loss_forward`` of one sample (a 1-d input) without reduction: CPU's
    kernel returns a 0-d loss where the meta kernel gives shape (1,)."""
    output, is_target = result
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == 0 and args[0].dim() <= 1 and output.dim() == 1:
        output = output.reshape(())
    return output, is_target


# ops whose CPU kernel's output metadata differs from what fake CPU tensors give
_CPU_KERNEL_FIXES = {
    "aten::multilabel_margin_loss_forward": _multilabel_margin_cpu_outputs,
    "aten::max_pool3d_with_indices": _unbatched_max_pool3d_layout,
    "aten::_embedding_bag": _embedding_bag_cpu_outputs(forward_only=False),
    "aten::_embedding_bag_forward_only": _embedding_bag_cpu_outputs(forward_only=True),
    **{name: _batch_norm_layout(_norm_outputs_like_cpu(0, (1, 2, 3, 4), (1, 2))) for name in (
        "aten::native_batch_norm", "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit.no_stats",
        "aten::_native_batch_norm_legit_no_training", "aten::_native_batch_norm_legit_functional",
        "aten::_batch_norm_with_update", "aten::_batch_norm_with_update_functional", "aten::_batch_norm_no_update")},
    # (grad_out, input, ...): the input's gradient in the layout of the forward's output
    "aten::native_batch_norm_backward": _batch_norm_layout(input_slot=1),
    "aten::native_layer_norm": _norm_outputs_like_cpu(0, (2, 3), (1, 2)),
    "aten::native_group_norm": _in_input_memory_format(0, then=_norm_outputs_like_cpu(0, (1, 2), (1, 2))),
    # (grad_out, input, mean, rstd, weight, ...): the input's gradient has the input's dtype
    "aten::native_group_norm_backward": _in_input_memory_format(
        1, then=_norm_outputs_like_cpu(1, (4,), (), grad_output=0)),
    **{f"aten::{name}": _in_input_memory_format(0) for name in (
        "reflection_pad2d", "replication_pad2d", "reflection_pad3d", "replication_pad3d",
        "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "max_unpool2d")},
    **{f"aten::{name}_backward": _in_input_memory_format(1) for name in (  # (grad_output, input, ...)
        "reflection_pad2d", "replication_pad2d", "reflection_pad3d", "replication_pad3d")},
    "aten::roll": _in_input_memory_format(0, only_with_dims=True),
    **{f"aten::{name}": _contiguous_results for name in (
        "mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward", "glu_backward",
        "rrelu_with_noise", "log_sigmoid_forward")},
}


def _fake_cpu_mode():
    global _fake_mode
    if _fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        # no fallback kernels: an op without a meta kernel becomes a sync op, it never runs
        # a real kernel on the client
        _fake_mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    return _fake_mode


_CPU = torch.device("cpu")


def _to_fake_cpu(value, mode):
    if isinstance(value, torch.Tensor):
        if on_device(value):
            from torch._subclasses.fake_tensor import FakeTensor
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            return FakeTensor(mode, meta, _CPU)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fake_cpu(v, mode) for v in value) if not isinstance(value, torch.Size) else value
    if isinstance(value, torch.device):
        return _CPU if value.type == DEVICE_TYPE else value
    if isinstance(value, _Generator):
        return None
    return value


def _template(result, specs, sources, top=True):
    """A recipe to rebuild ``result``'s structure from the fresh output tensors."""
    if top and isinstance(result, tuple) and len(sources) == len(result):
        return ("tuple", [("arg", sources[i]) if sources[i] else _template(r, specs, sources, False)
                          for i, r in enumerate(result)])
    if top and len(sources) == 1 and sources[0] is not None:
        return ("arg", sources[0])
    if isinstance(result, torch.Tensor):
        specs.append(output_spec(result.shape, result.stride(), result.dtype))
        return len(specs) - 1
    if isinstance(result, (tuple, list)):
        return ("tuple" if isinstance(result, tuple) else "list", [_template(r, specs, sources, False) for r in result])
    return ("value", result)


def _build(template, tensors, args, kwargs):
    if type(template) is int:
        return tensors[template]
    kind, value = template
    if kind == "tuple":
        return tuple(_build(t, tensors, args, kwargs) for t in value)
    if kind == "list":
        return [_build(t, tensors, args, kwargs) for t in value]
    if kind == "arg":
        return _get_arg(args, kwargs, *value)
    return value


class SyncPlan:
    """Ops whose results are not tensors (or have data-dependent shapes): one round trip."""

    def __init__(self, op):
        self.name = _op_name(op)
        self.numbers = _number_slots(op)

    def __call__(self, op, args, kwargs):
        if self.numbers:
            args, kwargs = _numbers_as_tensors(self.numbers, args, kwargs)
        return _call_sync(op, self.name, args, kwargs)


def _call_sync(op, name, args, kwargs):
    proving = getattr(_state, "proving", None)
    if proving is not None:
        _state.proving = None  # (a call that fails proves nothing: the next sync call must not take it)
    rt = runtime()
    with rt.lock:
        value = rt.call_sync(name, args, kwargs)
        result = _from_result(rt, value)
    if proving is not None:
        _PROVEN_DTYPES.add(proving)
    if rt.node_warnings:
        rt.say_node_warnings()
    if len(op._schema.returns) > 1 and isinstance(result, list):
        return tuple(result)
    return result


def _real_stand_in(x):
    """A ``*_like`` factory reads only its input's metadata, but the node's kernel takes the
    input itself: a fake tensor (FakeTensorMode's fallback for an op with no fake kernel makes
    its real inputs with ``zeros_like(fake, device=...)`` under ``no_dispatch()``) has no
    storage there. An empty tensor of the same layout stands in for it."""
    from torch._subclasses.fake_tensor import FakeTensor
    if not isinstance(x, FakeTensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _from_result(rt: Runtime, value):
    from ..protocol.events import NewTensor

    if isinstance(value, NewTensor):
        return wrap_storage(rt, value.storage_id, value.nbytes, value.sizes, value.strides,
                            CODE_DTYPE[value.dtype], value.offset)
    if isinstance(value, list):
        return [_from_result(rt, v) for v in value]
    return value


# ---------------------------------------------------------------- ops with their own handling


_LAYOUTS: dict = {}  # (sizes, dtype, memory_format) -> (strides, nbytes)


def _fill_uninitialized(t: torch.Tensor) -> torch.Tensor:
    """ATen's ``fill_empty_deterministic_``: under ``torch.use_deterministic_algorithms(True)``
    (with ``torch.utils.deterministic.fill_uninitialized_memory``, its default) new memory is
    NaN, or the dtype's largest value (True for bool), never what happened to be there; a node's
    fresh memory is zeros, which a program checking for uninitialized reads would take as data."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    return t.fill_(True if t.dtype is torch.bool else torch.iinfo(t.dtype).max)


def _made_empty(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    """What ATen's ``empty`` does beyond allocating, for an empty tensor the client made: its
    complex32 warning, its deterministic fill, else the note that ``t`` is fresh."""
    if t.dtype is torch.complex32:
        checks.warn_once("ComplexHalf support is experimental and many operators don't support it yet.")
    if _DETERMINISTIC() and _FILL_UNINITIALIZED():
        return _fill_uninitialized(t)
    # weak: must not keep the last allocation alive; with the sequence number right after its
    # Alloc, so that a tensor the program made and wrote to since is not taken for C++'s own
    _state.fresh = (weakref.ref(t), rt.seq)
    return t


def _empty_memory_format(op, args, kwargs):
    sizes = tuple(args[0])
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    memory_format = kwargs.get("memory_format")
    key = (sizes, dtype, memory_format)
    layout = _LAYOUTS.get(key)
    if layout is None:
        checks.nonnegative_sizes(sizes)
        if memory_format is None or memory_format is torch.contiguous_format or memory_format is torch.preserve_format:
            strides = _contiguous_strides(sizes)
        else:
            strides = tuple(torch.empty(sizes, device="meta", memory_format=memory_format).stride())
        layout = (strides, _storage_nbytes(sizes, strides, dtype.itemsize))
        if len(_LAYOUTS) < 65536:
            _LAYOUTS[key] = layout
    strides, nbytes = layout
    rt = runtime()
    with rt.lock:
        t = wrap_storage(rt, rt.allocate(nbytes), nbytes, sizes, strides, dtype)
    return _made_empty(rt, t)


def _empty_strided(op, args, kwargs):
    sizes, strides = tuple(args[0]), tuple(args[1])
    if len(sizes) != len(strides):  # (ATen's check; ``set_`` below would say only "out of bounds")
        raise RuntimeError(f"dimensionality of sizes ({len(sizes)}) must match dimensionality of strides "
                           f"({len(strides)})")
    checks.nonnegative_sizes(sizes)
    dtype = kwargs.get("dtype") or (args[2] if len(args) > 2 and args[2] is not None else torch.get_default_dtype())
    rt = runtime()
    with rt.lock:
        t = new_empty(rt, sizes, strides, dtype)
    return _made_empty(rt, t)


def _plain(t: torch.Tensor) -> bool:
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _host_bytes(src: torch.Tensor):
    """The bytes an upload of ``src`` sends, and ``unchanged()``: whether those bytes are still
    what was sent. The recovery log keeps them by reference while that holds, not a copy.

    A private copy (a non-contiguous or conjugated source) never changes. The program's own
    tensor is unchanged while its version counter is (every in-place op on it or on a view of it
    bumps that), or once nothing but the log refers to the old bytes: ``module.to(device)``
    re-points each parameter at its device copy (``param.data = ...``), after which the
    optimizer's in-place updates bump the counter without touching the host bytes. An inference
    tensor has no counter: None, and the log copies its bytes."""
    c = src.detach().resolve_conj().resolve_neg().contiguous()
    if c.numel() == 0:
        return memoryview(b""), _always
    flat = c.reshape(-1).view(torch.uint8)
    data = memoryview(flat.numpy())
    if c.data_ptr() != src.data_ptr():
        return data, _always
    del c, flat
    if src.is_inference():
        return data, None  # (no version counter: the recovery log keeps a copy)
    storage = src.untyped_storage()  # ours: this and the byte view the memoryview keeps alive
    ptr, version = storage.data_ptr(), src._version

    def unchanged() -> bool:
        if src._version == version:
            return True
        return src.untyped_storage().data_ptr() != ptr and _use_count(storage._cdata) <= _OURS
    return data, unchanged


_use_count = torch._C._storage_Use_Count
_OURS = 2


def _always() -> bool:
    return True


def upload(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Host → device copy into ``dst`` (broadcasting and dtype conversion as ``copy_``)."""
    rt = runtime()
    with rt.lock:
        if src.dtype == dst.dtype and src.shape == dst.shape and _plain(dst):
            data, unchanged = _host_bytes(src)
            storage_id = storage_id_of(dst)
            if dst.storage_offset() == 0 and data.nbytes == dst.untyped_storage().nbytes():
                rt.mark_overwrite(storage_id)
            rt.write(storage_id, dst.storage_offset() * dst.element_size(), data, unchanged)
            if data.nbytes <= mirror.MAX_BYTES:
                mirror.remember(rt, dst, src)
            return dst
        staging = new_empty(rt, tuple(src.shape), _contiguous_strides(tuple(src.shape)), src.dtype)
        data, unchanged = _host_bytes(src)
        rt.write(storage_id_of(staging), 0, data, unchanged)
        rt.submit(rt.encode_op("aten::copy_", (dst, staging), {}, ()))
    return dst


# large downloads land in recycled warm blocks (``_memory.RecyclingHostTensors``)
DOWNLOADS = RecyclingHostTensors(StorageCache(max_bytes=1 << 30, min_bytes=8 << 20, max_age=10.0))


def download(src: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """Device → host: a CPU tensor with ``src``'s values (one round trip, none when the client
    knows them: ``client/mirror.py``). The bytes are received straight into ``into`` (a
    contiguous CPU tensor of the same shape and dtype) or into a new tensor."""
    rt = runtime()
    if rt.mirror:
        known = mirror.host_view(rt, src)
        if known is not None:
            if into is None:
                return known.clone(memory_format=torch.contiguous_format)
            return into.copy_(known)
    host = into if into is not None else DOWNLOADS.empty(tuple(src.shape), src.dtype)
    with rt.lock:
        if not _plain(src):
            src = aten.clone.default(src, memory_format=torch.contiguous_format)
        nbytes = src.numel() * src.element_size()
        # as_strided, not reshape(-1): a contiguous tensor may keep any stride on a size-1 dim
        # (a one-element diagonal, an expand), and view(uint8) needs stride 1
        flat = host.as_strided((host.numel(),), (1,))
        target = memoryview(flat.view(torch.uint8).numpy()) if nbytes else None
        along = rt.read_along.pop(storage_id_of(src), None) if rt.read_along else None
        if along is not None and nbytes:
            along_host = torch.empty(along.shape, dtype=along.dtype)
            rt.read_many([(storage_id_of(src), src.storage_offset() * src.element_size(), nbytes, target),
                          (storage_id_of(along), 0, along_host.numel() * along_host.element_size(),
                           memoryview(along_host.view(-1).view(torch.uint8).numpy()))])
            mirror.remember_read(rt, along, along_host)
        else:
            rt.read(storage_id_of(src), src.storage_offset() * src.element_size(), nbytes, into=target)
        if nbytes <= mirror.MAX_BYTES:
            mirror.remember_read(rt, src, host)
    return host


def _copy_from(op, args, kwargs):
    src, dst = args[0], args[1]
    src_remote = on_device(src)
    dst_remote = on_device(dst)
    if dst_remote and src.shape != dst.shape:
        checks.broadcast_into(dst.shape, src.shape)
    if dst_remote and checks.internal_overlap(dst):  # (ATen's TensorIterator refuses it, for any source)
        raise RuntimeError(checks.INTERNAL_OVERLAP_MESSAGE)
    if src_remote and dst_remote:
        if storage_id_of(src) == storage_id_of(dst) and checks.overlap(dst, src) and not checks.same_memory(dst, src):
            raise RuntimeError(checks.OVERLAP_MESSAGE)
        rt = runtime()
        with rt.lock:
            known = None
            if rt.mirror:  # a copy writes into ``dst``'s storage and nowhere else
                # (not from ``dst``'s own storage: ``x.copy_(x.t())`` overlaps, which the
                # node's copy refuses, writing nothing: the mirror must not hold its result)
                if storage_id_of(src) != storage_id_of(dst):
                    known = mirror.host_view(rt, src)
                rt.mirror.pop(storage_id_of(dst), None)
            rt.submit_fresh(rt.encode_op("aten::copy_", (dst, src), {}, ()))
            if known is not None:
                mirror.remember(rt, dst, known)
        return dst
    if dst_remote:
        return upload(src, dst)
    if (dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous()
            and not dst.is_conj() and not dst.is_neg() and not dst.requires_grad):
        download(src, into=dst)
    else:
        dst.copy_(download(src))
    return dst


def _copy_from_and_resize(op, args, kwargs):
    src, dst = args[0], args[1]
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return _copy_from(op, (src, dst), {})


def _local_scalar_dense(op, args, kwargs):
    t = args[0]
    rt = runtime()
    storage_id = storage_id_of(t)
    reads = rt.scalar_reads
    if storage_id not in reads:
        if len(reads) >= 8:  # (the oldest goes: zipped iterations read a few storages in turn)
            del reads[next(iter(reads))]
        reads[storage_id] = True
    elif storage_id not in rt.mirror:
        with rt.lock:
            mirror.read_whole(rt, t)
    return download(t).item()


def _resize(op, args, kwargs):
    t, sizes = args[0], tuple(args[1])
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if memory_format is None and tuple(t.shape) == sizes:
        # (ATen keeps the tensor as it is: ``torch.ones(5, out=x[::2])`` resizes its out tensor
        # to its own size, and wrote base[0:5] instead of every other element)
        return t
    if memory_format is torch.preserve_format:
        raise RuntimeError("Unsupported memory formatPreserve")
    if memory_format is None or memory_format is torch.contiguous_format:
        strides = _contiguous_strides(sizes)
    else:
        strides = tuple(torch.empty(sizes, device="meta", memory_format=memory_format).stride())
    offset = t.storage_offset()
    needed = _storage_nbytes(sizes, strides, t.element_size(), offset)
    storage = t.untyped_storage()
    if needed > storage.nbytes():
        rt = runtime()
        with rt.lock:
            old_nbytes = storage.nbytes()
            grown = new_empty(rt, (needed,), (1,), torch.uint8)
            if old_nbytes:
                old = _create_empty((old_nbytes,), torch.uint8)
                _set_storage(old, storage, 0, (old_nbytes,), (1,))
                rt.submit(rt.encode_op("aten::copy_", (grown[:old_nbytes], old), {}, ()))
            storage = grown.untyped_storage()
        _set_storage(t, storage, offset, sizes, strides)
        if _DETERMINISTIC() and _FILL_UNINITIALIZED():  # (ATen's ``fill_resize_deterministic_``: the new bytes)
            itemsize = t.element_size()
            grown_part = _create_empty((0,), t.dtype)
            _set_storage(grown_part, storage, old_nbytes // itemsize, (needed // itemsize - old_nbytes // itemsize,),
                         (1,))
            _fill_uninitialized(grown_part)
        return t
    _set_storage(t, storage, offset, sizes, strides)
    return t


def _set_empty(op, args, kwargs):
    t = args[0]
    rt = runtime()
    with rt.lock:
        fresh = new_empty(rt, (0,), (1,), t.dtype)
    _set_storage(t, fresh.untyped_storage(), 0, (0,), (1,))
    return t


def _is_pinned(op, args, kwargs):
    return False


def _record_stream(op, args, kwargs):
    return None


def _local(op, args, kwargs):
    return op.redispatch(CPU_KEYSET, *args, **kwargs)


SPECIAL = {
    aten.empty.memory_format: _empty_memory_format,
    aten.empty_strided.default: _empty_strided,
    aten._copy_from.default: _copy_from,
    aten._copy_from_and_resize.default: _copy_from_and_resize,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.resize_.default: _resize,
    aten.set_.source_Storage_storage_offset: _local,
    aten.set_.source_Storage: _local,
    aten.set_.source_Tensor: _local,
    aten.set_.default: _set_empty,
    aten.is_set_to.default: _local,
    aten._unsafe_view.default: _local,
    aten.is_pinned.default: _is_pinned,
    aten.record_stream.default: _record_stream,
    # a NaN or inf in the input raises "input tensor should not contain infs or NaNs" at the call
    # on CPU and on CUDA (whose eig runs on the host): so here, with a reply, not at a later line
    aten.linalg_eig.default: SyncPlan(aten.linalg_eig.default),
}


def _cudnn_conv_layout(input_slot: int, weight_slot: int, outputs: tuple[int, ...] | None):
    """A convolution's layout on a CUDA node, as cuDNN gives it (ATen's
    ``cudnn_conv_suggest_memory_format``): channels-last when the input or the weight is, for
    2-d and 3-d convolutions in float32, half and bfloat16 with cuDNN enabled. The meta kernel
    cannot tell the backend and answers contiguous: a channels-last net on a CUDA node then
    went on in another layout than on a local GPU (seen on an H200: each convolution's result
    copied into the contiguous layout, and every later op ran in it). ``outputs``: the slots of
    a result tuple that take the layout (None: the result itself)."""
    from torch._prims_common import suggest_memory_format

    def fix(args, kwargs, result):
        x = args[input_slot] if len(args) > input_slot else None
        w = args[weight_slot] if len(args) > weight_slot else None
        if (not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() not in (4, 5)
                or x.dim() != w.dim() or not x.numel() or not torch.backends.cudnn.enabled
                or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
            return result
        channels_last = torch.channels_last if w.dim() == 4 else torch.channels_last_3d
        if channels_last not in (suggest_memory_format(x), suggest_memory_format(w)):
            return result

        def restride(r):
            if isinstance(r, torch.Tensor) and r.dim() == w.dim():
                return torch.empty(r.shape, dtype=r.dtype, device=r.device, memory_format=channels_last)
            return r
        if outputs is None:
            return restride(result)
        return tuple(restride(r) if i in outputs else r for i, r in enumerate(result))
    return fix


# ops whose CUDA kernel's output metadata differs from what the meta kernel gives
def _nansum_of_no_dims(args, kwargs, result):
    """``nansum(x, dim=())`` reduces every dim on CPU and CUDA (``make_dim_mask``: an empty
    list means all), where its meta kernel reduces none."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or len(dim) or not isinstance(result, torch.Tensor) or not isinstance(args[0], torch.Tensor):
        return result
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return torch.empty((1,) * args[0].dim() if keepdim else (), dtype=result.dtype, device=result.device)


def _multi_margin_loss_of_a_scalar_target(args, kwargs, result):
    """``multi_margin_loss(x, target, reduction="none")`` with a 0-d target: the CPU and CUDA
    kernels give a 0-d loss (``reduction == None && target.dim() > 0`` sizes it by the batch,
    else ``{}``), where the meta kernel gives ``[1]``."""
    target = _get_arg(args, kwargs, 1, "target", False)
    reduction = _get_arg(args, kwargs, 5, "reduction", False)  # (absent: mean)
    if reduction != 0 or not isinstance(result, torch.Tensor) or not isinstance(target, torch.Tensor) or target.dim():
        return result
    return torch.empty((), dtype=result.dtype, device=result.device)


_KERNEL_FIXES_EVERYWHERE = {"aten::nansum": _nansum_of_no_dims,
                            "aten::multi_margin_loss": _multi_margin_loss_of_a_scalar_target}
_CPU_KERNEL_FIXES.update(_KERNEL_FIXES_EVERYWHERE)

_CUDA_KERNEL_FIXES = {
    **_KERNEL_FIXES_EVERYWHERE,
    "aten::convolution.default": _cudnn_conv_layout(0, 1, None),
    # (grad_output, input, weight, ...) -> (grad_input, grad_weight, grad_bias)
    "aten::convolution_backward.default": _cudnn_conv_layout(1, 2, (0, 1)),
    # a CUDA node runs group norm on a contiguous copy of a channels-last input (node/ops.py)
    "aten::native_group_norm": _contiguous_results,
    "aten::native_group_norm_backward": _contiguous_results,
    "aten::_embedding_bag": _embedding_bag_index_dtype,
    "aten::_embedding_bag_forward_only": _embedding_bag_index_dtype,
}


# ---------------------------------------------------------------- ops registered by name


class _RenamedPlan(FunctionalPlan):
    """Convolution reaches a PrivateUse1 backend only as ``convolution_overrideable``; the
    node runs the real ``aten::convolution`` (so cuDNN/oneDNN picks the kernel there)."""

    def __init__(self, op, target, name: str, adapt=None):
        super().__init__(target)
        self.name = name
        self.sources = _alias_sources(target)
        self.adapt = adapt

    def __call__(self, op, args, kwargs):
        if self.adapt is not None:
            args = self.adapt(args)
        return super().__call__(self.meta_op, args, kwargs)


def _conv_backward_args(args):
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask = args
    bias_channels = weight.shape[1] * groups if transposed else weight.shape[0]
    return (grad_output, input, weight, [bias_channels], stride, padding, dilation, transposed,
            output_padding, groups, output_mask)


_conv_plan = None
_conv_backward_plan = None


def _convolution_overrideable(*args):
    return _conv_plan(None, args, {})


def _convolution_backward_overrideable(*args):
    return _conv_backward_plan(None, args, {})


_to_copy_composite = None  # aten's own _to_copy kernel for our key, which ours wraps
_UNINITIALIZED = torch.nn.parameter.UninitializedTensorMixin


def _to_copy(keyset, *args, **kwargs):
    """``_to_copy`` of a gpuwire tensor. A device→host copy with ``non_blocking=True`` (or
    ``pin_memory=True``) makes aten allocate pinned CPU memory through the PrivateUse1 hooks,
    which a Python backend cannot implement ("getPinnedMemoryAllocator"). A download is
    synchronous here anyway: run it as a blocking copy into ordinary memory."""
    if args and isinstance(args[0], _UNINITIALIZED):
        # a lazy module's parameter before its first forward (``nn.LazyLinear(4).to(device)``):
        # its ``shape`` raises by design; what is copied is the empty tensor under it
        args = (args[0].as_subclass(torch.Tensor), *args[1:])
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        if kwargs.get("non_blocking") or kwargs.get("pin_memory"):
            kwargs = dict(kwargs, non_blocking=False, pin_memory=None)
        src = args[0] if len(args) == 1 else None
        if (src is not None and _byte_copy(src, kwargs) and not src.is_conj() and not src.is_neg()
                and (src.numel() * src.element_size() >= DOWNLOADS.cache.min_bytes
                     or src.stride() == _contiguous_strides(tuple(src.shape)))):
            # large: into a recycled warm block (``DOWNLOADS``), not fresh pages; small (``.cpu()``,
            # ``.tolist()`` of metrics): directly, not through aten's composite (an empty CPU
            # tensor, then ``copy_`` through a Python kernel), when its layout is aten's anyway
            return download(src)
    elif len(args) == 1 and (device is None or torch.device(device).type == DEVICE_TYPE):
        src = args[0]
        copied = _to_copy_on_device(src, kwargs) if on_device(src) else _to_copy_from_host(src, kwargs)
        if copied is not None:
            return copied
    return _to_copy_composite.call_boxed(keyset, *args, **kwargs)


_BYTE_COPY_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _byte_copy(src, kwargs) -> bool:
    """Whether ``_to_copy(src, **kwargs)`` to another device is a copy of ``src``'s bytes as they
    lie: dtype and strided layout kept, no pinned memory, a contiguous source whose contiguous
    layout the memory format keeps."""
    return (kwargs.get("dtype") in (None, src.dtype) and kwargs.get("layout") in _TO_COPY_DEFAULTS
            and not kwargs.get("pin_memory") and kwargs.get("memory_format") in _BYTE_COPY_FORMATS
            and src.is_contiguous())


def _to_copy_from_host(src, kwargs):
    """``x.to(device)`` of a contiguous host tensor, its dtype kept (a batch every step, every
    weight of ``model.to(device)``): the new device tensor and its upload, directly. Left to aten's
    kernel it is ``empty_strided`` then ``copy_`` through two Python kernels. The result's
    layout is aten's: the source's strides under ``preserve_format``, else contiguous. None: not
    this case (aten's kernel)."""
    if not src.is_cpu or src.layout is not torch.strided or src.is_quantized or not _byte_copy(src, kwargs):
        return None
    if kwargs.get("memory_format") is torch.contiguous_format:
        strides = _contiguous_strides(tuple(src.shape))
    else:
        strides = tuple(src.stride())
    rt = runtime()
    with rt.lock:
        dst = new_empty(rt, tuple(src.shape), strides, src.dtype)
    if src.numel() == 0:
        # nothing to send (transformers' KV caches start as ``torch.tensor([], device=...)``,
        # two a layer every training step): 20.6 -> 16.6 us a call
        mirror.remember(rt, dst, src)
        return dst
    return upload(src, dst)


# (dtype, sizes, strides, target dtype, memory format) -> output spec of ``_to_copy`` on the device
_TO_COPY_SPECS: dict = {}
INFERENCE_CACHES.append(_TO_COPY_SPECS)
_TO_COPY_DEFAULTS = (None, torch.strided)


def _to_copy_specs(args, kwargs):
    """The output specs ``_to_copy_on_device`` holds for this call, when it served it (a copy
    from the device to the device), else None."""
    device = kwargs.get("device")
    if len(args) != 1 or not on_device(args[0]) or (device is not None and torch.device(device).type != DEVICE_TYPE):
        return None
    if kwargs.get("layout") not in _TO_COPY_DEFAULTS or kwargs.get("pin_memory"):
        return None
    src = args[0]
    spec = _TO_COPY_SPECS.get((src.dtype, src.shape, src.stride(), kwargs.get("dtype") or src.dtype,
                               kwargs.get("memory_format")))
    return None if spec is None else (spec,)


def _to_copy_on_device(src, kwargs):
    """``_to_copy`` from the device to the device (``x.to(torch.bfloat16)``, ``x.half()``,
    autocast's casts of every weight, ``x.to(memory_format=...)``) as one message whose result
    layout is known here. Left to aten's kernel it is ``empty_strided`` then ``_copy_from``
    through two Python kernels (32 us a call against 13 us for ``x + 1``). The layout is the
    meta kernel's answer for the source's layout, cached (a lazy conj/neg bit of the source
    travels in its descriptor and is resolved by the node's copy, as by aten's). None: not this
    case (aten's kernel); the caller has checked that ``src`` is on the device."""
    if kwargs.get("layout") not in _TO_COPY_DEFAULTS or kwargs.get("pin_memory"):
        return None
    dtype = kwargs.get("dtype") or src.dtype
    memory_format = kwargs.get("memory_format")
    key = (src.dtype, src.shape, src.stride(), dtype, memory_format)
    spec = _TO_COPY_SPECS.get(key)
    if spec is None:
        meta = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta")
        out = aten._to_copy.default(meta, dtype=dtype, memory_format=memory_format)
        sizes, strides = tuple(out.shape), tuple(out.stride())
        spec = (sizes, strides, dtype, DTYPE_CODE[dtype], _storage_nbytes(sizes, strides, dtype.itemsize))
        if len(_TO_COPY_SPECS) >= _CACHE_MAX:
            _TO_COPY_SPECS.clear()
        _TO_COPY_SPECS[key] = spec
    node_kwargs = {"dtype": dtype}
    if memory_format is not None:
        node_kwargs["memory_format"] = memory_format
    sizes, strides, _, code, nbytes = spec
    rt = runtime()
    with rt.lock:
        # writes only its fresh result: the values known of ``src`` stay known, and become
        # those of the copy (``client/mirror.py``), as with ``_copy_from``
        known = mirror.host_view(rt, src) if rt.mirror else None
        storage_id = rt.reserve(nbytes)
        copy = wrap_storage(rt, storage_id, nbytes, sizes, strides, dtype)
        rt.submit_fresh(rt.encode_op("aten::_to_copy", (src,), node_kwargs,
                                          ((storage_id, nbytes, sizes, strides, code),)))
        if known is not None:
            mirror.remember(rt, copy, known)
    return copy


# ---------------------------------------------------------------- registration


def register() -> None:
    """Make ``torch.device("gpuwire")`` exist in this process (idempotent, no connection)."""
    global _registered, DEVICE, _conv_plan, _conv_backward_plan
    if _registered:
        return
    from . import native, torch_module

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", DEVICE_TYPE):
        raise RuntimeError(f"the PrivateUse1 device is already taken by {current!r}; gpuwire needs it")
    if current != DEVICE_TYPE:
        # ``_setup_privateuseone_for_python_backend``'s steps, with the client helper's C++ hooks
        # where there is one (``native.register_hooks``: pinned host memory for PyTorch's C++,
        # which DDP's reducer needs), else its Python hooks
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(DEVICE_TYPE, torch_module.module)
        native_hooks = native.register_hooks()
        if not native_hooks:
            torch._C._acc.register_python_privateuseone_hook(torch_module.Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(torch_module.Guard())
        if native_hooks:  # (the C++ guard at once: a torch.Event made before the first op keeps its guard)
            try:
                native.install_guard()
            except Exception:  # noqa: BLE001 - never fail ``import torch``: the first attach installs it, or says why
                pass
    torch_module.bridge_accelerator_memory()
    DEVICE = torch.device(DEVICE_TYPE, 0)
    global _library, _aten_library
    _library = torch.library.Library("_", "IMPL")
    tracing = os.environ.get("GPUWIRE_TRACE", "") not in ("", "0")
    _library.fallback(_traced_fallback if tracing else _fallback, dispatch_key="PrivateUse1")
    _library.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    _library.fallback(_sparse_refused, dispatch_key="SparsePrivateUse1")
    _library.fallback(_quantized_refused, dispatch_key="QuantizedPrivateUse1")
    _library.fallback(_strided_nested_refused, dispatch_key="NestedTensorPrivateUse1")
    _conv_plan = _RenamedPlan(None, aten.convolution.default, "aten::convolution.default")
    _conv_backward_plan = _RenamedPlan(None, aten.convolution_backward.default, "aten::convolution_backward.default",
                                       _conv_backward_args)
    _aten_library = torch.library.Library("aten", "IMPL")
    # (from a dense gpuwire tensor these dispatch on PrivateUse1, not on the layouts' keys above)
    for names, refused in ((_QUANTIZING_OPS, _quantized_refused), (_SPARSIFYING_OPS, _sparse_refused)):
        for name in names:
            packet = getattr(aten, name, None)
            for overload in packet.overloads() if packet is not None else ():
                _aten_library.impl(name if overload == "default" else f"{name}.{overload}",
                                   functools.partial(refused, getattr(packet, overload)), "PrivateUse1")
    _aten_library.impl("_lazy_clone", _lazy_clone, "PrivateUse1")
    _aten_library.impl("_embedding_bag_backward", _dense_embedding_bag_gradient, "PrivateUse1")
    _aten_library.impl("_nested_tensor_from_mask", _scripted_encoder_nested_batch, "PrivateUse1")
    _aten_library.impl("embedding_sparse_backward", _dense_embedding_gradient, "PrivateUse1")
    _aten_library.impl("_fused_moving_avg_obs_fq_helper", _observer_state_sized_per_channel, "PrivateUse1")
    # (ATen's only kernel is a composite that calls ``batch_norm_cpu``: an eval BatchNorm in an
    # exported or training-IR graph raised "Expected tensor to have CPU Backend"; the node runs it)
    _aten_library.impl("_batch_norm_no_update", functools.partial(_fallback, aten._batch_norm_no_update.default),
                       "PrivateUse1")
    for overload in ("default", "msg"):
        _aten_library.impl("_assert_async" if overload == "default" else f"_assert_async.{overload}", functools.partial(
            _assert_async_sized, getattr(aten._assert_async, overload)), "PrivateUse1")
    with warnings.catch_warnings():  # (ATen's own entry there is a fallthrough: "Overriding a ... kernel")
        warnings.simplefilter("ignore")
        _aten_library.impl("dot", _dot_of_conjugates, "Conjugate")
        _aten_library.impl("vdot", _vdot_of_conjugates, "Conjugate")
    _aten_library.impl("convolution_overrideable", _convolution_overrideable, "PrivateUse1")
    _aten_library.impl("convolution_backward_overrideable", _convolution_backward_overrideable, "PrivateUse1")
    # The Conjugate/Negative math-bit fallbacks resolve a lazy conj/neg input of _copy_from
    # by cloning it, and clone copies through _copy_from again: infinite recursion (a segfault)
    # for any conj/neg gpuwire tensor (e.g. every complex FFT). Let them fall through: the bits
    # travel in the tensor descriptors and the node's copy_ resolves them.
    for key in ("Conjugate", "Negative"):
        _aten_library.impl("_copy_from", torch.library.fallthrough_kernel, key)
        _aten_library.impl("_copy_from_and_resize", torch.library.fallthrough_kernel, key)
    global _to_copy_composite
    _to_copy_composite = torch._C._dispatch_get_computed_kernel_for_dispatch_key("aten::_to_copy",
                                                                                DispatchKey.PrivateUse1)
    register_kernel(_aten_library, "_to_copy", _to_copy, with_keyset=True)
    from . import compile as _compile
    from . import fused
    fused.register(_aten_library)
    meta_kernels.register(_aten_library)
    _compile.register()
    precision.install()
    _register_direct(_aten_library)
    _register_fallback_ops(_aten_library, tracing)  # last: after every other PrivateUse1 kernel
    _registered = True


def _register_fallback_ops(aten_library, tracing: bool) -> None:
    """Register the fallback's work as a per-op PrivateUse1 kernel for every ``aten`` op that
    would reach the boxed fallback.

    PyTorch's Python kernels take a detour when a TorchDispatchMode is active at the kernel or an
    argument is a tensor subclass with the Python key: the call is routed through the
    interpreter's "trampoline", which looks the kernel up among the per-op registrations
    (``Library.impl``) only. A Python *fallback* is not among them, so that call fails an
    internal assert; on autograd's device thread the error then unwinds through a stream guard
    whose destructor calls back into Python, and the process aborts ("terminate called without
    an active exception"). PyTorch's composite-compliance tests (a tensor-subclass gradient on
    gpuwire tensors) and any wrapper subclass whose backward runs there hit it. As per-op kernels
    the same plans are found on that path too. ~870 ops, ~10 ms at import; the fallback stays
    for other namespaces."""
    global _view_library
    table = torch._C._dispatch_dump_table
    special = {_op_name(op) for op in SPECIAL}
    local = {_op_name(op) for op, plan in SPECIAL.items() if plan is _local}
    if not tracing:  # (traced, every view goes through the Python kernel to be printed)
        _view_library = torch.library.Library("aten", "IMPL")
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        for line in table(qualified).splitlines():
            if line.startswith("PrivateUse1:"):
                if line.endswith("[backend fallback]"):
                    name = qualified[len("aten::"):]
                    library = aten_library
                    if _view_library is not None and (qualified in local or (
                            qualified not in special and _is_view_schema(qualified))):
                        library = _view_library
                        _VIEW_OPS.append(name)
                    elif qualified not in special:
                        register_kernel(aten_library, name, _per_op_kernel(qualified, tracing))
                        break
                    library.impl(name, _per_op_kernel(qualified, tracing), "PrivateUse1")
                break
    if native.module is not None:
        use_native_kernels(native.module)


# Ops whose plan is ``_view_plan`` or ``_local`` (a redispatch to CPU's metadata-only kernel):
# their Python kernels live in a library of their own, which the native helper replaces with C++
# kernels doing the same redispatch (``use_native_kernels``).
_VIEW_OPS: list[str] = []
_view_library = None


def _is_view_schema(qualified: str) -> bool:
    """What ``_make_plan`` reads from a schema to give an op ``_view_plan``."""
    name, _, overload = qualified.partition(".")
    try:
        schema = torch._C._get_schema(name, overload)
    except RuntimeError:
        return False
    returns = schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) \
        and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def use_native_kernels(loaded) -> None:
    """Replace the Python kernels of view ops and of ``_NATIVE_OPS`` with ``loaded``'s C++ ones
    (client/native.cpp): a view redispatches to CPU's kernel as ``_view_plan`` does, without the
    GIL and a Python call (3.3 -> 1.2 us a ``view``); an op whose call signature its plan has
    served is sent from C++ (``_native_submit``), any other call goes to the plan
    (``_native_learn``). Idempotent; if the C++ registration fails the Python kernels are put
    back."""
    global _view_library, _op_library
    library, _view_library = _view_library, None
    if library is not None:
        library._destroy()
        try:
            loaded.register_views(_VIEW_OPS)
        except RuntimeError as exc:  # (the dispatcher refused one: views stay correct, only slower)
            _view_library = torch.library.Library("aten", "IMPL")
            for name in _VIEW_OPS:
                _view_library.impl(name, _per_op_kernel(f"aten::{name}", False), "PrivateUse1")
            logging.getLogger("gpuwire").warning("gpuwire: view ops stay on their Python kernels: %s", exc)
    library, _op_library = _op_library, None
    if library is not None and not _native_ops_wanted():
        _op_library, library = library, None
    if library is not None:
        library._destroy()
        try:
            loaded.configure_ops(_native_learn, _native_submit, _native_submit_many, codec.EXT_TENSOR,
                                 _native_tables())
            loaded.register_ops(_NATIVE_OPS)
        except RuntimeError as exc:
            _op_library = torch.library.Library("aten", "IMPL")
            for name, _, plan, *_ in _NATIVE_OPS:
                if type(plan) is _KernelEntry:
                    _op_library.impl(name, plan.kernel, "PrivateUse1", with_keyset=plan.with_keyset)
                else:
                    _op_library.impl(name, plan, "PrivateUse1", with_keyset=True)
            logging.getLogger("gpuwire").warning("gpuwire: ops stay on their Python kernels: %s", exc)


def _native_ops_wanted() -> bool:
    """Whether the native op kernels serve this process: ``GPUWIRE_NATIVE_OPS=1``/``0`` decides;
    by default not in the ranks of a multi-process job (``WORLD_SIZE`` > 1, as torchrun sets it).
    There, FSDP2 under ``gpuwire run`` hung in about one run of three with them (both ranks
    waiting in gloo's all-gather of ``get_model_state_dict``; 8 of 8 runs finished without):
    not understood yet, so such jobs keep the Python kernels (docs/NOTES-next-session.md)."""
    chosen = os.environ.get("GPUWIRE_NATIVE_OPS", "")
    if chosen:
        return chosen not in ("0", "false", "no")
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) <= 1
    except ValueError:
        return True


def _aten_op(qualified: str):
    """The OpOverload of ``aten::name.overload`` (made on first use: there are thousands)."""
    packet, _, overload = qualified[len("aten::"):].partition(".")
    return getattr(getattr(aten, packet), overload or "default")


def _per_op_kernel(qualified: str, tracing: bool):
    """The fallback for one op, as a kernel (called without the op: it is resolved on first use)."""
    resolved = []

    def kernel(*args, **kwargs):
        if not resolved:
            resolved.append(_aten_op(qualified))
        op = resolved[0]
        if tracing:
            return _traced_fallback(op, *args, **kwargs)
        plan = _PLANS.get(op._op)
        if plan is None:
            plan = _PLANS[op._op] = _make_plan(op)
        return plan(op, args, kwargs)
    return kernel


def _lazy_clone(self):
    """``torch._lazy_clone``: a copy-on-write clone needs the storage's data pointer to be the
    one PyTorch's kernels write through, and a remote storage's is not (PyTorch raised "Expected
    storage != nullptr"); an eager clone gives the same values, never aliased."""
    return aten.clone.default(self)


_CONJUGATE_KEY = torch._C.DispatchKeySet(DispatchKey.Conjugate)


def _dot_of_conjugates(self, other):
    """``dot`` of a lazily conjugated input (the Conjugate key's kernel, reached only then): ATen's
    kernel turns it into a ``vdot`` or a conjugated result (a conj view: ``is_conj()`` is part of
    the result a local run gives); the node's kernel saw resolved inputs and returned a resolved
    result. Other devices' calls go on as ATen's fallthrough sends them."""
    if not (on_device(self) and on_device(other)):
        with torch._C._ExcludeDispatchKeyGuard(_CONJUGATE_KEY):
            return aten.dot.default(self, other)
    if self.is_conj() and other.is_conj():
        return aten.dot.default(self.conj(), other.conj()).conj()
    if self.is_conj():
        return aten.vdot.default(self.conj(), other)
    return aten.vdot.default(other.conj(), self)


def _vdot_of_conjugates(self, other):
    """``vdot`` of a lazily conjugated input (see ``_dot_of_conjugates``)."""
    if not (on_device(self) and on_device(other)):
        with torch._C._ExcludeDispatchKeyGuard(_CONJUGATE_KEY):
            return aten.vdot.default(self, other)
    if self.is_conj() and other.is_conj():
        return aten.vdot.default(other.conj(), self.conj())
    if self.is_conj():
        return aten.dot.default(self.conj(), other)
    return aten.dot.default(self, other.conj()).conj()


# the ops that make a sparse tensor from a dense one (Tensor.to_sparse*, dense.to_sparse(layout=...))
_SPARSIFYING_OPS = ("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc")


def _sparse_refused(op, *args, **kwargs):
    raise checks.sparse_refusal(op)


_DENSE_INSTEAD_OF_SPARSE = ("gpuwire: the gradient of an Embedding/EmbeddingBag(sparse=True) is a dense tensor on the "
                            "gpuwire device (sparse tensors have no remote form): the same values, as big as the whole "
                            "weight; an optimizer that takes sparse gradients only (SparseAdam) refuses it")


def _warn_dense_instead_of_sparse() -> None:
    global _warned_dense_instead_of_sparse
    if not _warned_dense_instead_of_sparse:
        _warned_dense_instead_of_sparse = True
        warnings.warn(_DENSE_INSTEAD_OF_SPARSE, stacklevel=3)


_warned_dense_instead_of_sparse = False


def _dense_embedding_bag_gradient(*args, **kwargs):
    """``EmbeddingBag(sparse=True)``'s backward, computed dense: the node's kernel made a sparse
    gradient it cannot keep ("Cannot access storage of SparseTensorImpl" at the next sync point).
    SGD, Adagrad, Adam ... take a dense gradient and update the same rows by the same amounts."""
    if len(args) > 9 and args[9] is True:
        _warn_dense_instead_of_sparse()
        args = (*args[:9], False, *args[10:])
    elif kwargs.get("sparse") is True:
        _warn_dense_instead_of_sparse()
        kwargs = {**kwargs, "sparse": False}
    return _fallback(aten._embedding_bag_backward.default, *args, **kwargs)


def _dense_embedding_gradient(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """``Embedding(sparse=True)``'s backward, computed dense (see ``_dense_embedding_bag_gradient``)."""
    _warn_dense_instead_of_sparse()
    return aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def _observer_state_sized_per_channel(self, observer_on, fake_quant_on, running_min, running_max, scale, zero_point,
                                      averaging_const, quant_min, quant_max, ch_axis, per_row_fake_quant=False,
                                      symmetric_quant=False):
    """Quantization-aware training's fused observer and fake quantizer (``FusedMovingAvgObsFakeQuantize``,
    every ``get_default_qat_qconfig`` weight). Per channel, its kernel sizes the observer's state
    on the first call (``running_min``/``running_max`` from 0 elements, ``scale``/``zero_point``
    from 1 to one per channel): a kernel's resize of its in-place arguments happens on the node
    only, so the client's tensors kept their old sizes and from the second step on the node
    read one channel's scale for all (training drifted from CPU's). The sizing is done here,
    as the kernel does it, and the kernel then finds its state sized."""
    if per_row_fake_quant and running_min.numel() == 0:
        channels = self.size(ch_axis)
        running_min.resize_(channels).fill_(math.inf)
        running_max.resize_(channels).fill_(-math.inf)
        scale.resize_(channels)
        zero_point.resize_(channels)
    return _fallback(aten._fused_moving_avg_obs_fq_helper.default, self, observer_on, fake_quant_on, running_min,
                     running_max, scale, zero_point, averaging_const, quant_min, quant_max, ch_axis,
                     per_row_fake_quant, symmetric_quant)


def _assert_async_sized(op, condition, *message):
    """``torch._assert_async``: as CUDA's, its tensor's size is checked at the call and its value
    at the next sync point (the node checks it: ``ops._assert_nonzero``)."""
    if condition.numel() != 1:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous" if condition.numel() == 0
                           else "Boolean value of Tensor with more than one value is ambiguous")
    return _fallback(op, condition, *message)


# the ops that make a quantized tensor from a float one (or from nothing)
_QUANTIZING_OPS = ("quantize_per_tensor", "quantize_per_tensor_dynamic", "quantize_per_channel",
                   "_make_per_tensor_quantized_tensor", "_make_per_channel_quantized_tensor", "empty_quantized",
                   "_empty_affine_quantized", "_empty_per_channel_affine_quantized")


def _quantized_refused(op, *args, **kwargs):
    """Quantized tensors (qint8, quint8, qint32 ...: a scale and zero point beside the values)
    have no remote form; CUDA runs few of their ops either, and PyTorch deprecates them
    (pytorch/pytorch#184982). Refused where they would be made, not at the next sync with the
    node's "Copying from quantized Tensor to non-quantized Tensor"."""
    raise NotImplementedError(
        f"gpuwire: quantized tensors are not supported on the gpuwire device ({op}). Quantize and run quantized "
        "models on the CPU, or keep the model in floating point (bfloat16 / float16) on the device; "
        "x.dequantize() gives a float tensor you can move to it")


def _scripted_encoder_nested_batch(*args, **kwargs):
    """``_nested_tensor_from_mask`` reached on the device: only a TorchScript-compiled
    ``TransformerEncoder`` gets here (in eager mode it runs the dense batch, ``shims``), on its
    eval-mode fast path with a padding mask, which builds a strided nested tensor."""
    raise NotImplementedError(
        "gpuwire: a TorchScript TransformerEncoder in eval mode given a src_key_padding_mask takes PyTorch's "
        "nested-tensor fast path, which the gpuwire device does not have: run the encoder in eager mode (gpuwire "
        "runs that path on the dense batch), or build it with nn.TransformerEncoder(..., enable_nested_tensor=False) "
        "(or set encoder.use_nested_tensor = False) before scripting it")


def _strided_nested_refused(op, *args, **kwargs):
    """Nested tensors of the strided layout (PyTorch's older C++ form) have no remote form;
    the jagged layout is a Python subclass over dense tensors and runs as they do."""
    raise NotImplementedError(
        f"gpuwire: nested tensors of the strided layout are not supported on the gpuwire device ({op}); "
        "make them with torch.nested.nested_tensor(..., layout=torch.jagged), which PyTorch recommends and "
        "gpuwire runs, or pad to a dense batch")


def set_pending_seed(seed: int) -> None:
    global _pending_seed
    _pending_seed = seed
    if _runtime is not None and _runtime.alive:
        _runtime.seed(seed)


def _debug(*parts) -> None:
    print("gpuwire:", *parts, file=sys.stderr)
