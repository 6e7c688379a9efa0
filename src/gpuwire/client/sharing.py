"""Device tensors between processes: ``torch.multiprocessing`` queues and pipes, DataLoader
workers that return ``.cuda()`` tensors, ``mp.spawn`` arguments.

Sits beside ``client.shims``: PyTorch pickles a tensor for another process through
``ForkingPickler`` reductions that share its memory (a CPU tensor by a shared-memory file, a
CUDA tensor by a CUDA IPC handle). A gpuwire storage has neither: the reduction raised
``_share_fd_: only available on CPU`` in the sender's queue thread, the item was dropped, and the
receiver waited for ever. Each process here has its own session with the node, so a device
tensor crosses as its bytes: the sender downloads them into the pickle itself, the receiver
uploads them into its own session on the same device. (Not as a CPU tensor in shared memory:
nothing would keep that host copy alive until a spawned child opened it, and spawn refused its
closed file descriptor.) What crosses is a copy: unlike CUDA IPC, a write on one side is not seen
on the other (docs/compatibility.md). Except for a tensor the program made shared
(``share_memory_()``, ``Module.share_memory()``: Hogwild training, whose trainers update the
parent's model): its storage is shared by the node with the receiver's session when both
processes use the same node, each side's writes the other's; elsewhere it crosses as a copy and
says so, once a process (the program expects the other process's writes).
"""

from __future__ import annotations

import sys
import warnings

import torch

from .wire import DEVICE_TYPE, on_device

_installed = False
_MARKED_SHARED = "_gpuwire_shared"  # attribute set on a device tensor by ``share_memory_()``
_warned_of_copies = False
_NOT_SHARED = ("gpuwire: a device tensor made shared with share_memory_() (Module.share_memory(): "
               "Hogwild training) crossed between processes as a copy: the two processes do not use the "
               "same gpuwire node (or the sender has ended), so writes made on one side are not seen on "
               "the other, as they would be through CUDA IPC. Run both on one node (gpuwire run gives its "
               "processes one), or train with DistributedDataParallel (torchrun)")


def _host_bytes(host: torch.Tensor) -> bytes:
    return host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _rebuild_tensor(data: bytes, dtype, shape, index, requires_grad: bool, parameter: bool,
                    shared: tuple | None = None) -> torch.Tensor:
    tensor = _adopt_shared(shared, dtype, shape) if shared is not None else None
    adopted = tensor is not None
    if not adopted:
        tensor = _from_bytes(data, dtype, shape).to(torch.device(DEVICE_TYPE, index))
    tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad) if parameter else tensor.requires_grad_(requires_grad)
    if adopted:  # (shared on: a trainer that hands it to a process of its own)
        setattr(tensor, _MARKED_SHARED, True)
    return tensor


def _rebuild_storage(data: bytes, index) -> torch.UntypedStorage:
    return _from_bytes(data, torch.uint8, (len(data),)).untyped_storage().to(device=torch.device(DEVICE_TYPE, index))


