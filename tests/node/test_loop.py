"""The node's native op loop (node/loop.py) against the Python path it stands in for.

Every case sends the same Op frames, as a client's connection encodes them, through two node
connections: one bound to a session with the loop, one to a session without it. A frame's
first sight teaches the loop the op, its second the argument signature, and from the third on
the loop runs it from the frame's bytes; the two sessions must then hold the same results
(values, dtypes, layouts), the same tables and the same pending error, and the loop's counters
must show that it ran the frames it was meant to."""

from __future__ import annotations

import os

import pytest
import torch

from gpuwire.node import loop as node_loop
from gpuwire.node import native
from gpuwire.node.backend import Backend
from gpuwire.node.ops import OpTable
from gpuwire.node.session import RanOp, RngOwner, Session
from gpuwire.protocol import NEED_DATA, Connection, Role, codec
from gpuwire.protocol.events import Alloc, Device, DType, Hello, Layout, MemoryFormat, Op, Sync, TensorRef, Welcome, Write

from .test_native import BUILDS


@pytest.fixture(scope="module", autouse=True)
def loop_module():
    native.install()
    if node_loop.module is None:
        assert not BUILDS or os.environ.get("GPUWIRE_NODE_LOOP") == "0", \
            f"this machine has a C++ compiler, yet the node's op loop did not build: {node_loop.status()}"
        pytest.skip(node_loop.status())  # (no compiler: the Python path is the rest of the suite's)
    return node_loop.module


class Node:
    """A session behind a server connection, fed the bytes a client connection sends."""

    def __init__(self, with_loop: bool, budget: int | None = None):
        backend = Backend.select("cpu")
        saved = node_loop.module
        if not with_loop:
            node_loop.module = None
        try:
            self.session = Session(backend, RngOwner(backend), OpTable())
        finally:
            node_loop.module = saved
        assert (self.session.op_runner is not None) is with_loop
        self.session.memory_budget = budget
        self.conn = Connection(Role.SERVER)
        self.conn.receive_data(Connection(Role.CLIENT).send(Hello()))
        assert isinstance(self.conn.next_event(), Hello)
        self.conn.bind(ext_hook=self.session.decode_hook, payload_sink=self.session.payload_sink,
                       op_runner=self.session.op_runner, op_frames_runner=self.session.op_frames_runner)
        self.conn.send(Welcome())
        self.ran = 0  # events for frames the loop ran (one for all the frames it ran at once)

    def feed(self, data: bytes) -> list:
        self.conn.receive_data(data)
        replies = []
        while (event := self.conn.next_event()) is not NEED_DATA:
            self.ran += type(event) is RanOp
            reply = self.session.handle(event)
            if reply is not None:
                replies.append(reply)
        return replies

    def values(self, storage_id: int, dtype: torch.dtype, shape, strides=None) -> torch.Tensor:
        storage = self.session.storages[storage_id]
        view = torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides or torch.empty(shape).stride())
        return view.clone()

    def tables(self) -> tuple:
        s = self.session
        return (sorted(s.storages), s.bytes_in_use, s.ops_run,
                None if s.pending_error is None else (s.pending_error.exc_type, s.pending_error.message))


class Pair:
    """One client connection's frames, fed to a node with the loop and one without."""

    def __init__(self, budget: int | None = None):
        self.client = Connection(Role.CLIENT)
        self.client.send(Hello())
        self.client.receive_data(Connection(Role.SERVER).send(Welcome()))
        self.client.next_event()
        self.fast, self.python = Node(True, budget), Node(False, budget)
        self.seq = 0
        self.next_id = 0x10000

    def send(self, event) -> list:
        return self.send_bytes(self.client.send(event))

    def send_bytes(self, data: bytes) -> list:
        got = self.fast.feed(data)
        assert [type(r).__name__ for r in got] == [type(r).__name__ for r in self.python.feed(data)]
        return got

    def upload(self, values: torch.Tensor) -> TensorRef:
        storage_id, self.next_id = self.next_id, self.next_id + 0x1000
        data = values.contiguous().view(torch.uint8).numpy().tobytes()
        self.send(Alloc(seq=self.next_seq(), storage_id=storage_id, nbytes=len(data), overwrite=True))
        self.send(Write(seq=self.next_seq(), storage_id=storage_id, byte_offset=0, payload=data))
        return TensorRef(storage_id, 0, tuple(values.shape), tuple(values.contiguous().stride()),
                         codec.DTYPE_CODES[str(values.dtype).removeprefix("torch.")])

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def op(self, name: str, args: list, kwargs: dict | None = None, result=None) -> tuple | None:
        """Run ``name``; ``result`` (a CPU tensor shaped like its one result) declares an output."""
        storage_id, frame = self.op_frame(name, args, kwargs, result)
        self.send_bytes(frame)
        return storage_id

    def op_frame(self, name: str, args: list, kwargs: dict | None = None, result=None) -> tuple:
        """(the result's storage id or None, the frame's bytes) of an op, not sent yet."""
        outs, storage_id = [], None
        if result is not None:
            storage_id, self.next_id = self.next_id, self.next_id + 0x1000
            nbytes = result.numel() * result.element_size()
            outs = [[storage_id, nbytes, list(result.shape), list(result.stride()),
                     codec.DTYPE_CODES[str(result.dtype).removeprefix("torch.")]]]
        return storage_id, self.client.send(Op(seq=self.next_seq(), name=name, args=args, kwargs=kwargs or {}, outs=outs))

    def same(self) -> None:
        assert self.fast.tables() == self.python.tables()


