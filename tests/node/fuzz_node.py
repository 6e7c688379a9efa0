"""Fuzz a real node for a while: ``python -m tests.node.fuzz_node --minutes 10``.

Runs the node-request fuzzer (tests/node/test_request_fuzz.py) in rounds, each a fresh node
and a fresh hypothesis seed with ``--scale`` times CI's number of examples, until the time is
up; stops at the first failure and prints the seed that reproduces it::

    python -m pytest tests/node/test_request_fuzz.py --hypothesis-seed=SEED   (GPUWIRE_FUZZ_SCALE=...)

Run it from the repository root. Exit status 0: no failure in the time given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILE = os.path.join("tests", "node", "test_request_fuzz.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.node.fuzz_node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    parser.add_argument("--scale", type=float, default=5.0,
                        help="examples per round as a multiple of CI's ~3,000 cases (default 5)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.minutes * 60
    totals: Counter = Counter()
    rounds, scale, per_unit = 0, args.scale, None
    while True:
        remaining = deadline - time.monotonic()
        if per_unit is not None:  # fit the last round into the time left
            scale = min(args.scale, remaining / per_unit)
        if remaining <= 0 or scale < 0.05:
            break
        seed = random.getrandbits(64)
        with tempfile.TemporaryDirectory() as folder:
            report = os.path.join(folder, "report.json")
            env = {**os.environ, "GPUWIRE_FUZZ_SCALE": f"{scale:.3f}", "GPUWIRE_FUZZ_REPORT": report}
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                   "ignore::DeprecationWarning", TEST_FILE, f"--hypothesis-seed={seed}"]
            started = time.monotonic()
            result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            elapsed = time.monotonic() - started
            stats = {}
            if os.path.exists(report):
                with open(report) as f:
                    stats = json.load(f)
        rounds += 1
        totals.update(stats)
        per_unit = elapsed / max(scale, 1e-3)
        print(f"round {rounds}: seed {seed}, scale {scale:.2f}, {elapsed:.0f} s, {stats}", flush=True)
        if result.returncode != 0:
            print(result.stdout[-6000:], result.stderr[-3000:], sep="\n")
            print(f"FAILED in round {rounds}; reproduce with:\n  GPUWIRE_FUZZ_SCALE={scale:.3f} python -m pytest "
                  f"{TEST_FILE} --hypothesis-seed={seed}", flush=True)
            return 1
    print(f"node fuzz: {rounds} rounds, {totals.get('cases', 0)} cases, {totals.get('frames', 0)} frames, "
          f"{totals.get('attacker_drops', 0)} attacker sessions dropped by the node, "
          f"{totals.get('good_checks', 0)} good-client checks, no failure", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
