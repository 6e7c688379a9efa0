"""``torch.distributed`` collectives on gpuwire tensors, staged through the host.

Sits beside ``client.cuda_compat``. Collective libraries (gloo, NCCL) read device memory
directly, and a gpuwire tensor's memory is on a node: neither can take one. This backend
("gpuwire", registered for the gpuwire device type) copies each tensor to the host, runs the
same collective on a gloo group of the same ranks, and copies the result back. With it
``DistributedDataParallel``, ``all_reduce``, ``broadcast``, ``all_gather`` … work on gpuwire
tensors with gloo's semantics. ``init_process_group("gloo")`` (and, under ``gpuwire run``,
``"nccl"``, which needs GPUs on this machine) adds it for the gpuwire device.

What crosses it: tensors in and out of the program's collectives; the staging copies are
ordinary device↔host transfers.
"""

from __future__ import annotations

import datetime
import functools
import sys
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllToAllOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

from .wire import DEVICE_TYPE, called_by_pytorch, on_device

BACKEND = "gpuwire"


def _done(result):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _host(tensors):
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _flat(tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor):
            yield t
        else:
            yield from _flat(t)


def _run_on_host(start, *tensors) -> None:
    """``start()`` (a gloo collective on the host tensors ``tensors``), waited for, and then the
    wait for gloo's worker thread to let go of those tensors.

    That thread still held them after ``wait()`` returned in half the collectives (measured), and
    where it drops the last reference to a tensor that has a Python object, the drop takes the
    GIL. At interpreter exit the thread is killed inside that destructor and the rank dies of
    SIGABRT ("terminate called without an active exception"; one job in a few hundred that ends
    right after a collective). Holding the tensors here until the thread has dropped its
    references leaves the last drop to this thread, which holds the GIL."""
    held = _use_counts(tensors)
    work = start()
    work.wait()
    del work
    _wait_for_gloo_to_let_go(held)


def _use_counts(tensors) -> list:
    return [(t, t._use_count()) for t in _flat(tensors)]


def _wait_for_gloo_to_let_go(held) -> None:
    deadline = time.monotonic() + 1.0  # (microseconds, unless the machine is overloaded)
    while any(t._use_count() > count for t, count in held) and time.monotonic() < deadline:
        time.sleep(0.00005)


class _Deferred(dist.Work):
    """A point-to-point operation in flight on host copies: ``wait()`` waits for gloo and then
    uploads what arrived. Not waited for when queued: gloo's send waits for the peer's receive,
    so two ranks that each ``isend`` before they ``irecv`` (``batch_isend_irecv``, ring
    exchanges) would block each other."""

    def __init__(self, start, host, after=None):
        super().__init__()
        self._held = _use_counts(host)
        self._work, self._after, self._done = start(), after, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            _wait_for_gloo_to_let_go(self._held)  # (see _run_on_host)
            if self._after is not None:
                self._after()
            self._done, self._held = True, None
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def source_rank(self) -> int:
        return self._work.source_rank()

    def get_future(self):
        self.wait()
        future = Future()
        future.set_result(None)
        return future


def _back(tensors, host) -> None:
    with torch.no_grad():
        for t, h in zip(tensors, host):
            t.copy_(h)


