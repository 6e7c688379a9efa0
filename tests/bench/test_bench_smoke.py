"""The benchmark suite as CI runs it: ``python -m bench --quick`` completes, prints its table and
writes one JSON file per benchmark with the fields a report needs (no thresholds asserted: speed
is judged by the benchmarks themselves, on a quiet machine). The GPU benchmark's code path,
which only runs where CUDA is, is exercised on the CPU backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SMOKE = ("per_op", "round_trips", "step_ratio", "generate", "bulk", "latency")  # the rest have tests of their own


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    env.pop("GPUWIRE_NODE", None)
    return env


def test_quick_suite_writes_every_figure_as_json(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", ",".join(SMOKE), "--out", str(tmp_path),
                          "--timeout", "240"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gpuwire bench summary (quick" in run.stdout
    for name in SMOKE:
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["name"] == name and data["status"] == "ok", data.get("errors")
        assert data["torch_version"] == torch.__version__ and data["machine"]["intra_op_threads"] >= 1
        assert "git_sha" in data and data["figures"]
        for figure in data["figures"]:
            assert {"figure", "value", "unit", "baseline", "ratio"} <= figure.keys(), figure
            assert isinstance(figure["value"], (int, float)), figure
    round_trips = {f["figure"]: f for f in json.loads((tmp_path / "round_trips.json").read_text())["figures"]}
    assert round_trips["mlp: round trips / step"]["value"] == 1  # the suite's one hard claim, exact in quick mode too


GPU_PATH_ON_CPU = """
import json, sys
import torch
torch.set_num_threads(1)
from bench import gpu
from bench.common import Context, Result, detach
ctx = Context(quick=True, threads=1, log=lambda *a: None)
result = Result(name="gpu")
try:
    gpu.compare(ctx, result, local_device="cpu", backend="cpu", matmul_n=64, matmul_reps=3,
                gpt=dict(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32), batch=2, seq=8, steps=2)
finally:
    detach()
    ctx.kill_all()
print(json.dumps({"figures": result.figures, "errors": result.errors}))
"""


def test_gpu_benchmark_runs_its_code_path_on_the_cpu_backend():
    """``bench/gpu.py`` has only ever met a GPU through this path: the same measurements, tiny
    (in a process of its own: it attaches to a node of its own)."""
    run = subprocess.run([sys.executable, "-c", GPU_PATH_ON_CPU], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["errors"] == [], result["errors"]
    labels = [f["figure"] for f in result["figures"]]
    assert any(label.startswith("matmul 64x64 bfloat16") for label in labels), labels
    assert sum("train step" in label for label in labels) == 2 and any("bf16 autocast" in label for label in labels)
    for figure in result["figures"]:
        assert figure["value"] > 0 and figure["baseline"] > 0, figure
    # the local side runs in a child process (one accelerator per process in autograd): the same
    # float32 training there and through gpuwire gives the same losses
    fp32_step = next(f for f in result["figures"] if "train step" in f["figure"] and "autocast" not in f["figure"])
    assert fp32_step["note"] == "losses equal local's bit for bit", fp32_step
    # under autocast the CPU's op lists differ from CUDA's (which the device follows): the losses
    # differ, and the note says from which step and whether local equals itself run again
    amp_step = next(f for f in result["figures"] if "autocast" in f["figure"])
    assert "losses differ from local's from step" in amp_step["note"], amp_step
    assert amp_step["note"].endswith("local equals itself run again"), amp_step


def test_gpuwire_bench_runs_the_suite_from_any_directory(tmp_path):
    """``gpuwire bench`` is ``python -m bench`` from wherever it is typed: its options and
    errors are the suite's, and the results land where ``--out`` says."""
    gpuwire = [sys.executable, "-m", "gpuwire", "bench"]
    helped = subprocess.run([*gpuwire, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--only" in helped.stdout and "--quick" in helped.stdout, helped.stderr
    wrong = subprocess.run([*gpuwire, "--only", "nope"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2 and "unknown benchmark(s) nope" in wrong.stderr
    run = subprocess.run([*gpuwire, "--quick", "--only", "per_op", "--out", str(tmp_path / "out")], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "per_op.json").read_text())["status"] == "ok"