def ref_of(t: TensorRef, sizes, strides, offset=0) -> TensorRef:
    return TensorRef(t.storage_id, offset, tuple(sizes), tuple(strides), t.dtype)


def runs(pair: Pair, name: str, make_args, expected, times: int = 4, kwargs=None) -> None:
    """Send op ``name`` ``times`` times (``make_args(i)``: the i-th call's arguments); each result
    must equal ``expected(i)`` (a CPU tensor) on both nodes, and the loop must have run every
    call from the third on."""
    ran = []
    for i in range(times):
        want = expected(i)
        before = pair.fast.ran
        out = pair.op(name, make_args(i), kwargs(i) if callable(kwargs) else kwargs, result=want)
        ran.append(pair.fast.ran - before)
        for node in (pair.fast, pair.python):
            got = node.values(out, want.dtype, want.shape, want.stride())
            assert torch.equal(got, want), (name, i, got, want)
        pair.same()
    # (the op may be known from an earlier case: entries are the node's, signatures too)
    assert ran[0] == 0 and ran[2:] == [1] * (times - 2), f"{name}: the loop ran calls {ran}"
    assert pair.python.ran == 0


def test_ops_run_by_the_loop_equal_the_python_path_bit_for_bit():
    pair = Pair()
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    w, b = torch.randn(6, 3), torch.randn(3)
    rx, ry, rw, rb = pair.upload(x), pair.upload(y), pair.upload(w), pair.upload(b)
    runs(pair, "aten::add.Tensor", lambda i: [rx, ry], lambda i: torch.add(x, y, alpha=2), kwargs={"alpha": 2})
    runs(pair, "aten::addmm", lambda i: [rb, rx, rw], lambda i: torch.addmm(b, x, w, beta=0.5, alpha=1.5),
         kwargs={"beta": 0.5, "alpha": 1.5})
    # a Python number where the op takes a tensor: a wrapped number (an int tensor times 0.5 is float32)
    ints = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    ri = pair.upload(ints)
    runs(pair, "aten::mul.Tensor", lambda i: [ri, 0.1 + i], lambda i: ints * (0.1 + i))
    runs(pair, "aten::add.Tensor", lambda i: [ri, 7], lambda i: ints + 7)
    # a transposed view, a list of tensors and a dim
    xt = ref_of(rx, (6, 4), (1, 6))
    runs(pair, "aten::cat", lambda i: [[xt, xt]], lambda i: torch.cat([x.t(), x.t()], 1), kwargs={"dim": 1})
    # a dim list, keepdim and a dtype
    runs(pair, "aten::sum.dim_IntList", lambda i: [rx, [1], True], lambda i: x.sum(1, keepdim=True, dtype=torch.float64),
         kwargs={"dtype": DType(codec.DTYPE_CODES["float64"])})
    # Tensor?[] with a None (x[:, idx])
    idx = torch.tensor([5, 0, 2])
    ridx = pair.upload(idx)
    runs(pair, "aten::index.Tensor", lambda i: [rx, [None, ridx]], lambda i: x[:, idx])
    # SymInt[] sizes; a cast with a dtype, a layout, a device and a memory format
    runs(pair, "aten::repeat", lambda i: [rx, [2, 1, 3]], lambda i: x.repeat(2, 1, 3))
    as_f64 = {"dtype": DType(codec.DTYPE_CODES["float64"]), "layout": Layout(codec.LAYOUT_NAMES.index("strided")),
              "device": Device("cuda", 0), "memory_format": MemoryFormat(codec.MEMORY_FORMAT_NAMES.index("preserve_format"))}
    runs(pair, "aten::_to_copy", lambda i: [xt], lambda i: x.t().to(torch.float64), kwargs=as_f64)


