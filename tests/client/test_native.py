"""gpuwire's native client helpers (client/native.py): the device guard and tensor descriptors in
C++, installed when a program attaches, built once per machine, and the Python paths kept
wherever they cannot be built."""

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
    assert "device.py" in _kernel_source("aten::add.Tensor")  # (ops with work to send stay Python's)
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
