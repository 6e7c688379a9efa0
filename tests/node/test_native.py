"""The node's C++ helpers (node/native.py) against the Python paths they stand in for.

Each case runs on two sessions, one made with the helpers and one without, and compares what
a client could observe: the tensor a descriptor decodes to (layout, storage, values), the
error a bad descriptor gets, what a stored result leaves in the session's tables, and the
allocation guard's cache keys."""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwire.node import native
from gpuwire.node.backend import Backend
from gpuwire.node.ops import OpTable
from gpuwire.node.session import NODE_ID_BASE, RngOwner, Session, SessionError, _signature
from gpuwire.protocol import codec
from gpuwire.protocol.events import Free, Op

from .test_session_fast_paths import F32, descriptor, upload

F16 = codec.DTYPE_CODES["float16"]
I64 = codec.DTYPE_CODES["int64"]
C64 = codec.DTYPE_CODES["complex64"]
BUILDS = shutil.which(os.environ.get("CXX", "c++")) is not None and os.environ.get("GPUWIRE_NATIVE", "1") != "0"


@pytest.fixture(scope="module", autouse=True)
def helpers():
    if not native.install():
        assert not BUILDS, f"this machine has a C++ compiler, yet the node's helpers did not build: {native.status()}"
        # no compiler (or GPUWIRE_NATIVE=0): there are no helpers to compare, and the node runs the
        # Python paths, which the rest of the suite tests; with a compiler this fails above instead
        pytest.skip(native.status())
    return native.module


def make_session(with_helpers: bool, budget: int | None = None) -> Session:
    backend = Backend.select("cpu")
    saved = native.module
    if not with_helpers:
        native.module = None
    try:
        session = Session(backend, RngOwner(backend), OpTable())
    finally:
        native.module = saved
    session.memory_budget = budget
    assert (session.decode_hook != session.ext_hook) is with_helpers
    return session


def both() -> tuple[Session, Session]:
    sessions = make_session(True), make_session(False)
    for session in sessions:
        upload(session, 0x1000, torch.arange(64, dtype=torch.float32))
        upload(session, 0x2000, torch.arange(8.0).to(torch.complex64) * (1 + 2j))
        # a first view of each dtype is Python's (it makes the base tensor views of that dtype
        # are made from): after these, the C++ hook decides every descriptor below
        for storage_id, code in ((0x1000, F32), (0x1000, F16), (0x1000, I64), (0x2000, C64)):
            assert decoded(session, descriptor(storage_id, 0, (1,), (1,), code))[0] == "tensor"
    fast = sessions[0]
    assert set(fast._view_bases) >= {F32, F16, I64, C64}
    return sessions


def decoded(session: Session, data: bytes):
    """What the connection hands the op for a descriptor: the tensor, or the error it records."""
    session.decode_error = None
    try:
        value = session.decode_hook(codec.EXT_TENSOR, data)
    except codec.DecodeError as exc:  # malformed: the whole frame is refused
        return ("decode error", str(exc))
    error, session.decode_error = session.decode_error, None
    if value is None:
        return ("error", type(error).__name__, str(error))
    storage = value.untyped_storage()
    try:
        # (str: NaN == NaN; a broadcast view of ~10^18 elements is compared by its layout alone: summing
        # it would take hours)
        values = str(value.tolist() if value.numel() < 100 else value.sum().item() if value.numel() <= 1 << 20
                     else "large")
    except (RuntimeError, NotImplementedError) as exc:  # (a negative bit on bools: no op can read it)
        values = str(exc)
    return ("tensor", value.dtype, tuple(value.shape), value.stride(), value.storage_offset(), value.is_conj(),
            value.is_neg(), value.data_ptr() - storage.data_ptr() if value.numel() else 0, values)


DESCRIPTORS = [
    (0x1000, 0, (8, 8), (8, 1)),
    (0x1000, 0, (8, 8), (8, 1)),  # again: the cached view
    (0x1000, 3, (4, 5), (1, 4)),  # transposed, offset
    (0x1000, 0, (2, 3, 4), (0, 4, 1)),  # broadcast (zero stride)
    (0x1000, 63, (), ()),  # a scalar at the last element
    (0x1000, 64, (0,), (1,)),  # empty, offset at the end (narrow of an edge)
    (0x1000, 0, (64,), (1,), I64),  # a reinterpretation that reaches past the end
    (0x1000, 0, (32,), (1,), I64),
    (0x1000, 0, (128,), (1,), F16),
    (0x1000, 1, (64,), (1,)),  # one past the end
    (0x1000, 0, (65,), (1,)),
    (0x1000, 0, (2, 2), (-1, 1)),  # negative stride
    (0x1000, 0, (2, 2), (1,)),  # sizes and strides disagree
    (0x1000, 0, (1 << 40, 1 << 40), (0, 0)),  # more elements than int64 counts
    (0x1000, 0, (4,), (1,), 250),  # unknown dtype code
    (0x2000, 0, (8,), (1,), C64),
    (0x2000, 0, (8,), (1,), C64, 1),  # conjugated
    (0x7777, 0, (1,), (1,)),  # never allocated
    (NODE_ID_BASE + 5, 0, (1,), (1,)),
]


