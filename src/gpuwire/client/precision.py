"""Math-mode flags follow the program to the node: TF32, float32 matmul precision,
reduced-precision reductions, deterministic algorithms, cuDNN's benchmark/deterministic, SDPA's
allowed attention kernels, and the default dtype.

Sits beside ``client.device``. ``torch.backends.cuda.matmul.allow_tf32 = True``,
``torch.set_float32_matmul_precision("high")``, ``torch.backends.cudnn.allow_tf32``,
``torch.backends.fp32_precision`` and their kin set process-global flags that decide how the
*device's* kernels compute: on a GPU, TF32 makes float32 matmuls and convolutions several times
faster; on a CPU, "medium" lets oneDNN use bfloat16. Set on the client, they would change
nothing where the kernels run. Every such setter goes through one of torch's ``torch._C._set_*``
functions, looked up at call time; wrapping those records each call (the last one per flag,
in order) and queues the whole list to the node as one op, ``gpuwire::precision``, in order
with the program's other ops. The node replays the calls, so the same C++ links between the
flags hold there as here, and applies them only while this session's ops run (other tenants
keep theirs). A new session (first connection, resume elsewhere, rebuild after a failure) is
sent the list too. What crosses: the setter names and their bool/str arguments (a list of ints for SDPA's
backend priority order).
"""

from __future__ import annotations

import functools
import importlib

import torch

OP_NAME = "gpuwire::precision"
SETTERS = (
    "_set_float32_matmul_precision",
    "_set_cublas_allow_tf32",
    "_set_cudnn_allow_tf32",
    "_set_cublas_allow_fp16_reduced_precision_reduction",
    "_set_cublas_allow_bf16_reduced_precision_reduction",
    "_set_cpu_allow_fp16_reduced_precision_reduction",
    "_set_fp32_precision_setter",  # (backend, op, precision): the torch >= 2.9 API
    # which kernels run: ``torch.use_deterministic_algorithms`` (recorded as (mode, warn_only)),
    # ``torch.backends.cudnn.benchmark / deterministic / enabled`` (a CUDA node's convolutions),
    # ``torch.utils.deterministic.fill_uninitialized_memory``
    "_set_deterministic_algorithms",
    "_set_cudnn_benchmark", "_set_cudnn_deterministic", "_set_cudnn_enabled",
    "_set_deterministic_fill_uninitialized_memory",
    # the default dtype: factories without a dtype (``torch.ones``, ``randn``, ``full``,
    # ``arange`` of floats ...) run on the node with its own, which was float32 whatever the
    # program set: float64 values came back rounded through float32. Recorded as its name;
    # ``_set_default_tensor_type`` (``torch.set_default_tensor_type``) records it too.
    "_set_default_dtype", "_set_default_tensor_type",
    # which attention kernels SDPA may pick (``torch.nn.attention.sdpa_kernel``,
    # ``torch.backends.cuda.enable_flash_sdp(False)`` and kin): the node picks, so a program's
    # ``sdpa_kernel(SDPBackend.MATH)`` (reproducibility, double backward) ran the node's flash
    # kernel, and differed from a local run in the last bits
    "_set_sdp_use_flash", "_set_sdp_use_mem_efficient", "_set_sdp_use_math", "_set_sdp_use_cudnn",
    "_set_sdp_use_overrideable", "_set_sdp_use_fa3", "_set_math_sdp_allow_fp16_bf16_reduction",
    "_set_sdp_priority_order",
)

_calls: dict[tuple, list] = {}  # flag -> [setter, *args] of its last setting, oldest first
_installed = False


def calls() -> list:
    """The setter calls the node must replay, in the order they were last made."""
    return list(_calls.values())


def _flag(name: str, args: tuple) -> tuple:
    return (name, *args[:2]) if name == "_set_fp32_precision_setter" else (name,)


def _record(name: str, args: tuple) -> None:
    key = _flag(name, args)
    _calls.pop(key, None)
    _calls[key] = [name, *args]
    from . import device as _device
    rt = _device.current_runtime()
    if rt is not None:
        send(rt)


def send(rt) -> None:
    """Queue the current calls to ``rt``'s session, in order with its other ops."""
    if not _calls:
        return
    from . import device as _device
    with rt.lock:
        _device.queue_op(rt, OP_NAME, [calls()], {})


def frame(conn, seq: int = 0) -> bytes:
    """The op as a frame of ``conn`` (a rebuilt session gets it before the replayed log)."""
    return conn.encode_op(seq, OP_NAME, [calls()], {}, ())


def _is_int_list(value) -> bool:
    return type(value) is list and len(value) <= 16 and all(type(v) is int for v in value)


def install() -> None:
    """Wrap torch's setters (idempotent; no connection, nothing sent until a session exists)."""
    global _installed
    if _installed:
        return
    wrapped = {}
    for name in SETTERS:
        original = getattr(torch._C, name, None)
        if original is None:  # (an older torch)
            continue

        def recording(*args, _name=name, _original=original, **kwargs):
            dtype_before = torch.get_default_dtype()
            result = _original(*args, **kwargs)  # torch validates the values, and raises, here
            if _name == "_set_deterministic_algorithms":
                args = (bool(args[0]), bool(kwargs.get("warn_only", False)))
            elif _name in ("_set_default_dtype", "_set_default_tensor_type"):
                _name, args = "_set_default_dtype", (str(torch.get_default_dtype()).removeprefix("torch."),)
                if torch.get_default_dtype() != dtype_before:
                    from . import device as _device
                    _device.forget_learned_layouts()  # (learned under the other default dtype)
            elif _name == "_set_sdp_priority_order":  # (a list of SDPBackend values)
                args = ([int(backend) for backend in args[0]],)
            if all(type(a) in (bool, str) or _is_int_list(a) for a in args) and len(args) <= 3:
                _record(_name, args)
            return result

        wrapped[original] = functools.wraps(original)(recording)
        setattr(torch._C, name, wrapped[original])
    # ``torch.backends.cudnn.allow_tf32 = x`` and kin go through properties that captured the
    # setter when torch was imported
    backends = importlib.import_module("torch.backends")
    for name in ("torch.backends", "torch.backends.cudnn", "torch.backends.mkldnn"):
        for prop in vars(type(importlib.import_module(name))).values():
            if isinstance(prop, backends.ContextProp) and prop.setter in wrapped:
                prop.setter = wrapped[prop.setter]
    _installed = True
