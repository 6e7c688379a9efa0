"""One client's state on a node: its storages, its random generator, its pending error.

Sits between the server (which feeds it decoded events) and torch (which runs the ops).
What crosses its boundary: protocol events in, reply events out. A session can reach only the
storages in its own table; every tensor descriptor is checked against the real allocation's
bounds before a view of it is made, so no descriptor can read outside what it owns.
"""

from __future__ import annotations

import collections
import gc
import secrets
import logging
import sys
import threading
import time
import uuid
import warnings
from itertools import chain
from math import prod
from operator import mul

import msgpack
import torch

from .._aten import RESIZED_ONLY_BY_NUMEL
from .._memory import StorageCache
from ..protocol import codec
from ..protocol.codec import dense_layout
from ..protocol.events import (
    Alloc,
    CallSync,
    Data,
    Error,
    Free,
    NewTensor,
    Op,
    Query,
    Read,
    Restore,
    Result,
    Seed,
    SetRngState,
    Sync,
    SyncDone,
    Write,
)
from . import loop as node_loop
from . import native as node_native
from .backend import Backend
from ..pool.sizes import format_size
from .composite import tensor_leaves
from .ops import (APPLIED_PRECISION, CURRENT, LOW_PRECISION_REFUSED, SESSION_OPS, OpTable, apply_precision,
                  math_mode, run_upcast)

log = logging.getLogger("gpuwire.node")

TORCH_DTYPES = tuple(getattr(torch, name, None) for name in codec.DTYPE_NAMES)
DTYPE_CODE = {dt: code for code, dt in enumerate(TORCH_DTYPES) if dt is not None}
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
LAYOUTS = tuple(getattr(torch, name, None) for name in codec.LAYOUT_NAMES)
NODE_ID_BASE = 1 << 60  # node-chosen storage ids live above every client-chosen one
VIEW_CACHE_MAX = 4096  # cached descriptor views per session
_INT64_LIMIT = 1 << 63
_storage_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref
# freed CPU-backend blocks of 1 MiB and more, kept for reuse by the next allocation of the same
# size (what a CUDA device's caching allocator does); shared by the node's sessions, which see
# only zeroed or fully overwritten memory either way (``allocate``). _memory.py says why.
# storages sessions shared with the other sessions of this node (``Session._share``): secret ->
# (storage, device)
SHARED_STORAGES: dict = {}
_SHARED_LOCK = threading.Lock()
# freed objects wait for the connection's idle moment (``Session.bury``) up to these: a step's
# small tensors, never enough memory to matter (an allocation that fails on a GPU buries first)
DYING_BYTES_LIMIT = 64 << 20
DYING_OBJECTS_LIMIT = 4096
HOST_STORAGES = StorageCache(max_bytes=1 << 30, min_bytes=1 << 20)
_CACHED_FROM = HOST_STORAGES.min_bytes
# in-place ops that write every element of ``self`` and read none: a fresh storage they fill
# need not be zeroed first
OVERWRITES_SELF = frozenset({
    "aten::copy_", "aten::copy_.default", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_",
    "aten::bernoulli_.float", "aten::bernoulli_.Tensor", "aten::normal_", "aten::uniform_", "aten::random_",
    "aten::random_.from", "aten::random_.to", "aten::exponential_", "aten::geometric_", "aten::cauchy_",
    "aten::log_normal_",
})
MAX_INLINE_BYTES = 1 << 20

_EXT_TENSOR = codec.EXT_TENSOR
_get_ident = threading.get_ident
_unpack_tensor_ref_fields = codec.unpack_tensor_ref_fields
# the bytes of a tensor descriptor as a client encodes it (``client.wire``): see ``_adopt``
_pack_descriptor = msgpack.Packer(use_bin_type=True, autoreset=True).pack

warnings.filterwarnings("ignore", message="The given buffer is not writable")
# the node's own complex32 tensors (views, results' storage) would say it on the node's stderr at
# every first use; the client says it once where the program makes one (``device._warn_complex_half``)
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
# the allocation guard's meta run of a range factory's out= kernel resizes an out whose number of
# elements is right (``RESIZED_ONLY_BY_NUMEL``), and its Python meta kernel warns of it: the real
# kernel will not resize it. (Scoped to that module: a CPU kernel's own warning comes from C++.)
warnings.filterwarnings("ignore", message="An output with one or more elements was resized",
                        module=r"torch\._prims_common\.wrappers")


class RanOp:
    """An Op frame the native loop ran while it was being decoded (node/loop.py): nothing is
    left for ``Session.handle`` to do but the session loop's bookkeeping of its ``seq``."""

    __slots__ = ("seq",)
    expects_reply = False

    def __init__(self, seq: int):
        self.seq = seq


class SessionError(Exception):
    """A command of this session failed; reported to the client, the node carries on."""


class RngOwner:
    """The device's default generator is shared by sessions; each session owns it while it
    runs ops, so ``torch.manual_seed(s)`` on a client reproduces a local run's random stream.
    Swapping happens only when another session ran in between."""

    def __init__(self, backend: Backend):
        self.generator = backend.default_generator()
        self.owner: Session | None = None
        self.lock = threading.RLock()

    def acquire(self, session: "Session") -> None:
        if self.owner is session:
            return
        if self.owner is not None:
            self.owner.rng_state = self.generator.get_state()
        if session.rng_state is not None:
            self.generator.set_state(session.rng_state)
        else:
            self.generator.manual_seed(torch.initial_seed() if session.backend.kind == "cpu" else 0)
            session.rng_state = self.generator.get_state()
        self.owner = session

    def release(self, session: "Session") -> None:
        if self.owner is session:
            self.owner = None


