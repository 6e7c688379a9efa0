"""Sensitivity to round-trip time: CNN and tiny GPT-2 training steps through a delay proxy.

For each RTT (0, 1, 10, 50 ms; --quick: 0 and 10) a ``bench.delay_proxy`` child is put
between this client and the node (one-way delay = RTT/2 each way; at 0 ms the proxy still
forwards, so its own cost is included). A fresh session attaches through it; a training step
of the CNN and of the tiny GPT-2 (``MODELS``) is timed alternately with the same step on local
CPU (medians after warm-up). A first row goes direct to the node (no proxy), so the proxy's own
cost (a Python process competing for the same cores) can be read off the 0 ms row. A step
with one round trip should cost about local + RTT; the figure reports the bound local + 1.2 × RTT and whether
the median step stays within it, and what each RTT added over the 0 ms row through the same
proxy, in RTTs (about the round trips per step when time scales with round trips, not with op
count). The measured ``synchronize()`` time on an idle session is reported too, to show the
RTT the proxy actually adds.
"""

from __future__ import annotations

import time

import torch

from .common import median
from .models import DESCRIPTIONS, Workload
from .step_ratio import timed

NAME = "latency"
DESCRIPTION = "CNN and GPT-2 step time through a TCP delay proxy at several RTTs vs local CPU step + 1.2*RTT"
MODELS = ("cnn", "gpt2")


def run(ctx, result) -> None:
    rtts = [0, 10] if ctx.quick else [0, 1, 10, 50]
    warm, steps = 3, (10 if ctx.quick else 25)
    result.config.update({"rtt_ms": rtts, "warmup_steps": warm, "steps": steps,
                          "models": {kind: DESCRIPTIONS[kind] for kind in MODELS}})
    for kind in MODELS:
        _model(ctx, result, kind, rtts, warm, steps)


def _model(ctx, result, kind: str, rtts: list, warm: int, steps: int) -> None:
    import gpuwire

    node = ctx.node()
    at_zero = None
    for rtt in [None, *rtts]:  # None: direct to the node, no proxy (shows what the proxy itself costs)
        label = "direct, no proxy" if rtt is None else f"{rtt} ms RTT"
        proxy = None
        try:
            if rtt is None:
                ctx.attach(node.address)
            else:
                proxy = ctx.proxy(node.address, rtt / 2)
                ctx.attach(proxy.address)
            local = Workload(kind, "cpu")
            remote = Workload(kind, torch.device("gpuwire"))
            for _ in range(warm):
                local.step()
                remote.step()
            syncs = []
            for _ in range(10):
                t0 = time.perf_counter()
                gpuwire.synchronize()
                syncs.append(time.perf_counter() - t0)
            s0 = gpuwire.stats()["round_trips"]
            lt, rt = [], []
            for _ in range(steps):
                lt.append(timed(local))
                rt.append(timed(remote))
            rts = (gpuwire.stats()["round_trips"] - s0) / steps
            lm, rm = median(lt) * 1e3, median(rt) * 1e3
            if rtt is None:
                result.add(f"{kind} step, {label}", rm, "ms", lm, baseline_label="local CPU ms",
                           note=f"{rts:g} round trips/step")
                result.add(f"{kind}: idle synchronize(), {label}", median(syncs) * 1e3, "ms")
                continue
            bound = lm + 1.2 * rtt
            result.add(f"{kind} step @ {label}", rm, "ms", lm, baseline_label="local CPU ms",
                       target=f"<= {bound:.2f} ms (local + 1.2*RTT)", ok=rm <= bound,
                       note=f"{rts:g} round trips/step")
            result.add(f"{kind}: idle synchronize() @ {label}", median(syncs) * 1e3, "ms",
                       note="measured round trip through the proxy")
            if rtt == 0:
                at_zero = rm
            elif at_zero is not None:
                # what the RTT itself added, in RTTs: ~round trips per step if time scales with
                # round trips, far more if it scaled with op count
                added = (rm - at_zero) / rtt
                result.add(f"{kind}: step time added per RTT @ {label}", added, "RTTs",
                           target=f"<= 1.2 ({rts:g} round trip/step)", ok=added <= 1.2,
                           note=f"(step @ {rtt} ms - step @ 0 ms through the same proxy) / RTT")
            del local, remote
        except Exception as exc:  # noqa: BLE001
            result.fail(f"{kind} {label}", exc)
        finally:
            from .common import detach
            detach()
            if proxy is not None:
                ctx.kill(proxy)
