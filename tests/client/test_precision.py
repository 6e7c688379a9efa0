"""Math-mode flags (TF32, float32 matmul precision) set by a program apply where its kernels
run: on the node, for its own session only, in order with its ops."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import gpuwire
from gpuwire.node.ops import math_mode

OTHER_SESSION = textwrap.dedent("""
    import sys, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    torch.ones(1, device="gpuwire").sum().item()  # runs an op while the first session's flags are set
    print(gpuwire.client.device.runtime().query("precision"))
""")


def _node_flags():
    return gpuwire.client.device.runtime().query("precision")



@pytest.fixture(autouse=True)
def flags_settable():
    """PyTorch's own test utilities, which the conformance tests import into the same worker,
    freeze torch.backends' flags against bare assignment (``disable_global_flags``); a program
    sets them freely, as these tests do."""
    with torch.backends.__allow_nonbracketed_mutation():
        yield

def test_flags_reach_the_node_in_order_and_stay_in_their_session(node, device):
    defaults = _node_flags()
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _node_flags()["cuda.matmul.allow_tf32"] is True
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
        flags = _node_flags()
        assert flags["float32_matmul_precision"] == "medium" and flags["cudnn.allow_tf32"] is False
        # the same links between the flags as in this process (medium: bf16 for oneDNN matmuls)
        assert flags == math_mode()
        assert torch.equal((a.to(device) @ b.to(device)).cpu(), a @ b)  # computed as here
        # another tenant of the node runs with the node's defaults, not with these
        env = {k: v for k, v in os.environ.items() if k != "GPUWIRE_NODE"}
        other = subprocess.run([sys.executable, "-c", OTHER_SESSION, node.address], capture_output=True, text=True,
                               timeout=120, env=env)
        assert other.returncode == 0, other.stderr[-3000:]
        assert other.stdout.strip() == str(defaults)
        assert _node_flags() == flags  # and this session's come back for its next op
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]
        torch.backends.cudnn.allow_tf32 = True
    assert _node_flags() == math_mode()  # put back as this process put them back


def test_a_new_session_gets_the_flags_set_before_it(node, tmp_path):
    program = textwrap.dedent("""
        import sys, torch, gpuwire
        torch.backends.cuda.matmul.allow_tf32 = True  # before the device exists, as scripts do
        torch.set_float32_matmul_precision("high")
        gpuwire.attach(sys.argv[1])
        flags = gpuwire.client.device.runtime().query("precision")
        print(flags["cuda.matmul.allow_tf32"], flags["float32_matmul_precision"])
    """)
    done = subprocess.run([sys.executable, "-c", program, node.address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "high"]


def test_a_setter_the_node_does_not_accept_fails_the_op_not_the_session(device):
    rt = gpuwire.client.device.runtime()
    with rt.lock:
        gpuwire.client.device.queue_op(rt, "gpuwire::precision", [[["_set_num_threads", True]]], {})
    with pytest.raises(gpuwire.RemoteError, match="not a math-mode setter"):
        gpuwire.synchronize()
    assert torch.ones(2, device=device).sum().item() == 2.0


def test_deterministic_and_cudnn_flags_reach_the_node(device):
    # reproducibility scripts set these, and on a CUDA node they pick the kernels
    # (deterministic scatter/index_add, cuDNN's benchmarked convolution algorithms)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = True
        flags = _node_flags()
        assert flags["deterministic_algorithms"] is True and flags["deterministic_algorithms_warn_only"] is True
        assert flags["cudnn.benchmark"] is True and flags["cudnn.deterministic"] is True
        x = torch.randn(4, 3)
        index = torch.tensor([0, 2, 0, 1])
        got = torch.zeros(3, 3, device=device).index_add_(0, index.to(device), x.to(device))
        assert torch.equal(got.cpu(), torch.zeros(3, 3).index_add_(0, index, x))
        torch.use_deterministic_algorithms(False)
        assert _node_flags()["deterministic_algorithms"] is False
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]
    assert _node_flags() == math_mode()


OTHER_SESSION_PUT = textwrap.dedent("""
    import sys, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    # bfloat16 calls run with a reply the first time (``_dtypes_unproven``): the node's synchronous path
    x = torch.zeros(4, dtype=torch.bfloat16, device="gpuwire")
    x.put_(torch.tensor([0, 0], device="gpuwire"), torch.ones(2, dtype=torch.bfloat16, device="gpuwire"))
    print(x.cpu().tolist())
