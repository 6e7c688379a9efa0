"""Sensitivity to round-trip time: CNN training step through a delay proxy.

For each RTT (0, 1, 10, 50 ms; --quick: 0 and 10) a ``bench.delay_proxy`` child is put
between this client and the node (one-way delay = RTT/2 each way; at 0 ms the proxy still
forwards, so its own cost is included). A fresh session attaches through it; the CNN step is
timed alternately with a local CPU step (medians after warm-up). A first row goes direct to
the node (no proxy), so the proxy's own cost (a Python process competing for the same
cores) can be read off the 0 ms row. A step with one round trip
should cost about local + RTT; the figure reports the bound local + 1.2 × RTT and whether
the median step stays within it. The measured ``synchronize()`` time on an idle session is
reported too, to show the RTT the proxy actually adds.
"""

from __future__ import annotations

import time

import torch

from .common import median
from .models import DESCRIPTIONS, Workload
from .step_ratio import timed

NAME = "latency"
DESCRIPTION = "CNN step time through a TCP delay proxy at several RTTs vs local CPU step + 1.2*RTT"


def run(ctx, result) -> None:
    import gpuwire

    rtts = [0, 10] if ctx.quick else [0, 1, 10, 50]
    warm, steps = 3, (10 if ctx.quick else 25)
    result.config.update({"rtt_ms": rtts, "warmup_steps": warm, "steps": steps, "model": DESCRIPTIONS["cnn"]})
    node = ctx.node()
    for rtt in [None, *rtts]:  # None: direct to the node, no proxy (shows what the proxy itself costs)
        label = "direct, no proxy" if rtt is None else f"{rtt} ms RTT"
        proxy = None
        try:
            if rtt is None:
                ctx.attach(node.address)
            else:
                proxy = ctx.proxy(node.address, rtt / 2)
                ctx.attach(proxy.address)
            local = Workload("cnn", "cpu")
            remote = Workload("cnn", torch.device("gpuwire"))
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
                result.add(f"cnn step, {label}", rm, "ms", lm, baseline_label="local CPU ms",
                           note=f"{rts:g} round trips/step")
                result.add(f"idle synchronize(), {label}", median(syncs) * 1e3, "ms")
                continue
            bound = lm + 1.2 * rtt
            result.add(f"cnn step @ {label}", rm, "ms", lm, baseline_label="local CPU ms",
                       target=f"<= {bound:.2f} ms (local + 1.2*RTT)", ok=rm <= bound,
                       note=f"{rts:g} round trips/step")
            result.add(f"idle synchronize() @ {label}", median(syncs) * 1e3, "ms",
                       note="measured round trip through the proxy")
            del local, remote
        except Exception as exc:  # noqa: BLE001
            result.fail(label, exc)
        finally:
            from .common import detach
            detach()
            if proxy is not None:
                ctx.kill(proxy)
