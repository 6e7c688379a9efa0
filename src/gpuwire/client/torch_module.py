"""``torch.gpuwire``: the device module PyTorch looks up for the renamed PrivateUse1 device.

Sits between PyTorch's generic device plumbing (seeding, serialization, autocast queries,
``torch.get_device_module``) and the runtime. Nothing here connects to a node until a call
needs the node (seeding before first use is remembered and sent on connect).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
import threading
import types
import weakref

import torch

from . import device as _device
from .wire import DEVICE_TYPE


class Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1
# a Python-API function through ctypes: ctypes raises the calling thread's pending Python error
# after any such call, which is how ``Guard.type_`` notices one
_PENDING = ctypes.pythonapi.PyErr_Occurred
_PENDING.argtypes, _PENDING.restype = [], ctypes.c_void_p
last_device_thread_error: BaseException | None = None


class Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        """The device type, asked by C++ at every device guard (hundreds of times a training
        step, mostly on autograd's device thread; ~0.1 us).

        PyTorch's Python device guard asks it from ``noexcept`` methods (``exchangeStream``),
        including the stream guard that autograd's device thread unwinds when a backward node
        raises. A Python error raised there by a kernel or a tensor subclass is still pending
        in the thread at that moment, so calling into Python fails and the process aborts
        ("terminate called without an active exception"; PyTorch's TestCompositeCompliance
        test_backward hits it on its first expected failure). Here the pending error is taken
        out of the way, so the call succeeds: the backward then fails with a SystemError
        ("... returned NULL without setting an exception") instead of killing the process, and
        the original error is printed and kept in ``last_device_thread_error``."""
        try:
            _PENDING()
        except BaseException as exc:  # noqa: BLE001 - the pending error of the unwinding kernel
            _hold(exc)
        return _PRIVATEUSE1


def _hold(exc: BaseException) -> None:
    global last_device_thread_error
    if isinstance(exc, SystemError) and exc.__cause__ is not None:
        exc = exc.__cause__
    last_device_thread_error = exc
    try:
        sys.stderr.write(f"gpuwire: error in a backward pass on autograd's device thread "
                         f"(PyTorch reports it as a SystemError): {type(exc).__name__}: {exc}\n")
    except Exception:  # noqa: BLE001 - never raise from here
        pass


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _device.current_runtime() is not None


def _lazy_init() -> None:
    """PyTorch's lazy device initialization (``torch.accelerator.*`` queries, which dynamo makes
    at every ``torch.compile`` whatever the device): nothing to do before the first op, which
    connects. Connecting here started an embedded node in programs that never use the device."""


def _is_in_bad_fork() -> bool:
    return False


def launcher_devices() -> int:
    """How many device indices a rank started by a launcher (torchrun, accelerate launch,
    deepspeed: ``LOCAL_RANK`` set) may name: its launcher gives local rank i the GPU ``cuda:i``
    (``torch.cuda.set_device(local_rank)``, ``DDP(device_ids=[local_rank])``; DeviceMesh sets
    it itself), and here each rank is a process with a session of its own, so each rank's index
    is its session's device. 1 outside a launcher."""
    try:
        rank = int(os.environ["LOCAL_RANK"])
        size = int(os.environ.get("LOCAL_WORLD_SIZE", rank + 1))
    except (KeyError, ValueError):
        return 1
    return max(1, rank + 1, size)


# The device indices this process may name, all of them its session's one device (under CUDA
# compatibility ``cuda_compat.enable`` sets it again). Under CUDA compatibility the index last
# set is ``current_device`` (a rank's tensors read as cuda:<its local rank>); natively tensors
# are gpuwire:0 and so is the current device, whichever index was set: FSDP2 expects its
# parameters on ``gpuwire:<current_device()>`` once DeviceMesh has set the rank's LOCAL_RANK.
VISIBLE_DEVICES = launcher_devices()
_current = [0]
TRACKS_INDEX = [False]


