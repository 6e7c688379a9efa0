"""A session's memory budget: the client raises torch.OutOfMemoryError at the line that
over-allocates; the node enforces it regardless; other sessions are unaffected."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gpuwire
from gpuwire.client import wire
from gpuwire.client.runtime import Runtime


@pytest.fixture
def budget_node():
    from tests.conftest import NodeProcess
    node = NodeProcess("--session-memory", "1MiB")
    yield node
    node.kill()


def test_client_raises_oom_at_the_allocating_line(budget_node):
    code = textwrap.dedent(f"""
        import torch, gpuwire
        gpuwire.attach("{budget_node.address}")
        a = torch.zeros(150_000, device="gpuwire")           # 600 KB
        try:
            b = torch.zeros(150_000, device="gpuwire")       # would be 1.2 MB > 1 MiB
        except torch.OutOfMemoryError as e:
            print("OOM", "budget" in str(e))
        del a
        c = torch.ones(150_000, device="gpuwire")            # fits again once a is freed
        print("after", c.sum().item())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OOM True" in result.stdout, result.stderr
    assert "after 150000.0" in result.stdout


def test_node_enforces_the_budget_even_if_the_client_does_not(budget_node):
    greedy = Runtime(budget_node.address)
    greedy.memory_budget = None  # a client that ignores its budget
    greedy.allocate(800_000)
    greedy.allocate(800_000)
    with pytest.raises(torch.OutOfMemoryError, match="memory budget"):
        greedy.synchronize()
    polite = Runtime(budget_node.address)  # another tenant on the same node is unaffected
    sid = polite.allocate(900_000)
    polite.write(sid, 0, memoryview(b"\x01" * 16))
    assert bytes(polite.read(sid, 0, 16)) == b"\x01" * 16
    greedy.close()
    polite.close()


# ---------------------------------------------------------------- the node's meta check (issue 7)
#
# A hostile client declares small outputs (or none) for an op whose real output is huge. The node
# runs the op on meta tensors first and refuses it before allocating: the node process's peak
# resident memory (VmHWM, read from /proc) shows no allocation ever happened.

import time  # noqa: E402

from gpuwire.protocol.codec import DTYPE_CODES, pack_tensor_ref  # noqa: E402

F32 = DTYPE_CODES["float32"]
GiB = 1 << 30


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def _op(rt: Runtime, name: str, args, kwargs=None, outs=()):
    with wire.host_tensors_by_value():  # a hostile client sends host tensors wherever it likes
        rt.enqueue(rt.conn.encode_op(rt.next_seq(), name, args, kwargs or {}, [list(o) for o in outs]))
    rt.synchronize()


@pytest.mark.timeout(120)
def test_node_refuses_ops_whose_real_output_outgrows_the_declaration(budget_node):
    rt = Runtime(budget_node.address)
    rt.memory_budget = None  # a hostile client: it declares what it likes
    sid = rt.allocate(64)
    rt.write(sid, 0, memoryview(torch.arange(16, dtype=torch.float32).numpy()).cast("B"))
    x = pack_tensor_ref(sid, 0, (4, 4), (4, 1), F32)
    wide = pack_tensor_ref(sid, 0, (1 << 15, 1 << 13), (0, 0), F32)  # a 1 GiB view of 4 bytes: in bounds
    rt.synchronize()
    before = _peak_rss(budget_node.proc.pid)

    def small_out():
        return [[rt.reserve(64), 64, [4, 4], [4, 1], F32]]

    cases = [
        ("aten::repeat", [x, [1 << 12, 1 << 12]], {}, small_out(), r"aten::repeat would allocate 1GiB"),
        ("aten::contiguous", [wide], {}, small_out(), r"aten::contiguous would allocate 1GiB"),
        ("aten::clone", [wide], {}, small_out(), r"aten::clone would allocate 1GiB"),
        ("aten::new_empty", [x, [1 << 28]], {}, (), r"aten::new_empty would allocate 1GiB"),
        ("aten::add.Tensor", [pack_tensor_ref(sid, 0, (1 << 15, 1), (0, 1), F32),  # broadcasting
                              pack_tensor_ref(sid, 0, (1, 1 << 13), (1, 0), F32)], {}, (),
         r"aten::add.Tensor would allocate 1GiB"),
        ("aten::bincount", [torch.tensor([(1 << 27) - 1])], {}, (), r"aten::bincount would allocate 1GiB .*values"),
        ("gpuwire::forward_with_rng", ["aten::repeat", x, [1 << 12, 1 << 12]], {}, (),
         r"aten::repeat would allocate 1GiB"),
    ]
    for name, args, kwargs, outs, message in cases:
        with pytest.raises(torch.OutOfMemoryError, match=message) as info:
            _op(rt, name, args, kwargs, outs)
        assert "this session has left" in str(info.value), str(info.value)
    # an out= tensor of the wrong size: aten would grow its storage, outside the budget
    with pytest.raises(Exception, match=r"aten::add.out would resize an argument of shape \[4, 4\] to "
                                        r"\[32768, 8192\].*out= tensors of the result's shape"):
        _op(rt, "aten::add.out", [wide, 1], {"out": x})

    after = _peak_rss(budget_node.proc.pid)
    assert after - before < 256 << 20, f"the node's peak memory grew by {(after - before) >> 20} MiB"
    # the session goes on, its data intact; the same ops at honest sizes run
    assert torch.equal(torch.frombuffer(bytearray(rt.read(sid, 0, 64)), dtype=torch.float32),
                       torch.arange(16, dtype=torch.float32))
    out = rt.reserve(256)
    _op(rt, "aten::repeat", [x, [2, 2]], {}, [[out, 256, [8, 8], [8, 1], F32]])
    got = torch.frombuffer(bytearray(rt.read(out, 0, 256)), dtype=torch.float32).reshape(8, 8)
    assert torch.equal(got, torch.arange(16, dtype=torch.float32).reshape(4, 4).repeat(2, 2))
    rt.close()


