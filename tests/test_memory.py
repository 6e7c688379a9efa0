"""The node's cache of freed CPU storages (gpuwire._memory)."""

import time

import torch

from gpuwire._memory import StorageCache

MiB = 1 << 20


def test_a_freed_block_is_handed_back_for_the_same_size_only():
    cache = StorageCache(max_bytes=64 * MiB)
    first = cache.allocate(4 * MiB)
    ptr = first.data_ptr()
    cache.release(first)
    del first
    assert cache.bytes_held == 4 * MiB
    other = cache.allocate(4 * MiB + 1)
    assert other.data_ptr() != ptr and cache.misses == 2
    again = cache.allocate(4 * MiB)
    assert again.data_ptr() == ptr and cache.hits == 1 and cache.bytes_held == 0
    assert cache.allocate(4 * MiB).data_ptr() != ptr  # never handed out twice


def test_a_block_still_in_use_is_never_cached():
    cache = StorageCache(max_bytes=64 * MiB)
    storage = cache.allocate(2 * MiB)
    view = torch.empty(0, dtype=torch.uint8).set_(storage)  # a tensor still refers to it
    cache.release(storage)
    assert cache.bytes_held == 0
    view[:4] = 7
    assert cache.allocate(2 * MiB).data_ptr() != view.data_ptr()


def test_small_blocks_go_back_to_the_allocator():
    cache = StorageCache(max_bytes=64 * MiB)
    cache.release(torch.empty(1000, dtype=torch.uint8).untyped_storage())
    assert cache.bytes_held == 0


def test_the_cache_is_bounded_in_bytes_and_drops_the_oldest():
    cache = StorageCache(max_bytes=5 * MiB)
    blocks = [cache.allocate(2 * MiB) for _ in range(3)]
    ptrs = [b.data_ptr() for b in blocks]
    for b in blocks:
        cache.release(b)
    del blocks, b
    assert cache.bytes_held == 4 * MiB  # the oldest of three went back to the system
    assert {cache.allocate(2 * MiB).data_ptr() for _ in range(2)} == set(ptrs[1:])


def test_blocks_unused_for_a_while_are_returned():
    cache = StorageCache(max_bytes=64 * MiB, max_age=0.05)
    cache.release(cache.allocate(2 * MiB))
    time.sleep(0.1)
    cache.release(cache.allocate(3 * MiB))  # any call expires the old ones
    assert cache.bytes_held == 3 * MiB