def device_count() -> int:
    return VISIBLE_DEVICES


def current_device() -> int:
    return _current[0]


class InvalidDeviceOrdinal(RuntimeError, ValueError):
    """``set_device`` of an index the session does not have: a RuntimeError, as CUDA's "invalid
    device ordinal" is (scripts catch that), and a ValueError, as gpuwire raised before."""


def _index_of(device) -> int | None:
    if isinstance(device, str):
        device = torch.device(device)
    index = device.index if isinstance(device, torch.device) else device
    return None if index in (None, -1) else index


def _absent(index: int) -> str:
    return (f"gpuwire device {index} does not exist: this session has one device"
            + (" (index 0)" if VISIBLE_DEVICES == 1 else f", visible as indices 0-{VISIBLE_DEVICES - 1}"))


def set_device(index) -> None:
    index = _index_of(index)
    if index is None:
        return
    if not 0 <= index < VISIBLE_DEVICES:
        raise InvalidDeviceOrdinal(f"invalid device ordinal: {_absent(index)}")
    if TRACKS_INDEX[0]:
        _current[0] = index


def check_device_id(device) -> None:
    """``get_device_properties`` / ``get_device_name`` / ``get_device_capability`` of an index the
    session does not have raise as PyTorch's CUDA functions do (AssertionError "Invalid device
    id"), instead of describing a device that is not there."""
    index = _index_of(device)
    if isinstance(index, int) and not 0 <= index < VISIBLE_DEVICES:  # (anything else: described as before)
        raise AssertionError(f"Invalid device id ({_absent(index)})")


class device:
    """``torch.gpuwire.device(i)`` (and ``torch.cuda.device`` under CUDA compatibility): a context
    manager PyTorch uses (``torch.load(map_location=...)``); one device, so entering it changes
    nothing (another index is refused). A class, as in PyTorch: its own code tests
    ``isinstance(x, torch.cuda.device)`` (``torch.cuda._utils._get_device_index``, hence
    ``torch.cuda.memory_cached()``, ``torch.cuda.StreamContext``)."""

    def __init__(self, index=None):
        if isinstance(index, (str, torch.device)):
            index = torch.device(index).index
        self.prev_idx = current_device()
        set_device(index)
        self.idx = -1 if index == -1 else current_device()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        if self.idx != -1:
            set_device(self.prev_idx)
        return False


class device_of(device):
    """``torch.gpuwire.device_of(obj)`` (and ``torch.cuda.device_of``): the device of a tensor on
    this device, a no-op for anything else."""

    def __init__(self, obj):
        super().__init__(current_device() if isinstance(obj, torch.Tensor) and obj.is_cuda else -1)


def synchronize(device=None) -> None:
    rt = _device.current_runtime()
    if rt is not None:
        rt.synchronize()


def manual_seed(seed: int) -> None:
    _device.set_pending_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    manual_seed(torch.seed())


seed_all = seed


def initial_seed() -> int:
    """The seed the device's generator was last seeded with (``torch.cuda.manual_seed(77)`` then
    ``torch.cuda.initial_seed()`` is 77, as on CUDA; it gave the CPU generator's)."""
    seeded = _device._pending_seed
    return seeded if seeded is not None else torch.initial_seed()


def get_rng_state(device="gpuwire") -> torch.Tensor:
    state = _device.runtime().query("rng_state")
    return torch.frombuffer(bytearray(state), dtype=torch.uint8).clone()


def set_rng_state(new_state: torch.Tensor, device="gpuwire") -> None:
    _device.runtime().set_rng_state(bytes(new_state.contiguous().numpy().tobytes()))


def get_rng_state_all() -> list:
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    for state in states:
        set_rng_state(state)


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


def _memory(key: str) -> int:
    rt = _device.current_runtime()
    if rt is None:
        return 0
    return int(rt.query("memory")[key])


def memory_allocated(device=None) -> int:
    return _memory("bytes_in_use")


