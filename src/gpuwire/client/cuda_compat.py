"""CUDA compatibility: a program written for ``"cuda"`` runs on the gpuwire device unchanged.

Sits on top of ``client.device``; opt-in (``gpuwire.attach(cuda_compat=True)``, on by default
under ``gpuwire run``). What it changes, and why each is needed:

* a TorchFunctionMode rewrites ``device="cuda"``/``"cuda:N"``/``torch.device("cuda")`` in every
  torch call, ``.to("cuda")`` and ``.cuda()`` to the gpuwire device (``Module.cuda()`` goes
  through ``Tensor.cuda`` too);
* ``Tensor.device`` reports ``cuda:N`` and ``Tensor.is_cuda`` is True for gpuwire tensors, so
  ``x.device.type == "cuda"`` checks in user and library code take the GPU path (a device
  object read back from a tensor flows into later calls, where the mode maps it again);
  gpuwire's own code tests devices with ``wire.on_device`` (dispatch keys), which no
  property or mode can disguise;
* ``torch.cuda.*`` (availability, counts, names, properties, memory, RNG, streams, events,
  synchronize) describes the remote GPU — or the CPU backend, whose name says so;
* ``torch.autocast("cuda")`` / ``torch.amp.GradScaler("cuda")`` map to the gpuwire device, where
  autocast kernels follow CUDA's op lists (``client.autocast``);
* ``torch.load(map_location="cuda")`` and checkpoints saved on a CUDA machine load onto gpuwire.

PyTorch keeps the mode stack per thread: every thread started through ``threading`` after
``enable`` (thread pools, data loaders, ``transformers`` loading weights with ``device_map``)
gets the mode pushed when it starts. Threads started from C/C++ code are not covered. Things that cannot work say so: CUDA graphs, NCCL,
custom CUDA kernels (see ``docs/compatibility.md``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
import warnings

import torch
from torch.overrides import TorchFunctionMode

from . import device as _device
from . import torch_module as _torch_module
from .wire import DEVICE_TYPE, called_by_pytorch, on_device

CUDA_RUNTIME_VERSION = "12.8"  # what ``torch.version.cuda`` says under ``gpuwire run`` (see ``enable``)
_base_device = torch._C.TensorBase.device.__get__
_base_is_cuda = torch._C.TensorBase.is_cuda.__get__
_enabled = False
GPUWIRE: torch.device | None = None  # torch.device("gpuwire", 0) once the device is registered


class NotSupportedByGpuwire(RuntimeError):
    """A CUDA feature that cannot work over the network (or not yet)."""


def _map_device(value):
    """'cuda', 'cuda:0', torch.device('cuda', 0) -> gpuwire device (every index this process
    may name is its session's device: ``torch_module.VISIBLE_DEVICES``)."""
    if isinstance(value, torch.device):
        return torch.device(DEVICE_TYPE, _session_index(value.index)) if value.type == "cuda" else value
    if isinstance(value, str):
        if value == "cuda" or value.startswith("cuda:"):
            index = value[5:]
            return torch.device(DEVICE_TYPE, _session_index(int(index) if index else None))
    return value


def _session_index(cuda_index) -> int:
    if cuda_index is None or 0 <= cuda_index < _torch_module.VISIBLE_DEVICES:
        return 0
    # (it became cuda:0 without a word: a model split over cuda:0 and cuda:1 ran on one GPU)
    visible = _torch_module.VISIBLE_DEVICES
    raise RuntimeError(f"CUDA error: invalid device ordinal: cuda:{cuda_index} does not exist here "
                       f"(gpuwire: this process has {visible} GPU{'s' if visible > 1 else ''}, "
                       f"{'cuda:0' if visible == 1 else f'cuda:0-{visible - 1}'}; for more GPUs, run one process "
                       "per GPU, e.g. under torchrun, each with its own gpuwire session)")


_PYTHON_FUNCTION = types.FunctionType
# higher-order ops (``flex_attention``'s eager path, ``torch.cond``, ``checkpoint``'s HOP) run
# Python implementations the same way, e.g. ``torch.arange(..., device=scores.device)``
# and so do ops called as ``torch.ops`` objects (prims, refs and decompositions: a prim's Python
# kernel makes its result with ``torch.empty_permuted(..., device=a.device)``)
_HIGHER_ORDER_OP = (torch._ops.HigherOrderOperator, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
# Python-level torch functions that run the program's code (hooks, custom backward) or show
# the device to the user: inside them a gpuwire tensor keeps saying "cuda"
_USER_FACING = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad, torch.Tensor.__repr__,
                torch.Tensor.__str__, torch.Tensor.__format__, torch.Tensor.register_hook}
# How many Python-level torch functions (``F.embedding_bag``, ``torch.functional.stft`` ...) are
# running on this thread. The mode is off inside them (PyTorch pops a mode while its handler
# runs), so their own factories, e.g. ``torch.arange(..., device=input.device)``, are not
# rewritten: there a gpuwire tensor tells its real device
_inside = threading.local()


def _as_program_code(hook):
    """``hook`` run as the program's own code, where gpuwire tensors say "cuda", even when an op
    inside a Python-level torch function calls it (saved-tensor hooks: activation checkpointing
    records each saved tensor's device and compares it at recomputation)."""
    @functools.wraps(hook)
    def run(*args):
        depth = getattr(_inside, "depth", 0)
        if not depth:
            return hook(*args)
        _inside.depth = 0
        try:
            return hook(*args)
        finally:
            _inside.depth = depth
    return run


def _patch_saved_tensor_hooks() -> None:
    autograd_c = torch._C._autograd
    push = autograd_c._push_saved_tensors_default_hooks

    def push_as_program_code(pack_hook, unpack_hook):
        return push(_as_program_code(pack_hook), _as_program_code(unpack_hook))

    autograd_c._push_saved_tensors_default_hooks = push_as_program_code


class CudaToGpuwire(TorchFunctionMode):
    """Rewrites CUDA device arguments to the gpuwire device; everything else passes through."""

    # (runs for every torch call the program makes: identity checks and one dict lookup)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            pinned = kwargs.get("pin_memory")
            if device is not None or pinned:
                kwargs = dict(kwargs)
                if device is not None:
                    kwargs["device"] = _map_device(device)
                if pinned:
                    # page-locked host memory needs an allocator a Python backend cannot give
                    # (it raised "implement getPinnedMemoryAllocator"), and buys nothing when
                    # bytes go through a socket: safetensors' load_file(device="cuda") and
                    # libraries' staging buffers ask for it (``Tensor.pin_memory``: shims.py)
                    kwargs["pin_memory"] = False
        if func is _TENSOR_TO:
            if len(args) > 1:
                args = (args[0], _map_device(args[1]), *args[2:])
        elif func is _TENSOR_CUDA:
            return args[0].to(GPUWIRE, non_blocking=bool(kwargs and kwargs.get("non_blocking", False)))
        else:
            kind = type(func)
            runs_python = _RUNS_PYTHON.get(kind)
            if runs_python is None:
                runs_python = _RUNS_PYTHON[kind] = kind is _PYTHON_FUNCTION or issubclass(kind, _HIGHER_ORDER_OP)
            if runs_python and func not in _USER_FACING:
                depth = getattr(_inside, "depth", 0)
                _inside.depth = depth + 1
                try:
                    return func(*args, **kwargs) if kwargs else func(*args)
                finally:
                    _inside.depth = depth
        try:
            return func(*args, **kwargs) if kwargs else func(*args)
        except RuntimeError as exc:
            _as_the_program_names_devices(exc)
            raise


def _as_the_program_names_devices(exc: RuntimeError) -> None:
    """PyTorch's own checks name the device ``gpuwire:0`` ("found at least two devices,
    gpuwire:0 and cpu!"): a program that runs on ``"cuda"`` reads ``cuda:0``, as its tensors'
    ``device`` says."""
    if exc.args and isinstance(exc.args[0], str) and _SHOWN_AS_GPUWIRE in exc.args[0]:
        exc.args = (exc.args[0].replace(_SHOWN_AS_GPUWIRE, "cuda:0"), *exc.args[1:])


_SHOWN_AS_GPUWIRE = f"{DEVICE_TYPE}:0"
_TENSOR_TO, _TENSOR_CUDA = torch.Tensor.to, torch.Tensor.cuda
# per type of ``func``: does calling it run Python code of PyTorch's (see ``_inside``)?
_RUNS_PYTHON: dict = {}


def _remote_info() -> dict:
    return _device.runtime().device_info


class _DeviceProperties(types.SimpleNamespace):
    """``torch.cuda.get_device_properties()``: the attributes CUDA's has, printed as CUDA prints
    them (scripts log it; a namespace printed as ``namespace(...)``)."""

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
                f"uuid={self.uuid}, L2_cache_size={self.L2_cache_size // (1 << 20)}MB)")