class Session:
    def __init__(self, backend: Backend, rng: RngOwner, ops: OpTable, *, peer: str = "?"):
        self.id = uuid.uuid4().hex[:12]
        self.backend = backend
        self.device = backend.device
        self.rng = rng
        self.ops = ops
        self.peer = peer
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self.memory_budget: int | None = None  # bytes; None: the whole device
        self._device_bytes: int | None = None
        self.share = 1.0  # compute share (0, 1]: weight in the device's fair scheduler
        self.lease_id: str | None = None  # pool mode: the lease this session runs under
        self.lease_expiry: float | None = None  # unix time; the node ends the session after it
        self.token_verifier = None
        self.ended_reason: str | None = None
        self.vtime = 0.0
        self.device_seconds = 0.0
        self.rng_state: torch.Tensor | None = None
        self.pending_error: Error | None = None
        self.decode_error: Exception | None = None
        self.generators: dict[int, torch.Generator] = {}
        self._landed = None  # the payload_sink view of the Write being received in place
        self._unzeroed = None  # [storage_id, bytes covered so far, nbytes] after an overwrite Alloc
        self.node_info = None  # set by the server: node-wide facts for `gpuwire smi`
        self.client_pid = 0
        self.client_version = ""
        # failover: the highest command seq applied; commands at or below ``replay_floor`` that
        # a resumed client resends are skipped (never run twice); replies kept for a resume
        self.applied_seq = 0
        self.replay_floor = 0
        self.recent_replies = collections.deque(maxlen=16)
        self.resume_key: str | None = None
        self.resume_grace = 0.0
        self.parked_until: float | None = None
        self.peer_op_names: list[str] = []
        self.migrate_hook = None
        self.drain_notice: dict | None = None
        self.forward_warnings = False  # its client takes its kernels' warnings (Notice "warnings")
        self.created = time.monotonic()
        self.attached = threading.Event()  # a connection serves this session now
        self.attached.set()
        self.detached = threading.Event()  # set once that connection has let go
        # a resuming client waits to take the session over: the serving connection stops at its
        # next batch boundary, with commands it received but did not run left for the client to
        # resend (it resends every command after ``applied_seq``)
        self.taking_over = False
        self.ops_run = 0
        self._next_node_id = NODE_ID_BASE
        self._live_ptrs: set[int] = set()
        # CPU storages made by ``Alloc`` (uploads, large fills), which go back to ``HOST_STORAGES``
        # when freed. Kernel outputs go back to malloc instead: a kernel allocates through malloc,
        # so a block parked in the cache would make every next output of that size fresh memory,
        # faulted in page by page (a CNN step faulted 4x the pages a local run does).
        self._cache_on_free: set[int] = set()
        self._view_bases = {}  # dtype code -> empty tensor used as the base of views
        self._views: dict = {}  # descriptor bytes -> (storage id, storage, view, sizes, strides, offset)
        self._view_keys: dict = {}  # storage id -> descriptors cached in _views
        # ``Tensor.get_device()`` of this session's tensors (-1: the CPU)
        self._device_index = -1 if self.device.type == "cpu" else (self.device.index or 0)
        self._overwriting = None  # storage id an op is filling in place of zeroing it
        self._thread = None  # the thread that last ran this session's commands
        self._op_entries: dict = {}  # op name -> (resolved op, what to call, guard kind, ..., per-signature check)
        # SDPA graphs kept for their backward (``ops._sdpa_keep``): handle storage data_ptr ->
        # (weak ref to the handle storage, output, inputs, bytes the graph saved)
        self._kept: dict = {}
        self._sweep_kept_above = 64
        self._shared_tokens: list = []  # what this session shared (``_share``), withdrawn when it ends
        # freed storages, views and graphs not yet deallocated, and their bytes (``_free``)
        self._dying: list = []
        self._dying_bytes = 0
        self.precision: tuple = ()  # math-mode setter calls for this session's ops (``ops._precision``)
        # the C++ helpers of its hot path (node/native.py) where they are installed, else Python's
        helpers = node_native.module
        device_type = node_native.DEVICE_TYPES.get(self.device.type)
        self._native_adopt = helpers.adopt if helpers is not None and device_type is not None else None
        self._native_device = (device_type, self._device_index)
        self._signature = helpers.signature if helpers is not None else _signature
        # what the connection decodes tensor descriptors with (``ext_hook``, cached views in C++)
        self.decode_hook = helpers.TensorHook(self._views, self._view_keys, self.storages, self._view_bases,
                                              self.ext_hook) if helpers is not None else self.ext_hook
        # what the connection offers each Op frame's bytes to (``Connection.bind(op_runner=...)``)
        self._loop = None
        if node_loop.module is not None and self._native_adopt is not None:
            self._loop = node_loop.module.Loop(self, self.decode_hook, rng, rng.lock, self._native_adopt,
                                               device_type, self._device_index, self.device)
        self.op_runner = self._loop.run if self._loop is not None else None
        # ... and the frames that follow one another in the receive buffer, run at once
        self.op_frames_runner = self._loop.run_frames if self._loop is not None else None

    # ------------------------------------------------------------ decoding hooks

    def ext_hook(self, code: int, data: bytes):
        """msgpack ext hook: wire values straight into node objects, checked."""
        if code == _EXT_TENSOR:
            # the same descriptor (a parameter, an optimizer state, a live activation, an op's
            # result: see ``_adopt``) arrives again and again: reuse its view while the storage
            # and the view's metadata are unchanged (a kernel may resize an out= argument in place)
            hit = self._views.get(data)
            if hit is not None:
                storage_id, storage, t, sizes, strides, offset = hit
                if (self.storages.get(storage_id) is storage and t.shape == sizes and t.stride() == strides
                        and t.storage_offset() == offset):
                    return t
            fields = _unpack_tensor_ref_fields(data)
            try:
                t = self.view(*fields)
            except SessionError as exc:
                # well-formed but not allowed (foreign id, out of bounds): the command fails,
                # the session goes on; ``handle`` reports it
                if self.decode_error is None:
                    self.decode_error = exc
                return None
            storage_id = fields[0]
            storage = self.storages.get(storage_id)
            if storage is not None:  # (a storage slice's view is made again each time: ``_inside``)
                self._remember_view(data, (storage_id, storage, t, fields[2], fields[3], fields[1]))
            return t
        if code == codec.EXT_DTYPE:
            if len(data) != 1:
                raise codec.DecodeError("malformed dtype")
            return self._dtype(data[0])
        if code == codec.EXT_DEVICE:
            value = codec.unpack_device_fields(data)
            if value[0] == "cpu":
                return torch.device("cpu")
            if value[0] == "meta":
                raise codec.DecodeError("the meta device cannot be used on a node")
            return self.device
        if code == codec.EXT_MEMORY_FORMAT:
            if len(data) != 1 or data[0] >= len(MEMORY_FORMATS):
                raise codec.DecodeError("malformed memory format")
            return MEMORY_FORMATS[data[0]]
        if code == codec.EXT_LAYOUT:
            if len(data) != 1 or data[0] >= len(LAYOUTS) or LAYOUTS[data[0]] is None:
                raise codec.DecodeError("malformed layout")
            return LAYOUTS[data[0]]
        if code == codec.EXT_COMPLEX:
            return codec.unpack_complex(data)
        if code == codec.EXT_GENERATOR:
            if not data:
                return None  # the session's generator is the device default while it runs
            return self.generator(codec.unpack_small(data, "generator id"))
        if code == codec.EXT_INLINE_TENSOR:
            dtype, sizes, payload = codec.unpack_inline_tensor_fields(data)
            if len(payload) > MAX_INLINE_BYTES:
                raise codec.DecodeError("inline tensor too large")
            flat = torch.frombuffer(bytearray(payload), dtype=self._dtype(dtype)) if payload else \
                torch.empty(0, dtype=self._dtype(dtype))
            return flat.reshape(sizes)
        raise codec.DecodeError(f"unknown extension type {code}")

    def generator(self, generator_id) -> torch.Generator:
        """The session's explicit generator ``generator_id`` (``torch.Generator(device=…)`` on
        the client), created on first use with torch's default seed."""
        if type(generator_id) is not int or not 0 <= generator_id < (1 << 32):
            raise codec.DecodeError("malformed generator id")
        gen = self.generators.get(generator_id)
        if gen is None:
            if len(self.generators) >= 4096:
                raise SessionError("too many generators in one session")
            gen = self.generators[generator_id] = torch.Generator(device=self.device)
            gen.manual_seed(67280421310721)
        return gen

    def _dtype(self, code: int) -> torch.dtype:
        dt = TORCH_DTYPES[code] if 0 <= code < len(TORCH_DTYPES) else None
        if dt is None:
            raise codec.DecodeError(f"dtype code {code} is not supported by this node")
        return dt

    def _inside(self, address: int, offset: int, dtype: torch.dtype) -> tuple:
        """The storage a storage slice's address lies in, and the view's offset in it: a client's
        ``UntypedStorage[a:b]`` is a storage whose address is ``a`` bytes into another's (client
        storage ids are addresses, and ranges of live ones do not overlap). Looked up only where
        an id is no storage's own."""
        for storage_id, storage in self.storages.items():
            delta = address - storage_id
            if 0 < delta < storage.nbytes():
                if delta % dtype.itemsize:
                    raise SessionError(f"a view of {dtype} at byte {delta} of a storage is not aligned to its "
                                       "elements")
                return storage, offset + delta // dtype.itemsize
        raise SessionError(f"storage {address:#x} is not allocated in this session "
                           "(freed, never allocated, or owned by another session)")

    def view(self, storage_id: int, offset: int, sizes: tuple, strides: tuple, dtype_code: int, flags: int = 0):
        """A node tensor for a client descriptor, after checking it stays inside the storage."""
        storage = self.storages.get(storage_id)
        dtype = self._dtype(dtype_code)
        if storage is None:
            storage, offset = self._inside(storage_id, offset, dtype)
        # (C builtins over the tuples: this runs for every view a client makes of a result)
        if sizes:
            if len(strides) != len(sizes):
                raise SessionError(f"tensor view with {len(sizes)} sizes but {len(strides)} strides")
            if min(strides) < 0:
                raise SessionError("negative strides are not supported")
            if max(sizes) >= _INT64_LIMIT or prod(sizes) * dtype.itemsize >= _INT64_LIMIT:
                # a zero-stride (or empty) view passes the bounds check below however large its
                # shape; past int64 torch cannot even build it
                raise SessionError(f"tensor view of sizes {list(sizes)} has more elements than int64 can count")
            # the last element, offset + sum((size - 1) * stride); an empty view reads nothing, so
            # its offset may lie past the end, as on CPU/CUDA (``narrow``/negative padding of an edge)
            high = offset + sum(map(mul, sizes, strides)) - sum(strides) if all(sizes) else -1
        else:
            high = offset
        # checked here, never left to ``set_``: it would grow the storage to fit (memory outside
        # the session's budget), not refuse
        if (high + 1) * dtype.itemsize > storage.nbytes():
            raise SessionError(
                f"tensor view (offset {offset}, sizes {list(sizes)}, strides {list(strides)}, {dtype}) reaches "
                f"outside its storage of {storage.nbytes()} bytes")
        base = self._view_bases.get(dtype_code)
        if base is None:
            base = self._view_bases[dtype_code] = torch.empty(0, dtype=dtype, device=self.device)
        try:
            t = base.new().set_(storage, offset, sizes, strides)
        except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
            # whatever else torch refuses in a view: this command fails, not the session
            raise SessionError(f"invalid tensor view (offset {offset}, sizes {list(sizes)}, strides "
                               f"{list(strides)}): {exc}") from None
        if flags:
            if flags & 1:
                t = t.conj()
            if flags & 2:
                t = torch._neg_view(t)
        return t

    # ------------------------------------------------------------ storage table

    def apply_lease(self, claims: dict) -> None:
        self.lease_id = str(claims.get("lease"))
        self.memory_budget = int(claims["memory"]) if claims.get("memory") else self.memory_budget
        self.share = float(claims.get("share") or 1.0)
        self.lease_expiry = float(claims["exp"]) if claims.get("exp") else None

    def check_budget(self, nbytes: int) -> None:
        """Refuse an allocation past the session's memory budget, before allocating."""
        if self.memory_budget is not None and self.bytes_in_use + nbytes > self.memory_budget:
            raise torch.OutOfMemoryError(
                f"gpuwire: allocating {format_size(nbytes)} would exceed this session's memory budget of "
                f"{format_size(self.memory_budget)} ({format_size(self.bytes_in_use)} in use). Free tensors (del, "
                "torch.cuda.empty_cache()) or ask for a larger budget")

    def _store(self, storage_id: int, storage: torch.UntypedStorage) -> None:
        if storage_id in self.storages:
            self._release(storage_id)
        nbytes = storage.nbytes()
        self.check_budget(nbytes)
        self.storages[storage_id] = storage
        self.bytes_in_use += nbytes
        if self.bytes_in_use > self.peak_bytes:
            self.peak_bytes = self.bytes_in_use
        if nbytes:
            self._live_ptrs.add(storage.data_ptr())

    def _release(self, storage_id: int) -> None:
        self._free((storage_id,))

    def _free(self, storage_ids: list) -> None:
        """``Free``: each storage, its graph kept for a backward, its cached views (which hold
        references to it) and its bytes; one loop with its lookups hoisted, since a client frees
        a few hundred storages at a time, about one an op (a method call each was half of it).

        The storages, views and graphs leave the session's tables and accounts here, but their
        objects go to ``_dying``, deallocated by ``bury`` when the connection finds nothing to
        run: their destructors (a Python tensor each, a malloc'd block, an autograd graph) were
        ~1 ms of a GPT-2 step's node thread, on its critical path (docs/performance.md "Session 41")."""
        storages_pop, views_pop, view_keys_pop = self.storages.pop, self._views.pop, self._view_keys.pop
        live_discard, kept, cache_on_free = self._live_ptrs.discard, self._kept, self._cache_on_free
        dying = self._dying
        keep_dying = dying.append
        freed = 0
        try:
            for sid in storage_ids:
                if type(sid) is not int:
                    continue
                storage = storages_pop(sid, None)
                if storage is not None:
                    nbytes = storage.nbytes()
                    freed += nbytes
                    if nbytes:
                        ptr = storage.data_ptr()
                        live_discard(ptr)
                        if kept and ptr in kept:
                            self._drop_graph(ptr)
                        if sid in cache_on_free:  # (its views go now: the cache takes only a storage no one holds)
                            cache_on_free.discard(sid)
                            for data in view_keys_pop(sid, ()):
                                views_pop(data, None)
                            HOST_STORAGES.release(storage)
                            continue
                    keep_dying(storage)
                for data in view_keys_pop(sid, ()):
                    keep_dying(views_pop(data, None))
        finally:
            self.bytes_in_use -= freed
            self._dying_bytes += freed
        if self._dying_bytes > DYING_BYTES_LIMIT or len(dying) > DYING_OBJECTS_LIMIT:
            self.bury()

    @property
    def has_dying(self) -> bool:
        return bool(self._dying)

    def bury(self) -> None:
        """Deallocate what ``_free`` let go of (the connection calls it when nothing waits to run,
        and before anything that measures or needs the device's memory)."""
        if self._dying:
            self._dying = []  # (the old list's objects go now, with it)
            self._dying_bytes = 0

    def keep_graph(self, handle: torch.UntypedStorage, output, inputs: list, saved_bytes: int) -> None:
        """Keep an autograd graph for a backward to come, under its handle storage, charging what
        it saved to this session; dropped when the handle is freed (``_release``). A handle that
        was never stored (a malformed command) dies at once; its entry is swept here later."""
        if len(self._kept) > self._sweep_kept_above:
            for ptr in [ptr for ptr, entry in self._kept.items() if _storage_expired(entry[0])]:
                self._drop_graph(ptr)
            self._sweep_kept_above = max(64, 2 * len(self._kept))
        self.check_budget(saved_bytes)
        ptr = handle.data_ptr()
        self._drop_graph(ptr)
        self._kept[ptr] = (handle._weak_ref(), output, inputs, saved_bytes)
        self.bytes_in_use += saved_bytes
        if self.bytes_in_use > self.peak_bytes:
            self.peak_bytes = self.bytes_in_use

    def kept_graph(self, handle: torch.Tensor):
        """(output, inputs) of the graph kept under ``handle``, or None (freed, never kept)."""
        entry = self._kept.get(handle.untyped_storage().data_ptr()) if handle.numel() else None
        if entry is None or _storage_expired(entry[0]):
            return None
        return entry[1], entry[2]

    def _drop_graph(self, ptr: int) -> None:
        entry = self._kept.pop(ptr, None)
        if entry is not None:
            _free_weak_ref(entry[0])
            self.bytes_in_use -= entry[3]
            self._dying.append(entry)  # (the graph's destructors run in ``bury``)
            self._dying_bytes += entry[3]

    def allocate(self, storage_id: int, nbytes: int, zero: bool = True) -> None:
        if storage_id >= NODE_ID_BASE and not storage_id < self._next_node_id:
            # below the counter is a node-chosen id being restored (failover, migration)
            raise SessionError(f"storage id {storage_id:#x} is in the node's range")
        self._settle_unzeroed()
        self.check_budget(nbytes)
        # Zeroed, so that a tenant never reads what an earlier one left in device memory — but
        # lazily: the next command decides. Writes covering it in order (``overwrite``, an
        # upload), or an op that writes all of it without reading it (``empty_like(x).bernoulli_``,
        # ``clone``'s ``copy_``, ``zeros``' ``fill_``), leave nothing to zero; any other command,
        # or a failure of that op, zeroes it first (``_settle_unzeroed``, ``handle``).
        if self.device.type == "cpu":
            storage = HOST_STORAGES.allocate(nbytes)  # a recently freed block of that size, or a fresh one
        else:
            try:
                storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            except torch.OutOfMemoryError:
                if not self._dying:
                    raise
                self.bury()
                storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        self._store(storage_id, storage)
        if nbytes >= _CACHED_FROM and self.device.type == "cpu":
            self._cache_on_free.add(storage_id)
        self._unzeroed = [storage_id, 0, nbytes]

    def _settle_unzeroed(self) -> None:
        """Zero what the in-order Writes after an ``overwrite`` Alloc did not cover, before any
        other command can read it."""
        pending, self._unzeroed = self._unzeroed, None
        if pending is not None:
            storage_id, covered, nbytes = pending
            if covered < nbytes and storage_id in self.storages:
                self._bytes_view(storage_id, covered, nbytes - covered).zero_()

    def _covers_unzeroed(self, event) -> bool:
        pending = self._unzeroed
        if pending is None:
            return False
        cls = type(event)
        if cls is Free and pending[0] in event.storage_ids:
            self._unzeroed = None  # freed unread (``torch.empty`` then dropped): nothing to zero
            return True
        if cls is Write and event.storage_id == pending[0] and event.byte_offset == pending[1]:
            pending[1] += len(event.payload)
            if pending[1] >= pending[2]:
                self._unzeroed = None
            return True
        if cls is Op and event.name in OVERWRITES_SELF and not pending[1] and event.args:
            storage = self.storages.get(pending[0])
            target = event.args[0]
            if (storage is None or not isinstance(target, torch.Tensor) or target.storage_offset()
                    or target.numel() * target.element_size() != pending[2] or not pending[2]):
                return False
            ptr = storage.data_ptr()
            if target.untyped_storage().data_ptr() != ptr or not _dense(target):
                return False
            for value in (*event.args[1:], *event.kwargs.values()):  # a source must not be the garbage itself
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    return False
            self._unzeroed = None
            self._overwriting = pending[0]  # zeroed after all if the op fails (``handle``)
            return True
        return False

    def close(self) -> None:
        with _SHARED_LOCK:
            for token in self._shared_tokens:
                SHARED_STORAGES.pop(token, None)
        self._shared_tokens.clear()
        for ptr in list(self._kept):
            self._drop_graph(ptr)
        self.bury()
        self.storages.clear()
        self._cache_on_free.clear()
        self._live_ptrs.clear()
        self.bytes_in_use = 0
        self.rng.release(self)
        self._loop = self.op_runner = self.op_frames_runner = None  # (the loop holds the session: no cycle outlives it)

    # ------------------------------------------------------------ events

    def handle(self, event):
        """Run one event; return the reply event or None. Never raises for a client's mistake."""
        cls = type(event)
        if cls is RanOp:
            return None
        seq = getattr(event, "seq", 0)
        if self._thread != _get_ident():
            _apply_thread_count()
            self._thread = _get_ident()
        try:
            if self.decode_error is not None:
                exc, self.decode_error = self.decode_error, None
                raise exc
            if self._unzeroed is not None and not self._covers_unzeroed(event):
                self._settle_unzeroed()
            if cls is Op:
                self._run_op(event)
                self._overwriting = None
                return None
            if cls is Alloc:
                self.allocate(event.storage_id, event.nbytes, zero=not event.overwrite)
                return None
            if cls is Free:
                self._free(event.storage_ids)
                return None
            if cls is Write:
                self._write(event)
                return None
            if cls is Seed:
                with self.rng.lock:
                    self.rng.acquire(self)
                    self.rng.generator.manual_seed(event.seed)
                    self.rng_state = self.rng.generator.get_state()
                return None
            if cls is SetRngState:
                state = torch.frombuffer(bytearray(event.payload), dtype=torch.uint8).clone()
                with self.rng.lock:
                    self.rng.acquire(self)
                    self.rng.generator.set_state(state)
                    self.rng_state = state
                return None
            if cls is Restore:
                self.restore(event)
                return None
        except Exception as exc:  # noqa: BLE001 - any failure is the client's to see
            self._fail(seq, _describe(event), exc)
            if self._overwriting is not None:  # the op that was to write all of it did not
                storage_id, self._overwriting = self._overwriting, None
                storage = self.storages.get(storage_id)
                if storage is not None and storage.nbytes():
                    self._bytes_view(storage_id, 0, storage.nbytes()).zero_()
            if cls is Op:
                self._fill_outs(event.outs)
            return self._take_error(seq) if cls.expects_reply else None
        # commands that expect a reply
        if self.pending_error is not None:
            return self._take_error(seq)
        try:
            if cls is Read:
                return Data(seq=seq, payload=self._read(event))
            if cls is Sync:
                self.backend.synchronize()
                return SyncDone(seq=seq)
            if cls is CallSync:
                return Result(seq=seq, value=self._call_sync(event))
            if cls is Query:
                return Result(seq=seq, value=self._query(event.what))
        except Exception as exc:  # noqa: BLE001
            self._fail(seq, _describe(event), exc)
            return self._take_error(seq)
        raise SessionError(f"unexpected event {cls.__name__}")

    def _fail(self, seq: int, what: str, exc: Exception) -> None:
        log.debug("session %s: %s (seq %d) failed: %s", self.id, what, seq, exc)
        if self.pending_error is None:
            self.pending_error = Error(seq=seq, op=what, exc_type=type(exc).__name__, message=str(exc))

    def _take_error(self, reply_to: int) -> Error:
        error = self.pending_error
        self.pending_error = None
        error.reply_to = reply_to
        return error

    def _room(self) -> int:
        """Bytes this session may still allocate: its budget, else the device's memory."""
        if self.memory_budget is not None:
            return self.memory_budget - self.bytes_in_use
        return self._device_memory() - self.bytes_in_use

    def _guard_allocation(self, event: Op | CallSync, fn, kind: str | None = None) -> int:
        """Refuse, before running, an op whose results could not fit, so a hostile client
        cannot make the node allocate the machine away: the sizes the client declared, and
        the sizes a run of the op on meta tensors computes from the real arguments' shapes,
        strides and dtypes (``repeat`` with huge repeats, ``new_empty``, broadcasting,
        factories). The meta answer is cached per (op, argument signature), so an op seen
        before costs one signature and one dict lookup. An op may not grow an existing
        storage (an out= tensor of the wrong size): that memory would escape the budget.
        Returns the fresh bytes it measured for the op's results and temporaries (what the
        native loop may run the same signature within), -1 where it measured none."""
        outs = event.outs if type(event) is Op else None  # (a CallSync declares nothing)
        room = None
        if outs:
            declared = 0
            for out in outs:
                if type(out) is list and len(out) > 1 and type(out[1]) is int:
                    declared += out[1]
            budget = self.memory_budget  # ``_room``, inline
            room = (budget if budget is not None else self._device_bytes or self._device_memory()) - self.bytes_in_use
            if declared > room:
                raise _no_room(event.name, declared, room)
        name = event.name
        if kind is None:
            kind = _OP_KINDS.get(name)
            if kind is None:
                kind = _OP_KINDS[name] = _op_kind(name, fn)
        args, kwargs = event.args, event.kwargs
        if kind is _IN_PLACE:  # writes only into its first argument, whose size it cannot change
            first = args[0] if args else None
            if type(first) is _TENSOR and first.numel() > _LARGE:
                self._check_width(name, first.numel() * first.element_size())
            return 0
        if kind is _RECOMPUTE:  # the inner aten op runs here: check that one
            name, fn, args, kwargs = _recomputed_op(name, args)
            kind = _OP_KINDS.get(name) or _OP_KINDS.setdefault(name, _op_kind(name, fn))
            if kind is _IN_PLACE:
                return -1
        sizer = _SDPA_SIZERS.get(name)
        if sizer is not None and not kwargs:
            sized = sizer(args)
            if sized is not None:  # (malformed arguments: the meta run below decides)
                fresh, widest, scratch = sized
                if widest > _LARGE:
                    self._check_width(name, widest)
                if room is None:
                    room = self._room()
                if fresh > room:
                    how = "computed from its arguments' shapes"
                    if scratch:
                        how += (f", {format_size(scratch)} of it the attention matrices of SDPA's math path, which this "
                                f"{self.device.type} node takes for these arguments (dropout, or a layout no fused "
                                "kernel supports): shorten the sequences or batch, or drop attention dropout")
                    raise _no_room(name, fresh, room, how)
                return fresh
        # out= ops return their out= arguments, whose result shapes do not depend on strides:
        # their signature leaves strides out (the hot path of structured kernels)
        strided = kind is not _OUT
        key = self._signature(name, args, kwargs, strided)
        try:
            cost = _META_COSTS[key]
        except KeyError:
            cost = _META_COSTS[key] = _meta_cost(fn, args, kwargs, strided)
            if len(_META_COSTS) > _META_COSTS_MAX:
                _META_COSTS.clear()
        except Exception:  # noqa: BLE001 - an unhashable argument (a msgpack map): no caching
            cost = _meta_cost(fn, args, kwargs, strided)
        fresh, grown, resized, widest = cost
        if widest > _LARGE:
            self._check_width(name, widest)
        how = "computed by its meta kernel from the arguments' shapes"
        if kind is _VALUE_SIZED:
            bound = _value_sized_bytes(name, args, kwargs)
            if bound is not None and bound > fresh:
                fresh, how = bound, "computed from its arguments' values"
        if fresh < 0:
            return -1  # no meta answer (no meta kernel, invalid arguments): the real run decides
        if resized is not None or grown:
            what = (f"resize an argument of shape {list(resized[0])} to {list(resized[1])}" if resized is not None
                    else f"grow an existing storage by {format_size(grown)}")
            raise SessionError(
                f"gpuwire: {name} would {what}; a node never resizes a tensor it was given in place, "
                "since that memory would escape the session's budget: pass out= tensors of the result's shape")
        if fresh:
            if room is None:
                room = self._room()
            if fresh > room:
                raise _no_room(name, fresh, room, how)
        return fresh

    def _check_width(self, name: str, nbytes: int) -> None:
        """A zero-stride view passes the bounds check however large it is; a kernel over one
        larger than the whole device would hold the device (and every session) for minutes."""
        if nbytes > self._device_memory():
            raise SessionError(
                f"gpuwire: {name} was given a tensor of {format_size(nbytes)} (a broadcast view), more than this "
                f"device's {format_size(self._device_memory())} of memory; refused, since running it would "
                "occupy the device for every session: reduce the broadcast sizes")

    def _device_memory(self) -> int:
        """Bytes of memory the device has (the CPU backend: the host's)."""
        if self._device_bytes is None:
            self._device_bytes = int(self.backend.describe().get("total_memory") or 0) or (1 << 62)
        return self._device_bytes

    def _run_op(self, event: Op) -> None:
        name = event.name
        entry = self._op_entries.get(name)
        if entry is None:
            fn = self.ops.resolve(name)  # (a refused name raises here every time: never cached)
            kind = _OP_KINDS.get(name)
            if kind is None:
                kind = _OP_KINDS[name] = _op_kind(name, fn)
            entry = self._op_entries[name] = (fn, _direct(fn), kind, _number_list_slots(fn),
                                              _loop_eligible(name, fn, kind), self.ops.signature_check(name, fn))
        fn, call, kind, number_lists, loop_eligible, check = entry
        args, kwargs, outs = event.args, event.kwargs, event.outs
        if number_lists:
            _refuse_tensors_as_number_lists(name, number_lists, args, kwargs)
        if check is not None:  # (before the loop learns the signature: node/guards.py)
            instead = check(args, kwargs)
            if instead is not None:
                call, loop_eligible = instead, False
        fresh = self._guard_allocation(event, fn, kind)
        out_state = None
        if kind is _OUT and not outs:
            out_state = [(value, value.is_conj(), value.is_neg(), value.stride())
                         for value in chain(args, kwargs.values()) if type(value) is _TENSOR]
        rng = self.rng
        with rng.lock:
            if rng.owner is not self:
                rng.acquire(self)
            if self.precision is not APPLIED_PRECISION[0]:  # another session's math-mode flags
                apply_precision(self.precision)
            if name in SESSION_OPS:
                CURRENT.session = self
                try:
                    result = call(*args, **kwargs)
                finally:
                    CURRENT.session = None
            else:
                try:
                    result = call(*args, **kwargs)
                except (RuntimeError, NotImplementedError) as exc:
                    # a CPU kernel without the half-precision support CUDA's has: compute in
                    # float32, as CUDA's half kernels do inside
                    if self._device_index != -1 or not LOW_PRECISION_REFUSED.search(str(exc)):
                        raise
                    result = run_upcast(fn, args, kwargs)
                    loop_eligible = False  # (this signature stays Python's)
        self.ops_run += 1
        if self._loop is not None:  # the native loop runs this signature from now on
            self._loop.learn(event.seq, name, loop_eligible, fresh)
        if out_state is not None:
            self._restore_out_layouts(out_state)
        if outs:
            if type(result) is _TENSOR:
                if len(outs) != 1:
                    raise SessionError(f"{name} returned 1 tensors, the client expected {len(outs)}")
                self._adopt(result, outs[0], name)
                return
            tensors = tensor_leaves(result)
            if len(tensors) != len(outs) and type(result) in (tuple, list) and len(result) == len(outs) \
                    and all(r is None or type(r) is _TENSOR for r in result):
                # an output the kernel left undefined (``_native_multi_head_attention``'s weights
                # without need_weights) that shape inference gave as an empty tensor: store that
                tensors = list(result)
            if len(tensors) != len(outs):
                raise SessionError(f"{name} returned {len(tensors)} tensors, the client expected {len(outs)}")
            for tensor, out in zip(tensors, outs):
                if tensor is None:
                    if type(out) is not list or len(out) < 2 or type(out[0]) is not int or type(out[1]) is not int:
                        raise SessionError("malformed output declaration")
                    self.allocate(out[0], out[1])
                else:
                    self._adopt(tensor, out, name)

    def _native_loop_failed(self, seq: int, name: str, exc: BaseException, outs: list) -> bool:
        """The native loop's op ``name`` (frame ``seq``) raised ``exc`` in its kernel or while its
        results were stored: report it as ``handle`` reports a failed op (True), or False where
        the Python path must run it again (a CPU kernel without half precision: ``_run_op``
        computes it in float32; the kernel raised before writing anything)."""
        if (self._device_index == -1 and isinstance(exc, (RuntimeError, NotImplementedError))
                and LOW_PRECISION_REFUSED.search(str(exc))):
            return False
        self._fail(seq, name, exc)
        self._fill_outs(outs)
        return True

    def _restore_out_layouts(self, before: list) -> None:
        """Put an out= kernel's result in the layout the client knows. The kernel's changes to
        its out tensor's metadata live in this node's tensor object only, and the client reads
        the storage by the layout it sent:
        - a lazy conjugate (or negation) bit instead of the values (``linalg_lu_solve(left=False)``
          writes through ``out.mH``);
        - new strides: CPU kernels restride a same-sized out to their input's memory format
          (``replication_pad2d``, ``reflection_pad3d`` of a channels-last input wrote
          channels-last bytes that the client read as contiguous: wrong values).
        Write the values in the declared layout, and forget the cached views of the tensor."""
        for value, conj, neg, strides in before:
            restrided = value.stride() != strides
            if not restrided and (conj or not value.is_conj()) and (neg or not value.is_neg()):
                continue  # no bit added (a view the client sent conjugated stays as it was)
            if restrided and len(strides) != value.dim():
                continue  # resized to another rank: the client's shape check reports it
            values = value.resolve_conj().resolve_neg()
            if restrided:
                values = values.clone()  # (read before the same bytes are rewritten)
            plain = torch.empty(0, dtype=value.dtype, device=value.device).set_(
                value.untyped_storage(), value.storage_offset(), value.shape, strides)
            plain.copy_(values)
            for key in [key for key, entry in self._views.items() if entry[2] is value]:
                self._views.pop(key, None)

    def _adopt(self, tensor, out, name: str = "") -> None:
        """Store an op's result under the client-chosen storage id, in the layout the client
        computed; copy when the kernel chose another layout or returned an existing buffer."""
        if self._native_adopt is not None and self._native_adopt(self, tensor, out, *self._native_device):
            return  # stored as the kernel made it, by the C++ helper (the usual case)
        storage_id, nbytes, sizes, strides, dtype_code = out
        if type(storage_id) is not int or storage_id >= NODE_ID_BASE:
            raise SessionError("bad output storage id")
        dtype = self._dtype(dtype_code)
        storage = tensor.untyped_storage()
        sizes, strides = tuple(sizes), tuple(strides)
        have = storage.nbytes()
        ptr = storage.data_ptr() if have else 0
        if (tensor.dtype is not dtype or tensor.storage_offset() != 0 or tensor.shape != sizes
                or (tensor.stride() != strides and tensor.numel() > 1) or tensor.get_device() != self._device_index
                or tensor.is_conj() or tensor.is_neg()
                or have < nbytes or (have and ptr in self._live_ptrs)):
            if tensor.shape != sizes:
                # copy_ would broadcast (silently wrong) or fail with a baffling message
                raise SessionError(
                    f"the kernel returned an output of shape {list(tensor.shape)} where the client's shape "
                    f"inference (the op's meta kernel) predicted {list(sizes)}; the meta kernel disagrees "
                    f"with the {self.device.type} kernel for these arguments")
            _check_inside_storage(tensor)
            if tensor.dtype is not dtype:
                _say_dtype_disagreement(name, tensor.dtype, dtype)
            fixed = torch.empty_strided(sizes, strides, dtype=dtype, device=self.device)
            fixed.copy_(tensor)
            tensor = fixed
            storage = fixed.untyped_storage()
            have = storage.nbytes()
            ptr = storage.data_ptr() if have else 0
        # ``_store``, inline (one per op result)
        storages = self.storages
        if storage_id in storages:
            self._release(storage_id)
        budget = self.memory_budget
        if budget is not None and self.bytes_in_use + have > budget:
            self.check_budget(have)
        storages[storage_id] = storage
        self.bytes_in_use += have
        if self.bytes_in_use > self.peak_bytes:
            self.peak_bytes = self.bytes_in_use
        if have:
            self._live_ptrs.add(ptr)
        # the client names this result next by the descriptor of exactly this layout: cache the
        # result as that descriptor's view, so it need not be decoded and rebuilt (a different
        # encoding only misses; ``ext_hook`` checks storage and metadata on every hit)
        if not tensor.requires_grad:
            self._remember_view(_pack_descriptor((storage_id, 0, sizes, strides, dtype_code, 0)),
                                (storage_id, storage, tensor, sizes, strides, 0))

    def _remember_view(self, data: bytes, entry: tuple) -> None:
        """Cache ``entry`` (storage id, storage, view, sizes, strides, offset) as the view of the
        descriptor bytes ``data``, listed under its storage so that ``Free`` drops it."""
        views = self._views
        if len(views) >= VIEW_CACHE_MAX:
            views.clear()
            self._view_keys.clear()
        if data not in views:
            keys = self._view_keys.get(entry[0])
            if keys is None:
                self._view_keys[entry[0]] = [data]
            else:
                keys.append(data)
        views[data] = entry

    def _fill_outs(self, outs: list) -> None:
        """A failed op's outputs still exist (zeroed), so later ops fail for their own reasons
        rather than with 'unknown storage' noise."""
        for out in outs or ():
            try:
                if out[0] not in self.storages:
                    self.allocate(out[0], out[1])
            except Exception:  # noqa: BLE001
                pass

    def _bytes_view(self, storage_id: int, byte_offset: int, nbytes: int) -> torch.Tensor:
        return self.view(storage_id, byte_offset, (nbytes,), (1,), codec.DTYPE_CODES["uint8"])

    def payload_sink(self, header: list, nbytes: int):
        """Connection hook: on the CPU backend a large Write lands directly in the storage it
        targets (bounds-checked here); anything else goes through a buffer and ``_write``."""
        if self.device.type != "cpu" or header[0] != Write.code or len(header) != 4:
            return None
        _, _seq, storage_id, byte_offset = header
        if type(storage_id) is not int or type(byte_offset) is not int or byte_offset < 0:
            return None
        try:
            view = memoryview(self._bytes_view(storage_id, byte_offset, nbytes).numpy())
        except SessionError:
            return None  # ``_write`` reports the error when the event is handled
        self._landed = view
        return view

    def _write(self, event: Write) -> None:
        payload = event.payload
        if payload is self._landed:  # already received in place
            self._landed = None
            return
        n = len(payload)
        if not n:
            return
        dst = self._bytes_view(event.storage_id, event.byte_offset, n)
        dst.copy_(torch.frombuffer(payload, dtype=torch.uint8))

    def _read(self, event: Read):
        if event.nbytes == 0:
            return b""
        src = self._bytes_view(event.storage_id, event.byte_offset, event.nbytes)
        if src.device.type != "cpu":
            src = src.cpu()
        return memoryview(src.numpy())

    def _call_sync(self, event: CallSync):
        fn = self.ops.resolve(event.name)
        slots = _SYNC_NUMBER_LISTS.get(event.name)
        if slots is None:  # (a name ``resolve`` accepted: one entry an aten op at most)
            slots = _SYNC_NUMBER_LISTS[event.name] = _number_list_slots(fn)
        _refuse_tensors_as_number_lists(event.name, slots, event.args, event.kwargs)
        check = self.ops.signature_check(event.name, fn)
        instead = check(event.args, event.kwargs) if check is not None else None
        if instead is not None:
            fn = instead
        self._guard_allocation(event, fn)
        # an out= tensor the kernel resizes (``nonzero(x, out=empty)``) grows its storage in place:
        # charged as it was, its release took more than it had charged (-64 bytes a session)
        args_storages = [(s, s.nbytes(), s.data_ptr()) for s in _tensor_storages(event.args, event.kwargs)
                         if s.nbytes() == 0 or s.data_ptr() in self._live_ptrs]
        kind = _OP_KINDS.get(event.name)
        if kind is None:
            kind = _OP_KINDS[event.name] = _op_kind(event.name, fn)
        out_state = None
        if kind is _OUT:  # (as in ``_run_op``: the client reads an out= tensor by the layout it sent)
            out_state = [(value, value.is_conj(), value.is_neg(), value.stride(), value.shape)
                         for value in chain(event.args, event.kwargs.values()) if type(value) is _TENSOR]
        with self.rng.lock:
            self.rng.acquire(self)
            # this session's math-mode flags, as ``_run_op`` applies them: a call with a reply (an
            # op's first with a new dtype) ran with the last session's (another tenant's TF32,
            # deterministic algorithms, SDPA backends)
            if self.precision is not APPLIED_PRECISION[0]:
                apply_precision(self.precision)
            if event.name in SESSION_OPS:
                CURRENT.session = self
            try:
                result = fn(*event.args, **event.kwargs)
            except (RuntimeError, NotImplementedError) as exc:  # (as in ``_run_op``)
                if self._device_index != -1 or not LOW_PRECISION_REFUSED.search(str(exc)):
                    raise
                result = run_upcast(fn, event.args, event.kwargs)
            finally:
                CURRENT.session = None
                self._charge_resized(args_storages)
        self.ops_run += 1
        if out_state is not None:  # (an out the kernel resized is the client's to resize: ``_call_sync_outs``)
            self._restore_out_layouts([state[:4] for state in out_state if state[0].shape == state[4]])
        return self._encode_result(result)

    def _charge_resized(self, storages) -> None:
        """Charge the growth (or credit the shrinking) of storages an op resized in place."""
        for storage, nbytes, ptr in storages:
            now = storage.nbytes()
            if now == nbytes and (not now or storage.data_ptr() == ptr):
                continue
            self.bytes_in_use += now - nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            if nbytes:
                self._live_ptrs.discard(ptr)
            if now:
                self._live_ptrs.add(storage.data_ptr())

    def _encode_result(self, value):
        if isinstance(value, torch.Tensor):
            _check_inside_storage(value)
            if value.device != self.device and value.device.type != "cpu":
                value = value.to(self.device)
            if value.device.type == "cpu" and self.device.type != "cpu":
                value = value.to(self.device)
            # a dense result that fills its storage keeps its layout (``nonzero``'s is column-major
            # on CPU and CUDA); others are copied into a contiguous one
            keep = not value.storage_offset() and (value.is_contiguous() or _dense(value) and (
                value.untyped_storage().nbytes() == value.numel() * value.element_size()))
            contiguous = value if keep else value.contiguous()
            if contiguous.is_conj() or contiguous.is_neg():
                contiguous = contiguous.resolve_conj().resolve_neg()
            storage = contiguous.untyped_storage()
            if storage.nbytes() and storage.data_ptr() in self._live_ptrs:
                contiguous = contiguous.clone()
                storage = contiguous.untyped_storage()
            nbytes = storage.nbytes()
            storage_id = self._next_node_id
            self._next_node_id += max(nbytes, 1) + 511 & ~255
            self._store(storage_id, storage)
            return NewTensor(storage_id, nbytes, 0, tuple(contiguous.shape), tuple(contiguous.stride()),
                             DTYPE_CODE[contiguous.dtype])
        if isinstance(value, (tuple, list)):
            return [self._encode_result(v) for v in value]
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, (int, float, bool, complex, str, bytes)) or value is None:
            return value
        if isinstance(value, torch.Size):
            return list(value)
        raise SessionError(f"cannot return a value of type {type(value).__name__}")

    # ------------------------------------------------------------ moving a session (docs/failover.md)

    def export_state(self) -> dict:
        """Everything but the storages a rebuilt session needs to continue this one's stream."""
        with self.rng.lock:
            if self.rng.owner is self:
                state = self.rng.generator.get_state()
            else:
                state = self.rng_state
        rng = bytes(state.numpy().tobytes()) if state is not None else b""
        generators = [[gid, bytes(gen.get_state().numpy().tobytes())] for gid, gen in self.generators.items()]
        return {"rng_state": rng, "generators": generators, "next_node_id": self._next_node_id,
                "last_seq": self.applied_seq}

    def restore(self, event) -> None:
        """Apply a ``Restore``: generator states, the node-chosen id counter, the applied seq."""
        if event.rng_state:
            state = torch.frombuffer(bytearray(event.rng_state), dtype=torch.uint8).clone()
            with self.rng.lock:
                self.rng.acquire(self)
                self.rng.generator.set_state(state)
                self.rng_state = state
        for item in event.generators:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], bytes)):
                raise SessionError("malformed generator state in Restore")
            self.generator(item[0]).set_state(torch.frombuffer(bytearray(item[1]), dtype=torch.uint8).clone())
        if event.next_node_id:
            if not NODE_ID_BASE <= event.next_node_id < (1 << 63):
                raise SessionError("node id counter out of range in Restore")
            self._next_node_id = max(self._next_node_id, event.next_node_id)
        self.applied_seq = max(self.applied_seq, event.last_seq)

    def _share(self, storage_id: str) -> str:
        """``share:<id>``: a secret naming this storage to the other sessions of this node (a
        tensor the program made shared, sent to another process: Hogwild training), valid while
        this session lives."""
        try:
            storage = self.storages[int(storage_id)]
        except (ValueError, KeyError):
            raise SessionError(f"share of an unknown storage {storage_id!r}") from None
        token = secrets.token_hex(16)
        with _SHARED_LOCK:
            SHARED_STORAGES[token] = (storage, self.device)
        self._shared_tokens.append(token)
        return token

    def _adopt_shared(self, token: str, storage_id: str) -> None:
        """``adopt-shared:<secret>:<id>``: the storage another session of this node shared, under a
        fresh id of this one's; each side's writes are the other's (as CUDA IPC's are)."""
        with _SHARED_LOCK:
            entry = SHARED_STORAGES.get(token)
        if entry is None or entry[1] != self.device:
            raise SessionError("unknown shared storage: it was shared on another node, or by a process that "
                               "has ended")
        try:
            sid = int(storage_id)
        except ValueError:
            raise SessionError(f"malformed storage id {storage_id!r}") from None
        if sid in self.storages or not 0 < sid < NODE_ID_BASE:
            raise SessionError(f"storage id {sid:#x} is taken or out of range")
        self._store(sid, entry[0])

    def _query(self, what: str):
        self.bury()  # (what it reports, the device's memory above all, counts nothing freed as held)
        if what == "snapshot":
            return self.export_state()
        if what.startswith("migrate:") and self.migrate_hook is not None and self.lease_id is not None:
            import json
            try:
                target = json.loads(what[len("migrate:"):])
                address, token = str(target["address"]), target.get("token")
            except (ValueError, KeyError, TypeError):
                raise SessionError('malformed migrate query: expected migrate:{"address": ..., "token": ...}') from None
            return self.migrate_hook(self, address, token if isinstance(token, str) else None)
        if what == "device":
            return self.backend.describe()
        if what == "memory":
            return {"bytes_in_use": self.bytes_in_use, "peak_bytes": self.peak_bytes,
                    "storages": len(self.storages), "device_bytes_in_use": self.backend.memory_in_use(),
                    "device_free": self.backend.free_memory()}
        if what == "rng_state":
            with self.rng.lock:
                self.rng.acquire(self)
                state = self.rng.generator.get_state()
            return bytes(state.numpy().tobytes())
        if what == "precision":  # the math-mode flags this session's kernels run with
            with self.rng.lock:
                if self.precision is not APPLIED_PRECISION[0]:
                    apply_precision(self.precision)
                return math_mode()
        if what == "reset_peak":
            self.peak_bytes = self.bytes_in_use
            return None
        if what == "node" and self.node_info is not None:
            return self.node_info()
        if what.startswith("share:"):
            return self._share(what[len("share:"):])
        if what.startswith("adopt-shared:"):
            token, _, storage_id = what[len("adopt-shared:"):].partition(":")
            return self._adopt_shared(token, storage_id)
        if what.startswith("lease-token:") and self.lease_id is not None:
            claims = self.token_verifier(what[len("lease-token:"):])
            if claims.get("lease") != self.lease_id:
                raise SessionError("a refreshed token must be for the same lease")
            self.lease_expiry = float(claims["exp"])
            return {"expires": self.lease_expiry}
        raise SessionError(f"unknown query {what!r}")


