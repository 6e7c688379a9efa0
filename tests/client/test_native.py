"""gpuwire's native client helpers (client/native.py): the device guard and tensor descriptors in
C++, installed when a program attaches, built once per machine, and the Python paths kept
wherever they cannot be built."""

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import msgpack

from gpuwire.client import native, torch_module, wire

# a training step whose gradients the child prints, then which guard served it
PROGRAM = textwrap.dedent("""
    import torch, gpuwire
    from gpuwire.client import native
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).to("gpuwire")
    model(torch.randn(4, 8).to("gpuwire")).square().mean().backward()
    print([p.grad.cpu().sum().item() for p in model.parameters()])
    print(native.status())
""")


# where no C++ compiler or no torch headers exist, gpuwire runs on the Python guard (tested below)
needs_a_compiler = pytest.mark.skipif(
    not shutil.which(os.environ.get("CXX", "c++")) or not (Path(torch.__file__).parent / "include" / "c10").is_dir(),
    reason="no C++ compiler or no torch headers here: the Python guard serves")


def _run(node, **env):
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPUWIRE_NODE": node.address, **env})
    assert done.returncode == 0, done.stderr
    grads, guard = done.stdout.strip().splitlines()[-2:]
    return grads, guard


@needs_a_compiler
def test_the_cpp_guard_serves_backward_without_calling_python(device, monkeypatch):
    assert native.install() and native.status() == "native"
    calls = []
    answer = torch_module.Guard.type_
    monkeypatch.setattr(torch_module.Guard, "type_", lambda self: calls.append(1) or answer(self))
    x = torch.randn(5, 3, requires_grad=True)
    y = x.to(device)
    (y.sin() * y).sum().backward()
    local = x.detach().clone().requires_grad_()
    (local.sin() * local).sum().backward()
    assert torch.equal(x.grad, local.grad)
    assert calls == []  # (the Python guard answered ~6 calls an autograd node before)


@needs_a_compiler
def test_without_a_compiler_or_when_turned_off_python_trains_the_same(node, device, tmp_path):
    off, guard = _run(node, GPUWIRE_NATIVE="0")
    assert guard == "python (GPUWIRE_NATIVE=0)"
    broken, guard = _run(node, CXX=str(tmp_path / "no-such-compiler"), GPUWIRE_CACHE_DIR=str(tmp_path / "cache"))
    assert guard.startswith("python (") and "no-such-compiler" in guard and broken == off
    # and the same gradients as the C++ guard gives, here
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).to(device)
    model(torch.randn(4, 8).to(device)).square().mean().backward()
    assert native.status() == "native" and str([p.grad.cpu().sum().item() for p in model.parameters()]) == off
    assert not list((tmp_path / "cache").glob("*.partial"))  # nothing half-written left behind