def _properties(device=None):
    _torch_module.check_device_id(device)
    info = _remote_info()
    major, minor = _capability_of(info)
    return _DeviceProperties(
        name=info.get("name", "gpuwire device"), total_memory=int(info.get("total_memory", 0)),
        major=major, minor=minor, multi_processor_count=int(info.get("multi_processor_count", 1)),
        is_integrated=False, is_multi_gpu_board=False, uuid=f"gpuwire-{info.get('index', 0)}",
        L2_cache_size=0, warp_size=32, gcnArchName="", backend=info.get("backend"),
        software=bool(info.get("software")))


def _capability(device=None) -> tuple[int, int]:
    _torch_module.check_device_id(device)
    return _capability_of(_remote_info())


def _capability_of(info: dict) -> tuple[int, int]:
    if info.get("software"):
        # the CPU backend runs fp16/bf16 ops; report an Ampere-class capability so libraries
        # enable the paths a modern GPU would take (the device name says it is software)
        return 8, 0
    return int(info.get("major", 0)), int(info.get("minor", 0))


# (the device module's streams and events: the same objects under torch.cuda)
Event, Stream = _torch_module.Event, _torch_module.Stream
_current_stream, _stream_context = _torch_module.current_stream, _torch_module.stream


def _unsupported(what: str, instead: str):
    def fail(*args, **kwargs):
        raise NotSupportedByGpuwire(f"{what} is not supported by gpuwire (the GPU is across the network): {instead}")
    return fail