def max_memory_allocated(device=None) -> int:
    return _memory("peak_bytes")


# the node allocates each storage as asked (no cache of its own beyond the device's): what is
# reserved is what is allocated
memory_reserved, max_memory_reserved = memory_allocated, max_memory_allocated


def reset_peak_memory_stats(device=None) -> None:
    rt = _device.current_runtime()
    if rt is not None:
        rt.query("reset_peak")


reset_max_memory_allocated = reset_peak_memory_stats


def reset_accumulated_memory_stats(device=None) -> None:
    """(no accumulated counters are kept)"""


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device, as this session sees it: what it does not hold, and
    no more than the device can still give (other tenants' and processes' use: on a CPU node
    the host's available memory, which PyTorch's tests and batch-size finders trust before
    allocating tens of GB)."""
    rt = _device.runtime()
    total = int(rt.device_info.get("total_memory", 0))
    memory = rt.query("memory")
    free = max(total - int(memory.get("bytes_in_use", 0)), 0)
    device_free = memory.get("device_free")
    return (min(free, int(device_free)) if isinstance(device_free, int) else free), total


def _nested_memory_stats() -> dict:
    used, peak = _memory("bytes_in_use"), _memory("peak_bytes")
    counters = {"all": {"current": used, "peak": peak}}
    return {"allocated_bytes": counters, "reserved_bytes": counters, "active_bytes": counters}


def memory_stats(device=None) -> dict:
    """The allocator statistics a CUDA program reads (flattened, as ``torch.cuda.memory_stats``)."""
    return {f"{name}.all.{which}": value for name, pools in _nested_memory_stats().items()
            for which, value in pools["all"].items()}


def memory_summary(device=None, abbreviated=False) -> str:
    return f"gpuwire device memory: {_memory('bytes_in_use')} bytes allocated, {_memory('peak_bytes')} peak"


def bridge_accelerator_memory() -> None:
    """``torch.accelerator.memory_allocated()`` and the rest ask PyTorch's C++ for the current
    accelerator's ``DeviceAllocator``, which a device backed from Python (as this one is) does not
    have: they failed with "INTERNAL ASSERT FAILED ... Allocator for gpuwire is not a
    DeviceAllocator". Where the gpuwire device is the current accelerator, the C++ entry points
    those functions call answer from the node's figures instead; elsewhere (a machine with a local
    GPU) PyTorch's own answer."""
    def bridged(name, ours):
        original = getattr(torch._C, name, None)
        if original is None or getattr(original, "_gpuwire_bridge", False):
            return

        def entry(*args):
            accelerator = torch.accelerator.current_accelerator()
            if accelerator is None or accelerator.type != DEVICE_TYPE:
                return original(*args)
            return ours(*args)
        entry._gpuwire_bridge = True
        setattr(torch._C, name, entry)

    bridged("_accelerator_isAllocatorInitialized", lambda: True)
    bridged("_accelerator_getDeviceStats", lambda index=None: _nested_memory_stats())
    bridged("_accelerator_resetPeakStats", lambda index=None: reset_peak_memory_stats())
    bridged("_accelerator_resetAccumulatedStats", lambda index=None: None)
    bridged("_accelerator_getMemoryInfo", lambda index=None: mem_get_info())
    bridged("_accelerator_emptyCache", lambda: empty_cache())


def empty_cache() -> None:
    rt = _device.current_runtime()
    if rt is not None:
        with rt.lock:
            rt._collect_garbage()
            rt._flush()


def get_device_properties(device=None) -> types.SimpleNamespace:
    check_device_id(device)
    info = _device.runtime().device_info
    return types.SimpleNamespace(**info)


def get_device_name(device=None) -> str:
    check_device_id(device)
    return _device.runtime().device_info.get("name", "gpuwire device")


