"""Patches to PyTorch's Python layer where it assumes a device is CPU/CUDA-like.

Sits beside ``client.device`` and is installed with it. Each patch is small, keeps the
original behaviour for everything that is not the gpuwire device, and says why it exists:

* ``Module.to/cpu/cuda`` across the gpuwire boundary swap parameters in place (PyTorch's
  ``param.data = …`` path refuses PrivateUse1, and the fallback of making new Parameter
  objects would silently untie tied weights, e.g. GPT-2's embedding and LM head).
* ``torch.UntypedStorage(n, device="gpuwire")`` (used by ``storage.to``, hence by
  ``torch.load(map_location=...)``) crashes in C++ for a Python backend with no allocator;
  it is routed to a remote allocation.
"""

from __future__ import annotations

import functools
import threading

import torch

from .wire import DEVICE_TYPE

_local = threading.local()
_installed = False


def _crosses_gpuwire(module: torch.nn.Module, target: torch.device | None) -> bool:
    if target is not None and target.type == DEVICE_TYPE:
        return True
    for tensor in module.parameters():
        return tensor.device.type == DEVICE_TYPE and (target is None or target.type != DEVICE_TYPE)
    for tensor in module.buffers():
        return tensor.device.type == DEVICE_TYPE and (target is None or target.type != DEVICE_TYPE)
    return False


def _swapping(method, target_of):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(_local, "swap", False):
            return method(self, *args, **kwargs)
        try:
            target = target_of(*args, **kwargs)
        except Exception:  # noqa: BLE001 - let the original method report bad arguments
            target = None
        if not _crosses_gpuwire(self, target):
            return method(self, *args, **kwargs)
        _local.swap = True
        try:
            return method(self, *args, **kwargs)
        finally:
            _local.swap = False
    return wrapper


def _target_of_to(*args, **kwargs):
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return torch.device(device) if device is not None else None


def _target_cpu(*args, **kwargs):
    return torch.device("cpu")


def _target_cuda(device=None, *args, **kwargs):
    return torch.device("cuda")


def _patch_untyped_storage() -> None:
    original_new = torch.UntypedStorage.__new__

    def __new__(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            from . import device as _device
            if args and not isinstance(args[0], int):
                host = original_new(cls, *args, **{k: v for k, v in kwargs.items() if k != "device"})
                remote = __new__(cls, host.nbytes(), device=device)
                remote.copy_(host)
                return remote
            nbytes = args[0] if args else 0
            rt = _device.runtime()
            with rt.lock:
                return _device.new_empty(rt, (nbytes,), (1,), torch.uint8).untyped_storage()
        return original_new(cls, *args, **kwargs)

    torch.UntypedStorage.__new__ = __new__


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_untyped_storage()
    original_flag = torch.__future__.get_swap_module_params_on_conversion

    def get_swap_module_params_on_conversion() -> bool:
        return getattr(_local, "swap", False) or original_flag()

    torch.__future__.get_swap_module_params_on_conversion = get_swap_module_params_on_conversion
    Module = torch.nn.Module
    Module.to = _swapping(Module.to, _target_of_to)
    Module.cpu = _swapping(Module.cpu, _target_cpu)
    Module.cuda = _swapping(Module.cuda, _target_cuda)
    _installed = True