@needs_a_compiler
def test_a_first_attach_builds_both_client_helpers_side_by_side(node, tmp_path):
    """On a machine with no build yet, the first attach builds the op kernels' helper and the
    autocast helper at the same time (two compilers), and both then serve."""
    cache = tmp_path / "cache"
    program = textwrap.dedent("""
        import torch, gpuwire
        from gpuwire.client import autocast, native
        x = torch.randn(4, 8).to("gpuwire")
        with torch.autocast("gpuwire", dtype=torch.bfloat16):
            y = x @ x.t()
        print(native.status(), autocast.status(), y.dtype)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "GPUWIRE_NODE": node.address, "GPUWIRE_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["native", "native", "torch.bfloat16"]
    assert sorted(path.name.split("-")[0] for path in cache.iterdir()) == ["gpuwire_autocast", "gpuwire_native"]


def test_a_python_error_in_a_backward_on_the_device_thread_reaches_the_caller(device):
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("from the backward")

    x = torch.ones(3, device=device, requires_grad=True)
    try:
        Fails.apply(x).sum().backward()
    except ValueError as exc:
        assert "from the backward" in str(exc)
    else:
        raise AssertionError("the backward's error was lost")
    (x * 3).sum().backward()  # the device thread goes on
    assert torch.equal(x.grad.cpu(), torch.full((3,), 3.0))


@needs_a_compiler
def test_native_descriptors_are_the_bytes_python_packs(device):
    assert native.install()
    x = torch.randn(4, 6, dtype=torch.complex64).to(device)
    big = torch.zeros(300, 70000, dtype=torch.uint8, device=device)  # (offsets past 2**16 and 2**32 bytes apart)
    cases = [x, x[1:], x[:, 2:].t(), x.conj(), torch.ops.aten._neg_view.default(x[2:]), x[0:0], x[0, 0],
             big[200:], big[:, 40000:], big.view(-1)[1234567:], torch.nn.Parameter(torch.ones(3, device=device)),
             torch.ones(1, device=device).expand(5, 2)]
    cases += [torch.zeros(2, 3, dtype=dtype, device=device) for dtype in (
        torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
        torch.complex128)]
    for t in cases:
        assert native.module.encode_default(t) == wire.encode_default(t), (t.shape, t.dtype)
    assert native.module.encode_device_tensors(cases) == wire.python_encode_device_tensors(cases)
    # anything else goes to the Python hook, which raises or encodes it as before
    assert native.module.encode_device_tensors([x, torch.ones(2)]) is None
    assert native.module.encode_default(1.5j) == wire.encode_default(1.5j)
    with pytest.raises(wire.HostTensorArgument):
        native.module.encode_default(torch.ones(2))
    assert msgpack.unpackb(native.module.encode_default(big[200:]).data)[1] == 200 * 70000


def _kernel_source(qualified: str) -> str:
    return next(line for line in torch._C._dispatch_dump_table(qualified).splitlines() if line.startswith("PrivateUse1:"))


@needs_a_compiler
def test_view_ops_run_in_cpp_and_give_what_cpu_gives(device):
    from gpuwire.client import device as client_device
    assert native.install()
    # the ops whose Python kernel redispatched to CPU's metadata kernel now have the C++ one
    for qualified in ("aten::view", "aten::as_strided", "aten::unfold", "aten::_reshape_alias",
                      "aten::view_as_real", "aten::set_.source_Storage_storage_offset"):
        assert "native.cpp" in _kernel_source(qualified), qualified
    assert "device.py" in _kernel_source("aten::_foreach_add_.Scalar")  # (ops the C++ kernels do not serve)
    assert client_device._view_library is None

    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    remote = base.to(device)
    cases = [
        lambda t: t.view(-1), lambda t: t.view(2, 3, 8), lambda t: t.t(), lambda t: t[1:, 2:].as_strided((2, 3), (1, 4), 5),
        lambda t: t.unfold(1, 3, 2), lambda t: t.reshape(8, 6), lambda t: t.view(torch.int32), lambda t: t[:, 1],
        lambda t: t.split(3, dim=1)[2], lambda t: t.unsqueeze(0).expand(2, 6, 8), lambda t: t.permute(1, 0)[::2],
        lambda t: torch.view_as_real(t.to(torch.complex64)), lambda t: t.diagonal(offset=1),
    ]
    for case in cases:
        want, got = case(base), case(remote)
        assert got.device == remote.device and (got.shape, got.stride(), got.storage_offset()) == \
            (want.shape, want.stride(), want.storage_offset())
        assert torch.equal(got.cpu(), want)
    view = remote.view(-1)[5:9]
    view.fill_(-1.0)  # (a view shares its base's memory)
    assert torch.equal(remote.cpu().view(-1)[5:9], torch.full((4,), -1.0))
    with pytest.raises(RuntimeError) as remote_error:
        remote.t().view(-1)
    with pytest.raises(RuntimeError) as local_error:
        base.t().view(-1)
    assert str(remote_error.value) == str(local_error.value)
    # gradients through views, on autograd's device thread
    x = torch.randn(4, 6, requires_grad=True)
    y = x.detach().to(device).requires_grad_()
    for t in (x, y):
        (t.view(6, 4).t().unfold(0, 2, 1) * torch.arange(3.0).view(3, 1, 1).to(t.device)).sum().backward()
    assert torch.equal(y.grad.cpu(), x.grad)


# calls of ops the native op kernels serve, each compared with CPU bit for bit; every one runs
# three times (the first teaches the kernel its signature, the others take the C++ path)
OP_CASES = [
    ("add", lambda x, y: x + y), ("add alpha", lambda x, y: torch.add(x, y, alpha=2.5)),
    ("add int", lambda x, y: x + 3), ("add float", lambda x, y: 1.5 + x), ("add bool", lambda x, y: x + True),
    ("sub", lambda x, y: x - y), ("mul scalar", lambda x, y: x * -0.25), ("rsub", lambda x, y: 2 - x),
    ("div floor", lambda x, y: torch.div(x, y + 3, rounding_mode="floor")),
    ("div", lambda x, y: x / (y.abs() + 1)), ("pow", lambda x, y: x ** 3), ("pow tensor", lambda x, y: x.abs() ** y),
    ("mm", lambda x, y: x @ y.t()), ("addmm", lambda x, y: torch.addmm(x[:, 0], x, y.t(), beta=0.5, alpha=2)),
    ("gelu tanh", lambda x, y: torch.nn.functional.gelu(x, approximate="tanh")), ("gelu", lambda x, y: torch.nn.functional.gelu(x)),
    ("clamp min", lambda x, y: x.clamp(min=-0.1)), ("clamp both", lambda x, y: x.clamp(-0.2, 0.3)),
    ("mean dim dtype", lambda x, y: x.mean(dim=(0,), keepdim=True, dtype=torch.float64)),
    ("softmax", lambda x, y: torch.softmax(x, dim=-1)), ("log_softmax", lambda x, y: torch.log_softmax(x, 0)),
    ("leaky_relu", lambda x, y: torch.nn.functional.leaky_relu(x, 0.3)), ("cumsum", lambda x, y: x.cumsum(1, dtype=torch.float64)),
    ("triu", lambda x, y: x.triu(1)), ("argmax", lambda x, y: x.argmax()), ("argmax dim", lambda x, y: x.argmax(1, keepdim=True)),
    ("gather", lambda x, y: x.gather(1, (y.abs() * 3).long() % 5)), ("where-ish", lambda x, y: torch.maximum(x, y)),
    ("transposed input", lambda x, y: x.t() * y.t()), ("sliced input", lambda x, y: x[1:, 2:].exp() + y[:3, :3]),
    ("expanded input", lambda x, y: x[:1].expand(4, 5) + y), ("0-dim", lambda x, y: x[0, 0] * y[1, 1]),
    ("empty", lambda x, y: x[:0] + y[:0]), ("int", lambda x, y: (x * 10).long() * 3 + 1),
    ("float64", lambda x, y: x.double().sin()), ("half", lambda x, y: x.half() * y.half()),
    ("bfloat16", lambda x, y: x.bfloat16().tanh()), ("bitwise", lambda x, y: (x > 0).int() & (y > 0).int()),
    ("int sum (mirrored)", lambda x, y: (x * 10).long().sum(1)), ("float sum", lambda x, y: x.sum(1, keepdim=True)),
    # several results
    ("layer_norm", lambda x, y: torch.nn.functional.layer_norm(x, (5,), y[0], y[1])),
    ("max dim", lambda x, y: x.max(1)), ("sort", lambda x, y: x.sort(1, descending=True)), ("topk", lambda x, y: x.topk(2)),
    ("nll_loss", lambda x, y: torch.nn.functional.nll_loss(x.log_softmax(1), (y[:, 0].abs() * 3).long() % 5)),
    # ops whose kernels hand calls to a FunctionalPlan: Scalars count by value, factories, memory formats
    ("clone", lambda x, y: x.t().clone()), ("clone contiguous", lambda x, y: x.t().clone(memory_format=torch.contiguous_format)),
    ("clone channels_last", lambda x, y: x.view(1, 2, 2, 5).clone(memory_format=torch.channels_last)),
    ("zeros", lambda x, y: torch.zeros(3, 2, device=y.device) + x[:3, :2]),
    ("full float then int", lambda x, y: (torch.full((2, 3), 1.5, device=x.device), torch.full((2, 3), 7, device=x.device))),
    ("arange 3 then 5", lambda x, y: (torch.arange(3, device=x.device), torch.arange(5, device=x.device),
                                      torch.arange(1.0, 2.0, 0.25, device=x.device))),
    ("ones_like", lambda x, y: torch.ones_like(x, dtype=torch.float64)), ("empty_like zeroed", lambda x, y: torch.zeros_like(x.t())),
    ("eye", lambda x, y: torch.eye(3, 4, device=x.device)),
    ("casts", lambda x, y: (x.to(torch.bfloat16), x.t().half(), x.double(), x.to(torch.int32), x.bool())),
    ("cast to channels_last", lambda x, y: x.view(1, 2, 2, 5).to(torch.float16, memory_format=torch.channels_last)),
    ("to and from the host", lambda x, y: (x.to("cpu", torch.float64).to(x.device), x.cpu().to(y.device, torch.float16))),
    # in place on the first argument, which comes back
    ("add_", lambda x, y: x.add_(y, alpha=2)), ("mul_ scalar", lambda x, y: x.mul_(-0.5)), ("clamp_", lambda x, y: x.clamp_(min=0)),
    ("in place on a view", lambda x, y: (x[1:, 2:].mul_(3), x)[1]), ("in place, int", lambda x, y: (x * 4).long().add_(3)),
    # in place, not structured (a MutatingPlan checks a signature once, then C++ sends it)
    ("relu_", lambda x, y: x.relu_()), ("relu_ on a view", lambda x, y: (x.t()[1:].relu_(), x)[1]),
    ("hardtanh_", lambda x, y: torch.nn.functional.hardtanh_(x, -0.5, 0.25)),
    ("relu6 in place", lambda x, y: torch.nn.functional.relu6(x * 8, inplace=True)),
    ("zero_", lambda x, y: (x[1:3].zero_(), x)[1] + y), ("fill_", lambda x, y: (x[:, 1].fill_(2.5), x)[1]),
    ("fill_ int", lambda x, y: (x * 4).long().fill_(-7)),
    # composites sent whole (fused.COMPOSITES_SENT_WHOLE), a FunctionalPlan each
    ("masked_fill", lambda x, y: x.masked_fill(y > 0, float("-inf"))), ("F.pad", lambda x, y: torch.nn.functional.pad(x, (1, 2))),
    ("logsumexp", lambda x, y: x.logsumexp(1)), ("repeat", lambda x, y: x.t().repeat(2, 1)),
    ("bce with logits", lambda x, y: torch.nn.functional.binary_cross_entropy_with_logits(x, y.sigmoid())),
    # a Tensor?[] argument: indexing by tensors (``x[idx]``, ``x[:, idx]``, ``x[rows, cols]``)
    ("index", lambda x, y: x[(y[:, 0].abs() * 3).long() % 4]),
    ("index two dims", lambda x, y: x[(y[:, 0].abs() * 3).long() % 4, (y[:, 1].abs() * 4).int() % 5]),
    ("index after a slice", lambda x, y: x.t()[:, (y[0].abs() * 4).long() % 4]),
    ("index by a mask", lambda x, y: x[y > 0]),
    # a Tensor[] argument
    ("cat", lambda x, y: torch.cat([x, y, x[:1]])), ("cat dim 1, strided", lambda x, y: torch.cat([x.t(), y.t()[:, 1:]], 1)),
    ("cat promotes", lambda x, y: torch.cat([x, y.double()])), ("stack", lambda x, y: torch.stack([x, y], -1)),
    ("cat of a conj view", lambda x, y: torch.cat([x.to(torch.complex64).conj(), y.to(torch.complex64)]).resolve_conj()),
    ("layer_norm backward", lambda x, y: torch.ops.aten.native_layer_norm_backward(y, x, (5,), x.mean(1, keepdim=True),
                                                                                   x.var(1, keepdim=True), y[0], y[1],
                                                                                   [True, False, True])),
]


@needs_a_compiler
@pytest.mark.parametrize("name, case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_native_op_kernels_give_what_cpu_gives(device, name, case):
    assert native.install()
    torch.manual_seed(0)
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    want = case(x.clone(), y.clone())  # (an in-place case writes its arguments)
    for _ in range(3):
        got = case(x.to(device), y.to(device))
        for g, w in zip(*((r,) if isinstance(r, torch.Tensor) else tuple(r) for r in (got, want))):
            if w is None:  # (a result its output mask left out)
                assert g is None
                continue
            assert g.device.type == "gpuwire" and (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
            assert torch.equal(g.cpu(), w), name


@needs_a_compiler
def test_an_index_by_tensors_is_sent_from_cpp_and_one_by_a_mask_is_not(device):
    """``x[idx]`` (``index.Tensor``, a ``Tensor?[]`` of indices) took the Python path on every
    call: 8.5 us against 3. A mask's result size is its count of True values, which only the
    node knows: each such call asks Python (the node), never a cached layout."""
    from gpuwire.client import device as client_device
    assert native.install()
    submitted = []

    def submit(*args):
        address = client_device._native_submit(*args)
        if args[0] == "aten::index.Tensor" and address is not None:
            submitted.append(args[0])
        return address

    with _watched_op_kernels(client_device._native_learn, submit):
        host = torch.randn(6, 5)
        x = host.to(device)
        for k in range(6):
            rows = torch.tensor([k, 0, 5])
            assert torch.equal(x[rows.to(device)].cpu(), host[rows])
        assert len(submitted) >= 4
        del submitted[:]
        for k in range(6):  # (one signature, a different count each call)
            mask = torch.arange(6) < k
            assert torch.equal(x[mask.to(device)].cpu(), host[mask])
            assert torch.equal(x[:, mask[:5].to(device)].cpu(), host[:, mask[:5]])
        assert submitted == []
        assert torch.equal(x[torch.tensor([1, 4])].cpu(), host[[1, 4]])  # (host indices: as CUDA takes them)
        with pytest.raises(IndexError, match="out of bounds|index 6 is out of bounds"):
            x[torch.tensor([6], device=device)].cpu()


@needs_a_compiler
def test_a_learned_signature_is_sent_from_cpp_and_anything_new_asks_python(device):
    from gpuwire.client import device as client_device
    assert native.install()
    learned, submitted = [], []

    def learn(plan, args, kwargs):
        answer = client_device._native_learn(plan, args, kwargs)
        name = getattr(plan, "qualified", None) or plan.name
        if name == "aten::mul.Tensor":
            learned.append((name, answer[1] is not None))
        return answer

    def submit(*args):
        if args[0] == "aten::mul.Tensor":
            submitted.append(args[0])
        return client_device._native_submit(*args)

    with _watched_op_kernels(learn, submit):
        x = torch.randn(3, 4, device=device)
        for _ in range(4):
            x * 2.0
        assert learned == [("aten::mul.Tensor", True)] and submitted == ["aten::mul.Tensor"] * 3
        x * 3  # (an int: another kind of number, another signature)
        x[:, :2] * 2.0  # (other strides)
        assert learned[1:] == [("aten::mul.Tensor", True)] * 2 and len(submitted) == 3
        assert native.module.op_cache_sizes()["aten::mul.Tensor"] >= 3
        with pytest.raises(RuntimeError, match="must match the size"):
            x * torch.randn(5, 4, device=device)  # (a new signature: the composite's own error)
        with pytest.raises(RuntimeError, match="same device|cpu"):
            x * torch.ones(3, 4)  # (a host tensor: the Python path's refusal, as on CUDA)


@contextlib.contextmanager
def _watched_op_kernels(learn, submit=None):
    """The native op kernels with ``learn`` (and ``submit``) in place of the runtime's hooks,
    starting with no signature learned (earlier tests in this process taught it some)."""
    from gpuwire.client import device as client_device
    native.module.configure_ops(learn, submit or client_device._native_submit, client_device._native_submit_many,
                                wire.codec.EXT_TENSOR, client_device._native_tables())
    native.module.clear_op_caches()
    try:
        yield
    finally:
        native.module.configure_ops(client_device._native_learn, client_device._native_submit,
                                    client_device._native_submit_many, wire.codec.EXT_TENSOR, client_device._native_tables())


@needs_a_compiler
def test_an_in_place_op_that_is_not_structured_is_checked_once_then_sent_from_cpp(device):
    # ``relu_`` (every ``nn.ReLU(inplace=True)``) took the Python in-place path on every call:
    # 6 us against ``add_``'s 3.6 on the C++ one
    from gpuwire.client import device as client_device
    assert native.install()
    learned = []

    def learn(plan, args, kwargs):
        answer = client_device._native_learn(plan, args, kwargs)
        if getattr(plan, "qualified", None) == "aten::relu_":
            learned.append(answer[1])
        return answer

    with _watched_op_kernels(learn):
        x = torch.randn(3, 4, device=device)
        for _ in range(4):
            x.relu_()
        assert learned == [()]  # (checked once, then served by C++: nothing fresh to declare)
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            torch.zeros(3, 1, device=device).expand(3, 4).relu_()  # (another signature: checked)
        with pytest.raises(RuntimeError, match="Boolean inputs not supported for relu"):
            torch.zeros(3, dtype=torch.bool, device=device).relu_()
        values = torch.tensor([3, -1, 2], device=device)
        assert values.sum().item() == 4  # (the client now knows the values: mirrored)
        values.relu_()
        values.relu_()
        assert values.sum().item() == 5 and values.tolist() == [3, 0, 2]  # (the C++ path dropped them)


@needs_a_compiler
def test_masked_fill_checks_each_new_value_against_the_dtype_on_the_cpp_path(device):
    # (served by C++ once a signature is learned: its C++ key holds the value, so a new value is
    # checked by the plan first, as ATen checks it on the host)
    assert native.install()
    x = torch.arange(20, dtype=torch.uint8, device=device).view(4, 5)
    mask = x > 9
    for _ in range(3):
        assert x.masked_fill(mask, 3).cpu().tolist() == torch.arange(20, dtype=torch.uint8).view(4, 5).masked_fill(
            mask.cpu(), 3).tolist()
    with pytest.raises(RuntimeError, match="value cannot be converted to type uint8_t without overflow"):
        x.masked_fill(mask, 256)


@needs_a_compiler
def test_native_results_are_tensors_like_pythons_and_are_freed(device):
    import gpuwire
    from gpuwire.client import device as client_device
    assert native.install()
    rt = client_device.runtime()
    x = torch.randn(64, 64, device=device)
    for _ in range(3):
        python_made = torch.ops.aten.mm.default(x, x)  # (learned on the first call)
    native_made = x @ x
    assert torch._C._dispatch_keys(native_made) == torch._C._dispatch_keys(python_made)
    for t in (native_made, python_made):
        s = t.untyped_storage()
        assert (s.nbytes(), s.resizable(), t.storage_offset(), t.is_leaf, t.requires_grad) == (64 * 64 * 4, False, 0, True, False)
    assert torch.equal(native_made.cpu(), python_made.cpu())
    gpuwire.synchronize()
    before = rt.bytes_in_use
    made = [x @ x for _ in range(300)]  # (more than a scan's worth)
    assert rt.bytes_in_use == before + 300 * 64 * 64 * 4
    del made
    gpuwire.synchronize()  # (collects, and frees on the node)
    assert rt.bytes_in_use == before


@needs_a_compiler
def test_native_ops_refuse_past_the_memory_budget_and_train_on_the_device_thread(device):
    from gpuwire.client import device as client_device
    assert native.install()
    rt = client_device.runtime()
    x = torch.randn(256, 256, device=device)
    for _ in range(2):
        x + x
    import gpuwire
    gpuwire.synchronize()  # (collects what died: bytes_in_use is what lives)
    saved = rt.memory_budget
    rt.memory_budget = rt.bytes_in_use + 256 * 256 * 4 + 1000
    try:
        y = x + x  # (fits)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 256KiB"):
            x + x
        del y
    finally:
        rt.memory_budget = saved
    a, b = torch.randn(6, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    c, d = a.detach().to(device).requires_grad_(), b.detach().to(device).requires_grad_()
    norm = torch.nn.LayerNorm(3)
    remote_norm = torch.nn.LayerNorm(3).to(device)
    for _ in range(3):
        for p, q, ln in ((a, b, norm), (c, d, remote_norm)):
            p.grad = q.grad = None
            (ln(torch.tanh(p @ q)) * 0.5 + p.sum()).pow(2).mean().backward()
        assert torch.equal(c.grad.cpu(), a.grad) and torch.equal(d.grad.cpu(), b.grad)
        assert torch.equal(remote_norm.weight.grad.cpu(), norm.weight.grad)


# calls whose messages the C++ path and the Python path must write alike: trailing positional
# defaults, keyword-only arguments at and off their defaults, numbers of each kind, factories,
# memory formats, lists of bools, several results
REATTACH_PROGRAM = textwrap.dedent("""
    import gc, os, weakref, torch, gpuwire
    from gpuwire.client import device, native
    def known_calls(rt):
        x = torch.arange(4.0, device="gpuwire")
        for _ in range(3):
            y = x * 2.0  # (the first call teaches the kernel; the others take C++)
        before = rt.ops_sent
        y = x * 2.0
        return rt.ops_sent - before, y.cpu().tolist()
    first = gpuwire.attach(os.environ["GPUWIRE_NODE"])
    print("first", known_calls(first))
    gone = weakref.ref(first)
    gpuwire.detach()
    del first
    gc.collect()
    print("first runtime freed after detach", gone() is None)
    second = gpuwire.attach(os.environ["GPUWIRE_NODE"])
    print("second", known_calls(second))
    print(native.status())
""")


@needs_a_compiler
def test_a_detached_runtime_is_freed_and_the_op_kernels_serve_the_next(node):
    """After ``detach()`` nothing keeps the old runtime (its socket, its recovery log, its
    tracked storages) alive — its exit handler did — and after a new ``attach()`` a call the
    C++ kernels know goes to the new session."""
    done = subprocess.run([sys.executable, "-c", REATTACH_PROGRAM], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPUWIRE_NODE": node.address})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "native"
    assert lines[-4:-1] == ["first (1, [0.0, 2.0, 4.0, 6.0])", "first runtime freed after detach True",
                            "second (1, [0.0, 2.0, 4.0, 6.0])"]


FRAME_PROGRAM = textwrap.dedent("""
    import json, sys, msgpack, torch, gpuwire
    from gpuwire.client import device, native
    from gpuwire.protocol.connection import PREFIX
    from gpuwire.protocol import codec
    rt = device.runtime()
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, device="gpuwire"), torch.randn(5, 6, device="gpuwire")
    calls = [
        lambda: x + x, lambda: torch.add(x, 2, alpha=3), lambda: torch.add(x, 0.5, alpha=1), lambda: x * True,
        lambda: torch.addmm(x[:, 0], x, y[:, :4], beta=0.5, alpha=2.0),
        lambda: torch.nn.functional.gelu(x, approximate="tanh"), lambda: torch.nn.functional.gelu(x),
        lambda: x.sum(1, keepdim=True, dtype=torch.float64), lambda: x.sum((0, 1)),
        lambda: x.clamp(max=0.25), lambda: torch.softmax(x, -1),
        lambda: x.t().clone(memory_format=torch.contiguous_format), lambda: x.view(1, 2, 2, 5).clone(memory_format=torch.channels_last),
        lambda: torch.zeros(2, 3, dtype=torch.float16, device="gpuwire"), lambda: torch.full((2,), 7, device="gpuwire"),
        lambda: torch.nn.functional.layer_norm(x, (5,), y[0, :5], y[1, :5]),
        lambda: torch.ops.aten.native_layer_norm_backward(x, x, [5], x[:, :1], x[:, 1:2], y[0, :5], None, [True, True, False]),
        lambda: x.max(1), lambda: torch.arange(1.0, 2.0, 0.25, device="gpuwire"),
        lambda: x.clone().add_(y[:4, :5], alpha=0.5), lambda: x.clone().mul_(2), lambda: x.clone().clamp_(0.1),
        lambda: torch.cat([x, x.t().t(), y[:, :5]]), lambda: torch.cat([x, x], dim=-1),
    ]

    def plain(value):  # (a descriptor without its storage id: the ids differ between runs)
        if isinstance(value, msgpack.ExtType):
            if value.code == codec.EXT_TENSOR:
                return ["tensor", msgpack.unpackb(value.data)[1:]]
            return ["ext", value.code, value.data.hex()]
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    from gpuwire.client import runtime as runtime_module
    frames, real = [], runtime_module.send_parts
    runtime_module.send_parts = lambda sock, parts: (frames.extend(parts), real(sock, parts))[1]
    out = []
    for call in calls:
        for _ in range(4):  # (the first calls learn: layouts, dtypes the node takes, C++ plans)
            rt.flush()
            del frames[:]
            call()
            rt.flush()
        ops = [msgpack.unpackb(f[PREFIX.size:], raw=False, strict_map_key=False) for f in frames]
        ops = [o for o in ops if isinstance(o, list) and len(o) == 6]
        out.append([[o[0], plain(o[3]), plain(o[4]), [d[1:] for d in o[5]]] for o in ops])
    gpuwire.synchronize()
    assert all(out), f"calls that sent no op: {[i for i, ops in enumerate(out) if not ops]}"
    print(json.dumps(out))
    print(native.status())
