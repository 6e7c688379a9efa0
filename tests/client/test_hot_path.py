"""The client's per-op hot path: how fresh tensors are made and tracked, how tensors are
described on the wire, and when queued commands are written."""

import socket

import msgpack
import pytest
import torch

import gpuwire
from gpuwire import _io
from gpuwire.client import device as dev
from gpuwire.client import runtime as runtime_module
from gpuwire.client import torch_module, wire


def _rt():
    return dev.current_runtime()


def test_fresh_results_sit_on_their_own_remote_storage(device):
    x = torch.randn(6, 5)
    d = x.to(device)
    y = d + 1  # a cached structured op: contiguous result, storage filled in place
    y = d + 1
    storage = y.untyped_storage()
    assert y.data_ptr() == storage.data_ptr() and storage.nbytes() == 6 * 5 * 4
    assert y.stride() == (5, 1) and y.storage_offset() == 0
    assert storage.data_ptr() in _rt()._live
    # views of it are bounds-checked against that size, and read back as local
    assert torch.equal(y[2:].t().cpu(), (x + 1)[2:].t())
    z = y.t() * 2  # a non-contiguous input: the result layout is C++'s
    assert torch.equal(z.cpu(), (x + 1).t() * 2)


def test_wrap_storage_with_offset_or_strides_of_its_own(device):
    rt = _rt()
    with rt.lock:
        sid = rt.allocate(4 * 24)
        t = dev.wrap_storage(rt, sid, 4 * 24, (3, 4), (1, 3), torch.float32, offset=2)
    assert t.stride() == (1, 3) and t.storage_offset() == 2 and t.untyped_storage().nbytes() == 96
    assert t.untyped_storage().data_ptr() == sid
    t.copy_(torch.arange(12.0).reshape(3, 4))
    assert torch.equal(t.cpu(), torch.arange(12.0).reshape(3, 4))


def test_freed_storages_are_forgotten(device):
    rt = _rt()
    gpuwire.synchronize()
    before = rt.live_storages
    kept = [torch.ones(3, device=device) * i for i in range(5)]
    assert rt.live_storages >= before + 5
    assert all(isinstance(ref, runtime_module.StorageRef) for ref in rt._live.values())
    ref = rt._live[kept[0].untyped_storage().data_ptr()]
    assert not ref.expired()
    del kept
    gpuwire.synchronize()
    assert rt.live_storages == before


def test_tensor_descriptor_matches_tensor_ext(device):
    x = torch.randn(4, 6, dtype=torch.complex64).to(device)
    cases = [x, x[1:], x[:, 2:].t(), x.conj(), torch.ops.aten._neg_view.default(x[2:]), x[0:0],
             torch.ops.aten._neg_view.default(x[1:].conj())]
    for t in cases:
        assert wire.encode_default(t) == wire.tensor_ext(t)
    storage_id, offset, sizes, strides, _dtype, flags = msgpack.unpackb(wire.encode_default(cases[-1]).data)
    assert (storage_id, offset, sizes, strides, flags) == (dev.storage_id_of(x), 6, [3, 6], [6, 1], 3)
    assert torch.equal(cases[-1].cpu(), torch.ops.aten._neg_view.default(x.cpu()[1:].conj()))


def test_tensor_lists_are_keyed_and_encoded_in_one_pass_like_single_tensors(device):
    x = torch.randn(4, 6, dtype=torch.complex64).to(device)
    items = [x, x[1:], x[:, 2:].t(), x.conj(), torch.ops.aten._neg_view.default(x[2:]), x[0:0]]
    key, encoded, storage_ids = wire.encode_device_tensors(items)
    assert encoded == [wire.encode_default(t) for t in items]  # the node's view cache sees the same bytes
    assert storage_ids == [dev.storage_id_of(x)] * len(items)
    assert [k[3] for k in key] == [0, 0, 0, 1, 2, 0]  # conj / neg bits
    # anything but gpuwire tensors: the general path decides (and raises or sends by value)
    assert wire.encode_device_tensors([x, torch.ones(2)]) is None
    assert wire.encode_device_tensors([x, 1.5]) is None