def _patch_fake_tensors() -> None:
    """``torch.export`` / ``make_fx(tracing_mode="fake")`` of "cuda" tensors: the fake of a
    gpuwire tensor was made on its ``device`` as the program reads it, a real ``cuda:0``, while
    the fakes of its factories are on the gpuwire device ("found at least two devices"). Fakes
    are made from the real device, as in PyTorch's other Python code (``_inside``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    original = FakeTensorMode.from_tensor

    @functools.wraps(original)
    def from_tensor(self, tensor, *args, **kwargs):
        depth = getattr(_inside, "depth", 0)
        _inside.depth = depth + 1
        try:
            return original(self, tensor, *args, **kwargs)
        finally:
            _inside.depth = depth

    FakeTensorMode.from_tensor = from_tensor


def _patch_nested_factories() -> None:
    """``torch.nested.nested_tensor(..., device="cuda")``: a Python function that hands its
    device straight to C++ without passing through the mode, so "cuda" reached PyTorch's CUDA
    backend ("Could not run ... with arguments from the 'CUDA' backend")."""
    for name in ("nested_tensor", "as_nested_tensor"):
        original = getattr(torch.nested, name)

        @functools.wraps(original)
        def on_the_mapped_device(*args, __original=original, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _map_device(kwargs["device"])
            return __original(*args, **kwargs)

        setattr(torch.nested, name, on_the_mapped_device)


def _patch_warning_locations() -> None:
    """A warning PyTorch's C++ raises during a torch call (``float(x)`` of a tensor that requires
    grad, a tracer's warnings ...) names the innermost Python frame as where it happened: under
    ``gpuwire run`` that is this module's ``__torch_function__``, so the program was shown
    "cuda_compat.py:NNN: UserWarning" and gpuwire's source line. It is shown (or recorded) at
    the program's line, as without gpuwire. (Deduplication and ``module=`` filters were already
    decided by the time a warning is shown: those still see this module.)"""
    show = warnings._showwarnmsg
    here = __file__

    @functools.wraps(show)
    def show_at_the_programs_line(message):
        if message.filename == here:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename == here:
                frame = frame.f_back
            if frame is not None:
                message.filename, message.lineno, message.line = frame.f_code.co_filename, frame.f_lineno, None
        return show(message)

    warnings._showwarnmsg = show_at_the_programs_line
    warnings.warn = _warn_past_the_mode(warnings.warn)


def _warn_past_the_mode(warn):
    """A torch function written in Python (``F.dropout2d``, ``F.softmax``...) runs twice under
    the mode: it hands itself to ``handle_torch_function``, which calls this module's
    ``__torch_function__``, which calls it again. Its ``warnings.warn(..., stacklevel=2)`` (a
    deprecation of the caller's arguments) then named ``__torch_function__``'s line, or the
    function's own: shown at torch's line, deduplicated for all callers as one, outside a
    program's ``module=`` filters. Counted past those three frames, the level names the line a
    run without gpuwire names."""
    mode_code = CudaToGpuwire.__torch_function__.__code__
    overrides_file = sys.modules["torch.overrides"].__file__

    def past_the_mode(frame):
        """The frame that called ``frame``'s function, as if there were no mode in between."""
        caller = frame.f_back
        if caller is None or caller.f_code is not mode_code:
            return caller, False
        caller = caller.f_back
        while caller is not None and caller.f_code.co_filename == overrides_file:
            caller = caller.f_back
        if caller is not None and caller.f_code is frame.f_code:  # (the first call of the same function)
            caller = caller.f_back
        return caller, True

    @functools.wraps(warn)
    def warn_past_the_mode(message, category=None, stacklevel=1, *args, **kwargs):
        if not isinstance(stacklevel, int) or stacklevel < 2:
            return warn(message, category, stacklevel + 1 if isinstance(stacklevel, int) else stacklevel,
                        *args, **kwargs)
        frame, moved = sys._getframe(1), False
        for _ in range(stacklevel - 1):
            if frame is None:
                break
            frame, skipped = past_the_mode(frame)
            moved = moved or skipped
        if not moved or frame is None:
            return warn(message, category, stacklevel + 1, *args, **kwargs)
        level, walk = 1, sys._getframe(0)
        while walk is not None and walk is not frame:
            walk, level = walk.f_back, level + 1
        return warn(message, category, level, *args, **kwargs)

    return warn_past_the_mode


def _jiterator_refused_when_called(name: str):
    """``torch.cuda.jiterator``: the kernel it makes is CUDA C++ compiled here, so calling it is
    refused; making one is not (as CUDA compiles it at the first call): modules build theirs at
    import (PyTorch's own OpInfo database does), and importing them must work."""
    refused = _unsupported(f"a torch.cuda.jiterator.{name} kernel",
                           "write the kernel with PyTorch ops, which run on the remote GPU")

    def create(*args, **kwargs):
        return refused
    return create


class _CUDAGraph:
    def __init__(self, *args, **kwargs):
        _unsupported("CUDA graphs (torch.cuda.graph / CUDAGraph)",
                     "run the model eagerly; gpuwire already batches ops into few messages")()


def _cuda_functions() -> dict:
    tm = _torch_module
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: _device.runtime() and None,
        "_lazy_init": lambda: None,
        "device_count": tm.device_count,
        "current_device": tm.current_device,
        "set_device": tm.set_device,
        "device": tm.device,
        "device_of": tm.device_of,
        "can_device_access_peer": lambda device, peer_device: False,  # (one device: no peer)
        "get_allocator_backend": lambda: "native",
        # nothing is captured into a CUDA graph (``torch.cuda.graph`` is refused): SyncBatchNorm's
        # forward and transformers ask before every host read
        "is_current_stream_capturing": lambda: False,
        "get_device_name": lambda device=None: _properties(device).name,
        "get_device_properties": _properties,
        "get_device_capability": _capability,
        "get_arch_list": lambda: ["sm_80"],
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": _synchronize,
        **{name: getattr(tm, name) for name in (
            "mem_get_info", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
            "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats",
            "memory_stats", "memory_summary")},
        "empty_cache": tm.empty_cache,
        "ipc_collect": lambda: None,
        "manual_seed": tm.manual_seed,
        "manual_seed_all": tm.manual_seed,
        "seed": tm.seed,
        "seed_all": tm.seed,
        "initial_seed": tm.initial_seed,
        "get_rng_state": lambda device="cuda": tm.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": tm.set_rng_state(new_state),
        "get_rng_state_all": tm.get_rng_state_all,
        "set_rng_state_all": tm.set_rng_state_all,
        "Event": Event,
        "Stream": Stream,
        "current_stream": _current_stream,
        "default_stream": _torch_module.default_stream,
        "stream": _stream_context,
        "set_stream": _torch_module.set_stream,
        "utilization": _utilization,
        # NVML's sensors (torch asks pynvml, which needs a local driver): not measured by a node;
        # 0, as ``nvidia-smi`` here says N/A, rather than a ModuleNotFoundError in a logging line
        **{name: (lambda device=None: 0) for name in ("temperature", "power_draw", "clock_rate", "memory_usage")},
        "CUDAGraph": _CUDAGraph,
        "graph": _CUDAGraph,
        "make_graphed_callables": _unsupported("torch.cuda.make_graphed_callables", "call the modules directly"),
        "set_per_process_memory_fraction": _set_memory_fraction,
        "get_per_process_memory_fraction": _get_memory_fraction,
        "memory_stats_as_nested_dict": lambda device=None: tm._nested_memory_stats(),
        # NVML's device-wide figure: what this session holds on the node's device
        "device_memory_used": lambda device=None: tm.memory_allocated(device),
        # the local pinned-memory allocator's: nothing is pinned here (``pin_memory()`` keeps ordinary
        # memory, which is what a socket reads from)
        "host_memory_stats": lambda: {},
        "reset_peak_host_memory_stats": lambda: None,
        "reset_accumulated_host_memory_stats": lambda: None,
        "caching_allocator_enable": lambda value=True: None,
        # debugging aids some scripts turn on: the sync debug mode is kept (ops are not checked
        # against it), a memory snapshot is empty (the node's allocator is not local)
        "set_sync_debug_mode": _set_sync_debug_mode,
        "get_sync_debug_mode": lambda: _sync_debug_mode[0],
        "memory_snapshot": lambda *args, **kwargs: [],
        **{name: _unsupported(f"torch.cuda.{name} (a raw device pointer)", "allocate with torch.empty(..., device='cuda')")
           for name in ("caching_allocator_alloc", "caching_allocator_delete")},
        **{name: _unsupported(f"torch.cuda.{name} (a handle of the local CUDA library)",
                              "call PyTorch's ops (torch.matmul, torch.linalg), which run on the remote GPU")
           for name in ("current_blas_handle", "current_solver_handle")},
        "graph_pool_handle": _unsupported("torch.cuda.graph_pool_handle (CUDA graphs)", "run the model eagerly"),
        # (transformers' continuous batching with CUDA graphs makes one: PyTorch's placeholder said
        # "Tried to instantiate dummy base class MemPool")
        "MemPool": _MemPool,
        "use_mem_pool": _unsupported("torch.cuda.use_mem_pool (a private pool of the local CUDA allocator)",
                                     _ALLOCATE_AS_USUAL),
    }