class HostStagedGroup(dist.ProcessGroup):
    """A process group for gpuwire tensors: each collective runs on host copies through gloo."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gpuwire-host-staged/", store), rank, size, timeout)
        # c10d hands out this object as the whole group (a Python ProcessGroup replaces the one it
        # was building), and a group's name lives in its backends: with none, ``group_name``
        # raised "ProcessGroup name not set" (DeviceMesh, hence FSDP2 and DTensor, read it)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return BACKEND

    def _run(self, tensors, collective):
        host = _host(tensors)
        _run_on_host(lambda: collective(host), host)
        _back(tensors, host)
        return _done(tensors)

    def allreduce(self, tensor_list, opts=AllreduceOptions()):
        return self._run(tensor_list, lambda host: self._gloo.allreduce(host, opts))

    def broadcast(self, tensor_list, opts=BroadcastOptions()):
        return self._run(tensor_list, lambda host: self._gloo.broadcast(host, opts))

    def reduce(self, tensor_list, opts=ReduceOptions()):
        return self._run(tensor_list, lambda host: self._gloo.reduce(host, opts))

    def barrier(self, opts=BarrierOptions()):
        _run_on_host(lambda: self._gloo.barrier(opts))
        return _done(None)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self._run(tensors, lambda host: self._gloo.allreduce_coalesced(host, opts))

    def send(self, tensors, dst_rank: int, tag: int = 0):
        host = _host(tensors)
        return _Deferred(lambda: self._gloo.send(host, dst_rank, tag), host)

    def recv(self, tensors, src_rank: int, tag: int = 0):
        host = _host(tensors)
        return _Deferred(lambda: self._gloo.recv(host, src_rank, tag), host, after=lambda: _back(tensors, host))

    def recv_anysource(self, tensors, tag: int = 0):
        host = _host(tensors)
        return _Deferred(lambda: self._gloo.recv_anysource(host, tag), host, after=lambda: _back(tensors, host))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=AllToAllOptions()):
        host_out, host_in = _host([output, input])
        _run_on_host(lambda: self._gloo.alltoall_base(host_out, host_in, output_split_sizes, input_split_sizes, opts),
                     host_out, host_in)
        _back([output], [host_out])
        return _done([output])

    def alltoall(self, output_tensors, input_tensors, opts=AllToAllOptions()):
        """gloo has only the single-tensor all-to-all: the lists go flat, split by their sizes."""
        flat_in = torch.cat([t.detach().reshape(-1).cpu() for t in input_tensors])
        flat_out = flat_in.new_empty(sum(t.numel() for t in output_tensors))
        _run_on_host(lambda: self._gloo.alltoall_base(flat_out, flat_in, [t.numel() for t in output_tensors],
                                                      [t.numel() for t in input_tensors], opts),
                     flat_out, flat_in)
        _back(output_tensors, [part.reshape(t.shape) for part, t in
                               zip(flat_out.split([t.numel() for t in output_tensors]), output_tensors)])
        return _done(output_tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts=ReduceScatterOptions()):
        """gloo has no reduce-scatter of lists: reduce all of them, keep this rank's part."""
        reduce = AllreduceOptions()
        reduce.reduceOp = opts.reduceOp
        for output, inputs in zip(output_tensors, input_lists):
            host = torch.stack([t.detach().cpu() for t in inputs])
            _run_on_host(lambda: self._gloo.allreduce([host], reduce), host)
            _back([output], [host[self._rank]])
        return _done(output_tensors)

    def _run_into_lists(self, output_tensors, input_tensors, collective):
        """A collective whose outputs are lists of tensors (one per rank): all_gather, gather."""
        host_in = _host(input_tensors)
        host_out = [_host(outputs) for outputs in output_tensors]
        _run_on_host(lambda: collective(host_out, host_in), host_out, host_in)
        for outputs, host in zip(output_tensors, host_out):
            _back(outputs, host)
        return _done(output_tensors)

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        return self._run_into_lists(output_tensors, input_tensors,
                                    lambda out, in_: self._gloo.allgather(out, in_, opts))

    def gather(self, output_tensors, input_tensors, opts=GatherOptions()):
        return self._run_into_lists(output_tensors, input_tensors,
                                    lambda out, in_: self._gloo.gather(out, in_, opts))

    def scatter(self, output_tensors, input_tensors, opts=ScatterOptions()):
        host_out = _host(output_tensors)
        host_in = [_host(inputs) for inputs in input_tensors]
        _run_on_host(lambda: self._gloo.scatter(host_out, host_in, opts), host_out, host_in)
        _back(output_tensors, host_out)
        return _done(output_tensors)


def _create(store, rank: int, size: int, timeout):
    return HostStagedGroup(store, rank, size, timeout)


def _gpuwire_in_use() -> bool:
    """This process uses the gpuwire device: under ``gpuwire run``, attached, or pointed at a
    node. Any other process that imports gpuwire (the backend autoload) keeps torch's defaults,
    real NCCL on real GPUs included."""
    import os

    from . import cuda_compat
    from .device import current_runtime
    return cuda_compat.enabled() or current_runtime() is not None or bool(os.environ.get("GPUWIRE_NODE"))


DEVICE_MAP = f"cpu:gloo,cuda:gloo,{DEVICE_TYPE}:{BACKEND}"
# what the program's ``init_process_group`` asked for ("nccl", "gloo") when it became DEVICE_MAP
_asked: list = [None]


def with_gpuwire(backend):
    """The backend string ``init_process_group`` gets: the program's, plus this one for the
    gpuwire device (gloo for the host). NCCL needs GPUs here, so it becomes gloo."""
    name = "gloo" if backend is None else str(backend)
    if ":" in name or name.lower() not in ("gloo", "nccl") or not _gpuwire_in_use():
        return backend  # an explicit device map, another backend, or no gpuwire: as the program says
    return DEVICE_MAP


def _get_backend_as_asked(original):
    """``dist.get_backend()`` answers the program what it asked for ("nccl" under ``gpuwire
    run``): scripts branch on ``get_backend() == "nccl"``, and the device map took their other
    path. PyTorch's own callers keep the real configuration, on which its code paths depend (the
    coalescing manager, the object collectives' device)."""
    @functools.wraps(original)
    def get_backend(group=None):
        backend = original(group)
        if _asked[0] is None or backend != DEVICE_MAP:
            return backend
        if called_by_pytorch():
            return backend
        return _asked[0]
    return get_backend