def test_foreach_ops_match_cpu_as_list_layouts_and_dtypes_change(device):
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 3, 2)]
    host = [torch.randn(s) for s in shapes]
    remote = [h.to(device) for h in host]
    for step in range(3):
        # the same call with other layouts, dtypes and lengths must not reuse a cached layout
        views = [t.t() if t.dim() == 2 else t for t in remote[:step + 1]]
        host_views = [t.t() if t.dim() == 2 else t for t in host[:step + 1]]
        got, want = torch._foreach_sqrt(torch._foreach_abs(views)), torch._foreach_sqrt(torch._foreach_abs(host_views))
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride() and torch.equal(g.cpu(), w)
        torch._foreach_lerp_(remote, [t * 2 for t in remote], 0.25)
        torch._foreach_lerp_(host, [t * 2 for t in host], 0.25)
        assert all(torch.equal(r.cpu(), h) for r, h in zip(remote, host))
    doubles = [t.double() for t in remote]
    torch._foreach_mul_(doubles, 3.0)
    assert all(torch.equal(d.cpu(), h.double() * 3.0) for d, h in zip(doubles, host))
    assert torch.equal(torch.cat(remote[1:2] * 3).cpu(), torch.cat(host[1:2] * 3))


def test_an_in_place_foreach_op_drops_the_clients_copies_of_its_lists(device):
    torch._foreach_add_([torch.zeros(3, dtype=torch.int64, device=device)], 1)  # (now cached: one pass)
    counts = torch.tensor([1, 2, 3]).to(device)  # uploaded integers: the client knows their values
    flags = torch.tensor([True, False]).to(device)
    assert counts.tolist() == [1, 2, 3]
    torch._foreach_add_([counts], 1)
    assert counts.tolist() == [2, 3, 4]
    torch._foreach_mul_([counts.float(), flags.int()], 2)  # fresh results: nothing known changes
    assert flags.tolist() == [True, False]


def test_a_foreach_list_across_devices_runs_tensor_by_tensor_as_on_cuda(device):
    # (CUDA's foreach kernels take their slow path there: each tensor updated where it lives)
    remote, host = torch.ones(3, device=device), torch.ones(3)
    for _ in range(2):
        torch._foreach_add_([remote, host], 1)
    assert torch.equal(remote.cpu(), torch.full((3,), 3.0)) and torch.equal(host, torch.full((3,), 3.0))
    results = torch._foreach_mul([remote, host], 2)
    assert wire.on_device(results[0]) and results[1].is_cpu and torch.equal(results[1], torch.full((3,), 6.0))


def test_device_guard_type():
    assert torch_module.Guard().type_() == torch._C._autograd.DeviceType.PrivateUse1


@pytest.fixture
def clocked_flushes(device, monkeypatch):
    """(how many frames each send carried, ``op_after(seconds, x)``: advance the client's clock,
    then queue ``x.add_(1)``)."""
    clock = [1000.0]
    monkeypatch.setattr(runtime_module, "_perf_counter", lambda: clock[0])
    flushes = []
    real = runtime_module.send_parts
    monkeypatch.setattr(runtime_module, "send_parts", lambda sock, parts: flushes.append(len(parts)) or real(sock, parts))

    def op_after(seconds, x):
        clock[0] += seconds
        x.add_(1)
    return flushes, op_after


def test_a_queued_command_waits_its_age_for_company_then_goes_with_the_next(device, monkeypatch, clocked_flushes):
    x = torch.ones(4, device=device)
    x.add_(1)
    gpuwire.synchronize()
    flushes, queue_after = clocked_flushes
    flushes.clear()  # (the setup's own sends)
    rt = _rt()
    age = runtime_module.FLUSH_AGE  # GPUWIRE_FLUSH_AGE_US=200: a fixed age
    monkeypatch.setattr(rt, "_flush_age", age)
    monkeypatch.setattr(rt, "_flush_age_first", age)
    monkeypatch.setattr(rt, "_flush_age_max", age)

    def op_after(seconds):
        queue_after(seconds, x)

    op_after(0)  # opens a batch
    op_after(age * 0.9)
    assert flushes == []
    op_after(age * 0.2)  # the batch's first command waited past its age
    assert flushes == [3]
    op_after(0)
    op_after(age * 1.5)  # a fixed age: no back-off
    assert flushes == [3, 2]
    monkeypatch.setattr(rt, "_flush_age", 0.0)  # GPUWIRE_FLUSH_AGE_US=0: each command at once
    monkeypatch.setattr(rt, "_flush_age_max", 0.0)
    op_after(0)
    op_after(0)
    assert flushes == [3, 2, 1, 1]
    gpuwire.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 9.0))


