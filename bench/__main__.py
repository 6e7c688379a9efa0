"""Run the gpuwire benchmarks: ``python -m bench [--quick] [--only NAME,...] [--out bench/results]``.

Each benchmark runs its gpuwire measurement side by side with a local baseline in this same
run (see docs/performance.md). The runner starts the node (and proxies) it needs as child
processes with the same intra-op thread count as this process, prints a table, writes
``<out>/<name>.json`` per benchmark, and kills every child it started (by pid) at the end,
on error, on Ctrl-C / SIGTERM, and when a benchmark overruns ``--timeout``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

BENCHMARKS = ("per_op", "round_trips", "step_ratio", "issue", "generate", "bulk", "latency", "tenants", "memory", "gpu", "failover")


def default_threads() -> int:
    """Half the usable CPUs (at least 1): the node and the client each get their share, and
    the local baseline runs with the same count."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, usable // 2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description="Run the gpuwire benchmarks, each side by "
                                     "side with its local baseline; see docs/performance.md.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions and sizes (well under a minute on a 2-core VM)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", default="bench/results", help="folder for the <name>.json files")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads, both for the node and the local baseline (default: half the CPUs)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one benchmark may take before its processes are killed "
                             "(default 300, or 900 without --quick)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    args.names = names
    args.threads = args.threads or default_threads()
    args.timeout = args.timeout or (300.0 if args.quick else 900.0)
    return args


# ---------------------------------------------------------------- output


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3g}"
    return str(x)


def rows(results: list[dict]) -> list[list[str]]:
    out = []
    for res in results:
        for fig in res["figures"]:
            value = fig.get("error") or _fmt(fig["value"])
            out.append([res["name"], fig["figure"], value, fig.get("unit", ""), _fmt(fig.get("baseline")),
                        fig.get("baseline_is", ""), _fmt(fig.get("ratio")), fig.get("target", ""),
                        _fmt(fig["ok"]) if "ok" in fig else ""])
    return out


HEADERS = ["benchmark", "figure", "value", "unit", "baseline", "baseline is", "ratio", "target", "ok"]


def print_table(results: list[dict], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for r in [HEADERS, *rows(results)]:
            print(" | ".join(r))
        return
    table = Table(title=title, show_lines=False)
    for h in HEADERS:
        table.add_column(h, justify="right" if h in ("value", "baseline", "ratio") else "left",
                         overflow="fold")
    last = None
    for r in rows(results):
        if last is not None and r[0] != last:
            table.add_section()
        last = r[0]
        style = "red" if ("FAILED" in r[1] or r[8] == "NO") else None
        table.add_row(*r, style=style)
    Console(width=max(120, _terminal_width())).print(table)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 160


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)

    from .common import Context, Result, detach, environment, write_json

    out_dir = Path(args.out)
    ctx = Context(quick=args.quick, threads=args.threads, log=lambda *a: print(*a, file=sys.stderr))

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    results: list[dict] = []
    started = time.perf_counter()
    print(f"gpuwire bench: {', '.join(args.names)}; {'quick' if args.quick else 'full'} mode; "
          f"{args.threads} intra-op thread(s) on both sides; results in {out_dir}/", flush=True)
    try:
        for name in args.names:
            module = importlib.import_module(f"bench.{name}")
            result = Result(name=name, description=module.DESCRIPTION)
            result.config.update({"quick": args.quick, "threads": args.threads})
            timed_out = threading.Event()

            def overrun(name=name, timed_out=timed_out):
                timed_out.set()
                print(f"bench: {name} overran {args.timeout:g} s; killing its processes", file=sys.stderr)
                ctx.abort(f"{name} overran {args.timeout:g} s")

            ctx.aborted = None
            watchdog = threading.Timer(args.timeout, overrun)
            watchdog.daemon = True
            t0 = time.perf_counter()
            print(f"\n== {name}: {module.DESCRIPTION}", flush=True)
            watchdog.start()
            try:
                module.run(ctx, result)
            except KeyboardInterrupt as exc:
                result.fail(name, exc)
                raise
            except Exception as exc:  # noqa: BLE001 - a failed benchmark is a result, not the end of the run
                result.fail(name, exc)
            finally:
                watchdog.cancel()
                detach()
                if timed_out.is_set():
                    result.fail(name, TimeoutError(f"overran the {args.timeout:g} s limit (--timeout)"))
                result.duration_s = time.perf_counter() - t0
                data = result.to_json(environment(args.threads))
                write_json(out_dir / f"{name}.json", data)
                results.append(data)
                print_table([data], f"{name} ({result.status}, {result.duration_s:.1f} s)")
                for err in result.errors:
                    print(f"  {err['part']}: {err['error']}", file=sys.stderr)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        detach()
        ctx.kill_all()
    total = time.perf_counter() - started
    print()
    print_table(results, f"gpuwire bench summary ({'quick' if args.quick else 'full'}, {total:.0f} s, "
                         f"{args.threads} thread(s) each side)")
    failed = [r["name"] for r in results if r["status"] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)} (errors in their JSON files)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