def _monitored_barrier_as_asked(original):
    """``monitored_barrier`` is gloo's, and PyTorch refuses it unless the group's backend is
    "gloo": the device map is not. A program that asked for gloo gets it, on the group's host
    (gloo) backend, as a gloo run does; one that asked for NCCL is refused as it is on CUDA."""
    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        c10d = dist.distributed_c10d
        if _asked[0] != "gloo" or c10d._rank_not_in_group(group) or c10d.get_backend(group) != DEVICE_MAP:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.Backend.GLOO)
        elif isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        group_to_use = c10d._get_default_group() if group is None else group
        return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    return monitored_barrier


def _staged_all_gather_into_tensor(original):
    @functools.wraps(original)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not on_device(output_tensor):
            return original(output_tensor, input_tensor, group=group, async_op=async_op)
        host_out = output_tensor.detach().to("cpu", copy=True)  # (contiguous: its flat chunks are views)
        # flat, since the output may be (world * n, ...) or any shape of that many elements
        # (SyncBatchNorm gathers its statistics into a (1, world * n) tensor)
        dist.all_gather(list(host_out.view(-1).chunk(dist.get_world_size(group))),
                        input_tensor.detach().cpu().reshape(-1), group=group)
        _back([output_tensor], [host_out])
        return _done(output_tensor) if async_op else None
    return all_gather_into_tensor


def _staged_reduce_scatter_tensor(original):
    @functools.wraps(original)
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not on_device(output):
            return original(output, input, op=op, group=group, async_op=async_op)
        # gloo has no reduce_scatter: reduce everything, keep this rank's part
        host = input.detach().to("cpu", copy=True)
        dist.all_reduce(host, op=op, group=group)
        _back([output], [host.reshape(-1).chunk(dist.get_world_size(group))[dist.get_rank(group)].reshape(output.shape)])
        return _done(output) if async_op else None
    return reduce_scatter_tensor


# ``torch.distributed._functional_collectives`` (DTensor, FSDP2's state dicts, tensor parallelism)
# call these ops; their kernel looks up the group's backend for the tensor's device, and the
# gpuwire device has none a collective library can use ("No backend type associated with device
# type gpuwire"). Here each runs on a host copy, on the group's CPU (gloo) backend, and the result
# is uploaded; they complete before returning, so ``wait_tensor`` has nothing to wait for.
#
# They call the backend through its Python bindings, which release the GIL, and not through the
# ``_c10d_functional`` CPU kernels, which hold it: gloo's worker thread drops a finished
# collective's work while holding the queue's lock, and where that work held the last reference
# to a host copy with a Python object, the drop waits for the GIL, while the program's thread,
# holding the GIL, waited for that lock to queue its next collective (a deadlock, one run in ~40
# of two collectives, every time in a few hundred).
def _cpu_backend(group_name):
    group = (group_name if isinstance(group_name, dist.ProcessGroup)
             else dist.distributed_c10d._resolve_process_group(group_name))
    return group, group._get_backend(torch.device("cpu"))


def _host_copy(tensor):
    return tensor.detach().to("cpu").contiguous()


def _host_all_reduce(input, reduce_op: str, group_name):
    """A host copy of ``input`` all-reduced over the group (gloo has no "avg": a sum, divided)."""
    group, backend = _cpu_backend(group_name)
    average = reduce_op.lower() == "avg"
    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM if average else getattr(dist.ReduceOp, reduce_op.upper())
    host = _host_copy(input)
    _run_on_host(lambda: backend.allreduce([host], opts), host)
    if average:
        if host.is_floating_point() or host.is_complex():
            host /= group.size()
        else:
            host = host.div(group.size(), rounding_mode="trunc")
    return host


def _host_all_gather(input, group_size: int, group_name):
    _, backend = _cpu_backend(group_name)
    host = _host_copy(input)
    out = host.new_empty((group_size * host.shape[0], *host.shape[1:]))
    parts = list(out.chunk(group_size))
    _run_on_host(lambda: backend.allgather([parts], [host]), parts, host)
    return out


def _host_reduce_scatter(input, reduce_op: str, group_size: int, group_name):
    """gloo has no reduce-scatter: reduce everything on the host, keep this rank's part."""
    group, _ = _cpu_backend(group_name)
    return _host_all_reduce(input, reduce_op, group_name).chunk(group_size)[group.rank()]


def _host_broadcast(input, src: int, group_name):
    _, backend = _cpu_backend(group_name)
    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    host = _host_copy(input)
    _run_on_host(lambda: backend.broadcast([host], opts), host)
    return host


