"""``bench.gpu_timeline``: a node records its sessions' device timeline when asked
(``GPUWIRE_PROFILE_KERNELS``), and the tool cuts a timeline into steps at the loss read and
says what idled the device and which kernels one side ran more of. On a GPU the node records
kernels; here a real CPU node records its host ops, which exercises the same hook."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.gpu_timeline import compare, launchers, steps_of

from .test_bench_smoke import _env


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


def _step_trace(extra_gap: float, extra_kernel: bool) -> list[dict]:
    """Two whole steps: a loss read, kernels a (10 us), b (10 us) after a gap, c; a loss read."""
    events, t, correlation = [], 0.0, 0
    for _ in range(3):
        events.append(_x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", t, 2, bytes=4))
        t += 5
        for name, gap in (("a", 0), ("b", 30 + extra_gap), ("c", 0)) + ((("copy", 0),) if extra_kernel else ()):
            t += gap
            correlation += 1
            events.append(_x("cuda_runtime", "cudaLaunchKernel", t - 4, 2, correlation=correlation))
            events.append(_x("kernel", name, t, 10, correlation=correlation))
            t += 10
    return events


def test_steps_are_cut_at_the_loss_read_and_what_idled_the_device_is_named():
    local, remote = steps_of(_step_trace(0, False), 2), steps_of(_step_trace(100, True), 2)
    assert len(local) == len(remote) == 2
    first = local[0]
    assert first["kernels"] == 3 and first["busy_us"] == 32.0  # three kernels and the next loss read
    assert first["wall_us"] == 65.0 and first["idle_us"] == 33.0
    assert first["gaps"] == [{"us": 30.0, "after": "a", "before": "b", "launched_us_before_it_ran": 4.0}]
    report = compare(local, remote)
    assert report["remote"]["kernels"] == 4 and report["remote"]["idle_us"] == 133.0
    assert report["remote gaps by the kernel after them (all steps, us)"] == [("b", 130.0)]
    assert report["kernel time remote - local, us a step"] == [("copy", 10.0)]


def test_a_kernel_is_traced_to_the_host_ops_that_launched_it():
    events = [_x("cpu_op", "aten::reshape", 0, 100), _x("cpu_op", "aten::copy_", 10, 50),
              _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=7),
              _x("kernel", "direct_copy_kernel", 40, 5, correlation=7),
              _x("cuda_runtime", "cudaLaunchKernel", 200, 5, correlation=8),
              _x("kernel", "direct_copy_kernel", 210, 5, correlation=8)]
    assert launchers(events) == [("aten::reshape > aten::copy_", 1), ("", 1)]
    assert launchers([e for e in events if e["cat"] != "cpu_op"]) == []  # recorded without host ops


CLIENT = """
import sys, torch, gpuwire
gpuwire.attach(sys.argv[1])
x = torch.arange(6.0).to("gpuwire")
assert torch.equal((x * 3).cpu(), torch.arange(6.0) * 3)
gpuwire.detach()
"""


def test_a_node_asked_to_records_each_sessions_timeline(tmp_path):
    from bench.common import Context, wait_for_files
    ctx = Context(quick=True, threads=1)
    try:
        node = ctx.node("cpu", fresh=True, env={"GPUWIRE_PROFILE_KERNELS": str(tmp_path)})
        # (the client in a process of its own: this one's stays attached to the suite's node)
        run = subprocess.run([sys.executable, "-c", CLIENT, node.address], capture_output=True, text=True,
                             timeout=120, env=_env())
        assert run.returncode == 0, run.stderr[-2000:]
        (trace,) = wait_for_files(tmp_path, "session-*.trace.json", 60)
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert "aten::mul" in names, sorted(n for n in names if n and n.startswith("aten::"))
        assert not list(tmp_path.glob("*.partial"))
    finally:
        ctx.kill_all()
