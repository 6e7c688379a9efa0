"""What a user sees when things go wrong: remote op errors, unreachable or dead nodes."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import gpuwire
from gpuwire.client.runtime import Runtime

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env}, cwd=REPO)


def test_streamed_op_error_surfaces_at_next_sync_point(device):
    d = torch.arange(10.0, device=device)
    d.index_select(0, torch.tensor([3], device=device))  # (the dtypes' first call runs with a reply)
    bad_index = torch.tensor([3, 100], device=device)
    out = d.index_select(0, bad_index)  # queued: the client cannot know the index is out of range
    with pytest.raises(gpuwire.RemoteError) as info:
        out.cpu()
    err = info.value
    assert "index_select" in err.op
    assert err.seq > 0
    assert "out of range" in str(err) or "index" in str(err).lower()
    assert isinstance(err, (IndexError, RuntimeError))  # mirrors the node-side exception type
    # the session is still usable afterwards
    assert torch.equal((d * 2).cpu(), torch.arange(10.0) * 2)


def test_shape_errors_raise_like_local_torch(device):
    a, b = torch.ones(2, 3, device=device), torch.ones(4, 5, device=device)
    with pytest.raises(RuntimeError):
        (a @ b).cpu()


@pytest.mark.parametrize("op", [torch.neg, torch.floor, torch.abs, torch.sign])
def test_an_out_of_another_dtype_a_kernel_refuses_raises_at_the_call(device, op):
    """``torch.neg(x32, out=y64)`` raises on CPU and CUDA ("Found dtype Double but expected
    Float"); PyTorch's meta kernels accept it, so once float32 and float64 calls of the op had
    run it was queued and its error came from the next line that waited. ``sin`` takes such an
    out (it casts): that still works."""
    x = torch.tensor([1.5, -2.0])
    for in_dtype, out_dtype in ((torch.float32, torch.float32), (torch.float64, torch.float64)):
        op(x.to(device, in_dtype), out=torch.empty(0, dtype=out_dtype, device=device))  # (proven dtypes)
    for in_dtype, out_dtype in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        for _ in range(2):  # (and again: a refused combination is not remembered as proven)
            with pytest.raises(RuntimeError) as local:
                op(x.to(in_dtype), out=torch.empty(0, dtype=out_dtype))
            with pytest.raises(RuntimeError, match=str(local.value).splitlines()[0]):
                op(x.to(device, in_dtype), out=torch.empty(0, dtype=out_dtype, device=device))
    out = torch.empty(0, dtype=torch.float64, device=device)
    torch.sin(x.to(device), out=out)
    assert torch.equal(out.cpu(), torch.sin(x).double())
    assert torch.equal((torch.ones(2, device=device) * 2).cpu(), torch.full((2,), 2.0))  # (nothing left queued)


def test_a_number_of_another_kind_is_checked_at_the_call_and_host_scalars_are_taken(device):
    """PyTorch's test_foreach.py: ``torch._foreach_mul_(bool_tensors, 2)`` and ``mask.mul_(8)``
    cannot cast their results back (CPU and CUDA raise at the call); the first was queued once
    the op had run with bool tensors and a bool, the second always (a structured op given a
    number skipped the first-call proof), and their errors came from a later line. A number's kind now counts in the
    dtype combination an op's first call proves. ``_foreach_addcmul``'s ``scalars`` tensor is read
    on the host by CUDA's kernel: a queued call refused it as a host tensor."""
    flags = [torch.tensor([True, False], device=device), torch.tensor([True], device=device)]
    torch._foreach_mul_(flags, True)
    flags[0].mul_(True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="result type Long can't be cast to the desired output type Bool"):
            torch._foreach_mul_(flags, 2)
        with pytest.raises(RuntimeError, match="result type Long can't be cast to the desired output type Bool"):
            flags[0].mul_(8)  # (a structured op given a number: its meta kernel takes this too)
    assert [t.tolist() for t in flags] == [[True, False], [True]]
    host = [torch.randn(3, 3), torch.randn(2)]
    tensors = [t.to(device) for t in host]
    scalars = torch.tensor([0.5, -2.0])
    for _ in range(2):  # (the second call is queued)
        got = torch._foreach_addcmul(tensors, tensors, tensors, scalars)
        want = torch._foreach_addcmul(host, host, host, scalars)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_sync_mode_raises_at_the_failing_line(node):
    code = """
        import torch, gpuwire
        d = torch.arange(10.0, device="gpuwire")
        idx = torch.tensor([100], device="gpuwire")
        try:
            d.index_select(0, idx)   # FAILING LINE
        except gpuwire.RemoteError as e:
            print("raised-at-line", e.op)
    """
    result = run_script(code, {"GPUWIRE_NODE": node.address, "GPUWIRE_SYNC": "1"})
    assert "raised-at-line aten::index_select" in result.stdout, result.stderr


def test_closed_port_is_a_clear_error_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(gpuwire.NodeUnreachable, match="cannot connect"):
        Runtime(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 5


def _fake_server(behaviour):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        behaviour(conn)
        time.sleep(3)
        conn.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def test_silent_server_times_out_with_a_clear_error():
    address = _fake_server(lambda conn: None)
    start = time.monotonic()
    with pytest.raises(gpuwire.NodeUnreachable, match="did not answer the gpuwire handshake"):
        Runtime(address, connect_timeout=1.0)
    assert time.monotonic() - start < 5


def test_http_server_is_not_mistaken_for_a_node():
    address = _fake_server(lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(gpuwire.NodeUnreachable, match="not a gpuwire node"):
        Runtime(address, connect_timeout=5.0)


def test_wrong_token_is_refused():
    from tests.conftest import NodeProcess

    node = NodeProcess("--token", "s3cret")
    try:
        with pytest.raises(gpuwire.NodeUnreachable, match="refused the session.*token"):
            Runtime(node.address, token="wrong")
        rt = Runtime(node.address, token="s3cret")
        rt.close()
    finally:
        node.kill()


def test_node_killed_mid_run_raises_connection_lost(fresh_node):
    code = f"""
        import os, signal, torch, gpuwire
        gpuwire.attach("{fresh_node.address}")
        d = torch.randn(64, 64, device="gpuwire")
        print((d @ d).sum().item() is not None, flush=True)
        os.kill({fresh_node.proc.pid}, signal.SIGKILL)
        import time; time.sleep(0.5)
        try:
            for _ in range(1000):
                d = d @ d
            d.sum().item()
        except gpuwire.ConnectionLost as e:
            print("connection-lost:", e)
    """
    result = run_script(code, {}, timeout=60)
    assert "connection-lost: lost the connection to gpuwire node" in result.stdout, result.stdout + result.stderr
    assert "nothing listens there any more" in result.stdout, result.stdout
    assert "Segmentation" not in result.stderr


def test_after_a_lost_node_the_next_use_starts_a_new_session_on_the_node_that_replaced_it(fresh_node):
    """A supervisor (systemd, Kubernetes) restarts a node that died on the same address: the
    program was told of the loss once, at the call that found it; its next use of the device
    (a notebook's next cell, a suite's next test) gets a new session there instead of the same
    ConnectionLost forever, and a tensor of the lost session says what happened to it."""
    code = f"""
        import os, signal, subprocess, sys, time, torch, gpuwire
        gpuwire.attach("{fresh_node.address}")
        kept = torch.arange(4.0, device="gpuwire")
        print("before", kept.sum().item(), flush=True)
        os.kill({fresh_node.proc.pid}, signal.SIGKILL)
        time.sleep(0.3)
        try:
            (kept * 2).sum().item()
        except gpuwire.ConnectionLost as e:
            print("lost:", e, flush=True)
        try:
            torch.ones(2, device="gpuwire").sum().item()
        except gpuwire.NodeUnreachable as e:
            print("unreachable:", e, flush=True)
        node = subprocess.Popen([sys.executable, "-m", "gpuwire", "serve", "--host", "127.0.0.1", "--port",
                                 "{fresh_node.port}", "--backend", "cpu", "--exit-with-stdin"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            print(node.stdout.readline().strip(), flush=True)
            print("after", (torch.arange(6.0).to("gpuwire") * 3).sum().item(), flush=True)
            try:
                kept.cpu()
            except RuntimeError as e:
                print("kept:", e, flush=True)
        finally:
            gpuwire.detach()
            node.kill()
            node.wait()
    """
    result = run_script(code, {}, timeout=90)
    out = result.stdout
    assert "before 6.0" in out and "lost: lost the connection" in out, out + result.stderr
    assert f"unreachable: cannot connect to a gpuwire node at {fresh_node.address}" in out, out + result.stderr
    assert "after 45.0" in out, out + result.stderr
    assert "kept: this device tensor was made in an earlier gpuwire session" in out, out
    assert "was lost with its connection to the node" in out, out
    assert result.stderr.count("starting a new session on node") == 1, result.stderr


def test_embedded_node_starts_when_nothing_is_configured():
    code = """
        import torch
        x = torch.arange(6.0).reshape(2, 3)
        y = (x.to("gpuwire") * 3).sum().item()
        print("result", y)
    """
    env = {"GPUWIRE_NODE": ""}
    result = run_script(code, env, timeout=120)
    assert "result 45.0" in result.stdout, result.stderr
    assert result.stderr.count("started an embedded node") == 1
    assert "CPU backend" in result.stderr


def test_an_embedded_node_that_crashes_is_started_again_and_the_program_goes_on():
    """A PyTorch CPU kernel that crashes on an input a GPU refuses (torch 2.13's ``lu_unpack``
    of short pivots did) killed the embedded node, and every later call of the program raised
    ConnectionLost: one such test of a suite failed every test after it. The node is started
    again on the same address; the call that found the loss says why, the next use works."""
    code = """
        import os, signal, time, torch, gpuwire
        from gpuwire.client import embedded
        kept = torch.arange(4.0, device="gpuwire")
        print("before", kept.sum().item(), flush=True)
        crashed = embedded._process.pid
        os.kill(crashed, signal.SIGSEGV)
        time.sleep(0.3)
        try:
            (kept * 2).sum().item()
        except gpuwire.ConnectionLost as e:
            print("lost:", e, flush=True)
        x = torch.arange(6.0).reshape(2, 3)
        print("after", (x.to("gpuwire") * 3).sum().item(), embedded._process.pid != crashed, flush=True)
        try:
            (kept + 1).cpu()
        except RuntimeError as e:
            print("kept:", e, flush=True)
        print("again", (x.to("gpuwire") @ x.T.to("gpuwire")).cpu().equal(x @ x.T), flush=True)
    """
    result = run_script(code, {"GPUWIRE_NODE": ""}, timeout=120)
    out = result.stdout
    assert "before 6.0" in out, out + result.stderr
    assert "lost: lost the connection" in out, out + result.stderr
    assert "killed by SIGSEGV (a kernel crashed; with GPUWIRE_SYNC=1 the line whose op crashed it raises)" in out, out
    assert "after 45.0 True" in out, out + result.stderr
    assert "kept: this device tensor was made in an earlier gpuwire session" in out, out
    assert "again True" in out, out + result.stderr
    assert result.stderr.count("started an embedded node") == 1, result.stderr
    assert "Starting a new node at the same address" in result.stderr, result.stderr


def test_a_forked_child_shares_the_embedded_node_and_leaves_it_running():
    """A child forked from a program with an embedded node (``os.fork``, a fork-started worker)
    uses the parent's node; exiting normally it ran the parent's atexit hooks, which killed the
    parent's node, and every tensor the parent had on it."""
    code = """
        import os, sys, torch, gpuwire
        from gpuwire.client import embedded
        x = torch.ones(3, device="gpuwire")
        print("parent", x.sum().item(), flush=True)
        node = embedded._process.pid
        child = os.fork()
        if child == 0:
            print("child", torch.ones(2, device="gpuwire").sum().item(), embedded._process.pid == node, flush=True)
            sys.exit(0)
        os.waitpid(child, 0)
        print("parent after", (x * 2).sum().item(), embedded._process.pid == node, flush=True)
    """
    result = run_script(code, {"GPUWIRE_NODE": ""}, timeout=120)
    assert "child 2.0 True" in result.stdout, result.stdout + result.stderr
    assert "parent after 6.0 True" in result.stdout, result.stdout + result.stderr
    assert result.stderr.count("started an embedded node") == 1, result.stderr
    assert "killed by" not in result.stderr, result.stderr


def test_embedded_node_idles_politely_and_matches_local_cpu_bit_for_bit():
    """The embedded node shares the machine with the program: with OpenMP's default wait policy
    its idle workers spun on the program's cores (a nanoGPT step on 2 cores flipped between
    27 ms and 550 ms). Its workers sleep when idle; its thread count stays torch's default, so
    thread-partitioned reductions (LayerNorm's weight gradient) equal a local run bit for bit."""
    code = """
        import copy, torch
        from gpuwire.client import embedded
        torch.manual_seed(0)
        ln = torch.nn.LayerNorm(32)
        with torch.no_grad():
            ln.weight.normal_(); ln.bias.normal_()
        remote = copy.deepcopy(ln).to("gpuwire")
        x, gy = torch.randn(20, 10, 32), torch.randn(20, 10, 32)
        ln(x.requires_grad_()).backward(gy)
        remote(x.detach().to("gpuwire").requires_grad_()).backward(gy.to("gpuwire"))
        same = all(torch.equal(a.grad, b.grad.cpu()) for a, b in zip(ln.parameters(), remote.parameters()))
        environ = open(f"/proc/{embedded._process.pid}/environ").read().split(chr(0))
        print("equal", same, "policy", [v for v in environ if v.startswith("OMP_WAIT_POLICY=")])
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["GPUWIRE_NODE"] = ""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "equal True policy ['OMP_WAIT_POLICY=PASSIVE']" in result.stdout, result.stdout


def test_embedded_node_keeps_the_users_wait_policy(monkeypatch):
    from gpuwire.client import embedded
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert embedded.embedded_node_env("t")["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert embedded.embedded_node_env("t")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_remote_memory_is_freed_when_tensors_die(device):
    rt = gpuwire.client.device.current_runtime()
    gpuwire.synchronize()
    baseline = rt.query("memory")["bytes_in_use"]
    tensors = [torch.ones(1 << 16, device=device) for _ in range(20)]
    gpuwire.synchronize()
    assert rt.query("memory")["bytes_in_use"] >= 20 * (1 << 18)
    del tensors
    gpuwire.synchronize()
    assert rt.query("memory")["bytes_in_use"] <= baseline


def test_a_linear_algebra_failure_is_a_linalg_error(device):
    """``except torch.linalg.LinAlgError`` catches what the node's LAPACK refuses, as locally
    (test_linalg.py: a singular ``inv_ex(check_errors=True)`` and a non-positive-definite
    ``cholesky_ex`` raised a plain RuntimeError subclass)."""
    singular = torch.eye(3, device=device)
    singular[1, 1] = 0
    with pytest.raises(torch.linalg.LinAlgError, match="The diagonal element 2 is zero"):
        torch.linalg.inv_ex(singular, check_errors=True)
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        torch.linalg.cholesky_ex(-torch.eye(3, device=device), check_errors=True)
    assert torch.linalg.inv_ex(singular).info.item() == 2  # (without check_errors: the info only)


def test_eig_of_a_matrix_with_a_nan_raises_at_the_call(device):
    """CPU and CUDA (whose ``eig`` runs on the host) check the input's values before the kernel:
    the error comes at the call, not at a later line."""
    a = torch.randn(2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w, v = torch.linalg.eig(a.to(device))
    expected = torch.linalg.eig(a)
    assert torch.equal(w.cpu(), expected.eigenvalues) and torch.equal(v.cpu(), expected.eigenvectors)
    a[0, -1, -1] = float("nan")
    with pytest.raises(RuntimeError, match="torch.linalg.eig: input tensor should not contain infs or NaNs"):
        torch.linalg.eig(a.to(device))
    assert torch.ones(2, device=device).sum().item() == 2.0  # nothing left queued to fail later


def test_lstsq_takes_the_drivers_a_gpu_takes(device):
    a = torch.rand(2, 3, 3, dtype=torch.float64, device=device)
    b = torch.rand(2, 3, 2, dtype=torch.float64, device=device)
    for driver in (None, "gels"):
        solution = torch.linalg.lstsq(a, b, driver=driver).solution
        torch.testing.assert_close(solution.cpu(), torch.linalg.lstsq(a.cpu(), b.cpu()).solution)
    for driver in ("gelsd", "no_such_driver"):
        with pytest.raises(RuntimeError, match="`driver` other than `gels` is not supported on CUDA"):
            torch.linalg.lstsq(a, b, driver=driver)


def test_a_vector_norm_without_an_identity_over_an_empty_reduction_raises_at_the_call(device):
    """ATen refuses a negative or infinite order over an empty reduction before its kernel; the
    meta kernel does not, so it raised at the next sync point (test_linalg.py)."""
    for shape, dim in (((0,), None), ((0, 10), 0), ((10, 0), -1), ((0, 10), (0, 1)), ((0, 10), 1)):
        for order in (2, 0.5, float("inf"), -1, -0.5, float("-inf")):
            local, remote = torch.zeros(shape), torch.zeros(shape, device=device)
            try:
                expected = torch.linalg.vector_norm(local, order, dim=dim)
            except RuntimeError as exc:
                with pytest.raises(RuntimeError) as info:
                    torch.linalg.vector_norm(remote, order, dim=dim)
                assert str(info.value) == str(exc)
            else:
                assert torch.equal(torch.linalg.vector_norm(remote, order, dim=dim).cpu(), expected)
    assert torch.ones(2, device=device).sum().item() == 2.0  # nothing left queued to fail later


def test_cross_into_one_of_its_inputs_raises_at_the_call(device):
    x, y = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
    for call in (lambda: torch.cross(x, y, out=x), lambda: torch.linalg.cross(y, x, out=x),
                 lambda: torch.linalg.cross(x, y, out=y[:, :])):
        with pytest.raises(RuntimeError, match="input tensor and the written-to tensor refer to a single memory"):
            call()
    out = torch.empty(4, 3, device=device)
    torch.linalg.cross(x, y, out=out)
    assert torch.equal(out.cpu(), torch.linalg.cross(x.cpu(), y.cpu()))


def test_one_call_resizing_two_outs_warns_as_locally(device):
    """ATen says "An output with one or more elements was resized" for each out it resizes; the
    program sees what Python's filters make of the two: once by default (the same text at the
    same line), twice under "always". The client said the second again by default: the shape
    inference between the two outs changes the filters, which makes Python forget what it showed
    (test_linalg.py's test_slogdet_errors_and_warnings and test_eigvalsh_errors_and_warnings)."""
    import warnings
    for action in ("default", "always"):
        counts = []
        for where in ("cpu", device):
            a = torch.randn(2, 3, 3, device=where)
            sign, logabsdet = torch.empty(1, device=where), torch.empty(1, device=where)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter(action)
                torch.linalg.slogdet(a, out=(sign, logabsdet))
            counts.append(sum("was resized" in str(w.message) for w in said))
        assert counts[1] == counts[0], (action, counts)


_WARNED_ONCE_A_LINE = textwrap.dedent("""
    import sys, warnings, torch, torch.nn.functional as F
    shown = []
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    for n in range(2, 10):  # (a new signature each time: the client infers its results' shapes)
        x = torch.randn(n, 3, device=sys.argv[1])
        F.dropout2d(x, 0.5, training=True)  # (a 2-D input: PyTorch's deprecation warning)
        torch.add(x, 1, out=torch.empty(0, device=sys.argv[1]))
        torch.cumsum(x, 0).sum().item()
    print(sum("dropout2d" in line for line in shown))
""")


@pytest.mark.parametrize("where", ["cpu", "gpuwire"])
def test_a_library_warning_is_shown_once_a_line_as_locally(node, where):
    """Python shows a warning once for each line that raises it, by default; between two of the
    program's calls the client's shape inference on a signature's first call changed the filters
    (to ignore its meta kernels' warnings), which makes Python forget what it showed: the
    deprecation of a 2-D input to ``F.dropout2d`` (pytorch/examples' mnist_hogwild) was shown at
    each step of the warm-up."""
    run = subprocess.run([sys.executable, "-c", _WARNED_ONCE_A_LINE, where], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GPUWIRE_NODE": node.address})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"]


def test_assert_async_checks_as_a_gpu_does(device):
    """``torch._assert_async`` (``torch._check`` in exported programs, jagged nested tensors)
    was refused by the node, even when its condition held. As on CUDA its size is checked at
    the call and its value at the next sync point, with the CPU kernel's words; the session
    goes on after a failed one (on a CUDA node it is never a device-side assert)."""
    torch._assert_async(torch.tensor(1, device=device))
    torch._assert_async(torch.tensor(True, device=device), "holds")
    gpuwire.synchronize()
    with pytest.raises(RuntimeError, match="no values is ambiguous"):
        torch._assert_async(torch.tensor([], device=device))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.ones(2, device=device))
    torch._assert_async(torch.tensor(0.0, device=device), "the batch must not be empty")
    with pytest.raises(gpuwire.RemoteError, match="the batch must not be empty"):
        gpuwire.synchronize()
    torch._assert_async(torch.tensor(0, device=device))
    with pytest.raises(gpuwire.RemoteError, match="Expected Tensor with single nonzero value, but got zero"):
        gpuwire.synchronize()
    assert torch.equal(torch.arange(3, device=device).cpu(), torch.arange(3))