def _apply_thread_count() -> None:
    """Make the calling thread's kernels use the process's intra-op thread count
    (``serve --threads``). ``torch.set_num_threads`` in the main thread sets it for threads
    torch starts itself, but a session thread's BLAS calls keep the library's default (every
    core) until the thread sets it: on a small node that means kernels that compete with each
    other, and with the client, for cores."""
    torch.set_num_threads(torch.get_num_threads())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers each element of its extent exactly once (any dim order)."""
    return t.is_contiguous() or dense_layout(t.shape, t.stride())


def _describe(event) -> str:
    name = getattr(event, "name", None)
    return name or type(event).__name__


def _no_room(op: str, nbytes: int, room: int, how: str = "") -> torch.OutOfMemoryError:
    how = f" ({how})" if how else ""
    return torch.OutOfMemoryError(f"gpuwire: {op} would allocate {format_size(nbytes)}{how}, more than the "
                                  f"{format_size(max(room, 0))} this session has left. Free tensors, use smaller "
                                  "sizes, or ask for a larger memory budget")


# ---------------------------------------------------------------- allocation guard: meta check
#
# ``Session._guard_allocation`` runs every op on meta tensors (shapes, strides, dtypes; no
# memory) before the real run, and refuses it if its results cannot fit, if it would resize a
# tensor it was given, or if an argument is a broadcast view larger than the whole device (a
# kernel over it would hold the device for minutes). The answer depends only on the op and its
# argument signature, so it is cached process-wide (all sessions).
# A signature is a flat tuple that cannot be ambiguous: a tensor contributes (sizes, strides,
# dtype), a list a tuple opened by ``_LIST``, a non-int scalar its value then its type (so
# 1, 1.0 and True differ); keyword arguments follow ``_KWARGS`` and the tuple of their names.

_TENSOR = torch.Tensor
_META = torch.device("meta")
_LIST = object()
_KWARGS = object()
_IN_PLACE, _OUT, _CHECKED, _RECOMPUTE, _VALUE_SIZED = "in-place", "out=", "checked", "recompute", "value-sized"
_OP_KINDS: dict[str, str] = {}
_LARGE = 1 << 30  # arguments below this many bytes need no comparison with the device's memory
_META_COSTS: dict = {}  # signature -> _meta_cost(...) (fresh bytes, growth, resize, largest argument)
_META_COSTS_MAX = 1 << 14  # entries; the cache is cleared when full (a client cannot grow it without bound)
_NO_ALLOCATION_OPS = ("gpuwire::generator_manual_seed", "gpuwire::generator_get_state",
                      "gpuwire::generator_set_state")


_OpOverload = torch._ops.OpOverload
_overload_call = _OpOverload.__call__


def _direct(fn):
    """What to call for ``fn``: an aten overload's C++ callable itself when its Python
    ``__call__`` only forwards to it (one Python frame less per op), else ``fn``."""
    if type(fn) is _OpOverload and _FORWARDS:
        return fn._op
    return fn


def _forwarding_call(self, /, *args, **kwargs):
    return self._op(*args, **kwargs)


_FORWARDS = all(getattr(_overload_call.__code__, a) == getattr(_forwarding_call.__code__, a)
                for a in ("co_code", "co_names", "co_consts", "co_varnames", "co_argcount", "co_posonlyargcount"))


def _number_list_slots(fn) -> tuple:
    """(position, name) of the arguments ``fn``'s schema takes as a list of numbers or booleans
    (``size`` of ``new_empty``, ``dim`` of ``sum``)."""
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return ()
    slots = []
    for index, argument in enumerate(schema.arguments):
        type_name = str(argument.type)
        if type_name.startswith("Optional["):
            type_name = type_name[len("Optional["):-1]
        if type_name.startswith("List[") and "Tensor" not in type_name:
            slots.append((index, argument.name))
    return tuple(slots)


def _tensor_storages(args, kwargs) -> list:
    """The distinct storages of the tensors among an op's arguments (lists of tensors included)."""
    seen, storages = set(), []
    for t in tensor_leaves([args, list(kwargs.values())]):
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            storages.append(storage)
    return storages