""")


def test_a_synchronous_call_runs_with_its_own_sessions_flags(node, device):
    """The node's synchronous path (an op's first call with a new dtype, data-dependent sizes)
    ran with whichever session's flags were applied last: a tenant that never asked for
    deterministic algorithms got another tenant's "put_ does not have a deterministic
    implementation" (on CUDA: another tenant's TF32, SDPA backends, cuDNN choices)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert _node_flags()["deterministic_algorithms"] is True
        torch.ones(1, device=device).sum().item()  # (this session's flags applied last on the node)
        env = {k: v for k, v in os.environ.items() if k != "GPUWIRE_NODE"}
        other = subprocess.run([sys.executable, "-c", OTHER_SESSION_PUT, node.address], capture_output=True,
                               text=True, timeout=120, env=env)
        assert other.returncode == 0, other.stderr[-3000:]
        assert other.stdout.strip() == "[1.0, 0.0, 0.0, 0.0]"
        # and this session's own synchronous call runs with its own flags
        x = torch.zeros(4, dtype=torch.float16, device=device)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            x.put_(torch.tensor([0, 0], device=device), torch.ones(2, dtype=torch.float16, device=device))
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    assert _node_flags() == math_mode()


FACTORIES = {
    "ones": lambda d: torch.ones(3, device=d), "full": lambda d: torch.full((3,), 1 / 3, device=d),
    "arange": lambda d: torch.arange(0.0, 1.0, 0.1, device=d), "linspace": lambda d: torch.linspace(0, 1, 7, device=d),
    "eye": lambda d: torch.eye(3, device=d), "tensor": lambda d: torch.tensor([1 / 3, 2.5], device=d),
    "randn": lambda d: (torch.manual_seed(5), torch.randn(5, device=d))[1],
    "rand": lambda d: (torch.manual_seed(6), torch.rand(5, device=d))[1],
    "from a scalar": lambda d: torch.ones(2, device=d) * (1 / 3),
}


def test_the_default_dtype_reaches_the_node_and_stays_in_its_session(node, device):
    """``torch.set_default_dtype(torch.float64)``: factories without a dtype ran on the node with
    its own default, float32, and came back as float64 rounded through float32 (``full(1/3)``:
    0.3333333432674408); a factory called before the change kept answering float32."""
    learned = {name: make(device) for name, make in FACTORIES.items()}  # layouts learned under float32
    assert all(t.dtype == torch.float32 for t in learned.values())
    try:
        torch.set_default_dtype(torch.float64)
        assert _node_flags()["default_dtype"] == "float64"
        for name, make in FACTORIES.items():
            remote, local = make(device), make("cpu")
            assert remote.dtype == local.dtype == torch.float64, name
            assert torch.equal(remote.cpu(), local), name
        env = {k: v for k, v in os.environ.items() if k != "GPUWIRE_NODE"}
        other = subprocess.run([sys.executable, "-c", OTHER_SESSION, node.address], capture_output=True, text=True,
                               timeout=120, env=env)
        assert other.returncode == 0, other.stderr[-3000:]
        assert "'default_dtype': 'float32'" in other.stdout  # another tenant keeps the node's default
        torch.set_default_tensor_type(torch.FloatTensor)  # (the older API sets it too)
        assert _node_flags()["default_dtype"] == "float32"
        assert FACTORIES["full"](device).dtype == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)
    assert _node_flags()["default_dtype"] == "float32"


NODE_IN_THE_CLIENTS_PROCESS = textwrap.dedent("""
    import resource, torch, gpuwire
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # (the loop grew without bound)
    from gpuwire.node.server import NodeServer
    server = NodeServer("127.0.0.1", 0)
    host, port = server.bind()
    server.start_background()
    gpuwire.attach(f"{host}:{port}")
    torch.set_default_dtype(torch.float64)
    torch.backends.cuda.matmul.allow_tf32 = True
    x = torch.full((2,), 1 / 3, device="gpuwire")
    print(x.dtype, x.cpu().tolist(), gpuwire.stats()["ops_sent"] < 50)
""")


def test_a_node_in_the_clients_own_process_applies_the_settings_once(tmp_path):
    # the node called torch's setters, which the client (the same process) had wrapped to send
    # them to its node: each application sent them again, without end (a CI worker was killed
    # for memory at 22 GB)
    done = subprocess.run([sys.executable, "-c", NODE_IN_THE_CLIENTS_PROCESS], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "GPUWIRE_NODE"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["torch.float64", "[0.3333333333333333,", "0.3333333333333333]", "True"]


def test_sdpa_kernel_choice_reaches_the_node(node, device):
    # `sdpa_kernel(SDPBackend.MATH)` set the flags here only: the node ran its flash kernel,
    # whose results differ from a local math run in the last bits
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(3))

    def attention(dev):
        a, b, c = (t.to(dev).requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
        out = F.scaled_dot_product_attention(a, b, c, is_causal=True)
        out.square().sum().backward()
        return [t.detach().cpu() for t in (out, a.grad, b.grad, c.grad)]
    defaults = _node_flags()
    assert defaults["sdp.flash"] is True and defaults["sdp.math"] is True
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
        with sdpa_kernel(backend, set_priority=isinstance(backend, list)):
            flags = _node_flags()
            assert flags == math_mode(), flags
            want, got = attention("cpu"), attention(device)
        for a, b in zip(want, got):
            assert torch.equal(a, b), (backend, (a - b).abs().max())
    assert _node_flags() == defaults  # back as the context left them