@pytest.mark.parametrize("fields", DESCRIPTORS, ids=[str(d) for d in DESCRIPTORS])
def test_a_descriptor_decodes_to_what_the_python_hook_gives(fields):
    fast, python = both()
    data = descriptor(*fields)
    for _ in range(2):  # made, then cached
        assert decoded(fast, data) == decoded(python, data)


def test_malformed_descriptors_get_the_python_hooks_error():
    fast, python = both()
    for data in (b"", b"\x91\x01", b"\x96" + b"\xc0" * 6, descriptor(0x1000, 0, (2,), (1,))[:-1],
                 descriptor(0x1000, 0, (2,), (1,)) + b"\x00", b"\x96\xcd\x10\x00\x00\x91\x02\x91\x01\x05\x00"):
        assert decoded(fast, data) == decoded(python, data), data


def test_a_freed_or_replaced_storage_is_never_served_from_the_cache():
    for session in (make_session(True), make_session(False)):
        upload(session, 0x1000, torch.arange(8, dtype=torch.float32))
        data = descriptor(0x1000, 0, (8,), (1,))
        assert decoded(session, data)[-1] == str([float(i) for i in range(8)])
        session.handle(Free(seq=0, storage_ids=[0x1000]))
        assert decoded(session, data)[0] == "error"
        upload(session, 0x1000, torch.full((8,), 7.0))  # the same id, a new storage
        assert decoded(session, data)[-1] == str([7.0] * 8)
        # a view changed in place by a kernel (an out= argument resized) is rebuilt, not reused
        view = session.decode_hook(codec.EXT_TENSOR, descriptor(0x1000, 0, (2, 4), (4, 1)))
        view.as_strided_((4, 2), (2, 1))
        assert decoded(session, descriptor(0x1000, 0, (2, 4), (4, 1)))[2:4] == ((2, 4), (4, 1))


def tables(session: Session) -> tuple:
    return (sorted(session.storages), session.bytes_in_use, session.peak_bytes, len(session._live_ptrs),
            sorted(session._views), {k: len(v) for k, v in session._view_keys.items()})


def adopt_cases():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return [
        (a.clone(), [0x10, 48, [3, 4], [4, 1], F32]),  # as the kernel made it
        (a.t().contiguous().t(), [0x11, 48, [3, 4], [4, 1], F32]),  # other strides: copied
        (a[1:], [0x12, 32, [2, 4], [4, 1], F32]),  # an offset view: copied
        (a.clone(), [0x13, 48, [3, 4], [4, 1], I64]),  # another dtype: copied (converted)
        (torch.ones(1, 1).t(), [0x14, 4, [1, 1], [7, 7], F32]),  # one element, the client's strides
        (torch.ones(2, requires_grad=True) * 1, [0x15, 8, [2], [1], F32]),  # not cached as a view
        (a.clone(), [0x1000, 48, [3, 4], [4, 1], F32]),  # an id in use: replaced
        (a.clone(), [NODE_ID_BASE, 48, [3, 4], [4, 1], F32]),  # not a client id
        (a.clone(), [0x16, 48, [4, 3], [3, 1], F32]),  # not the predicted shape
        (a.clone(), (0x17, 48, [3, 4], [4, 1], F32)),  # not a list
        (a.clone(), [0x18, 96, [3, 4], [4, 1], F32]),  # declares more bytes than the kernel made
    ]


@pytest.mark.parametrize("case", range(len(adopt_cases())))
def test_a_result_is_stored_as_the_python_adopt_stores_it(case):
    outcomes = []
    for session in both():
        tensor, out = adopt_cases()[case]
        try:
            session._adopt(tensor, out)
            outcome = tables(session)
            if type(out[0]) is int and out[0] in session.storages:
                outcome += (decoded(session, descriptor(*out[:4], out[4])),)
        except (SessionError, torch.OutOfMemoryError) as exc:
            outcome = (type(exc).__name__, str(exc))
        outcomes.append(outcome)
    assert outcomes[0] == outcomes[1]


def test_a_result_past_the_budget_is_refused_as_python_refuses_it():
    outcomes = []
    for with_helpers in (True, False):
        session = make_session(with_helpers, budget=100)
        session._adopt(torch.ones(16), [0x1, 64, [16], [1], F32])
        with pytest.raises(torch.OutOfMemoryError) as refused:
            session._adopt(torch.ones(16), [0x2, 64, [16], [1], F32])
        outcomes.append((str(refused.value), tables(session)))
    assert outcomes[0] == outcomes[1]


