"""Where a remote step loses GPU time: ``python -m bench.gpu_timeline [--out DIR]`` with a GPU.

Sits beside ``bench.gpu`` (the ratio) and ``bench.gpu_profile`` (the host's side): it records the
device's own timeline (torch.profiler's CUDA activity: kernels, copies, and the launch behind
each) of the same GPT-2 small training steps on local CUDA and through a ``--backend cuda`` node
on this machine (``GPUWIRE_PROFILE_KERNELS``), cuts each into steps at the loss's 4-byte
device-to-host copy, and compares them step for step: wall time, the time the GPU was busy, what
idled it (each gap over ``GAP_US``, with the kernels either side and how long before it the next
kernel was launched: a short lead means the GPU waited for the host), and the kernels whose time
differs. A remote step that is longer with the same busy time starved the GPU; one with more busy
time ran other kernels. The local side runs in a child process without gpuwire (pytorch#161129).
Writes ``gpu_timeline.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

GAP_US = 20.0
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(trace_path: Path) -> list[dict]:
    with open(trace_path) as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _is_loss_read(event: dict) -> bool:
    return event.get("cat") == "gpu_memcpy" and "DtoH" in event.get("name", "") and \
        event.get("args", {}).get("bytes") == 4


def steps_of(events: list[dict], last: int) -> list[dict]:
    """The last ``last`` whole steps (loss read to loss read) of a trace, each summarised."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    reads = [i for i, e in enumerate(device) if _is_loss_read(e)]
    summaries = []
    for a, b in list(zip(reads, reads[1:]))[-last:]:
        start = device[a]["ts"] + device[a]["dur"]
        end = device[b]["ts"] + device[b]["dur"]
        work = device[a + 1:b + 1]
        busy, gaps, cursor, previous = 0.0, [], start, device[a]
        by_name: Counter = Counter()
        for event in work:
            gap = event["ts"] - cursor
            if gap > GAP_US:
                launch = launches.get(event.get("args", {}).get("correlation"))
                gaps.append({"us": round(gap, 1), "after": previous["name"][:80], "before": event["name"][:80],
                             "launched_us_before_it_ran": round(event["ts"] - launch["ts"], 1) if launch else None})
            busy += max(0.0, event["ts"] + event["dur"] - max(cursor, event["ts"]))
            if event["ts"] + event["dur"] > cursor:
                cursor, previous = event["ts"] + event["dur"], event
            by_name[event["name"][:100]] += event["dur"]
        summaries.append({"wall_us": round(end - start, 1), "busy_us": round(busy, 1),
                          "idle_us": round(end - start - busy, 1), "device_events": len(work),
                          "kernels": sum(1 for e in work if e["cat"] == "kernel"),
                          "gaps_over_threshold_us": round(sum(g["us"] for g in gaps), 1),
                          "gaps": sorted(gaps, key=lambda g: -g["us"]), "by_name": by_name})
    return summaries


