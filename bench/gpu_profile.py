"""Where a remote training step's time goes: ``python -m bench.gpu_profile [--backend cuda] [--out DIR]``.

Sits beside ``bench.gpu`` (which gives the ratio): it runs the same GPT-2 training step through
a node on this machine and splits each step into the client's time to issue its ops, the wait
for the loss, and the CPU time of the client and node processes, with the ops and round trips
the step costs; then profiles three steps of the client with cProfile, then five steps of a node's session thread. A step whose issue time
is close to its wall time is bound by the client's per-op cost; one whose node CPU time is, by
the node's. Writes ``gpu_profile.json``, ``gpu_profile_<variant>.txt`` (the client's profile) and
``gpu_profile_node_fp32.txt`` (the node's) to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from .common import Context, cpu_seconds, wait_for_files
from .gpu import GptTrainer

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)


def profile(node, amp: bool, gpt: dict, batch: int, seq: int, steps: int, out: Path) -> dict:
    import gpuwire
    trainer = GptTrainer(torch.device("gpuwire"), gpt, batch, seq, amp)
    for i in range(2):
        trainer.step(i)
    before = gpuwire.stats()
    client0, node0 = time.process_time(), cpu_seconds(node.pid)
    issue, wait = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        a, b, _ = trainer.timed_step(i)
        issue.append(a)
        wait.append(b)
    wall = (time.perf_counter() - t0) / steps
    after = gpuwire.stats()
    figures = {
        "step ms": round(wall * 1e3, 1),
        "issue ms (client, until the loss is read)": round(sum(issue) / steps * 1e3, 1),
        "wait ms (reading the loss)": round(sum(wait) / steps * 1e3, 1),
        "client CPU ms per step (all threads)": round((time.process_time() - client0) / steps * 1e3, 1),
        "node CPU ms per step (all threads)": round((cpu_seconds(node.pid) - node0) / steps * 1e3, 1),
        "ops per step": (after["ops_sent"] - before["ops_sent"]) / steps,
        "round trips per step": (after["round_trips"] - before["round_trips"]) / steps,
    }
    figures["client µs per op issued"] = round(figures["issue ms (client, until the loss is read)"] * 1e3 /
                                               max(figures["ops per step"], 1), 1)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(3):
        trainer.step(i)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    (out / f"gpu_profile_{'bf16' if amp else 'fp32'}.txt").write_text(text.getvalue())
    return figures


def profile_node(ctx, backend: str, amp: bool, gpt: dict, batch: int, seq: int, out: Path) -> None:
    """Three steps against a fresh node whose session thread runs under cProfile."""
    import gpuwire
    gpuwire.detach()
    directory = out / "node-profile"
    directory.mkdir(exist_ok=True)
    node = ctx.node(backend, fresh=True, env={"GPUWIRE_PROFILE_SESSIONS": str(directory.resolve())})
    gpuwire.attach(node.address)
    trainer = GptTrainer(torch.device("gpuwire"), gpt, batch, seq, amp)
    for i in range(5):
        trainer.step(i)
    del trainer
    gpuwire.detach()
    text = io.StringIO()
    for path in wait_for_files(directory, "session-*.prof", 30):
        pstats.Stats(str(path), stream=text).sort_stats("tottime").print_stats(40)
        path.unlink()
    (out / f"gpu_profile_node_{'bf16' if amp else 'fp32'}.txt").write_text(text.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--small", action="store_true", help="a tiny GPT-2 (exercises this script on a CPU)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpt = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64) if args.small else GPT2_SMALL
    batch, seq = (2, 16) if args.small else (8, 512)
    ctx = Context(quick=False, threads=torch.get_num_threads())
    results = {}
    try:
        ctx.attach(backend=args.backend)
        node = ctx.node(args.backend)
        for amp in (False, True):
            name = "bf16 autocast" if amp else "fp32"
            results[name] = profile(node, amp, gpt, batch, seq, 5, args.out)
            print(name, json.dumps(results[name], ensure_ascii=False), flush=True)
        profile_node(ctx, args.backend, False, gpt, batch, seq, args.out)
    finally:
        ctx.kill_all()
    (args.out / "gpu_profile.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