_SYNC_NUMBER_LISTS: dict = {}  # CallSync op name -> its ``_number_list_slots`` (schemas do not change)
_MAX_NUMBER_LIST = 4096  # (no op takes a longer list of sizes or dims)


def _refuse_tensors_as_number_lists(name: str, slots, args, kwargs) -> None:
    """A client sends sizes and dims as lists; a tensor there (hostile: a zero-stride view of
    10^17 elements) made PyTorch's argument parser iterate it element by element, which hung
    the session's thread. Refused before any call, with what was wrong."""
    for index, argument in slots:
        value = args[index] if index < len(args) else kwargs.get(argument) if type(kwargs) is dict else None
        if type(value) is _TENSOR and value.numel() > _MAX_NUMBER_LIST:
            raise SessionError(f"{name}: argument {argument!r} takes a list of numbers, not a tensor of "
                               f"{value.numel()} elements")


def _loop_eligible(name: str, fn, kind: str) -> bool:
    """Whether the native loop (node/loop.py) may run op ``name`` for signatures the Python
    path has run: an aten op called as its Python binding calls it, whose memory the guard
    measures per signature (no out=, no value-dependent sizes), with no random numbers (the
    device generator is swapped between sessions in Python), no session state, and tensor
    results only."""
    if (type(fn) is not _OpOverload or not name.startswith("aten::") or kind not in (_CHECKED, _IN_PLACE)
            or _direct(fn) is fn or name in SESSION_OPS or name in _SDPA_SIZERS or name in _VALUE_SIZED_OPS):
        return False
    if torch.Tag.nondeterministic_seeded in fn.tags:
        return False
    schema = fn._schema
    if any("Generator" in str(argument.type) for argument in schema.arguments):
        return False
    return all(str(result.type) == "Tensor" for result in schema.returns)


