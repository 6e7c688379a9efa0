"""Training-step time, remote over local, on the CPU backend (same intra-op thread count).

For each model, a remote copy (on a loopback node) and a local copy (this process, CPU) are
built from the same seed. After warm-up, N steps are timed alternately — local, remote,
local, remote … — so drift in a shared machine's load hits both sides alike. Reported:
median ms per step each side and the ratio remote/local (1.0 = no overhead).
"""

from __future__ import annotations

import time

import torch

from .common import median, quantiles
from .models import DESCRIPTIONS, MODELS, Workload

NAME = "step_ratio"
DESCRIPTION = "training step time remote (CPU-backend node on loopback) / local CPU, medians, interleaved"


# The bounds on remote / local step time.
RATIO_TARGET = {"mlp": 1.25, "cnn": 1.10, "gpt2": 1.10}


def timed(w: Workload) -> float:
    t0 = time.perf_counter()
    w.step()
    return time.perf_counter() - t0


def run(ctx, result) -> None:
    warm, steps = 3, (20 if ctx.quick else 40)
    result.config.update({"warmup_steps": warm, "steps": steps, "models": DESCRIPTIONS})
    for kind in MODELS:
        try:
            ctx.attach()
            local = Workload(kind, "cpu")
            remote = Workload(kind, torch.device("gpuwire"))
            for _ in range(warm):
                local.step()
                remote.step()
            lt, rt = [], []
            for _ in range(steps):
                lt.append(timed(local))
                rt.append(timed(remote))
            lm, rm = median(lt) * 1e3, median(rt) * 1e3
            (l25, l75), (r25, r75) = quantiles(lt), quantiles(rt)
            bound = RATIO_TARGET.get(kind)
            result.add(f"{kind}: step time", rm, "ms", lm, baseline_label="local CPU ms",
                       target=None if bound is None else f"<= {bound:g}x local",
                       ok=None if bound is None else rm <= bound * lm,
                       note=f"{DESCRIPTIONS[kind]}; IQR remote {r25 * 1e3:.2f}-{r75 * 1e3:.2f} ms, "
                            f"local {l25 * 1e3:.2f}-{l75 * 1e3:.2f} ms")
            del local, remote
        except Exception as exc:  # noqa: BLE001
            result.fail(kind, exc)