def test_after_a_sync_point_the_first_commands_go_at_once_then_the_age_ramps(device, monkeypatch, clocked_flushes):
    # the defaults (GPUWIRE_FLUSH_EAGER=32, GPUWIRE_FLUSH_AGE_US=25:200): right after a sync
    # point the node has nothing left to run, so the first commands go out each at once (a
    # step's upload and embedding, while the client runs the model's Python before its next
    # op), then soon; batches grow as the client gets ahead
    x = torch.ones(4, device=device)
    gpuwire.synchronize()
    flushes, queue_after = clocked_flushes
    rt = _rt()
    assert (rt._flush_age_first, rt._flush_age_max) == (25e-6, 200e-6)  # (unset GPUWIRE_FLUSH_AGE_US)
    # (unset GPUWIRE_FLUSH_EAGER: 32 for a GPU node; a CPU-backend node, as here, shares the
    # client's cores, and 0 measured faster there: set to a GPU node's default to test it)
    assert rt._flush_eager == (0 if rt.device_info.get("backend") == "cpu" else 32)
    monkeypatch.setattr(rt, "_flush_eager", runtime_module.FLUSH_EAGER)
    gpuwire.synchronize()  # (a sync point with nothing queued sends only its own frame)
    flushes.clear()

    def op_after(seconds):
        queue_after(seconds, x)

    for _ in range(32):
        op_after(1e-3)  # however long the client takes between them: none waits for the next
    assert flushes == [1] * 32
    flushes.clear()
    assert rt._flush_age == 25e-6
    waited = []
    for _ in range(5):
        age = rt._flush_age
        op_after(0)
        op_after(age * 1.01)  # the batch's first command waited just past the age: out it goes
        waited.append(round(age * 1e6))
    assert waited == [25, 50, 100, 200, 200] and flushes == [2] * 5
    gpuwire.synchronize()  # the node caught up: the next commands go at once again
    flushes.clear()
    op_after(0)
    assert flushes == [1]
    gpuwire.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 44.0))


def test_without_eager_sends_the_age_starts_small_after_each_sync_point(device, monkeypatch, clocked_flushes):
    x = torch.ones(4, device=device)
    rt = _rt()
    monkeypatch.setattr(rt, "_flush_eager", 0)  # GPUWIRE_FLUSH_EAGER=0
    gpuwire.synchronize()
    flushes, queue_after = clocked_flushes
    gpuwire.synchronize()
    flushes.clear()
    assert rt._flush_age == 25e-6
    queue_after(0, x)
    queue_after(10e-6, x)
    assert flushes == []  # (waits for company)
    queue_after(20e-6, x)
    assert flushes == [3] and rt._flush_age == 50e-6
    gpuwire.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 4.0))


def test_the_eager_count_is_read_from_the_environment_and_a_bad_value_says_what_to_give(monkeypatch):
    monkeypatch.delenv("GPUWIRE_FLUSH_EAGER", raising=False)
    assert runtime_module.configured_flush_eager() == runtime_module.configured_flush_eager("cuda") == 32
    assert runtime_module.configured_flush_eager("cpu") == 0  # (a CPU node: sends cost both ends cores)
    for text, expected in (("0", 0), ("8", 8), (" 64 ", 64)):
        monkeypatch.setenv("GPUWIRE_FLUSH_EAGER", text)
        assert runtime_module.configured_flush_eager() == runtime_module.configured_flush_eager("cpu") == expected
    for bad in ("many", "-1", "1.5", "1000001"):
        monkeypatch.setenv("GPUWIRE_FLUSH_EAGER", bad)
        with pytest.raises(ValueError, match="GPUWIRE_FLUSH_EAGER.*sync point"):
            runtime_module.configured_flush_eager()


def test_the_flush_age_is_set_in_microseconds_and_a_bad_value_says_what_to_give(monkeypatch):
    monkeypatch.delenv("GPUWIRE_FLUSH_AGE_US", raising=False)
    assert runtime_module.configured_flush_age() == (25e-6, 200e-6)
    for text, expected in (("50", (50e-6, 50e-6)), ("0", (0.0, 0.0)), ("25:200", (25e-6, 200e-6))):
        monkeypatch.setenv("GPUWIRE_FLUSH_AGE_US", text)
        assert runtime_module.configured_flush_age() == pytest.approx(expected)
    for bad in ("fast", "-5", "1e9", "200:25", "1:2:3"):
        monkeypatch.setenv("GPUWIRE_FLUSH_AGE_US", bad)
        with pytest.raises(ValueError, match="GPUWIRE_FLUSH_AGE_US.*microseconds"):
            runtime_module.configured_flush_age()