def _reduce_tensor(tensor: torch.Tensor, original):
    if not on_device(tensor):  # (not ``tensor.device``: under CUDA compatibility it says cuda)
        return original(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(  # (torch's own words for a CUDA or CPU tensor)
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries.  If you just want to transfer the data, call detach() on "
            "the tensor before serializing (e.g., putting it on the queue).")
    host = tensor.detach().cpu()  # (also what a receiver on another node gets)
    shared = _share(tensor) if getattr(tensor, _MARKED_SHARED, False) else None
    return _rebuild_tensor, (_host_bytes(host), host.dtype, tuple(host.shape), _device_index(tensor),
                             tensor.requires_grad, isinstance(tensor, torch.nn.Parameter), shared)


def _share(tensor: torch.Tensor) -> tuple | None:
    """(secret, storage bytes, strides, offset) naming ``tensor``'s storage to the other sessions
    of this node (the receiver adopts it: ``_adopt_shared``), or None where the node cannot."""
    from . import device, mirror
    rt, storage_id = device.runtime(), device.storage_id_of(tensor)
    try:
        secret = rt.query(f"share:{storage_id}")
    except Exception:  # noqa: BLE001 - an older node: a copy, said so
        _say_it_is_a_copy()
        return None
    rt.shared_storages.add(storage_id)
    mirror.forget_storages(rt, [storage_id])
    return secret, tensor.untyped_storage().nbytes(), tuple(tensor.stride()), tensor.storage_offset()


def _adopt_shared(shared: tuple, dtype: torch.dtype, shape) -> torch.Tensor | None:
    """The sender's storage itself, where this process's session is on the sender's node: each
    side's writes are the other's, as through CUDA IPC. None (a copy, said so) elsewhere."""
    from . import device
    secret, nbytes, strides, offset = shared
    rt = device.runtime()
    storage_id = rt.reserve(nbytes)
    try:
        rt.query(f"adopt-shared:{secret}:{storage_id}")
    except Exception:  # noqa: BLE001 - another node, or a sender that has ended
        _say_it_is_a_copy()
        return None
    rt.shared_storages.add(storage_id)  # (never mirrored; its writes are finished before it exits)
    return device.wrap_storage(rt, storage_id, nbytes, tuple(shape), strides, dtype, offset)


def _say_it_is_a_copy() -> None:
    global _warned_of_copies
    if not _warned_of_copies:
        _warned_of_copies = True
        warnings.warn(_NOT_SHARED, UserWarning, stacklevel=_programs_frame_level())


def _programs_frame_level() -> int:
    """The ``stacklevel`` of the program's line that sent the tensor (``Process.start()``,
    ``queue.put``...), past the pickling machinery; the process's first frame where it cannot tell."""
    import multiprocessing
    import os
    machinery = tuple(os.path.dirname(module.__file__) + os.sep for module in (multiprocessing, torch))
    machinery += (os.path.dirname(os.path.dirname(__file__)) + os.sep,)  # (gpuwire)
    frame, level = sys._getframe(2), 2  # (``_say_it_is_a_copy``'s caller: its level 2)
    while frame is not None and frame.f_back is not None and (
            frame.f_code.co_filename.startswith(machinery) or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    return level


def _device_index(tensor: torch.Tensor):
    return torch._C.TensorBase.device.__get__(tensor).index  # (the gpuwire device's own index)


def _reduce_storage(storage, original):
    if storage.device.type != DEVICE_TYPE:
        return original(storage)
    untyped = storage.untyped() if isinstance(storage, torch.TypedStorage) else storage
    host = torch.empty(0, dtype=torch.uint8).set_(untyped.cpu())
    return _rebuild_storage, (_host_bytes(host), storage.device.index)


def install() -> None:
    """Put the reductions in front of torch's for every class torch registered them for."""
    global _installed
    if _installed:
        return
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions
    reductions.init_reductions()  # (idempotent: torch ran it when torch.multiprocessing was imported)
    original_tensor, original_storage = reductions.reduce_tensor, reductions.reduce_storage

    def reduce_tensor(tensor):
        return _reduce_tensor(tensor, original_tensor)

    def reduce_storage(storage):
        return _reduce_storage(storage, original_storage)

    original_share_memory = torch.Tensor.share_memory_

    def share_memory_(self):
        if on_device(self):
            setattr(self, _MARKED_SHARED, True)  # (a device tensor is no CPU one to move into shared memory)
            return self
        return original_share_memory(self)

    share_memory_.__doc__ = original_share_memory.__doc__
    torch.Tensor.share_memory_ = share_memory_
    for cls, reducer in list(ForkingPickler._extra_reducers.items()):
        if reducer is original_tensor:
            ForkingPickler.register(cls, reduce_tensor)
        elif reducer is original_storage:
            ForkingPickler.register(cls, reduce_storage)
    _installed = True