""")


@needs_a_compiler
def test_the_cpp_path_sends_the_messages_the_python_path_sends(node):
    """The same calls, served in C++ in one process and by the Python kernels in another
    (``GPUWIRE_NATIVE=0``), put the same ops, arguments, keyword arguments and result
    declarations on the wire (the fresh storage ids aside)."""
    def run(**env):
        done = subprocess.run([sys.executable, "-c", FRAME_PROGRAM], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "GPUWIRE_NODE": node.address, **env})
        assert done.returncode == 0, done.stderr[-3000:]
        frames, status = done.stdout.strip().splitlines()[-2:]
        return frames, status
    python_frames, status = run(GPUWIRE_NATIVE="0")
    assert status.startswith("python")
    native_frames, status = run()
    assert status == "native"
    assert native_frames == python_frames


@needs_a_compiler
def test_an_error_in_a_native_op_on_autograds_device_thread_reaches_the_caller(device):
    import gpuwire
    from gpuwire.client import device as client_device
    assert native.install()
    rt = client_device.runtime()
    x = torch.randn(64, 64, device=device, requires_grad=True)
    for _ in range(2):  # (the backward's signatures learned: its mm calls take the C++ path)
        (x @ x).sum().backward()
    x.grad = None
    loss = (x @ x).sum()
    gpuwire.synchronize()
    saved = rt.memory_budget
    rt.memory_budget = rt.bytes_in_use + 100  # (no room for the backward's results)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="memory budget"):
            loss.backward()
    finally:
        rt.memory_budget = saved
    x.grad = None
    (x @ x).sum().backward()  # the device thread goes on
    expected = x.detach().cpu()
    expected = torch.ones(64, 64) @ expected.t() + expected.t() @ torch.ones(64, 64)
    assert torch.allclose(x.grad.cpu(), expected, atol=1e-4)


@needs_a_compiler
def test_a_native_in_place_op_drops_the_values_the_client_knew(device):
    """The client mirrors small integer tensors it uploaded (client/mirror.py) and answers reads
    of them locally; an in-place op served in C++ must drop those values, as the Python path
    does, or a read returns what the tensor held before."""
    assert native.install()
    m = torch.tensor([1, 2, 3]).to(device)
    for step in range(1, 4):
        m.add_(1)  # (the first teaches the kernel; the others are sent from C++)
        assert m.tolist() == [1 + step, 2 + step, 3 + step]


@needs_a_compiler
def test_ops_whose_results_the_client_mirrors_take_cpp_unless_it_knows_their_inputs(device):
    """Comparisons, ``all``/``any``, ``abs``, ``isnan``... of tensors the node computed are sent
    from C++ (they took the Python path on every call: 7-9 us against 3); of tensors whose values
    the client knows, the Python path computes the result's values too, so reading it costs no
    round trip; a predicate of a tiny tensor (a loss) goes to Python, which reads its argument
    along with the result."""
    from gpuwire.client import device as client_device
    assert native.install()
    watched = {"aten::eq.Scalar", "aten::all", "aten::abs", "aten::isinf", "aten::logical_not", "aten::sum.dim_IntList"}
    submitted = []

    def submit(*args):
        address = client_device._native_submit(*args)
        if args[0] in watched and address is not None:  # (None: the runtime declined, Python serves it)
            submitted.append(args[0])
        return address

    def round_trips():
        return client_device.runtime().round_trips

    with _watched_op_kernels(client_device._native_learn, submit):
        computed = torch.randn(256, device=device).mul(3).round().long()  # values only the node has
        host = computed.cpu()
        for _ in range(4):  # (the first calls learn their signatures)
            del submitted[:]
            assert (computed.add(0) == 0).all().item() is bool((host == 0).all())
            assert computed.add(0).abs().sum().item() == host.abs().sum().item()
            assert computed.float().isinf().logical_not().all().item() is True
        assert sorted(submitted) == sorted([*watched, "aten::all"])

        for attempt in range(3):  # (first calls with new signatures and dtypes have replies)
            del submitted[:]
            mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).to(device)  # uploaded: the client knows it
            before = round_trips()
            assert (mask == 1).all().item() is False and mask.abs().sum().item() == 3
            assert mask.logical_not().sum(dim=1).tolist() == [1, 2]
            assert attempt < 2 or round_trips() == before  # (answered from the values Python computed)
        assert submitted == []

        x = torch.tensor([2.0, float("inf")]).to(device)
        for _ in range(3):
            loss = (x * 1.0).sum()
            before = round_trips()
            assert bool(torch.isinf(loss)) is True and bool(torch.isnan(loss)) is False
            assert round_trips() == before + 1  # (the first read brought ``loss`` along)
        assert "aten::isinf" not in submitted


def test_the_ranks_of_a_multi_process_job_keep_the_python_op_kernels_unless_asked(monkeypatch):
    # (FSDP2 under gpuwire run hung in ~1 run of 3 with the C++ op kernels: not understood yet)
    from gpuwire.client import device as client_device
    for env, wanted in (({}, True), ({"WORLD_SIZE": "1"}, True), ({"WORLD_SIZE": "2"}, False),
                        ({"WORLD_SIZE": "2", "GPUWIRE_NATIVE_OPS": "1"}, True), ({"GPUWIRE_NATIVE_OPS": "0"}, False)):
        for name in ("WORLD_SIZE", "GPUWIRE_NATIVE_OPS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert client_device._native_ops_wanted() is wanted, env


@needs_a_compiler
def test_the_native_scan_finds_exactly_the_dead_storages(device):
    # ``_collect_garbage`` frees on the node what the C scan reports dead: one too many frees a
    # live tensor's memory, one too few leaks it
    from gpuwire.client import runtime
    from gpuwire.client.device import current_runtime
    assert native.install() and runtime._dead_storage_ids is native.module.dead_storage_ids
    kept = [torch.full((3,), float(i)).to(device) for i in range(300)]
    views = [t[1:] for t in kept[::7]]  # a view alone keeps its storage alive
    rt = current_runtime()
    ours = {t.untyped_storage().data_ptr() for t in kept}
    with rt.lock:
        rt._collect_garbage()
        del kept[::2]  # half the tensors die (some of them still have a view)
        dead = native.module.dead_storage_ids(rt._live)
        assert sorted(dead) == sorted(sid for sid, ref in rt._live.items() if torch.UntypedStorage._expired(ref))
        alive = {t.untyped_storage().data_ptr() for t in kept + views}
        assert set(dead) & ours == ours - alive and len(ours - alive) > 100
        rt._collect_garbage()
        assert not alive - set(rt._live)
    assert [t[0].item() for t in kept[:3]] == [1.0, 3.0, 5.0]
    with pytest.raises(TypeError):
        native.module.dead_storage_ids([])