def launchers(events: list[dict], kernel_word: str = "direct_copy", top: int = 12) -> list:
    """Which host ops launched the kernels whose name holds ``kernel_word``, with counts: the
    chain of ``cpu_op`` events (outermost first) around each kernel's launch (only where the
    trace was recorded with the host's ops)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    if not ops:
        return []
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    chains: Counter = Counter()
    for kernel in events:
        if kernel.get("cat") != "kernel" or kernel_word not in kernel.get("name", ""):
            continue
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            continue
        around = [op["name"] for op in ops if op.get("tid") == launch.get("tid")
                  and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
        chains[" > ".join(around[-4:])] += 1
    return chains.most_common(top)


def compare(local: list[dict], remote: list[dict], top: int = 15) -> dict:
    def mean(side, key):
        return round(sum(s[key] for s in side) / max(len(side), 1), 1)

    keys = ("wall_us", "busy_us", "idle_us", "gaps_over_threshold_us", "device_events", "kernels")
    names: Counter = Counter()
    for s in remote:
        names.update({k: v / len(remote) for k, v in s["by_name"].items()})
    for s in local:
        names.update({k: -v / len(local) for k, v in s["by_name"].items()})
    differing = sorted(((k, round(v, 1)) for k, v in names.items() if abs(v) >= 1.0), key=lambda kv: -abs(kv[1]))
    return {
        "steps compared": [len(local), len(remote)],
        "local": {k: mean(local, k) for k in keys},
        "remote": {k: mean(remote, k) for k in keys},
        "remote's largest gaps (last step)": remote[-1]["gaps"][:top] if remote else [],
        "local's largest gaps (last step)": local[-1]["gaps"][:top] if local else [],
        "remote gaps by the kernel after them (all steps, us)": _gaps_by(remote, top),
        "kernel time remote - local, us a step": differing[:top * 2],
    }


def _gaps_by(side: list[dict], top: int) -> list:
    totals: Counter = Counter()
    for s in side:
        for g in s["gaps"]:
            totals[g["before"]] += g["us"] / len(side)
    return [(k, round(v, 1)) for k, v in totals.most_common(top)]


def _record_local(trace_path: Path, gpt: dict, batch: int, seq: int, warm: int, steps: int, amp: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from .gpu import GptTrainer
    trainer = GptTrainer(torch.device("cuda"), gpt, batch, seq, amp)
    for i in range(warm):
        trainer.step(i)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if os.environ.get("GPUWIRE_PROFILE_KERNELS_CPU") else [])
    with profile(activities=activities) as recording:
        for i in range(warm, warm + steps):
            trainer.step(i)
    recording.export_chrome_trace(str(trace_path))


def _record_remote(directory: Path, gpt: dict, batch: int, seq: int, warm: int, steps: int, amp: bool) -> Path:
    import gpuwire

    from .common import Context, wait_for_files
    from .gpu import GptTrainer
    ctx = Context(quick=False, threads=torch.get_num_threads())
    node = ctx.node("cuda", fresh=True, env={"GPUWIRE_PROFILE_KERNELS": str(directory)})
    try:
        gpuwire.attach(node.address)
        trainer = GptTrainer(torch.device("gpuwire"), gpt, batch, seq, amp)
        for i in range(warm + steps):
            trainer.step(i)
        del trainer
        gpuwire.detach()
        found = wait_for_files(directory, "session-*.trace.json", 60)
        if not found:
            raise RuntimeError("the node wrote no kernel trace within 60 s")
        return found[0]
    finally:
        ctx.kill_all()


def main(argv=None) -> int:
    from .gpu_profile import GPT2_SMALL
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--amp", action="store_true", help="the step under bf16 autocast")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep-traces", action="store_true",
                        help="also write both raw traces (gzipped Chrome traces) to --out, to read in Perfetto; "
                             "GPUWIRE_PROFILE_KERNELS_CPU=1 adds the host ops on both sides")
    parser.add_argument("--local-side", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpt, batch, seq, warm = GPT2_SMALL, 8, 512, 3
    if args.local_side:
        _record_local(args.local_side, gpt, batch, seq, warm, args.steps + 1, args.amp)
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        local_trace = scratch / "local.trace.json"
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        subprocess.run([sys.executable, "-m", "bench.gpu_timeline", "--local-side", str(local_trace),
                        "--steps", str(args.steps)] + (["--amp"] if args.amp else []), env=env, check=True,
                       timeout=300)
        remote_trace = _record_remote(scratch, gpt, batch, seq, warm, args.steps + 1, args.amp)
        local_events, remote_events = _events(local_trace), _events(remote_trace)
        result = compare(steps_of(local_events, args.steps), steps_of(remote_events, args.steps))
        result["strided copies by launching op (whole run): local"] = launchers(local_events)
        result["strided copies by launching op (whole run): remote"] = launchers(remote_events)
        if args.keep_traces:
            suffix = "_bf16" if args.amp else ""
            for side, path in (("local", local_trace), ("remote", remote_trace)):
                with open(path, "rb") as src, gzip.open(args.out / f"{side}{suffix}.trace.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    result["config"] = {"gpt": gpt, "batch": batch, "seq": seq, "amp": args.amp, "gap_us": GAP_US,
                        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    name = f"gpu_timeline{'_bf16' if args.amp else ''}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    for key in ("steps compared", "local", "remote", "remote gaps by the kernel after them (all steps, us)",
                "kernel time remote - local, us a step", "strided copies by launching op (whole run): local",
                "strided copies by launching op (whole run): remote"):
        print(key, json.dumps(result[key]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