def _op_kind(name: str, fn) -> str:
    """How the guard treats op ``name`` (decided once per op name, from its schema)."""
    if name in _VALUE_SIZED_OPS:
        return _VALUE_SIZED
    if name in ("gpuwire::forward_with_rng", "gpuwire::backward_by_recompute"):
        return _RECOMPUTE
    if name in _NO_ALLOCATION_OPS:
        return _IN_PLACE
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return _CHECKED
    arguments = schema.arguments
    written = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    returns_written = all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)
    outs = [i for i, a in enumerate(arguments) if a.is_out]
    # in-place on its first argument only (add_, fill_, _foreach_mul_ ...): no fresh memory, and
    # the ops that resize their argument (resize_, set_ ...) are refused by name in node/ops.py
    if written == [0] and not outs and returns_written:
        return _IN_PLACE
    if outs and written == outs and returns_written:
        return _OUT
    return _CHECKED


def _signature(name: str, args, kwargs, strided: bool) -> tuple:
    key = [name]
    _add_signature(key, args, strided)
    if kwargs:
        key.append(_KWARGS)
        key.append(tuple(kwargs))
        _add_signature(key, kwargs.values(), strided)
    return tuple(key)


def _list_signature(values: list, strided: bool) -> tuple:
    key = [_LIST]
    _add_signature(key, values, strided)
    return tuple(key)