def test_in_place_and_scalar_lists_whose_values_change_every_call():
    pair = Pair()
    x = torch.randn(5)
    rx = pair.upload(x)
    before = pair.fast.ran
    expected = x.clone()
    for i in range(5):
        pair.op("aten::add_.Tensor", [rx, rx], {"alpha": 0.25 * i})  # (no result: in place)
        expected.add_(expected, alpha=0.25 * i)
        pair.same()
    for node in (pair.fast, pair.python):
        assert torch.equal(node.values(rx.storage_id, torch.float32, (5,)), expected)
    assert pair.fast.ran - before == 3  # the value of alpha is not part of the signature
    # an optimizer's step: a new list of scalars every call
    a, b = torch.randn(3), torch.randn(4)
    ra, rb = pair.upload(a), pair.upload(b)
    before = pair.fast.ran
    for i in range(4):
        scalars = [1.0 + i, 2.0 - i / 3]
        pair.op("aten::_foreach_div_.ScalarList", [[ra, rb], scalars])
        a, b = a / scalars[0], b / scalars[1]
        pair.same()
    assert pair.fast.ran - before == 2
    for node in (pair.fast, pair.python):
        assert torch.equal(node.values(ra.storage_id, torch.float32, (3,)), a)
        assert torch.equal(node.values(rb.storage_id, torch.float32, (4,)), b)


def test_a_kernel_error_is_the_same_pending_error():
    pair = Pair()
    num, den = pair.upload(torch.tensor([6, 8], dtype=torch.int64)), pair.upload(torch.tensor([3, 2], dtype=torch.int64))
    zero = pair.upload(torch.tensor([3, 0], dtype=torch.int64))
    for i in range(3):
        pair.op("aten::div.Tensor_mode", [num, den], {"rounding_mode": "floor"}, result=torch.zeros(2, dtype=torch.int64))
    ran = pair.fast.ran
    pair.op("aten::div.Tensor_mode", [num, zero], {"rounding_mode": "floor"}, result=torch.zeros(2, dtype=torch.int64))
    assert pair.fast.ran == ran + 1  # (the loop ran it, and reported its failure)
    assert pair.fast.session.pending_error is not None
    assert pair.fast.session.pending_error.exc_type == "RuntimeError"
    assert "ZeroDivisionError" in pair.fast.session.pending_error.message
    pair.same()  # the same error, and the failed op's output exists on both (zeroed)
    errors = pair.send(Sync(seq=pair.next_seq()))
    assert [type(e).__name__ for e in errors] == ["Error"]


def test_a_learned_signature_past_the_budget_goes_to_the_python_guard():
    pair = Pair(budget=4096)
    rx = pair.upload(torch.randn(64))  # 256 bytes
    for i in range(3):
        pair.op("aten::mul.Tensor", [rx, rx], result=torch.zeros(64))
    ran = pair.fast.ran
    assert ran >= 1  # (mul may be known from an earlier case: then twice)
    for node in (pair.fast, pair.python):
        node.session.memory_budget = node.session.bytes_in_use + 100  # no room for another result
    pair.op("aten::mul.Tensor", [rx, rx], result=torch.zeros(64))
    assert pair.fast.ran == ran  # the loop left it to Python, which refuses it
    assert pair.fast.session.pending_error.exc_type == "OutOfMemoryError"
    pair.same()


def test_what_the_loop_never_runs():
    pair = Pair()
    x = torch.randn(8)
    rx = pair.upload(x)
    before = dict(node_loop.module.stats())
    for i in range(4):  # random numbers: the device generator is the Python path's
        pair.op("aten::bernoulli.p", [rx, 0.5], result=torch.zeros(8))
        # out=: the guard keys it without strides, and restores layouts after the call
        pair.op("aten::abs.out", [rx], {"out": rx})
    assert pair.fast.ran == 0
    pair.same()
    after = node_loop.module.stats()
    assert after["not eligible"] - before["not eligible"] >= 6
    # a frame at or below the replay floor (resent after a reconnect) is the session loop's to skip
    for i in range(3):
        pair.op("aten::neg", [rx], result=torch.zeros(8))
    ran = pair.fast.ran
    pair.fast.session.replay_floor = pair.seq + 1
    pair.op("aten::neg", [rx], result=torch.zeros(8))
    assert pair.fast.ran == ran


def frames_ran() -> int:
    return node_loop.module.stats()["ran"]