@pytest.mark.timeout(180)
def test_honest_programs_pass_the_meta_check(budget_node):
    """Ops of every path (structured out=, functional, in-place, views, value-sized, composite)
    at honest sizes run under a budget and match CPU bit for bit."""
    code = textwrap.dedent(f"""
        import torch, gpuwire
        gpuwire.attach("{budget_node.address}")
        g = torch.Generator().manual_seed(0)
        a = torch.randn(16, 8, generator=g); b = torch.randn(8, 16, generator=g); i = torch.tensor([3, 1, 3, 0])
        def run(dev):
            x, y, idx = a.to(dev), b.to(dev), i.to(dev)
            out = torch.empty(16, 16, device=dev)
            torch.mm(x, y, out=out)
            z = x.repeat(2, 3) + 1
            z.mul_(2)
            w = torch.cat([x, x.t().contiguous().t()], 0).sum(0)
            e = x.expand(2, 16, 8).contiguous()
            r = torch.repeat_interleave(x[:2], torch.tensor([1, 2], device=dev), dim=0)
            return [out, z, w, e, r, torch.bincount(idx), torch.nn.functional.one_hot(idx), x.new_zeros(3, 3),
                    torch.add(x, x[0], out=torch.empty(16, 8, device=dev)), (x @ y).softmax(-1)]
        ref, got = run("cpu"), run("gpuwire")
        print("EQUAL", all(torch.equal(r, g.cpu()) for r, g in zip(ref, got)))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150)
    assert "EQUAL True" in result.stdout, result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_attention_is_sized_from_its_shapes(budget_node):
    """The node's SDPA ops are sized from their arguments' shapes (no meta run per new shape):
    honest calls of changing lengths run; an output that would outgrow the session, declared
    small, is refused before it allocates."""
    rt = Runtime(budget_node.address)
    rt.memory_budget = None
    sid = rt.allocate(4096)
    rt.write(sid, 0, memoryview(torch.full((1024,), 0.5).numpy()).cast("B"))
    rt.synchronize()
    before = _peak_rss(budget_node.proc.pid)
    for length in (3, 4, 5):  # a growing key/value cache
        q = pack_tensor_ref(sid, 0, (1, 2, 1, 8), (16, 8, 8, 1), F32)
        kv = pack_tensor_ref(sid, 0, (1, 2, length, 8), (16 * length, 8 * length, 8, 1), F32)
        out = rt.reserve(64)
        _op(rt, "gpuwire::sdpa", [q, kv, kv, None, 0.0, False, None, False], {},
            [[out, 64, [1, 2, 1, 8], [16, 8, 8, 1], F32]])
        got = torch.frombuffer(bytearray(rt.read(out, 0, 64)), dtype=torch.float32)
        assert torch.equal(got, torch.full((16,), 0.5))
    huge_q = pack_tensor_ref(sid, 0, (1 << 12, 2, 1 << 13, 8), (0, 0, 0, 1), F32)  # 2 GiB of output
    kv = pack_tensor_ref(sid, 0, (1, 2, 4, 8), (64, 32, 8, 1), F32)
    # (a query batch of 4096 over keys of batch 1 is no fused kernel's layout: the math path's
    # 4096 x 2 x 8192 x 4 float32 matrices, 2 GiB, come on top)
    with pytest.raises(torch.OutOfMemoryError, match=r"gpuwire::sdpa would allocate 4GiB .*2GiB of it the attention"):
        _op(rt, "gpuwire::sdpa", [huge_q, kv, kv, None, 0.0, False, None, False], {},
            [[rt.reserve(64), 64, [1, 2, 1, 8], [16, 8, 8, 1], F32]])
    assert _peak_rss(budget_node.proc.pid) - before < 256 << 20
    rt.close()


@pytest.mark.timeout(60)
def test_attention_math_path_temporaries_are_counted(budget_node):
    """SDPA with dropout takes the math path on a CPU node: B x H x L x S attention matrices
    that are temporaries, not results. A long sequence is refused before it allocates (it
    would otherwise grow the node past its budget, up to the OOM killer); the same shapes
    without dropout (the flash kernel, O(L) memory) run."""
    rt = Runtime(budget_node.address)
    rt.memory_budget = None
    sid = rt.allocate(64)
    rt.write(sid, 0, memoryview(torch.full((16,), 0.25).numpy()).cast("B"))
    rt.synchronize()
    before = _peak_rss(budget_node.proc.pid)

    def qkv(length):  # (1, 2, length, 8) views of 8 floats: in bounds, no memory
        return pack_tensor_ref(sid, 0, (1, 2, length, 8), (0, 0, 0, 1), F32)

    def out_decl(length):
        return [[rt.reserve(64 * length), 64 * length, [1, 2, length, 8], [16 * length, 8 * length, 8, 1], F32]]

    long = qkv(8192)  # 2 x 8192 x 8192 floats: 512 MiB a matrix, 2 GiB with dropout's
    with pytest.raises(torch.OutOfMemoryError, match=r"gpuwire::sdpa would allocate 2(\.0)?GiB .*attention matrices of "
                                                     r"SDPA's math path") as info:
        _op(rt, "gpuwire::sdpa", [long, long, long, None, 0.5, False, None, False], {}, out_decl(8192))
    assert "drop attention dropout" in str(info.value)
    with pytest.raises(torch.OutOfMemoryError, match="attention matrices"):
        _op(rt, "gpuwire::sdpa_backward", [qkv(8192), long, long, long, None, 0.5, False, None, False, False,
                                           None], {}, ())
    assert _peak_rss(budget_node.proc.pid) - before < 256 << 20
    # no dropout: the CPU flash kernel, which needs no matrix; and short sequences with dropout
    _op(rt, "gpuwire::sdpa", [qkv(4096), qkv(4096), qkv(4096), None, 0.0, False, None, False], {}, out_decl(4096))
    out = out_decl(16)
    _op(rt, "gpuwire::sdpa", [qkv(16), qkv(16), qkv(16), None, 0.5, False, None, False], {}, out)
    got = torch.frombuffer(bytearray(rt.read(out[0][0], 0, 64 * 16)), dtype=torch.float32)
    # each output: 0.25 (every value) times the sum of the kept attention weights (1/16 each, kept ones x2)
    assert all((value * 32).is_integer() and 0 <= value <= 0.5 for value in got.tolist())
    assert _peak_rss(budget_node.proc.pid) - before < 256 << 20
    rt.close()


@pytest.mark.timeout(60)
def test_ops_over_views_larger_than_the_device_are_refused_unrun(budget_node):
    """A zero-stride view passes the bounds check however large it is; a kernel over a view
    larger than the device's whole memory would hold the device for every session."""
    rt = Runtime(budget_node.address)
    sid = rt.allocate(64)
    astronomic = pack_tensor_ref(sid, 0, (1 << 20, 1 << 20, 1 << 10), (0, 0, 0), F32)  # 4 PiB of one float
    started = time.monotonic()
    for name, args in (("aten::sum.dim_IntList", [astronomic, [0, 1, 2], False]),
                       ("aten::fill_.Scalar", [astronomic, 1.0])):  # in place: checked too
        with pytest.raises(Exception, match=rf"{name} was given a tensor of 4096TiB \(a broadcast view\), more than "
                                            r"this device's .* of memory"):
            _op(rt, name, args, {}, [[rt.reserve(64), 4, [], [], F32]] if name.startswith("aten::sum") else ())
    assert time.monotonic() - started < 10
    rt.close()


@pytest.mark.timeout(60)
def test_call_sync_ops_are_guarded_too(budget_node):
    rt = Runtime(budget_node.address)
    sid = rt.allocate(64)
    before = _peak_rss(budget_node.proc.pid)
    with pytest.raises(torch.OutOfMemoryError, match=r"aten::repeat would allocate 1GiB"):
        rt.call_sync("aten::repeat", [pack_tensor_ref(sid, 0, (4, 4), (4, 1), F32), [1 << 12, 1 << 12]], {})
    assert _peak_rss(budget_node.proc.pid) - before < 256 << 20
    rt.close()