def test_send_parts_joins_small_frames_and_keeps_bulk_buffers():
    a, b = socket.socketpair()
    try:
        frames = [b"ab", b"", b"cde"]
        assert _io.send_parts(a, frames) == 5
        assert b.recv(16) == b"abcde"
        payload = memoryview(bytearray(b"xyz" * 10))
        assert _io.send_parts(a, [b"head", payload, b"tail"]) == 38
        got = b""
        while len(got) < 38:
            got += b.recv(64)
        assert got == b"head" + b"xyz" * 10 + b"tail"
        assert _io.send_parts(a, []) == 0
    finally:
        a.close()
        b.close()


def test_dtype_and_layout_copies_on_the_device_are_one_message_equal_to_cpu(device):
    """``_to_copy`` from the device to the device (``.to(dtype)``, ``.half()``, autocast's
    casts, ``.to(memory_format=...)``) is one op message with its result layout computed here;
    values, dtypes, shapes and strides equal a CPU run's, for dense, strided, broadcast,
    offset, channels-last and conjugated sources."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 3, 5, 6, generator=g) * 300
    cases = [
        (lambda t: t, {"dtype": torch.bfloat16}),
        (lambda t: t, {"dtype": torch.float16}),
        (lambda t: t, {"dtype": torch.int32}),
        (lambda t: t > 0, {"dtype": torch.float32}),
        (lambda t: t.transpose(1, 3), {"dtype": torch.float64}),
        (lambda t: t[1:, :, 2:4], {"dtype": torch.bfloat16}),
        (lambda t: t[:, :1].expand(4, 7, 5, 6), {"dtype": torch.float16}),
        (lambda t: t.contiguous(memory_format=torch.channels_last), {"dtype": torch.float16}),
        (lambda t: t, {"dtype": torch.float32, "memory_format": torch.channels_last}),
        (lambda t: t.transpose(0, 2), {"memory_format": torch.contiguous_format}),
        # (PyTorch's Conjugate fallback resolves the bit first: one message more, as before)
        (lambda t: t[..., 0].to(torch.complex64).conj(), {"dtype": torch.complex128}),
        (lambda t: t.flatten()[:0], {"dtype": torch.float16}),
    ]
    rt = _rt()
    for make, kwargs in cases:
        local = make(base)
        remote = make(base.to(device))
        gpuwire.synchronize()
        commands = rt.seq
        got = remote.to(**kwargs)
        want = local.to(**kwargs)
        assert rt.seq - commands <= (2 if local.is_conj() else 1), kwargs  # (an Alloc and a copy_ before)
        assert got.is_conj() == want.is_conj() and got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), kwargs
        assert torch.equal(got.cpu(), want), kwargs
    # the values the client knows of a host upload (integers) stay known through a cast: no round trip
    lengths = torch.tensor([3, 1, 2]).to(device)
    gpuwire.synchronize()
    trips = rt.round_trips
    assert lengths.long().to(torch.int32).tolist() == [3, 1, 2] and lengths.tolist() == [3, 1, 2]
    assert rt.round_trips == trips
    # autograd through the cast: the gradient comes back in the source's dtype
    w = torch.randn(5, 3, generator=g)
    wd = w.to(device).requires_grad_()
    (wd.to(torch.float64) * 2).sum().backward()
    assert wd.grad.dtype == torch.float32 and torch.equal(wd.grad.cpu(), torch.full((5, 3), 2.0))


def test_host_scalar_tensors_arrive_with_their_dtype_and_value(device):
    """A 0-dim CPU tensor among an op's arguments travels by value (``inline_ext``; a fast path
    for numpy-packable dtypes): the same bytes as the general path, and the op's result equals
    CPU's, type promotion included."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    xd = x.to(device)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.bool, torch.uint8, torch.complex64):
        s = torch.tensor(3, dtype=dtype)
        general = msgpack.ExtType(wire.codec.EXT_INLINE_TENSOR, msgpack.packb(
            (wire.DTYPE_CODE[dtype], (), bytes(s.reshape(1).view(torch.uint8).numpy())), use_bin_type=True))
        assert wire.inline_ext(s) == general, dtype
        got = (xd * s).cpu()
        want = x * s
        assert got.dtype == want.dtype and torch.equal(got, want), dtype
    conj = torch.tensor(1 + 2j, dtype=torch.complex64).conj()  # a lazy bit: resolved by the general path
    assert torch.equal((xd * conj).cpu(), x * conj)


