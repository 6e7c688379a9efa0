"""Print the figures of a results folder as a Markdown table (for docs/performance.md).

    python -m bench.report [bench/results]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .__main__ import BENCHMARKS, HEADERS, rows


def load(folder: Path) -> list[dict]:
    found = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    order = [n for n in BENCHMARKS if n in found] + [n for n in found if n not in BENCHMARKS]
    return [found[n] for n in order]


def markdown(results: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows(results):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else "bench/results")
    results = load(folder)
    if not results:
        sys.exit(f"no result files in {folder}/")
    first = results[0]
    m = first["machine"]
    dirty = "+dirty" if first.get("git_dirty") else ""
    print(f"gpuwire {first['gpuwire_version']} (git {str(first['git_sha'])[:10]}{dirty}), "
          f"torch {first['torch_version']}, {m['cpu_count']} CPUs, {m['platform']}, "
          f"{m['intra_op_threads']} intra-op thread(s) each side, {first['timestamp']}, "
          f"mode {'quick' if first['config'].get('quick') else 'full'}, load average {m.get('load_avg')}\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