_ALLOCATE_AS_USUAL = "allocate as usual: gpuwire manages the remote GPU's memory"


class _MemPool:
    def __init__(self, *args, **kwargs):
        _unsupported("torch.cuda.MemPool (a private pool of the local CUDA allocator, for CUDA graphs and "
                     "custom allocators)", _ALLOCATE_AS_USUAL)()


def _synchronize(device=None) -> None:
    """``torch.cuda.synchronize``: waits for every queued op; a device that is not a GPU is
    refused as CUDA refuses it."""
    if device is not None and not isinstance(device, int):
        kind = torch.device(device).type
        if kind not in ("cuda", DEVICE_TYPE):
            raise ValueError(f"Expected a cuda device, but got: {torch.device(device)}")
    _torch_module.check_device_id(device)
    _device.runtime().synchronize()


def _utilization(device=None) -> int:
    """Percent of the time the node's device ran ops since the previous reading (``nvidia-smi``'s
    utilization.gpu here), for every tenant of the device, as NVML counts it."""
    _torch_module.check_device_id(device)
    return int(round(_device.runtime().query("node").get("utilization", 0)))


# the NCCL of the CUDA wheels torch 2.13 ships (``nvidia-nccl-cu12``): ``"nccl"`` runs as gpuwire's
# host-staged collectives, and programs gate features on this version (accelerate, DeepSpeed)
NCCL_VERSION = (2, 27, 5)


_sync_debug_mode = [0]


def _set_sync_debug_mode(debug_mode) -> None:
    modes = {"default": 0, "warn": 1, "error": 2}
    if isinstance(debug_mode, str):
        if debug_mode not in modes:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = modes[debug_mode]
    _sync_debug_mode[0] = int(debug_mode)


def _patch_memory_history() -> None:
    """``torch.cuda.memory._record_memory_history`` / ``_snapshot`` / ``_dump_snapshot`` (memory
    profiling) call CUDA-only C functions; here recording is a no-op and a snapshot is empty:
    the allocations live in the node's allocator (``torch.cuda.memory_stats`` has this
    session's figures)."""
    import pickle

    memory = torch.cuda.memory
    empty = lambda: {"segments": [], "device_traces": [[]], "allocator_settings": {}}  # noqa: E731

    def dump_snapshot(filename="dump_snapshot.pickle"):
        with open(filename, "wb") as f:
            pickle.dump(empty(), f)

    memory._record_memory_history = lambda *args, **kwargs: None
    memory._snapshot = lambda *args, **kwargs: empty()
    memory._dump_snapshot = dump_snapshot


def _set_memory_fraction(fraction: float, device=None) -> None:
    """A cap on this process's share of the device: the session's budget, checked at the user's
    line as an allocation past it is (``Runtime.reserve``)."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _torch_module.check_device_id(device)
    _device.runtime().cap_memory(int(fraction * int(_remote_info().get("total_memory", 0))))


def _get_memory_fraction(device=None) -> float:
    """The program's cap from ``set_per_process_memory_fraction`` (1.0 without one)."""
    _torch_module.check_device_id(device)
    cap, total = _device.runtime()._memory_cap, int(_remote_info().get("total_memory", 0))
    return cap / total if cap is not None and total else 1.0


# the legacy typed-tensor classes, ``torch.cuda.FloatTensor(2, 3)`` and friends (older scripts)
_LEGACY_TYPES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
                 "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
                 "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8,
                 "BoolTensor": torch.bool}


