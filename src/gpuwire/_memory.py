"""Reuse of freed large host blocks: the CPU backend's storages on a node, downloads on a client.

Used by the node's sessions (``node/session.py``, ``HOST_STORAGES``) and by the client's
downloads (``client/device.py``, ``DOWNLOADS``: ``RecyclingHostTensors``). Nothing crosses a
process boundary here.

Why: on a fresh allocation the first write to every 4 KiB page traps into the kernel, which
finds and zeroes a page. Measured on the 2-core VM this project runs on, touching 256 MiB of
fresh memory took 250-450 ms, writing it again 50 ms, and loopback TCP moves 256 MiB in about
115 ms: page faults, not the socket, bounded bulk transfers (64 MiB uploads: 1.0 GiB/s into
fresh memory, 1.8-2.0 GiB/s into reused blocks, raw TCP 1.9). Asking for huge pages
(``madvise(MADV_HUGEPAGE)``) cut steady-state faulting 4x but stalled for seconds in direct
compaction on first use (transparent huge pages' ``defrag=madvise``), so it is not used.

``StorageCache``: a CUDA device has a caching allocator, so a training loop that uploads a
same-sized batch every step reuses the same block; the CPU backend's allocator returns large
blocks to the kernel at once (glibc ``mmap``s anything over 32 MiB). The node keeps recently
freed large storages for a while and hands one back for an allocation of the same size. What
a block held is never visible to the next user: the node zeroes new storages lazily unless
the first command overwrites all of it (``Session.allocate``), for fresh and reused memory alike.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import math
import threading
import time
import weakref

import torch


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_heap(*, mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20,
                    top_pad: int = 64 << 20) -> bool:
    """Make glibc keep freed kernel outputs in the heap instead of handing them back to the kernel
    (a CPU node; called once at ``gpuwire serve``). True when applied.

    A node frees activations in batches (the client's ``Free`` arrives every few hundred
    allocations or at a sync point), where a local run frees each the moment it dies. A batch of
    frees leaves a large free region at the top of the heap, which glibc trims (returns to the
    kernel) past its default 2 x the dynamic mmap threshold, so the next step's outputs fault
    their pages in again: replaying a recorded GPT-2 tiny step, the node took ~400 minor page faults
    a step where a local run takes none, and its kernels ran ~7 % slower
    (``python -m bench.node_replay``). Allocations below 32 MiB (glibc's own ceiling for its
    dynamic threshold) now stay in the heap, up to 256 MiB of free heap is kept, and the heap
    grows 64 MiB at a time; steady-state faults went to 0. Larger blocks are still mapped and
    unmapped per allocation, and the node's ``StorageCache`` recycles those of uploads.
    Not glibc (musl, macOS): nothing to do."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # (setting the trim threshold alone would freeze the mmap threshold at 128 KiB: every
    # activation above it mapped and faulted afresh, 20x the faults. Set all three.)
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad)))


class StorageCache:
    """Recently freed large CPU storages, handed back for allocations of the same size.

    Bounded in bytes and in age: a block unused for ``max_age`` seconds goes back to the
    system, as does the oldest when the cache is full. Thread-safe (sessions run on their own
    threads). A storage is taken in only when nothing else refers to it.
    """

    def __init__(self, max_bytes: int = 1 << 30, *, min_bytes: int = 1 << 20, max_age: float = 20.0):
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.max_age = max_age
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._free: collections.OrderedDict = collections.OrderedDict()  # token -> (nbytes, storage, since)
        self._by_size: dict[int, list] = {}
        self._tokens = iter(range(1 << 62))
        self._timer: threading.Timer | None = None  # returns what outlived max_age on an idle node

    def allocate(self, nbytes: int) -> torch.UntypedStorage:
        """A CPU storage of exactly ``nbytes``: a cached one, else a fresh one.
        Its contents are whatever was there: the caller zeroes or overwrites it."""
        if nbytes >= self.min_bytes:
            with self._lock:
                self._expire(time.monotonic())
                tokens = self._by_size.get(nbytes)
                if tokens:
                    token = tokens.pop()
                    if not tokens:
                        del self._by_size[nbytes]
                    _, storage, _ = self._free.pop(token)
                    self.bytes_held -= nbytes
                    self.hits += 1
                    return storage
                self.misses += 1
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()

    def release(self, storage: torch.UntypedStorage) -> None:
        """Offer a storage nobody uses any more; kept if it is large, CPU and unshared."""
        nbytes = storage.nbytes()
        # (not resizable is fine: exporting a storage to numpy, as receiving in place does, sets
        # that for good; nothing on the node grows a storage it holds)
        if (nbytes < self.min_bytes or nbytes > self.max_bytes or storage.device.type != "cpu"
                or torch._C._storage_Use_Count(storage._cdata) != 1):
            return
        now = time.monotonic()
        with self._lock:
            token = next(self._tokens)
            self._free[token] = (nbytes, storage, now)
            self._by_size.setdefault(nbytes, []).append(token)
            self.bytes_held += nbytes
            while self.bytes_held > self.max_bytes:
                self._drop_oldest()
            self._expire(now)
            self._arm()

    def _arm(self) -> None:
        if self._timer is None and self._free:
            self._timer = threading.Timer(self.max_age + 1.0, self._tick)
            self._timer.daemon = True
            self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
            self._expire(time.monotonic())
            self._arm()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._by_size.clear()
            self.bytes_held = 0

    def _expire(self, now: float) -> None:
        while self._free:
            _, (_, _, since) = next(iter(self._free.items()))
            if now - since <= self.max_age:
                break
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        token, (nbytes, _, _) = self._free.popitem(last=False)
        tokens = self._by_size[nbytes]
        tokens.remove(token)
        if not tokens:
            del self._by_size[nbytes]
        self.bytes_held -= nbytes


class RecyclingHostTensors:
    """New CPU tensors for downloads (``y.cpu()``) whose memory goes back to a ``StorageCache``
    when the tensor dies, so that the next download of that size lands in warm pages.

    Why: a fresh 64 MiB host tensor costs ~27 ms of page faults on this VM, as much as moving
    its bytes over loopback (``y.cpu()`` ran at half the raw socket's speed); a CUDA program
    downloading the same-sized result every step gets the same from PyTorch's caching host
    allocator. The tensor is an ordinary CPU tensor over a block of the cache: its storage
    holds a NumPy view of the block, and when that view dies its finalizer hands the block
    back. The finalizer only queues it (it may run inside the cache's lock, from a garbage
    collection); ``empty`` takes queued blocks into the cache. The tensor's storage cannot be
    resized (``resize_`` to a larger size raises), as with any tensor made from a buffer.
    """

    def __init__(self, cache: StorageCache):
        self.cache = cache
        self._returned: collections.deque = collections.deque()

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.cache.min_bytes or nbytes > self.cache.max_bytes:
            return torch.empty(shape, dtype=dtype)
        returned = self._returned
        while returned:
            self.cache.release(returned.popleft())
        block = self.cache.allocate(nbytes)
        view = torch.empty(0, dtype=torch.uint8).set_(block).numpy()
        finalizer = weakref.finalize(view, returned.append, block)
        finalizer.atexit = False
        carrier = torch.frombuffer(view, dtype=torch.uint8)
        return torch.empty(0, dtype=dtype).set_(carrier.untyped_storage(), 0, tuple(shape))  # contiguous
