"""Plot step time against round-trip time from a latency run: ``python -m bench.plot``.

Reads ``bench/results/latency.json`` (written by ``python -m bench --only latency``) and writes
``docs/img/step_vs_rtt.png``: per model, the median remote step at each RTT, the local step, and
the bound the target sets (local + 1.2 x RTT). Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def series(figures: list[dict]) -> dict[str, dict]:
    """{model: {"rtt": [...], "remote": [...], "local": [...]}} from the latency figures."""
    out: dict[str, dict] = {}
    for fig in figures:
        match = re.fullmatch(r"(\w+) step @ ([\d.]+) ms RTT", fig.get("figure", ""))
        if not match or fig.get("value") is None:
            continue
        model = out.setdefault(match.group(1), {"rtt": [], "remote": [], "local": []})
        model["rtt"].append(float(match.group(2)))
        model["remote"].append(fig["value"])
        model["local"].append(fig["baseline"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "latency.json"))
    parser.add_argument("--out", default=str(REPO / "docs" / "img" / "step_vs_rtt.png"))
    args = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    try:
        data = json.loads(Path(args.results).read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read {args.results}: {exc}; run `python -m bench --only latency` first", file=sys.stderr)
        return 2
    models = series(data.get("figures", []))
    if not models:
        print(f"{args.results} has no 'MODEL step @ X ms RTT' figures", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, (name, s) in zip(axes[0], sorted(models.items())):
        order = sorted(range(len(s["rtt"])), key=lambda i: s["rtt"][i])
        rtt = [s["rtt"][i] for i in order]
        remote = [s["remote"][i] for i in order]
        local = [s["local"][i] for i in order]
        ax.plot(rtt, remote, "o-", label="gpuwire (remote node)")
        ax.plot(rtt, local, "s--", label="local CPU")
        ax.plot(rtt, [lo + 1.2 * r for lo, r in zip(local, rtt)], ":", label="target: local + 1.2 x RTT")
        ax.set_xlabel("round-trip time (ms)")
        ax.set_ylabel("training step (ms, median)")
        ax.set_title(f"{name}: step time vs RTT")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gpuwire {str(data.get('git_sha') or '')[:8]}, torch {data.get('torch_version', '')}, "
                 f"{data.get('timestamp', '')}", fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
