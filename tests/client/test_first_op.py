"""The first op of a process (client/meta_kernels.defer_dynamo_import): PyTorch's Python meta
kernels import torch._dynamo on their first call (1.5-2.6 s on this VM), which a local CPU op
never pays; a fresh process checks that it no longer does, and that torch.compile still works
once dynamo is imported."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    x = torch.arange(4.0, device="gpuwire")
    y = (x + 1) * 2
    z = torch.softmax(y.view(2, 2), dim=-1)
    print("dynamo after the first ops:", "torch._dynamo" in sys.modules)
    # (only meta kernels are deferred: a compiled program may call these, where dynamo must find its own)
    zero_grad = torch.optim.Optimizer.zero_grad
    cells = dict(zip(zero_grad.__code__.co_freevars, (c.cell_contents for c in zero_grad.__closure__ or ())))
    print("zero_grad deferred:", type(getattr(cells.get("fn"), "__dynamo_disable", None)).__name__)
    import torch._dynamo
    compiled = torch.compile(lambda a: torch.relu(a - 3.0) + a.sum(), backend="eager")
    print("compiled:", compiled(torch.arange(4.0)).tolist())
    w = (x.view(4, 1) * 3).squeeze(1) / torch.tensor(2.0, device="gpuwire")  # (new signatures: meta kernels again)
    print("values:", [y.cpu().tolist(), z.cpu().tolist()[0], w.cpu().tolist()])
""")


def test_the_first_ops_of_a_process_do_not_import_dynamo_and_compile_still_works(node):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, node.address], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "dynamo after the first ops: False" in lines
    assert "zero_grad deferred: NoneType" in lines
    assert "compiled: [6.0, 6.0, 6.0, 6.0]" in lines
    expected_softmax = torch_softmax_first_row()
    assert f"values: {[[2.0, 4.0, 6.0, 8.0], expected_softmax, [0.0, 1.5, 3.0, 4.5]]}" in lines


def torch_softmax_first_row():
    import torch
    return torch.softmax(torch.tensor([[2.0, 4.0], [6.0, 8.0]]), dim=-1).tolist()[0]