def test_kernel_results_through_handle_match():
    outcomes = []
    for session in both():
        x = session.decode_hook(codec.EXT_TENSOR, descriptor(0x1000, 0, (8, 8), (8, 1)))
        session.handle(Op(seq=1, name="aten::native_layer_norm", args=[x, [8], None, None, 1e-5], kwargs={},
                          outs=[[0x30, 256, [8, 8], [8, 1], F32], [0x31, 32, [8, 1], [1, 1], F32],
                                [0x32, 32, [8, 1], [1, 1], F32]]))
        assert session.pending_error is None, session.pending_error
        outcomes.append((tables(session), [decoded(session, descriptor(0x30 + i, 0, s, st))
                                          for i, (s, st) in enumerate([((8, 8), (8, 1)), ((8, 1), (1, 1)),
                                                                       ((8, 1), (1, 1))])]))
    assert outcomes[0] == outcomes[1]


def test_the_guards_cache_key_is_pythons(helpers):
    t = torch.ones(2, 3)
    for args, kwargs, strided in [
        ([t, t.t(), 2, None, 1.5, True, [t, [1, 2]], "mean", torch.float16], {}, True),
        ([t], {"dim": [0, 1], "keepdim": False, "dtype": torch.int64}, True),
        ([t.t()], {"out": t}, False),
        ([], {}, True),
        ([torch.ones(2, dtype=torch.complex64), torch.tensor(3)], {"alpha": 2}, True),
    ]:
        native_key = helpers.signature("aten::x", args, kwargs, strided)
        python_key = _signature("aten::x", args, kwargs, strided)
        assert native_key == python_key and hash(native_key) == hash(python_key)
    assert helpers.signature("aten::x", [t], {}, True) != helpers.signature("aten::x", [t.t()], {}, True)
    assert helpers.signature("aten::x", [1], {}, True) != helpers.signature("aten::x", [True], {}, True)
    assert helpers.signature("aten::x", [1], {}, True) != helpers.signature("aten::x", [1.0], {}, True)


# descriptor fields a hostile client may send: around every bound the node checks
_INTS = st.one_of(st.integers(-3, 70), st.sampled_from([-(1 << 63), -(1 << 31), (1 << 31), (1 << 40), (1 << 62) - 1,
                                                        1 << 62, (1 << 62) + 1, (1 << 63) - 1, (1 << 64) - 1]))
_SMALL = st.integers(0, 9)  # views near the edge of the 64-float storage, in and out of bounds
_DESCRIPTORS = st.tuples(
    st.sampled_from([0x1000, 0x1000, 0x1000, 0x2000, 0x7777, NODE_ID_BASE, -1]), st.one_of(st.integers(0, 66), _INTS),
    st.one_of(st.lists(st.integers(0, 66), min_size=1, max_size=1), st.lists(_SMALL, max_size=3),
              st.lists(_INTS, max_size=5)),
    st.one_of(st.lists(st.integers(0, 2), min_size=1, max_size=1), st.lists(_SMALL, max_size=3),
              st.lists(_INTS, max_size=5)),
    st.one_of(st.sampled_from([F32, F32, F16, I64, C64]), _INTS), st.sampled_from([0, 0, 0, 1, 2, 3, 4, -1]))


_BOTH = None


@pytest.fixture(scope="module", autouse=True)
def _sessions_for_hypothesis(helpers):
    global _BOTH
    _BOTH = both()  # (one pair for all examples: decoding changes only the view cache)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=_DESCRIPTORS)
def test_any_descriptor_decodes_as_the_python_hook_decodes_it(fields):
    storage_id, offset, sizes, strides, dtype, flags = fields
    try:
        data = msgpack.packb((storage_id, offset, tuple(sizes), tuple(strides), dtype, flags), use_bin_type=True)
    except OverflowError:
        return  # not encodable: no client can send it
    fast, python = _BOTH
    for _ in range(2):
        assert decoded(fast, data) == decoded(python, data), fields


def test_a_result_in_memory_the_session_already_holds_is_copied():
    # an op that returns its input (or a view of it) as its result: the new id gets its own copy,
    # or freeing one id would free the other's memory
    outcomes = []
    for session in both():
        given = session.decode_hook(codec.EXT_TENSOR, descriptor(0x1000, 0, (64,), (1,)))
        session._adopt(given, [0x40, 256, [64], [1], F32])
        assert session.storages[0x40].data_ptr() != session.storages[0x1000].data_ptr()
        session.handle(Free(seq=0, storage_ids=[0x1000]))
        outcomes.append((tables(session), decoded(session, descriptor(0x40, 0, (64,), (1,)))))
    assert outcomes[0] == outcomes[1]


def test_a_node_says_which_paths_it_runs(node):
    from gpuwire.smi import fetch
    info, _ = fetch(node.address, None)
    # (a node process builds its own helpers: with a compiler here, it runs them)
    assert info["helpers"] == "native" if BUILDS else info["helpers"].startswith("python ("), info["helpers"]