class _DefaultGenerator:
    """``torch.cuda.default_generators[i]``: the session's generator on the node, by duck typing
    (a C++ ``torch.Generator`` cannot be made for a Python backend). The tuple was empty while
    ``device_count()`` said 1: RNG trackers (Megatron, DeepSpeed) index it and save and restore
    its state. As an op's ``generator=`` argument use ``torch.Generator(device="cuda")``."""

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)

    def manual_seed(self, seed: int) -> "_DefaultGenerator":
        _torch_module.manual_seed(seed)
        return self

    def seed(self) -> int:
        _torch_module.seed()
        return self.initial_seed()

    def initial_seed(self) -> int:
        return _torch_module.initial_seed()

    def get_state(self) -> torch.Tensor:
        return _torch_module.get_rng_state()

    def set_state(self, state: torch.Tensor) -> "_DefaultGenerator":
        _torch_module.set_rng_state(state)
        return self

    def __repr__(self) -> str:
        return f"<gpuwire default generator of {self.device}>"


class _LegacyTypeMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Tensor) and on_device(obj) and obj.dtype == cls.dtype

    def __call__(cls, *args, device=None):
        dtype = cls.dtype
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0].to(device=GPUWIRE, dtype=dtype)
        if len(args) == 1 and not isinstance(args[0], int) and not isinstance(args[0], torch.Size):
            return torch.tensor(args[0], dtype=dtype, device=GPUWIRE)  # data: a list, a tuple, a number array
        return torch.empty(*args if args else (0,), dtype=dtype, device=GPUWIRE)  # (``FloatTensor()``: empty)

    def __repr__(cls) -> str:
        return f"<class 'torch.cuda.{cls.__name__}'>"


def _patch_legacy_types() -> None:
    by_dtype = {}
    for name, dtype in _LEGACY_TYPES.items():
        legacy = _LegacyTypeMeta(name, (), {"dtype": dtype, "is_cuda": True, "__module__": "torch.cuda"})
        setattr(torch.cuda, name, legacy)
        by_dtype[dtype] = name
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            if on_device(self) and self.dtype in by_dtype:
                return f"torch.cuda.{by_dtype[self.dtype]}"
            return original_type(self, dtype, non_blocking, **kwargs)
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = getattr(torch.cuda, dtype[len("torch.cuda."):], dtype)
        if isinstance(dtype, _LegacyTypeMeta):
            return self.to(device=GPUWIRE, dtype=dtype.dtype, non_blocking=non_blocking)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type


def _patch_default_tensor_type() -> None:
    """``torch.set_default_tensor_type(torch.cuda.FloatTensor)`` (or its string; 2018-era scripts
    start so) raised "only floating-point types are supported", the CUDA types being gpuwire's
    stand-ins: it sets the default dtype and makes the remote GPU the default device, as on a CUDA
    machine; a CPU type afterwards puts both back."""
    original = torch.set_default_tensor_type
    cpu_name = {dtype: f"torch.{name}" for name, dtype in _LEGACY_TYPES.items()}
    tensor_new = torch.Tensor.__new__
    on_gpu = [False]

    def legacy_constructor(cls, *args, **kwargs):
        # ``torch.Tensor(3, 4)`` / ``torch.Tensor([1, 2])`` follow the default tensor type, which
        # ``set_default_device`` does not reach (a type call, not a torch function)
        made = tensor_new(cls, *args, **kwargs)
        if (cls is torch.Tensor and on_gpu[0] and made.is_cpu and "device" not in kwargs
                and not (len(args) == 1 and isinstance(args[0], torch.Tensor))):  # (an alias stays one)
            return made.to(GPUWIRE)
        return made

    @functools.wraps(original)
    def set_default_tensor_type(t):
        legacy = t
        if isinstance(t, str) and t.startswith("torch.cuda."):
            legacy = getattr(torch.cuda, t[len("torch.cuda."):], t)
        if isinstance(legacy, _LegacyTypeMeta):
            original(cpu_name[legacy.dtype])  # (the default dtype, and PyTorch's check that it floats)
            torch.set_default_device(GPUWIRE)
            # dynamo checks ``Tensor.__new__`` against its own rule when it is imported (gpuwire's
            # layout inference imports it at the first op of some kinds): it must see the original
            importlib.import_module("torch._dynamo")
            torch.Tensor.__new__ = staticmethod(legacy_constructor)
            on_gpu[0] = True
            return
        original(t)
        if on_gpu[0]:
            torch.set_default_device(None)
            torch.Tensor.__new__ = tensor_new
            on_gpu[0] = False

    torch.set_default_tensor_type = set_default_tensor_type


def _patch_nvtx() -> None:
    """NVTX ranges annotate a local CUDA profile; there is none here, so they do nothing."""
    nvtx = torch.cuda.nvtx
    for name in ("range_push", "range_pop", "range_start", "range_end", "mark"):
        setattr(nvtx, name, lambda *args, **kwargs: 0)

    @contextlib.contextmanager
    def nvtx_range(*args, **kwargs):
        yield

    nvtx.range = nvtx_range


