"""One client's state on a node: its storages, its random generator, its pending error.

Sits between the server (which feeds it decoded events) and torch (which runs the ops).
What crosses its boundary: protocol events in, reply events out. A session can reach only the
storages in its own table; every tensor descriptor is checked against the real allocation's
bounds before a view of it is made, so no descriptor can read outside what it owns.
"""

from __future__ import annotations

import logging
import threading
import uuid
import warnings

import msgpack
import torch

from ..protocol import codec
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
    Result,
    Seed,
    SetRngState,
    Sync,
    SyncDone,
    Write,
)
from .backend import Backend
from ..pool.sizes import format_size
from .composite import tensor_leaves
from .ops import OpTable

log = logging.getLogger("gpuwire.node")

TORCH_DTYPES = tuple(getattr(torch, name, None) for name in codec.DTYPE_NAMES)
DTYPE_CODE = {dt: code for code, dt in enumerate(TORCH_DTYPES) if dt is not None}
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
LAYOUTS = tuple(getattr(torch, name, None) for name in codec.LAYOUT_NAMES)
NODE_ID_BASE = 1 << 60  # node-chosen storage ids live above every client-chosen one
MAX_INLINE_BYTES = 1 << 20

warnings.filterwarnings("ignore", message="The given buffer is not writable")


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
        self.last_seq = 0
        self.ops_run = 0
        self._next_node_id = NODE_ID_BASE
        self._live_ptrs: set[int] = set()
        self._empty = {}  # dtype -> empty tensor used as the base of views

    # ------------------------------------------------------------ decoding hooks

    def ext_hook(self, code: int, data: bytes):
        """msgpack ext hook: wire values straight into node objects, checked."""
        if code == codec.EXT_TENSOR:
            fields = codec.unpack_tensor_ref_fields(data)
            try:
                return self.view(*fields)
            except SessionError as exc:
                # well-formed but not allowed (foreign id, out of bounds): the command fails,
                # the session goes on; ``handle`` reports it
                if self.decode_error is None:
                    self.decode_error = exc
                return None
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

    def view(self, storage_id: int, offset: int, sizes: tuple, strides: tuple, dtype_code: int, flags: int = 0):
        """A node tensor for a client descriptor, after checking it stays inside the storage."""
        storage = self.storages.get(storage_id)
        if storage is None:
            raise SessionError(f"storage {storage_id:#x} is not allocated in this session "
                               "(freed, never allocated, or owned by another session)")
        dtype = self._dtype(dtype_code)
        itemsize = dtype.itemsize
        numel_nonzero = all(sizes)
        if numel_nonzero:
            low = high = offset
            for size, stride in zip(sizes, strides):
                step = (size - 1) * stride
                if step < 0:
                    low += step
                else:
                    high += step
            if low < 0 or (high + 1) * itemsize > storage.nbytes():
                raise SessionError(
                    f"tensor view (offset {offset}, sizes {list(sizes)}, strides {list(strides)}, {dtype}) reaches "
                    f"outside its storage of {storage.nbytes()} bytes")
        # an empty view reads nothing, so its offset may lie past the end, as on CPU/CUDA
        # (``narrow``/negative padding of an edge gives one)
        if any(s < 0 for s in strides):
            raise SessionError("negative strides are not supported")
        base = self._empty.get(dtype)
        if base is None:
            base = self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        t = base.new_empty(0).set_(storage, offset, sizes, strides)
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
        storage = self.storages.pop(storage_id, None)
        if storage is not None:
            self.bytes_in_use -= storage.nbytes()
            if storage.nbytes():
                self._live_ptrs.discard(storage.data_ptr())

    def allocate(self, storage_id: int, nbytes: int, zero: bool = True) -> None:
        if storage_id >= NODE_ID_BASE:
            raise SessionError(f"storage id {storage_id:#x} is in the node's range")
        self._settle_unzeroed()
        self.check_budget(nbytes)
        if zero:
            # zeroed: a tenant never reads what an earlier one left in device memory
            self._store(storage_id, torch.zeros(nbytes, dtype=torch.uint8, device=self.device).untyped_storage())
            return
        self._store(storage_id, torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage())
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
        if (pending is not None and type(event) is Write and event.storage_id == pending[0]
                and event.byte_offset == pending[1]):
            pending[1] += len(event.payload)
            if pending[1] >= pending[2]:
                self._unzeroed = None
            return True
        return False

    def close(self) -> None:
        self.storages.clear()
        self._live_ptrs.clear()
        self.bytes_in_use = 0
        self.rng.release(self)

    # ------------------------------------------------------------ events

    def handle(self, event):
        """Run one event; return the reply event or None. Never raises for a client's mistake."""
        seq = getattr(event, "seq", 0)
        self.last_seq = seq
        cls = type(event)
        try:
            if self.decode_error is not None:
                exc, self.decode_error = self.decode_error, None
                raise exc
            if self._unzeroed is not None and not self._covers_unzeroed(event):
                self._settle_unzeroed()
            if cls is Op:
                self._run_op(event)
                return None
            if cls is Alloc:
                self.allocate(event.storage_id, event.nbytes, zero=not event.overwrite)
                return None
            if cls is Free:
                for sid in event.storage_ids:
                    if type(sid) is int:
                        self._release(sid)
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
        except Exception as exc:  # noqa: BLE001 - any failure is the client's to see
            self._fail(seq, _describe(event), exc)
            if cls is Op:
                self._fill_outs(event)
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
        if self._device_bytes is None:
            self._device_bytes = int(self.backend.describe().get("total_memory") or 0) or (1 << 62)
        return self._device_bytes - self.bytes_in_use

    def _guard_allocation(self, event: Op, fn) -> None:
        """Refuse, before running, an op whose results could not fit: the sizes the client
        declared, and for ops with no tensor argument (factories, which our client never sends
        whole) the sizes a meta run computes. A hostile client cannot make the node allocate
        the machine away this way."""
        room = self._room()
        declared = 0
        for out in event.outs:
            if type(out) is list and len(out) > 1 and type(out[1]) is int:
                declared += out[1]
        if declared > room:
            raise _no_room(event.name, declared, room)
        if any(isinstance(a, torch.Tensor) for a in event.args) or any(
                isinstance(v, torch.Tensor) for v in event.kwargs.values()):
            return
        if any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a) for a in event.args):
            return
        meta = torch.device("meta")
        kwargs = {k: (meta if isinstance(v, torch.device) else v) for k, v in event.kwargs.items()}
        args = [meta if isinstance(a, torch.device) else a for a in event.args]
        if "device" not in kwargs:
            kwargs["device"] = meta
        try:
            result = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - no meta answer: the real run reports its own error
            return
        needed = sum(t.untyped_storage().nbytes() for t in tensor_leaves(result))
        if needed > room:
            raise _no_room(event.name, needed, room)

    def _run_op(self, event: Op) -> None:
        fn = self.ops.resolve(event.name)
        self._guard_allocation(event, fn)
        with self.rng.lock:
            self.rng.acquire(self)
            result = fn(*event.args, **event.kwargs)
        self.ops_run += 1
        if event.outs:
            tensors = tensor_leaves(result)
            if len(tensors) != len(event.outs):
                raise SessionError(f"{event.name} returned {len(tensors)} tensors, the client expected {len(event.outs)}")
            for tensor, out in zip(tensors, event.outs):
                self._adopt(tensor, out)

    def _adopt(self, tensor, out) -> None:
        """Store an op's result under the client-chosen storage id, in the layout the client
        computed; copy when the kernel chose another layout or returned an existing buffer."""
        storage_id, nbytes, sizes, strides, dtype_code = out
        if type(storage_id) is not int or storage_id >= NODE_ID_BASE:
            raise SessionError("bad output storage id")
        dtype = self._dtype(dtype_code)
        storage = tensor.untyped_storage()
        if (tensor.dtype is not dtype or tensor.storage_offset() != 0 or tuple(tensor.shape) != tuple(sizes)
                or (tensor.numel() > 1 and tensor.stride() != tuple(strides)) or tensor.device != self.device
                or tensor.is_conj() or tensor.is_neg()
                or storage.nbytes() < nbytes or (storage.nbytes() and storage.data_ptr() in self._live_ptrs)):
            if tuple(tensor.shape) != tuple(sizes):
                # copy_ would broadcast (silently wrong) or fail with a baffling message
                raise SessionError(
                    f"the kernel returned an output of shape {list(tensor.shape)} where the client's shape "
                    f"inference (the op's meta kernel) predicted {list(sizes)}; the meta kernel disagrees "
                    f"with the {self.device.type} kernel for these arguments")
            fixed = torch.empty_strided(sizes, strides, dtype=dtype, device=self.device)
            fixed.copy_(tensor)
            storage = fixed.untyped_storage()
        self._store(storage_id, storage)

    def _fill_outs(self, event: Op) -> None:
        """A failed op's outputs still exist (zeroed), so later ops fail for their own reasons
        rather than with 'unknown storage' noise."""
        for out in event.outs or ():
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
        with self.rng.lock:
            self.rng.acquire(self)
            result = fn(*event.args, **event.kwargs)
        self.ops_run += 1
        return self._encode_result(result)

    def _encode_result(self, value):
        if isinstance(value, torch.Tensor):
            if value.device != self.device and value.device.type != "cpu":
                value = value.to(self.device)
            if value.device.type == "cpu" and self.device.type != "cpu":
                value = value.to(self.device)
            contiguous = value.contiguous() if (value.storage_offset() or not value.is_contiguous()) else value
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

    def _query(self, what: str):
        if what == "device":
            return self.backend.describe()
        if what == "memory":
            return {"bytes_in_use": self.bytes_in_use, "peak_bytes": self.peak_bytes,
                    "storages": len(self.storages), "device_bytes_in_use": self.backend.memory_in_use()}
        if what == "rng_state":
            with self.rng.lock:
                self.rng.acquire(self)
                state = self.rng.generator.get_state()
            return bytes(state.numpy().tobytes())
        if what == "reset_peak":
            self.peak_bytes = self.bytes_in_use
            return None
        if what == "node" and self.node_info is not None:
            return self.node_info()
        if what.startswith("lease-token:") and self.lease_id is not None:
            claims = self.token_verifier(what[len("lease-token:"):])
            if claims.get("lease") != self.lease_id:
                raise SessionError("a refreshed token must be for the same lease")
            self.lease_expiry = float(claims["exp"])
            return {"expires": self.lease_expiry}
        raise SessionError(f"unknown query {what!r}")


def _describe(event) -> str:
    name = getattr(event, "name", None)
    return name or type(event).__name__


def _no_room(op: str, nbytes: int, room: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"gpuwire: {op} would allocate {format_size(nbytes)}, more than the "
                                  f"{format_size(max(room, 0))} this session has left")
