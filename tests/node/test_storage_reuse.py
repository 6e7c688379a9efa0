"""Freed device blocks are reused (CPU backend, ``HOST_STORAGES``) but never show what an
earlier session left in them: a new storage reads as zeros unless the client overwrote it."""

import subprocess
import sys

import pytest

from gpuwire.client.runtime import Runtime
from gpuwire.protocol.events import Free, Op

MiB = 1 << 20


@pytest.fixture
def node():
    from tests.conftest import NodeProcess
    proc = NodeProcess()
    yield proc
    proc.kill()


def _leave_secret(rt: Runtime, nbytes: int) -> None:
    storage = rt.allocate(nbytes)
    rt.mark_overwrite(storage)
    rt.write(storage, 0, memoryview(b"\xab" * nbytes))
    rt.synchronize()
    rt.enqueue(rt.conn.send(Free(seq=rt.next_seq(), storage_ids=[storage])))
    rt.synchronize()


def test_a_reused_block_never_shows_another_sessions_bytes(node):
    owner, other = Runtime(node.address), Runtime(node.address)
    try:
        for nbytes in (4 * MiB, 3 * MiB + 4096):
            _leave_secret(owner, nbytes)
            fresh = other.allocate(nbytes)  # zeroed allocation of the size just freed
            assert bytes(other.read(fresh, 0, nbytes)) == bytes(nbytes)

            _leave_secret(owner, nbytes)
            half = other.allocate(nbytes)
            other.mark_overwrite(half)  # the client says it will write all of it, then writes half
            other.write(half, 0, memoryview(b"\x01" * (nbytes // 2)))
            got = bytes(other.read(half, 0, nbytes))
            assert got[:nbytes // 2] == b"\x01" * (nbytes // 2) and got[nbytes // 2:] == bytes(nbytes - nbytes // 2)

            _leave_secret(owner, nbytes)  # the same session gets no old bytes either
            again = owner.allocate(nbytes)
            assert bytes(owner.read(again, 0, nbytes)) == bytes(nbytes)
    finally:
        owner.close()
        other.close()


def test_kernel_outputs_go_back_to_malloc_and_uploads_to_the_cache():
    """A freed upload block waits in ``HOST_STORAGES`` for the next upload of its size; a freed
    kernel output does not: kernels allocate through malloc, so a parked output would make the
    next one fresh memory, faulted in page by page (it slowed a CNN step's kernels by a third)."""
    import torch

    from gpuwire.node.session import HOST_STORAGES
    from gpuwire.protocol import codec

    from .test_session_fast_paths import make_session, tensor, upload

    f32 = codec.DTYPE_CODES["float32"]
    session = make_session()
    HOST_STORAGES.clear()
    numel = MiB  # 4 MiB of float32
    upload(session, 0x1000, torch.ones(numel))
    x = tensor(session, 0x1000, 0, (numel,), (1,), f32)
    session.handle(Op(seq=1, name="aten::mul.Tensor", args=[x, x], kwargs={},
                      outs=[[0x2000, 4 * numel, [numel], [1], f32]]))
    assert session.pending_error is None, session.pending_error
    del x
    session.handle(Free(seq=2, storage_ids=[0x2000]))
    assert HOST_STORAGES.bytes_held == 0, "a kernel's output was parked in the upload cache"
    session.handle(Free(seq=3, storage_ids=[0x1000]))
    assert HOST_STORAGES.bytes_held == 4 * numel, "a freed upload block was not kept for the next upload"
    session.close()
    HOST_STORAGES.clear()


def test_a_block_freed_before_anything_read_it_is_not_zeroed_yet_reads_as_zeros_when_reused(node):
    """``torch.empty`` then dropped (a batch-size finder's failed try, a scratch buffer): the
    Alloc's lazy zeroing is skipped when the next command frees the storage, since nothing can
    read it; a later allocation that reuses the block still reads as zeros."""
    owner, other = Runtime(node.address), Runtime(node.address)
    try:
        nbytes = 5 * MiB
        _leave_secret(owner, nbytes)  # the block now holds another session's bytes
        dropped = owner.allocate(nbytes)  # reuses it: zeroing pending
        owner.enqueue(owner.conn.send(Free(seq=owner.next_seq(), storage_ids=[dropped])))
        owner.synchronize()
        fresh = other.allocate(nbytes)  # reuses it again
        assert bytes(other.read(fresh, 0, nbytes)) == bytes(nbytes)
    finally:
        owner.close()
        other.close()


_BATCHED_FREES = r"""
import sys, torch, gpuwire
gpuwire.attach(sys.argv[1])
node_pid = int(sys.argv[2])

def node_faults():
    fields = open(f"/proc/{node_pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt

x = torch.ones(128 * 1024, device="gpuwire")  # 512 KiB
per_round = []
for round in range(12):
    before = node_faults()
    outputs = [x * 2 for _ in range(40)]  # 20 MiB of kernel outputs, alive together
    del outputs  # freed as one batch at the next sync point, as activations are after a step
    gpuwire.synchronize()
    per_round.append(node_faults() - before)
print(sorted(per_round[4:])[len(per_round[4:]) // 2])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the node's page faults from /proc")
def test_a_cpu_node_keeps_freed_kernel_outputs_in_its_heap():
    """A client frees a step's activations in one batch; glibc would hand that free region back to
    the kernel and the next step's outputs would fault every page in again (~400 minor faults a
    GPT-2 tiny step, kernels ~7 % slower than a local run). ``gpuwire serve`` on the CPU backend
    keeps freed heap memory (``_memory.keep_freed_heap``): 20 MiB of outputs made and freed in a
    batch, round after round, fault (almost) nothing once warm; the default malloc settings
    fault ~5,000 pages a round."""
    from tests.conftest import NodeProcess
    node = NodeProcess("--threads", "1")
    try:
        run = subprocess.run([sys.executable, "-c", _BATCHED_FREES, node.address, str(node.proc.pid)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        faults_per_round = int(run.stdout.split()[-1])
        assert faults_per_round < 500, f"{faults_per_round} page faults a round on the node"
    finally:
        node.kill()


def test_keep_freed_heap_applies_on_glibc():
    code = "from gpuwire._memory import keep_freed_heap; print(keep_freed_heap())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    import platform
    expected = "True" if platform.libc_ver()[0] == "glibc" else "False"
    assert run.stdout.strip() == expected, run.stderr


def test_a_freed_storage_leaves_the_accounts_at_once_and_memory_when_the_session_is_idle():
    """``Free`` takes a storage out of the session's tables and bytes at once; its deallocation
    (with its views' and kept graphs') waits for ``bury``, which the serving connection calls
    when nothing waits to run (off a step's critical path), and every memory query calls first.
    What waits is bounded (``DYING_BYTES_LIMIT``): a program freeing more in one go than that
    gets it back without an idle moment."""
    import gc
    import weakref

    import torch

    from gpuwire.node import session as node_session
    from gpuwire.protocol import codec

    from .test_session_fast_paths import make_session, tensor, upload

    f32 = codec.DTYPE_CODES["float32"]
    session = make_session()
    upload(session, 0x1000, torch.arange(6, dtype=torch.float32))
    x = tensor(session, 0x1000, 0, (6,), (1,), f32)
    session.handle(Op(seq=1, name="aten::mul.Tensor", args=[x, x], kwargs={}, outs=[[0x2000, 24, [6], [1], f32]]))
    assert session.pending_error is None, session.pending_error
    del x
    product = weakref.ref(session.storages[0x2000])
    in_use = session.bytes_in_use
    session.handle(Free(seq=2, storage_ids=[0x2000]))
    gc.collect()
    assert 0x2000 not in session.storages and session.bytes_in_use == in_use - 24
    assert product() is not None and session.has_dying  # (not deallocated yet)
    assert session._query("memory")["bytes_in_use"] == in_use - 24
    assert product() is None and not session.has_dying  # (a query buries first)

    session.handle(Op(seq=3, name="aten::empty.memory_format", args=[[node_session.DYING_BYTES_LIMIT // 4 + 1]],
                      kwargs={"dtype": torch.float32, "device": torch.device("cpu")},
                      outs=[[0x3000, node_session.DYING_BYTES_LIMIT + 4, [node_session.DYING_BYTES_LIMIT // 4 + 1], [1], f32]]))
    assert session.pending_error is None, session.pending_error
    big = weakref.ref(session.storages[0x3000])
    session.handle(Free(seq=4, storage_ids=[0x3000]))
    gc.collect()
    assert big() is None and not session.has_dying  # (past the bound: deallocated at once)
    session.close()
