"""The node's guards around linear-algebra kernels that misbehave in torch 2.13.

Batched LU factorisations on a CPU-backend node with more than one intra-op thread: torch
2.13.0's CPU kernels factor a batch of two or more matrices of ~180 rows or more wrongly
when ATen has two or more threads (garbage pivots, MKL's "Parameter 6 was incorrect on entry
to SLASWP"): ``torch.inverse`` of a singular batch raised "Pivots given to lu_solve must all
be greater or equal to 1" instead of naming the singular element, ``det``/``slogdet`` were
wrong. A GPU's kernels are right, so a CPU node runs the LU family on one thread
(``node/ops.py`` ``BATCHED_LU_OPS``). The reference here is this process's CPU on one
thread, where the kernels are right.

``lu_unpack`` of pivots shorter than the LU's crashed the node process (gh-177829)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    torch.set_num_threads(1)  # (the reference: right on one thread)
    x = torch.randn((2, 200, 200), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    b = torch.randn((2, 200, 3), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    d, db = x.to("gpuwire"), b.to("gpuwire")
    checks = {
        "lu_factor": (torch.linalg.lu_factor(d), torch.linalg.lu_factor(x)),
        "lu": (torch.linalg.lu(d), torch.linalg.lu(x)),
        "solve": (torch.linalg.solve(d, db), torch.linalg.solve(x, b)),
        "inv": (torch.linalg.inv(d), torch.linalg.inv(x)),
        "det": (torch.linalg.det(d), torch.linalg.det(x)),
        "slogdet": (torch.linalg.slogdet(d), torch.linalg.slogdet(x)),
    }
    for name, (remote, local) in checks.items():
        remote = [remote] if isinstance(remote, torch.Tensor) else list(remote)
        local = [local] if isinstance(local, torch.Tensor) else list(local)
        print(name, all(torch.equal(r.cpu(), l) for r, l in zip(remote, local)))
    singular = torch.empty((2, 300, 300), device="gpuwire")
    singular[:] = torch.eye(300, device="gpuwire")
    singular[..., 10, 10] = 0
    try:
        torch.inverse(singular)
        print("inverse of a singular batch: no error")
    except torch.linalg.LinAlgError as exc:
        print("inverse of a singular batch:", str(exc).split(",")[0])
""")


def test_a_cpu_node_with_two_threads_factors_batches_right():
    from tests.conftest import NodeProcess
    node = NodeProcess("--threads", "2")
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT, node.address], capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        for name in ("lu_factor", "lu", "solve", "inv", "det", "slogdet"):
            assert f"{name} True" in lines, (lines, run.stderr[-2000:])
        assert "inverse of a singular batch: linalg.inv: (Batch element 0): The diagonal element 11 is zero" in lines
    finally:
        node.kill()


CRASHING_UNPACK = textwrap.dedent("""
    import sys, torch, gpuwire
    from gpuwire.client import checks
    gpuwire.attach(sys.argv[1])
    x = torch.rand(5, 5, 5, dtype=torch.double, generator=torch.Generator().manual_seed(0))
    lu, pivots = torch.linalg.lu_factor(x.to("gpuwire"))
    try:
        torch.lu_unpack(lu, torch.empty(0, dtype=torch.int32, device="gpuwire"))
        print("at the call: no error")
    except ValueError as exc:
        print("at the call:", str(exc).split(" (")[0])
    checks.check_lu_unpack_pivots = lambda lu_data, lu_pivots: None  # (a client that does not check)
    try:
        torch.lu_unpack(lu, torch.empty(0, dtype=torch.int32, device="gpuwire"))
        torch.ones(1, device="gpuwire").item()
        print("on the node: no error")
    except ValueError as exc:
        print("on the node:", str(exc).split(" (")[0])
    p, l, u = torch.lu_unpack(lu, pivots)
    print("then:", torch.allclose((p @ l @ u).cpu(), x), torch.ones(2, device="gpuwire").sum().item())
""")


def test_lu_unpack_with_short_pivots_is_refused_and_the_node_lives():
    """``lu_unpack`` of pivots shorter than the LU's (gh-177829) crashed the node process in
    torch 2.13's CPU kernel: every tenant's session. The client refuses it at the call; the node
    refuses it too, for a client that does not check, and goes on serving."""
    from tests.conftest import NodeProcess
    node = NodeProcess("--threads", "1")
    try:
        run = subprocess.run([sys.executable, "-c", CRASHING_UNPACK, node.address], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        assert lines[0] == "at the call: Expected LU_pivots to have shape [5, 5]", lines
        assert lines[1] == "on the node: Expected LU_pivots to have shape [5, 5]", lines
        assert lines[2] == "then: True 2.0", lines
        assert node.proc.poll() is None  # the node process is alive
    finally:
        node.kill()