def test_an_empty_upload_sends_no_bytes_and_behaves_as_on_cpu(device):
    """``torch.tensor([], device=...)`` (two a layer in every Hugging Face forward, for the KV
    cache) is one Alloc and no Write; ops on it, ``cat`` above all, give CPU's results."""
    rt = _rt()
    gpuwire.synchronize()
    commands = rt.seq
    empty = torch.tensor([], dtype=torch.float32, device=device)
    assert rt.seq - commands == 1 and empty.shape == (0,) and empty.dtype == torch.float32
    keys = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    got = torch.cat([empty, keys.to(device)], dim=-2)
    assert torch.equal(got.cpu(), torch.cat([torch.tensor([]), keys], dim=-2))
    assert empty.cpu().shape == (0,) and torch.zeros(0, 5).to(device).cpu().shape == (0, 5)
    # an empty integer tensor's values are known: reading them is no round trip
    ids = torch.tensor([], dtype=torch.int64, device=device)
    trips = rt.round_trips
    assert ids.tolist() == [] and ids.cpu().dtype == torch.int64 and rt.round_trips == trips


def test_host_to_device_copies_take_the_direct_path_with_aten_layouts(device, monkeypatch):
    """``x.to(device)`` of a contiguous host tensor (a batch, every weight of ``model.to``) is an
    Alloc and a Write, made directly rather than through aten's composite; the result's dtype,
    shape and strides are aten's (the ``meta`` device's answer: source strides under
    ``preserve_format``, odd strides of size-1 dimensions included), its values the source's."""
    taken = []
    direct = dev._to_copy_from_host
    monkeypatch.setattr(dev, "_to_copy_from_host", lambda src, kwargs: taken.append(direct(src, kwargs)) or taken[-1])
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(3, 4, generator=g),
        torch.randn(2, 1, 3, generator=g).as_strided((2, 1, 3), (3, 7, 1)),  # contiguous, odd stride on a size-1 dim
        torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),  # not contiguous: aten's
        torch.randn(4, 3, generator=g).t(),  # not contiguous: aten's
        torch.randn(4, generator=g).to(torch.complex64).conj(),  # the bit is resolved, as aten's copy_ does
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.arange(10, dtype=torch.int64),
        torch.rand(6, generator=g) > 0.5,
    ]
    rt = _rt()
    for x in cases:
        for kwargs in ({}, {"memory_format": torch.contiguous_format}, {"memory_format": torch.preserve_format},
                       {"non_blocking": True}):
            gpuwire.synchronize()
            commands, ops = rt.seq, rt.ops_sent
            got = x.to(device, **kwargs)
            want = x.to("meta", **{k: v for k, v in kwargs.items() if k != "non_blocking"})
            if x.is_contiguous():
                # (an Alloc, a Write, a Free of the previous result)
                assert taken[-1] is not None and rt.ops_sent == ops and rt.seq - commands <= 3, (x.shape, kwargs)
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), (x.shape, kwargs)
            assert not got.is_conj() and torch.equal(got.cpu(), x.resolve_conj()), (x.shape, kwargs)
    assert taken.count(None) >= 8  # the non-contiguous sources went to aten's kernel
    # a weight uploaded this way trains as a local one: autograd sees the host leaf
    w = torch.randn(3, generator=g, requires_grad=True)
    (w.to(device) * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_device_to_host_copies_keep_aten_layouts(device):
    """``y.cpu()`` of a small device tensor reads it directly when its layout is plain
    contiguous, and through aten otherwise: either way dtype, shape, strides (odd strides of
    size-1 dimensions included) and values are what the same copy gives on CPU."""
    g = torch.Generator().manual_seed(1)
    cases = [
        torch.randn(3, 4, generator=g),
        torch.randn(2, 1, 3, generator=g).as_strided((2, 1, 3), (3, 7, 1)),
        torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),
        torch.randn(4, 3, generator=g).t(),
        torch.tensor(7, dtype=torch.int64),
        torch.zeros(0, 2),
    ]
    for x in cases:
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        y.copy_(x)
        for kwargs in ({}, {"memory_format": torch.contiguous_format}, {"non_blocking": True}):
            got = y.to("cpu", **kwargs)
            want = x.to("meta", **{k: v for k, v in kwargs.items() if k != "non_blocking"})
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), (x.stride(), kwargs)
            assert torch.equal(got, x), kwargs
        assert y.tolist() == x.tolist()
