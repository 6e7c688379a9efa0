"""Two busy sessions with shares 0.25 and 0.75 get device time in that proportion (±10%)."""

import os
import subprocess
import sys
import textwrap
import time

from gpuwire.smi import fetch

LOAD = textwrap.dedent("""
    import sys, time, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    a = torch.randn(384, 384, device="gpuwire")
    print("ready", flush=True)
    sys.stdin.readline()                        # start together
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:       # stream without waiting: always work queued on the node
        b = a @ a
    print("done", flush=True)
""")


def test_busy_sessions_split_device_time_by_share(fresh_node):
    procs = []
    try:
        for share in ("0.25", "0.75"):
            procs.append(subprocess.Popen([sys.executable, "-c", LOAD, fresh_node.address, "6"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          env={**os.environ, "GPUWIRE_SHARE": share, "OMP_NUM_THREADS": "1"}))
        for p in procs:
            assert p.stdout.readline().startswith("ready")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        time.sleep(4.5)  # measure while both are still busy
        info, _ = fetch(fresh_node.address, None)
        by_share = {s["share"]: s["device_seconds"] for s in info["sessions"]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    total = by_share[0.25] + by_share[0.75]
    assert total > 1.0
    small = by_share[0.25] / total
    assert abs(small - 0.25) <= 0.10 * 0.25 + 0.025, by_share  # within ±10% of the 25% share (2.5 points slack)


def test_an_idle_share_is_lent_to_a_busy_session(fresh_node):
    """Alone on the device, a session with a 0.25 share is not throttled to 25%."""
    proc = subprocess.Popen([sys.executable, "-c", LOAD, fresh_node.address, "4"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "GPUWIRE_SHARE": "0.25", "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().startswith("ready")
        fetch(fresh_node.address, None)  # start the utilization window
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(3)
        info, _ = fetch(fresh_node.address, None)
    finally:
        proc.kill()
    assert info["utilization"] > 60, info
