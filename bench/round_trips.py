"""Round trips (and messages) per training step, from ``gpuwire.stats()`` deltas.

For each model: a few warm-up steps, then K steps (forward, loss, zero_grad, backward,
optimizer step, ``loss.item()``); round trips per step = Δround_trips / K. A step needs one
round trip (reading the loss); anything above that is a sync the client could not avoid
(a data-dependent shape, a non-tensor result, a host read).
"""

from __future__ import annotations

import torch

from .models import DESCRIPTIONS, MODELS, Workload

NAME = "round_trips"
DESCRIPTION = "round trips and messages per training step (gpuwire.stats deltas after warm-up)"


def run(ctx, result) -> None:
    import gpuwire

    warm, steps = 3, (5 if ctx.quick else 20)
    result.config.update({"warmup_steps": warm, "steps": steps, "models": DESCRIPTIONS})
    for kind in MODELS:
        try:
            ctx.attach()
            w = Workload(kind, torch.device("gpuwire"))
            for _ in range(warm):
                w.step()
            s0 = gpuwire.stats()
            for _ in range(steps):
                w.step()
            s1 = gpuwire.stats()
            rts = (s1["round_trips"] - s0["round_trips"]) / steps
            msgs = (s1["ops_sent"] - s0["ops_sent"]) / steps
            sent = (s1["bytes_sent"] - s0["bytes_sent"]) / steps
            result.add(f"{kind}: round trips / step", rts, "rt/step", target="<= 1", ok=rts <= 1,
                       note=DESCRIPTIONS[kind])
            result.add(f"{kind}: op messages / step", msgs, "msgs/step",
                       note=f"{sent / 1024:.1f} KiB sent per step (batch upload included)")
            del w
        except Exception as exc:  # noqa: BLE001
            result.fail(kind, exc)
