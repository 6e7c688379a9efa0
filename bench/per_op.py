"""Per-op client cost on loopback: small ops streamed, then one synchronize.

For each op, N calls (10,000; 1,000 with --quick) are issued back to back on a gpuwire tensor
and then ``gpuwire.synchronize()`` waits for the node to finish them all. Reported:
``us/op`` = (dispatch of the N ops + the final synchronize) / N, next to the same N calls on
a local CPU tensor; and the client's dispatch time alone (before the synchronize). Each loop
runs 3 times, local and remote alternating, and the median repetition is reported. Views
must send no message: the ops_sent delta over the view loop is reported (target 0).
"""

from __future__ import annotations

import time

import torch

from .common import median

NAME = "per_op"
DESCRIPTION = "client cost per op on loopback (streamed, one synchronize), vs the same op on local CPU"


# The client-cost targets (us/op of dispatch); the matmul is node-bound and has none.
CLIENT_COST_TARGET_US = {"x + 1 (1k floats)": 15.0, "x.add_(1) (1k floats)": 10.0, "x.view(-1) (1k floats)": 8.0}


def _ops(n_elems: int = 1000):
    return [
        ("x + 1 (1k floats)", lambda: torch.randn(n_elems), lambda x, _: x + 1),
        ("x.add_(1) (1k floats)", lambda: torch.randn(n_elems), lambda x, _: x.add_(1)),
        ("x.view(-1) (1k floats)", lambda: torch.randn(n_elems), lambda x, _: x.view(-1)),
        ("matmul 256x256", lambda: torch.randn(256, 256), lambda a, b: a @ b),
        # ops that are not structured: an in-place activation (``nn.ReLU(inplace=True)``) and
        # composites that reach the device as ``empty(0)`` + an out= op (session 35: 6 / 39 / 70 us)
        ("x.relu_() (1k floats)", lambda: torch.randn(n_elems), lambda x, _: x.relu_()),
        ("x.abs() (1k floats)", lambda: torch.randn(n_elems), lambda x, _: x.abs()),
        ("soft_margin_loss (1k floats)", lambda: torch.randn(n_elems),
         lambda x, y: torch.nn.functional.soft_margin_loss(x, y)),
    ]


def _loop(fn, a, b, n: int) -> None:
    for _ in range(n):
        fn(a, b)


def run(ctx, result) -> None:
    import gpuwire

    n = 1000 if ctx.quick else 10000
    warm, reps = 200, 3
    result.config.update({"ops_per_loop": n, "warmup": warm, "repetitions": reps})
    ctx.attach()
    dev = torch.device("gpuwire")
    for label, make, fn in _ops():
        try:
            a_cpu, b_cpu = make(), make()
            a, b = a_cpu.to(dev), b_cpu.to(dev)
            _loop(fn, a_cpu, b_cpu, warm)
            _loop(fn, a, b, warm)
            gpuwire.synchronize()
            local, total, dispatch, sent, sent_bytes, trips = [], [], [], [], [], []
            for _ in range(reps):  # local and remote alternate; the median repetition is reported
                t0 = time.perf_counter()
                _loop(fn, a_cpu, b_cpu, n)
                local.append(time.perf_counter() - t0)
                s0 = gpuwire.stats()
                t0 = time.perf_counter()
                _loop(fn, a, b, n)
                t1 = time.perf_counter()
                s_mid = gpuwire.stats()  # before the synchronize: what the loop itself sent
                gpuwire.synchronize()
                t2 = time.perf_counter()
                s1 = gpuwire.stats()
                total.append(t2 - t0)
                dispatch.append(t1 - t0)
                sent.append(s_mid["ops_sent"] - s0["ops_sent"])
                sent_bytes.append(s_mid["bytes_sent"] - s0["bytes_sent"])
                trips.append(s1["round_trips"] - s0["round_trips"])
            local_us = median(local) / n * 1e6
            result.add(f"{label}: per op", median(total) / n * 1e6, "us/op", local_us,
                       baseline_label="local CPU us/op")
            dispatch_us = median(dispatch) / n * 1e6
            bound = CLIENT_COST_TARGET_US.get(label)
            result.add(f"{label}: client dispatch only", dispatch_us, "us/op", local_us,
                       baseline_label="local CPU us/op",
                       target=None if bound is None else f"<= {bound:g} us", ok=None if bound is None else dispatch_us <= bound,
                       note=f"{max(sent)} op messages queued per loop of {n}, "
                            f"{max(trips)} round trip(s) incl. the synchronize")
            if "view" in label:
                result.add(f"messages sent for {n:,} views", max(sent), "msgs", target="== 0", ok=max(sent) == 0,
                           note=f"bytes written to the socket during the loop: {max(sent_bytes)}")
            del a, b
        except Exception as exc:  # noqa: BLE001 - record and go on with the next op
            result.fail(label, exc)