class Event:
    """``torch.cuda.Event``. ``record`` waits for the node to finish the work queued so far, so
    ``elapsed_time`` measures what ran on the node between two records (plus one round trip)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream=None):
        _device.runtime().synchronize()
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0


class Stream:
    """``torch.cuda.Stream``: the node runs a session's ops in order, so every stream's work is
    ordered with every other's and waiting and synchronizing behave accordingly. Streams are
    still distinct objects, as programs and PyTorch's own test harness use them: each has its
    own id (the default stream's is 0), compares and hashes by it, and ``with stream:`` /
    ``torch.cuda.stream(s)`` make it the thread's current stream."""

    _next_id = 1

    def __init__(self, device=None, priority: int = 0, *, stream_id: int | None = None, **_):
        self.priority = priority
        if stream_id is None:
            stream_id, Stream._next_id = Stream._next_id, Stream._next_id + 1
        self.stream_id = stream_id
        self.cuda_stream = stream_id  # (the handle CUDA gives: 0 for the default stream)
        self.device_index = 0
        _STREAMS[stream_id] = self

    @property
    def device(self) -> torch.device:
        from . import cuda_compat  # (imports this module)
        return torch.device("cuda" if cuda_compat.enabled() else "gpuwire", 0)

    @property
    def device_type(self) -> int:  # (c10::DeviceType, as torch.Stream gives it)
        from . import cuda_compat
        return 1 if cuda_compat.enabled() else 20

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        _device.runtime().synchronize()

    def query(self) -> bool:
        return True

    def __enter__(self):
        self._outer = current_stream()
        set_stream(self)
        return self

    def __exit__(self, *exc):
        set_stream(self._outer)
        return False

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(("gpuwire stream", self.stream_id))

    def __repr__(self) -> str:
        from . import cuda_compat
        kind = "torch.cuda.Stream" if cuda_compat.enabled() else "torch.gpuwire.Stream"
        return f"<{kind} device={self.device} cuda_stream={self.cuda_stream:#x}>"


_STREAMS: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()
_DEFAULT_STREAM: Stream | None = None
_current_streams = threading.local()  # (the current stream is per thread, as CUDA's is)


def default_stream(device=None) -> Stream:
    global _DEFAULT_STREAM
    if _DEFAULT_STREAM is None:
        _DEFAULT_STREAM = Stream(stream_id=0)
    return _DEFAULT_STREAM


def current_stream(device=None) -> Stream:
    return getattr(_current_streams, "stream", None) or default_stream()


@contextlib.contextmanager
def stream(stream=None):
    if stream is None:
        yield stream
        return
    outer = current_stream()
    set_stream(stream)
    try:
        yield stream
    finally:
        set_stream(outer)


def set_stream(stream) -> None:
    if stream is not None:
        _current_streams.stream = stream


def set_stream_by_id(stream_id: int, device_index: int = 0, device_type: int = 0) -> None:
    """``torch._C._cuda_setStream`` (PyTorch's test harness runs every CUDA test on a stream of
    its own so)."""
    found = _STREAMS.get(stream_id)
    set_stream(found if found is not None else default_stream() if stream_id == 0 else Stream(stream_id=stream_id))


module = types.ModuleType("torch.gpuwire", __doc__)
for _name, _value in list(globals().items()):
    if callable(_value) and not _name.startswith("__") and _name not in ("Hooks", "Guard", "types", "torch",
                                                                         "contextlib", "time", "threading", "weakref",
                                                                         "set_stream_by_id"):
        setattr(module, _name, _value)


def _module_attribute(name: str):
    # ``torch.cuda._initialized`` is a plain flag that PyTorch reads with getattr: activation
    # checkpointing saves and restores a device's random state only when its module says it is
    # initialized, so without it recomputed dropout draws new masks (wrong gradients, silently)
    if name == "_initialized":
        return is_initialized()
    raise AttributeError(f"module 'torch.gpuwire' has no attribute {name!r}")


module.__getattr__ = _module_attribute