def _add_signature(key: list, values, strided: bool) -> None:
    add = key.append
    for a in values:
        tp = type(a)
        if tp is _TENSOR:
            add(a.shape)
            if strided:
                add(a.stride())
            add(a.dtype)
        elif tp is int or a is None:
            add(a)
        elif tp is list:
            add(_list_signature(a, strided))
        else:
            add(a)
            add(tp)


def _to_meta(value, tensors: list):
    """``value`` with tensors replaced by placeholders (collected in ``tensors``), devices by
    meta, generators by None."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _META_PLACEHOLDER
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, torch.Generator):
        return None  # meta kernels draw nothing; a node generator would not match the device
    if type(value) is list:
        return [_to_meta(v, tensors) for v in value]
    return value


_META_PLACEHOLDER = object()
_NO_ANSWER = -1


def _meta_cost(fn, args, kwargs, strided: bool = True) -> tuple:
    """What one run of ``fn`` on meta copies of the arguments (their shapes, dtypes and, when
    ``strided``, strides) allocates: (bytes of fresh results or _NO_ANSWER when the op has no
    meta answer for these arguments, bytes by which argument storages grow, (old, new) shape
    of an argument it resizes or None, bytes of the largest argument counted element by
    element)."""
    tensors: list = []
    try:
        args = [_to_meta(a, tensors) for a in args]
        kwargs = {k: _to_meta(v, tensors) for k, v in kwargs.items()}
    except Exception:  # noqa: BLE001
        return _NO_ANSWER, 0, None, 0
    widest = max((prod(t.shape) * t.element_size() for t in tensors), default=0)
    made = []
    try:
        for t in tensors:
            made.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META) if strided
                        else torch.empty(t.shape, dtype=t.dtype, device=_META))
    except Exception:  # noqa: BLE001 - a layout without strides, sizes that overflow
        return _NO_ANSWER, 0, None, widest
    fill = iter(made)
    args = _fill_placeholders(args, fill)
    kwargs = {k: _fill_placeholders(v, fill) for k, v in kwargs.items()}
    if not made:  # a factory: make it build on meta
        kwargs.setdefault("device", _META)
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    before = [(m.shape, m.untyped_storage().nbytes()) for m in made]
    quiet = _QUIET_WARNINGS[0]
    if quiet is not None:  # (the kernel that runs next says its warnings to the client)
        quiet(True)
    try:
        result = fn(*args, **kwargs)
        fresh, grown, resized = _measure(made, before, result)
        if resized is not None and prod(resized[0]) == prod(resized[1]) and getattr(fn, "_name", None) in RESIZED_ONLY_BY_NUMEL:
            resized = None  # (the meta kernel resized an out whose number of elements was right: the kernel won't)
        return fresh, grown, resized, widest
    except Exception:  # noqa: BLE001 - no meta kernel, data-dependent sizes, invalid arguments
        return _NO_ANSWER, 0, None, widest
    finally:
        if quiet is not None:
            quiet(False)


# the node helpers' ``quiet_warnings`` once they are installed (``node/native.py``), else None
_QUIET_WARNINGS: list = [None]


def _dense_bytes(t) -> int:
    """Bytes of ``t`` laid out densely (a broadcast view counts every element it shows)."""
    return t.numel() * t.element_size()


def _sdpa_sizer(q_at: int, extra: int = 0, gradients: bool = False):
    """Bytes the node's SDPA ops need, from their arguments' shapes: the attention output (the
    query's shape with the values' head size) or the gradients (the inputs' shapes), plus the
    attention matrices when this node's SDPA takes the math path for these arguments (on CPU:
    dropout; on CUDA: layouts no fused kernel takes), and the largest argument. Replaces a
    meta run of SDPA, which runs its math decomposition in Python (milliseconds) at every new
    shape, i.e. at every generated token, and which counts results only: the math path's
    B x H x L x S matrices are temporaries, so a long sequence would exhaust a CPU node's
    memory (the OOM killer takes the node, and every session with it) unchecked."""
    def size(args):
        if len(args) < q_at + 4:
            return None
        q, k, v, mask = args[q_at:q_at + 4]
        if (type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR or q.dim() < 2
                or v.dim() < 2 or k.dim() < 2 or (mask is not None and type(mask) is not _TENSOR)):
            return None
        tensors = [t for t in args if type(t) is _TENSOR]
        widest = max(_dense_bytes(t) for t in tensors)
        if gradients:
            fresh = _dense_bytes(q) + _dense_bytes(k) + _dense_bytes(v) + (_dense_bytes(mask) if mask is not None else 0)
        else:
            fresh = prod(q.shape[:-1]) * v.shape[-1] * q.element_size()
        scratch = _math_path_scratch(q, k, v, mask, args[q_at + 4:q_at + 8], gradients)
        return fresh + extra + scratch, widest, scratch
    return size


_SDPA_MATH = int(torch.nn.attention.SDPBackend.MATH)


def _math_path_scratch(q, k, v, mask, options, gradients: bool) -> int:
    """Bytes of attention matrices SDPA's math path keeps alive at its peak, 0 when a fused
    kernel (flash, memory-efficient: O(L) memory) runs these arguments. Estimated: scores and
    their softmax (and dropout's mask and output) forward, as many again for their gradients
    backward, in at least float32 (the CPU math path computes half precision in float32)."""
    dropout_p = options[0] if options and type(options[0]) in (float, int) else 0.0
    is_causal = options[1] if len(options) > 1 and type(options[1]) is bool else False
    scale = options[2] if len(options) > 2 and type(options[2]) in (float, int) else None
    enable_gqa = options[3] if len(options) > 3 and type(options[3]) is bool else False
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, float(dropout_p), is_causal, scale=scale, enable_gqa=enable_gqa)
    except Exception:  # noqa: BLE001 - arguments SDPA refuses: the run fails on its own, no memory needed
        return 0
    if choice != _SDPA_MATH:
        return 0
    batch = max(prod(q.shape[:-2]), prod(k.shape[:-2]))
    matrix = batch * q.shape[-2] * k.shape[-2] * max(q.element_size(), 4)
    copies = 2 + (2 if dropout_p else 0)
    return matrix * copies * (2 if gradients else 1)


_SDPA_SIZERS = {
    "gpuwire::sdpa": _sdpa_sizer(0),
    "gpuwire::sdpa_keep": _sdpa_sizer(0, extra=(1 << 16) + 1),  # + the generator state and the 1-byte handle
    "gpuwire::sdpa_backward": _sdpa_sizer(1, gradients=True),
    "gpuwire::sdpa_backward_kept": _sdpa_sizer(3, gradients=True),
}


def _fill_placeholders(value, fill):
    if value is _META_PLACEHOLDER:
        return next(fill)
    if type(value) is list:
        return [_fill_placeholders(v, fill) for v in value]
    return value


def _measure(made: list, before: list, result) -> tuple:
    known = set()
    grown = 0
    resized = None
    for meta, (shape, nbytes) in zip(made, before):
        storage = meta.untyped_storage()
        known.add(storage._cdata)
        if storage.nbytes() > nbytes:
            grown += storage.nbytes() - nbytes
        if resized is None and meta.shape != shape and meta.numel():  # (resizing to empty frees nothing)
            resized = (tuple(shape), tuple(meta.shape))
    fresh = 0
    for t in tensor_leaves(result):
        storage = t.untyped_storage()
        if storage._cdata not in known:
            known.add(storage._cdata)
            fresh += storage.nbytes()
    return fresh, grown, resized


_DTYPE_DISAGREEMENTS: set = set()


def _say_dtype_disagreement(name: str, made, declared) -> None:
    """A kernel's result in another dtype than the client declared is converted (the program
    sees the declared one), and said once in the node's log: the client's shape inference
    disagrees with the kernel there, and a later op may read the converted values differently
    (session 39: ``_embedding_bag``'s int64 outputs declared int32)."""
    if (name, made, declared) not in _DTYPE_DISAGREEMENTS:
        _DTYPE_DISAGREEMENTS.add((name, made, declared))
        log.warning("%s: the kernel made a %s result where the client declared %s (converted); the client's "
                    "shape inference disagrees with this kernel: please report it", name or "an op", made, declared)


def _check_inside_storage(tensor) -> None:
    """A kernel's result must lie inside its storage before the node copies or keeps it: a view
    op that checks nothing (``_reshape_alias``, node/guards.py) made one reaching past its
    storage, and the copy read other memory of the node (other tenants' tensors among it)."""
    if not tensor.numel():
        return
    lowest = highest = tensor.storage_offset()
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride < 0:
            lowest += (size - 1) * stride
        else:
            highest += (size - 1) * stride
    if lowest < 0 or (highest + 1) * tensor.element_size() > tensor.untyped_storage().nbytes():
        raise SessionError(f"gpuwire: a kernel returned a view (offset {tensor.storage_offset()}, sizes "
                           f"{list(tensor.shape)}, strides {list(tensor.stride())}) reaching outside its storage of "
                           f"{tensor.untyped_storage().nbytes()} bytes; refused")


def _recomputed_op(name: str, args):
    """The aten op that ``gpuwire::forward_with_rng`` / ``backward_by_recompute`` runs, with its
    arguments (the backward's gradients are shaped like the arguments, so the forward decides)."""
    from .composite import resolve_aten
    inner = args[0] if args else None
    rest = args[1:] if name == "gpuwire::forward_with_rng" else args[3:]
    return inner, resolve_aten(inner), rest, {}


def _arg(args, kwargs, index: int, key: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(key, default)


def _as_count(value) -> int:
    """A non-negative int from a python number or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return max(int(value), 0)


def _value_sized_bytes(name: str, args, kwargs):
    """Bytes an op whose result size depends on the *values* of its tensor arguments would
    allocate (meta kernels cannot tell), read from those values; None if they are unusable
    (the real run then reports its own error)."""
    try:
        return _VALUE_SIZED_OPS[name](args, kwargs)
    except Exception:  # noqa: BLE001
        return None


def _bincount_bytes(args, kwargs):
    x, minlength = args[0], _as_count(_arg(args, kwargs, 2, "minlength", 0))
    length = max(minlength, _as_count(x.max()) + 1 if x.numel() else 0)
    return length * 8


def _one_hot_bytes(args, kwargs):
    x, classes = args[0], int(_arg(args, kwargs, 1, "num_classes", -1))
    if classes < 0:
        classes = _as_count(x.max()) + 1 if x.numel() else 0
    return x.numel() * classes * 8


def _repeat_interleave_bytes(args, kwargs):
    repeats = args[0]
    return _as_count(repeats.sum()) * 8 if repeats.numel() else 0


def _repeat_interleave_self_bytes(args, kwargs):
    x, repeats, dim = args[0], args[1], _arg(args, kwargs, 2, "dim")
    length = x.numel() if dim is None else x.shape[dim]
    total = _as_count(repeats.sum()) if repeats.numel() != 1 else _as_count(repeats) * length
    row = 1 if dim is None or not length else x.numel() // length
    return total * row * x.element_size() + total * 8  # the result, and the index it gathers with


def _combinations_bytes(args, kwargs):
    x, r = args[0], _as_count(_arg(args, kwargs, 1, "r", 2))
    n = x.numel() + (1 if _arg(args, kwargs, 2, "with_replacement", False) else 0)
    grid = n ** r
    return grid * (1 + r * x.element_size())  # masks over the n**r grid, then the selected values


def _pad_packed_sequence_bytes(args, kwargs):
    data, batch_sizes = args[0], args[1]
    total_length = int(_arg(args, kwargs, 4, "total_length", 0))
    steps = max(total_length, batch_sizes.numel())
    batch = _as_count(batch_sizes[0]) if batch_sizes.numel() else 0
    row = data.numel() // data.shape[0] if data.dim() and data.shape[0] else 0
    return steps * batch * row * data.element_size() + batch * 8


def _padded_dense_to_jagged_bytes(args, kwargs):
    dense, offsets = args[0], args[1]
    total = _arg(args, kwargs, 2, "total_L")
    total = _as_count(total) if total is not None else _as_count(offsets[0][-1])
    row = dense.numel() // max(dense.shape[0] * dense.shape[1], 1) if dense.dim() >= 2 else 1
    return total * row * dense.element_size()


_VALUE_SIZED_OPS = {
    "aten::bincount": _bincount_bytes,
    "aten::one_hot": _one_hot_bytes,
    "aten::repeat_interleave.Tensor": _repeat_interleave_bytes,
    "aten::repeat_interleave.self_Tensor": _repeat_interleave_self_bytes,
    "aten::combinations": _combinations_bytes,
    "aten::_pad_packed_sequence": _pad_packed_sequence_bytes,
    "aten::_padded_dense_to_jagged_forward": _padded_dense_to_jagged_bytes,
}


WARM_UP_SWITCH_INTERVAL = 0.0002  # seconds


def _warm_up_meta() -> None:
    """The first op on meta tensors in a process imports torch._dynamo (about a second). Done
    in the background when a node loads this module, so that second is not charged to the first
    session that sends an op (its fair-scheduler turn would then wait for every other session
    to use as much device time)."""
    # the imports run Python code holding the GIL, which a session thread woken by a command
    # waited for up to a whole switch interval (5 ms) at a time: switch often while it lasts
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(WARM_UP_SWITCH_INTERVAL)
    try:
        meta = torch.empty(1, device=_META)
        torch.ops.aten.add.Tensor(meta, meta)
    except Exception:  # noqa: BLE001 - only a warm-up
        pass
    finally:
        sys.setswitchinterval(switch_interval)
    settle_garbage_collector()


# young-generation threshold of a node process: a few hundred events between collections, not ~40
NODE_GC_THRESHOLDS = (10_000, 10, 10)


def settle_garbage_collector() -> None:
    """A node process's imports (torch, and dynamo for the guard's meta runs) leave ~300,000
    Python objects that every full collection walked again: ~85 ms a time, on a session's thread,
    and collections of the young generation every ~40 events (~150 us each). Freeze what the
    imports made (never garbage again) and collect the young generation less often. On the node
    replay of a GPT-2 tiny step (``bench.node_replay``) the collector's time fell from 323 to 61
    ms over ~26,000 events. Cyclic garbage still goes within a few hundred events."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*NODE_GC_THRESHOLDS)


def start_meta_warm_up() -> None:
    """Called by the server process once it listens (not at import: a thread inside torch while
    a refusing process exits makes the C++ runtime abort); at its end the process's garbage
    collector is settled for serving (``settle_garbage_collector``). Not in a program that embeds
    a node in its own process: its collector is its own."""
    threading.Thread(target=_warm_up_meta, daemon=True, name="gpuwire-meta-warm-up").start()