def test_frames_that_arrive_together_run_at_once_and_equal_the_python_path():
    """A client sends its queue in one write: the loop runs the Op frames that follow one
    another in the receive buffer in one call (one event for all of them), stops at a frame it
    does not run (a new op: Python's), which the Python path runs, and goes on after it."""
    pair = Pair()
    torch.manual_seed(1)
    x, y = torch.randn(16), torch.randn(16)
    rx, ry = pair.upload(x), pair.upload(y)
    expected = x.clone()
    for i in range(2):  # the op, then its signature, learned one frame at a time
        pair.op("aten::add_.Tensor", [rx, ry], {"alpha": 0.5})
        expected.add_(y, alpha=0.5)
    events, before = pair.fast.ran, frames_ran()
    chunk = b"".join(pair.op_frame("aten::add_.Tensor", [rx, ry], {"alpha": 0.5 + i})[1] for i in range(40))
    pair.send_bytes(chunk)
    for i in range(40):
        expected.add_(y, alpha=0.5 + i)
    assert frames_ran() - before == 40
    assert pair.fast.ran - events < 40  # (one event a millisecond of frames at most)
    pair.same()
    # a frame the loop does not run, between two runs of frames it does
    pair.op("aten::add_.Tensor", [rx, ry])  # (a signature without alpha: learned by running it)
    expected.add_(y)
    events, before = pair.fast.ran, frames_ran()
    parts = [pair.op_frame("aten::add_.Tensor", [rx, ry])[1] for _ in range(5)]
    out, frame = pair.op_frame("aten::atan2", [rx, ry], result=torch.zeros(16))  # a new op
    parts.append(frame)
    parts += [pair.op_frame("aten::add_.Tensor", [rx, ry])[1] for _ in range(5)]
    pair.send_bytes(b"".join(parts))
    for _ in range(5):
        expected.add_(y)
    expected_atan2 = torch.atan2(expected, y)
    for _ in range(5):
        expected.add_(y)
    assert frames_ran() - before == 10
    assert 2 <= pair.fast.ran - events < 10
    for node in (pair.fast, pair.python):
        assert torch.equal(node.values(rx.storage_id, torch.float32, (16,)), expected)
        assert torch.equal(node.values(out, torch.float32, (16,)), expected_atan2)
    pair.same()
    # frames after a failing one still run, and the failure is the same pending error
    num = pair.upload(torch.tensor([6, 8], dtype=torch.int64))
    den, zero = pair.upload(torch.tensor([3, 2])), pair.upload(torch.tensor([3, 0]))
    for _ in range(2):
        pair.op("aten::div.Tensor_mode", [num, den], {"rounding_mode": "floor"}, result=torch.zeros(2, dtype=torch.int64))
    before = node_loop.module.stats()
    parts = [pair.op_frame("aten::div.Tensor_mode", [num, d], {"rounding_mode": "floor"},
                           result=torch.zeros(2, dtype=torch.int64))[1] for d in (den, zero, den)]
    pair.send_bytes(b"".join(parts))
    after = node_loop.module.stats()
    assert (after["ran"] - before["ran"], after["failed"] - before["failed"]) == (1, 1)
    assert "ZeroDivisionError" in pair.fast.session.pending_error.message
    pair.same()  # (the frame after the failure: the Python path's, as when frames come one by one)


def test_a_frame_cut_by_the_end_of_what_arrived_waits_for_its_rest():
    pair = Pair()
    x = torch.randn(8)
    rx = pair.upload(x)
    for _ in range(2):
        pair.op("aten::neg_", [rx])
    before = frames_ran()
    chunk = b"".join(pair.op_frame("aten::neg_", [rx])[1] for _ in range(3))
    cut = len(chunk) - 5
    pair.send_bytes(chunk[:cut])
    assert frames_ran() - before == 2  # the third waits for its last bytes
    pair.send_bytes(chunk[cut:])
    assert frames_ran() - before == 3
    for node in (pair.fast, pair.python):
        assert torch.equal(node.values(rx.storage_id, torch.float32, (8,)), -x)  # (five negations)
    pair.same()


def test_a_node_says_whether_it_runs_the_loop(node):
    from gpuwire.smi import fetch
    info, _ = fetch(node.address, None)
    # (a node process builds its own loop: with a compiler here, it runs it)
    assert info["op_loop"] == "native" if BUILDS else info["op_loop"].startswith("python ("), info["op_loop"]
    if BUILDS:  # what it ran, and why the rest went to Python
        assert {"ran", "new op", "new signature", "not eligible", "failed"} <= set(info["op_loop_frames"])