def _host_all_to_all(input, output_split_sizes, input_split_sizes, group_name):
    _, backend = _cpu_backend(group_name)
    host = _host_copy(input)
    rows = sum(output_split_sizes) if output_split_sizes else host.shape[0]
    out = host.new_empty((rows, *host.shape[1:]))
    _run_on_host(lambda: backend.alltoall_base(out, host, list(output_split_sizes), list(input_split_sizes),
                                               AllToAllOptions()), out, host)
    return out


def _upload_like(device_tensor, host):
    """``host`` on ``device_tensor``'s device (``.to(t.device)`` would name "cuda" under gpuwire
    run, which this kernel, below the compatibility mode, must not)."""
    out = device_tensor.new_empty(host.shape, dtype=host.dtype)
    with torch.no_grad():
        out.copy_(host)
    return out


def _fresh(host_collective):
    """The functional op (a fresh result) of ``host_collective(input, *args)``."""
    def kernel(input, *args):
        return _upload_like(input, host_collective(input, *args))
    return kernel


def _into_input(host_collective):
    """The in-place op (``all_reduce_``, ``broadcast_``): the result written into ``input``."""
    def kernel(input, *args):
        _back([input], [host_collective(input, *args)])
        return input
    return kernel


def _into_out(host_collective):
    """The ``_out`` op: the result written into ``out``."""
    def kernel(input, *args, out):
        _back([out], [host_collective(input, *args)])
        return out
    return kernel


def _each(kernel):
    """The ``_coalesced`` op: ``kernel`` on each tensor of the list, in order on every rank."""
    def coalesced(inputs, *args):
        return [kernel(input, *args) for input in inputs]
    return coalesced


_FUNCTIONAL_KERNELS = {
    "all_reduce": _fresh(_host_all_reduce),
    "all_reduce_": _into_input(_host_all_reduce),
    "all_reduce_coalesced": _each(_fresh(_host_all_reduce)),
    "all_reduce_coalesced_": _each(_into_input(_host_all_reduce)),
    "all_gather_into_tensor": _fresh(_host_all_gather),
    "all_gather_into_tensor_out": _into_out(_host_all_gather),
    "all_gather_into_tensor_coalesced": _each(_fresh(_host_all_gather)),
    "reduce_scatter_tensor": _fresh(_host_reduce_scatter),
    "reduce_scatter_tensor_out": _into_out(_host_reduce_scatter),
    "reduce_scatter_tensor_coalesced": _each(_fresh(_host_reduce_scatter)),
    "broadcast": _fresh(_host_broadcast),
    "broadcast_": _into_input(_host_broadcast),
    "all_to_all_single": _fresh(_host_all_to_all),
}


def _register_functional_collectives() -> None:
    library = torch.library.Library("_c10d_functional", "IMPL")
    for name, kernel in _FUNCTIONAL_KERNELS.items():
        if hasattr(torch.ops._c10d_functional, name):  # (the set differs between torch versions)
            library.impl(name, kernel, "PrivateUse1")
    library.impl("wait_tensor", lambda tensor: tensor, "PrivateUse1")
    _LIBRARIES.append(library)


_LIBRARIES: list = []  # (a Library unregisters its kernels when it is collected)
_installed = False


def install() -> None:
    """Register the backend, and let ``init_process_group`` add it (idempotent)."""
    global _installed
    if _installed or not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE_TYPE])
    _register_functional_collectives()
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        given = with_gpuwire(backend)
        if given == DEVICE_MAP and backend is not None and str(backend).lower() in ("nccl", "gloo"):
            _asked[0] = str(backend).lower()
        return original(given, *args, **kwargs)

    # ``init_device_mesh`` (tensor parallelism, FSDP2, DTensor) starts the default group itself
    # through the name DeviceMesh imported, with no backend: torch then chose NCCL for "cuda"
    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group
    dist.get_backend = _get_backend_as_asked(dist.get_backend)  # (c10d's own name stays the real one)
    dist.monitored_barrier = _monitored_barrier_as_asked(dist.monitored_barrier)
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is not None and getattr(device_mesh, "init_process_group", None) is original:
        device_mesh.init_process_group = init_process_group
    # the single-tensor collectives reach the backend another way, which finds none for the
    # gpuwire device: stage them here, through the host group
    dist.all_gather_into_tensor = _staged_all_gather_into_tensor(dist.all_gather_into_tensor)
    dist.reduce_scatter_tensor = _staged_reduce_scatter_tensor(dist.reduce_scatter_tensor)
    if hasattr(dist, "all_gather_single"):  # (newer torch; SyncBatchNorm gathers its statistics with it)
        dist.all_gather_single = _staged_all_gather_into_tensor(dist.all_gather_single)
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = _staged_reduce_scatter_tensor(dist.reduce_scatter_single)
    _installed = True