def _patch_autocast() -> None:
    """``autocast("cuda")`` and ``GradScaler("cuda")`` → the gpuwire device."""
    original_init = torch.amp.autocast_mode.autocast.__init__

    @functools.wraps(original_init)
    def autocast_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type != "cuda":
            return original_init(self, device_type, dtype, enabled, cache_enabled)
        # CUDA's autocast takes any dtype (nanoGPT's default config enters
        # ``autocast("cuda", dtype=torch.float32)``); the generic check for other devices would
        # warn and disable it. So check with a supported dtype, then keep the one asked for.
        wanted = dtype if dtype is not None else torch.get_autocast_dtype(DEVICE_TYPE)
        original_init(self, DEVICE_TYPE, torch.float16, enabled, cache_enabled)
        self.fast_dtype = wanted

    torch.amp.autocast_mode.autocast.__init__ = autocast_init

    def cuda_autocast(enabled=True, dtype=torch.float16, cache_enabled=True):
        return torch.autocast("cuda", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    torch.cuda.amp.autocast = cuda_autocast
    original_is_enabled = torch.is_autocast_enabled

    def is_autocast_enabled(device_type=None):
        if device_type is None or device_type == "cuda":
            return original_is_enabled(DEVICE_TYPE)
        return original_is_enabled(device_type)

    torch.is_autocast_enabled = is_autocast_enabled
    original_get_dtype = torch.get_autocast_dtype
    torch.get_autocast_dtype = lambda device_type: original_get_dtype(DEVICE_TYPE if device_type == "cuda" else device_type)

    scaler_init = torch.amp.GradScaler.__init__

    @functools.wraps(scaler_init)
    def grad_scaler_init(self, device="cuda", *args, **kwargs):
        scaler_init(self, DEVICE_TYPE if device == "cuda" else device, *args, **kwargs)

    torch.amp.GradScaler.__init__ = grad_scaler_init

    def cuda_grad_scaler(*args, **kwargs):
        return torch.amp.GradScaler(DEVICE_TYPE, *args, **kwargs)

    torch.cuda.amp.GradScaler = cuda_grad_scaler
    from . import autocast
    autocast.register()


def _patch_tensor_device() -> None:
    current = _torch_module._current  # (the index last set: a rank's tensors say cuda:<its local rank>)

    def device(self):
        d = _base_device(self)
        if d.type == DEVICE_TYPE and not getattr(_inside, "depth", 0):
            return torch.device("cuda", d.index or current[0])
        return d

    def is_cuda(self):
        return on_device(self) or _base_is_cuda(self)

    torch.Tensor.device = property(device, doc=torch._C.TensorBase.device.__doc__)
    torch.Tensor.is_cuda = property(is_cuda, doc=torch._C.TensorBase.is_cuda.__doc__)
    # (PyTorch's reference-op mode lets the C descriptors' getters through by name: "no _refs
    # support for torch.Tensor.device.__get__" for these, in every ``torch._refs`` op)
    from torch._prims_common import torch_function_passthrough
    torch_function_passthrough.update({torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__})

    # ``x.record_stream(torch.cuda.current_stream())`` (prefetchers, FSDP-style code) tells the
    # CUDA caching allocator not to reuse x's memory before that stream's work: the node runs a
    # session's ops in order on one stream, so there is nothing to record; the C method refused
    # the compatibility Stream ("unknown parameter type")
    record_stream = torch.Tensor.record_stream

    @functools.wraps(record_stream)
    def record_stream_in_order(self, stream):
        if on_device(self):
            return None
        return record_stream(self, stream)

    torch.Tensor.record_stream = record_stream_in_order

    # ``x.numpy()`` / ``np.asarray(x)`` of a device tensor: CUDA's refusal, naming cuda
    numpy = torch.Tensor.numpy

    @functools.wraps(numpy)
    def numpy_refusing_like_cuda(self, *args, **kwargs):
        if on_device(self):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        return numpy(self, *args, **kwargs)

    torch.Tensor.numpy = numpy_refusing_like_cuda

    # tensor subclasses build their wrapper with ``_make_wrapper_subclass(cls, ..., device=
    # elem.device)``, which reads "cuda" here: DTensor's ``AsyncCollectiveTensor`` (every
    # collective of tensor parallelism) then claimed a real CUDA device, and autograd aborted the
    # process in C++ ("PyTorch is not linked with support for cuda devices")
    make_wrapper = torch.Tensor._make_wrapper_subclass

    def make_wrapper_on_gpuwire(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _map_device(device)
        return make_wrapper(cls, *args, **kwargs)

    torch.Tensor._make_wrapper_subclass = staticmethod(make_wrapper_on_gpuwire)


def _patch_serialization() -> None:
    """Checkpoints with CUDA storages (or ``map_location="cuda"``) load onto gpuwire, and what
    the program saves from its "cuda" tensors is tagged ``cuda:N`` as on a CUDA machine (it was
    ``gpuwire:0``, which nothing without gpuwire could load, even with ``map_location="cpu"``
    missing)."""
    def cuda_tag(obj):
        device = getattr(obj, "device", None)
        if isinstance(device, torch.device) and device.type == DEVICE_TYPE:
            return f"cuda:{device.index or 0}"
        return None

    def cuda_to_gpuwire(obj, location: str):
        if location.startswith("cuda"):
            return obj.to(device=GPUWIRE)
        return None

    torch.serialization.register_package(5, cuda_tag, cuda_to_gpuwire)
    original_load = torch.load

    @functools.wraps(original_load)
    def load(f, map_location=None, *args, **kwargs):
        return original_load(f, _map_device(map_location) if isinstance(map_location, (str, torch.device))
                             else map_location, *args, **kwargs)

    torch.load = load
    original_jit_load = torch.jit.load

    @functools.wraps(original_jit_load)
    def jit_load(f, map_location=None, *args, **kwargs):  # (``torch.jit.load(path, map_location="cuda")``)
        return original_jit_load(f, _map_device(map_location) if isinstance(map_location, (str, torch.device))
                                 else map_location, *args, **kwargs)

    torch.jit.load = jit_load


def _patch_default_device() -> None:
    original = torch.set_default_device

    @functools.wraps(original)
    def set_default_device(device):
        return original(_map_device(device))

    torch.set_default_device = set_default_device


def _patch_compile() -> None:
    """``torch.compile`` would hand the graph to inductor, which has no gpuwire code generator
    (and would launch kernels on the client): the program runs eagerly instead, said once."""
    def compile(model=None, *args, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn)
        if not _compile_warned:
            _note_compile()
        return model

    torch.compile = compile


_compile_warned = False


def _note_compile() -> None:
    global _compile_warned
    _compile_warned = True
    import sys
    print("gpuwire: torch.compile runs the model eagerly on the gpuwire device (ops are already batched "
          "into few messages)", file=sys.stderr)


def _patch_distributed() -> None:
    """NCCL needs GPUs on this machine: ``init_process_group("nccl")`` gets gloo for host tensors
    and host-staged collectives for gpuwire ones (``client.distributed``), so torchrun-style
    scripts run as they are."""
    import torch.distributed as dist
    if not dist.is_available():
        return
    dist.is_nccl_available = lambda: False
    # FSDP2 builds its default DeviceMesh on ``torch._C._get_accelerator()`` and then checks that
    # each parameter is on that device: the parameters say ``cuda:i`` here, so the accelerator
    # must too (it named the gpuwire device, and every ``fully_shard`` raised)
    original_accelerator = torch._C._get_accelerator

    def _get_accelerator(*args, **kwargs):
        device = original_accelerator(*args, **kwargs)
        return torch.device("cuda", device.index) if device.type == DEVICE_TYPE else device

    torch._C._get_accelerator = _get_accelerator


def _patch_accelerator() -> None:
    """``torch.accelerator.current_accelerator()`` says "cuda", as tensors' ``device`` does:
    scripts pick their device from it (pytorch/examples' ``--accel``, minGPT-ddp) and pass its
    type to ``autocast``; PyTorch's DDP compares it with its parameters' device type before
    copying inputs ("Expected current accelerator type gpuwire to match device type cuda").
    torch.distributed keeps the real device: it looks up the process group's backend by it,
    and the device map routes "cuda" to the host's gloo."""
    original = torch.accelerator.current_accelerator

    @functools.wraps(original)
    def current_accelerator(check_available: bool = False):
        device = original(check_available)
        if device is None or device.type != DEVICE_TYPE or called_by_pytorch(within=("torch.distributed",)):
            return device
        return torch.device("cuda", device.index)

    torch.accelerator.current_accelerator = current_accelerator


def _patch_threads() -> None:
    """Push the mode in every thread started through ``threading`` from now on: programs and
    libraries move tensors to ``"cuda"`` from worker threads (``transformers`` loads checkpoint
    shards in a thread pool when given a ``device_map``), where a thread without the mode would
    reach PyTorch's real CUDA backend and fail."""
    original = threading.Thread._bootstrap_inner

    @functools.wraps(original)
    def bootstrap_inner(self):
        if not _enabled:
            return original(self)
        CudaToGpuwire().__enter__()  # for the life of the thread, as on the main thread
        try:
            original(self)
        finally:
            # The stack lives in the thread's C++ thread-local state, whose destructor runs
            # when the OS thread exits (after ``join()`` has returned) and takes the GIL to
            # drop the modes left on it; a thread ending while the interpreter finalizes is
            # then killed inside that destructor and the process aborts ("terminate called
            # without an active exception": a DataLoader's pin-memory thread at the end of a
            # short script, ~1 run in 30). Emptied here, while the thread still runs Python.
            while torch._C._len_torch_function_stack():
                torch._C._pop_torch_function_stack()

    threading.Thread._bootstrap_inner = bootstrap_inner


def _mode_on_stack() -> bool:
    return any(type(m) is CudaToGpuwire for m in torch.overrides._get_current_function_mode_stack())


def _with_mode(fn):
    """``fn`` run with the mode on this thread's stack (pushed for the call if it is not)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _enabled or _mode_on_stack():
            return fn(*args, **kwargs)
        torch._C._push_on_torch_function_stack(CudaToGpuwire())
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._pop_torch_function_stack()
    return run


def _patch_python_backward() -> None:
    """Autograd runs a backward pass on its device thread with the thread-local state captured
    when the pass starts, torch-function modes included. ``loss.backward()`` reaches the engine
    from inside this mode's handler, where PyTorch has popped the mode, so the device thread
    ran the program's backward code without it: ``torch.zeros(3, device="cuda")`` in a custom
    ``autograd.Function.backward`` (or in a higher-order op's backward: flex_attention's, a
    reentrant checkpoint's, a module's full backward hook) or in a tensor's gradient hook
    reached PyTorch's real CUDA backend and aborted the process ("PyTorch is not linked with
    support for cuda devices"). Python backward functions and gradient hooks now run with the
    mode on the stack. Only they: the whole engine under the mode measured +26-28 % client CPU
    a training step (the mode's handler then intercepts every tensor attribute that gpuwire's
    own kernels read there)."""
    from torch.autograd.function import BackwardCFunction

    BackwardCFunction.apply = _with_mode(BackwardCFunction.apply)
    if hasattr(BackwardCFunction, "apply_boxed"):
        BackwardCFunction.apply_boxed = _with_mode(BackwardCFunction.apply_boxed)
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name, None)
        if original is None:
            continue

        def register(self, hook, _original=original):
            return _original(self, _with_mode(hook))

        setattr(torch.Tensor, name, functools.wraps(original)(register))
        if original in _USER_FACING:
            _USER_FACING.add(getattr(torch.Tensor, name))
    # callbacks queued to run at the end of a backward pass (FSDP reduces its gradients in one:
    # ``torch.empty(..., device="cuda")`` there raised "Could not run 'aten::empty.memory_format'
    # with arguments from the 'CUDA' backend")
    from torch.autograd.variable import Variable
    engine_type = type(Variable._execution_engine)

    class _Engine(engine_type):
        def queue_callback(self, callback):
            return super().queue_callback(_with_mode(callback))

    Variable._execution_engine = _Engine()
    # DDP's communication hooks run from its reducer on the device thread: PowerSGD's
    # ``torch.zeros(n, device=bucket.buffer().device)`` (which reads "cuda:<rank>") raised
    # "Could not run 'aten::empty.memory_format' with arguments from the 'CUDA' backend"
    from torch.nn.parallel import DistributedDataParallel
    register_comm_hook = DistributedDataParallel.register_comm_hook

    @functools.wraps(register_comm_hook)
    def register_comm_hook_in_mode(self, state, hook):
        return register_comm_hook(self, state, _with_mode(hook))

    DistributedDataParallel.register_comm_hook = register_comm_hook_in_mode


def _patch_cudnn() -> None:
    """cuDNN is a library of local kernels: a gpuwire tensor (which reports ``cuda``) is never
    acceptable to it. ``RNNBase.flatten_parameters`` asks on every LSTM .cuda() and forward; unpatched, a
    torch built without cuDNN warned "PyTorch was compiled without cuDNN/MIOpen support" there.
    The node picks its own kernels (cuDNN on a CUDA node)."""
    import torch.backends.cudnn as cudnn
    original = cudnn.is_acceptable

    @functools.wraps(original)
    def is_acceptable(tensor):
        if isinstance(tensor, torch.Tensor) and on_device(tensor):
            return False
        return original(tensor)

    cudnn.is_acceptable = is_acceptable


def _patch_profiler() -> None:
    """``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])`` (and the legacy
    ``use_cuda=True`` / ``use_device="cuda"``) asks a CUDA runtime the client does not have for
    kernel timings: every op printed "Failed to record CUDA event" with a stack, and recording
    took seconds. The kernels run on the node, so the CUDA activity is dropped (said once) and
    the profile shows this process's side, gpuwire's ops included."""
    from torch.autograd import profiler as legacy
    from torch.profiler import ProfilerActivity
    from torch.profiler import profiler as kineto

    original_kineto = kineto._KinetoProfile.__init__

    @functools.wraps(original_kineto)
    def kineto_init(self, *args, **kwargs):
        original_kineto(self, *args, **kwargs)
        if ProfilerActivity.CUDA in self.activities:
            self.activities.discard(ProfilerActivity.CUDA)
            self.activity_filters.pop(ProfilerActivity.CUDA, None)
            self.use_device = None
            _note_profiler()

    original_legacy = legacy.profile.__init__

    @functools.wraps(original_legacy)
    def legacy_init(self, *args, **kwargs):
        if kwargs.get("use_cuda") or kwargs.get("use_device") == "cuda":
            kwargs["use_cuda"], kwargs["use_device"] = False, None
            _note_profiler()
        original_legacy(self, *args, **kwargs)

    kineto._KinetoProfile.__init__ = kineto_init
    legacy.profile.__init__ = legacy_init


_profiler_noted = False


def _note_profiler() -> None:
    global _profiler_noted
    if not _profiler_noted:
        _profiler_noted = True
        import sys
        print("gpuwire: torch.profiler records this process only: CUDA kernel timings are not collected (the "
              "kernels run on the node; time them with torch.cuda.Event or `gpuwire smi`)", file=sys.stderr)


def enable() -> None:
    """Turn on CUDA compatibility in this process (idempotent)."""
    global _enabled, _mode, GPUWIRE
    if _enabled:
        return
    _device.register()
    GPUWIRE = torch.device(DEVICE_TYPE, 0)
    _torch_module.VISIBLE_DEVICES = _torch_module.launcher_devices()
    _torch_module.TRACKS_INDEX[0] = True
    # ``torch.cuda.random.get_rng_state`` (what the transformers Trainer calls at every checkpoint),
    # ``torch.cuda.memory.mem_get_info`` & co. are the same functions under their submodule's
    # name (and what that submodule's other functions call)
    submodules = [getattr(torch.cuda, name) for name in ("memory", "random", "graphs", "streams")
                  if isinstance(getattr(torch.cuda, name, None), types.ModuleType)]
    for name, fn in _cuda_functions().items():
        setattr(torch.cuda, name, fn)
        for module in submodules:
            if getattr(getattr(module, name, None), "__module__", None) == module.__name__:
                setattr(module, name, fn)
    # what ``is_initialized`` (above) says; read directly by activation checkpointing, which
    # otherwise does not restore the device's random state before recomputing (dropout masks)
    torch.cuda._initialized = True
    # libraries gate GPU features on a CUDA build (``torch.version.cuda is not None``):
    # transformers refuses ``TrainingArguments(tf32=True)`` without one. The client has no
    # CUDA runtime at all; it reports the version of the CUDA wheels torch 2.x ships by default
    if torch.version.cuda is None:
        torch.version.cuda = CUDA_RUNTIME_VERSION
    torch.cuda.default_generators = tuple(_DefaultGenerator(i) for i in range(_torch_module.VISIBLE_DEVICES))
    torch.cuda.graphs.CUDAGraph = _CUDAGraph
    torch.cuda.graphs.graph = _CUDAGraph
    _patch_tensor_device()
    _patch_saved_tensor_hooks()
    _patch_legacy_types()
    _patch_default_tensor_type()
    _patch_nvtx()
    torch.cuda.nccl.version = lambda: NCCL_VERSION
    # the C functions torch.cuda's Python and PyTorch's test harness call directly (every CUDA
    # test of a TestCase with ``_do_cuda_non_default_stream`` runs on a stream of its own)
    for name, value in (("_cuda_setStream", _torch_module.set_stream_by_id),
                        # (objects of their own: dynamo's trace rules refuse one function under two
                        # names, torch._C's and torch.cuda's)
                        ("_cuda_setDevice", lambda index: _torch_module.set_device(index)),
                        ("_cuda_getDevice", lambda: _torch_module.current_device())):
        if not hasattr(torch._C, name):
            setattr(torch._C, name, value)
    for name in ("_create_jit_fn", "_create_multi_output_jit_fn"):
        setattr(torch.cuda.jiterator, name, _jiterator_refused_when_called(name))
    _patch_autocast()
    _patch_serialization()
    _patch_default_device()
    _patch_compile()
    _patch_distributed()
    _patch_accelerator()
    _patch_threads()
    _patch_python_backward()
    _patch_memory_history()
    _patch_cudnn()
    _patch_profiler()
    _patch_warning_locations()
    _patch_nested_factories()
    _patch_fake_tensors()
    _mode = CudaToGpuwire()
    _mode.__enter__()  # stays on this thread's mode stack for the life of the program
    _enabled = True


def enabled() -> bool:
    return _enabled
