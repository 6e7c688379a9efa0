"""Round trips (and messages) per training step, from ``gpuwire.stats()`` deltas.

For each model: a few warm-up steps, then K steps (forward, loss, zero_grad, backward,
optimizer step, ``loss.item()``); round trips per step = Δround_trips / K. A step needs one
round trip (reading the loss); anything above that is a sync the client could not avoid
(a data-dependent shape, a non-tensor result, a host read).

Also a transformers-style step, as ``Trainer`` runs it: a BERT classifier given a padded
attention mask (the model checks ``padding_mask.all()``), then Trainer's per-step
``torch.isnan(loss) or torch.isinf(loss)`` in place of reading the loss; measured with the
client's known values (``client/mirror.py``) and without (GPUWIRE_KNOWN_VALUES=0), side by side.
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
    try:
        ctx.attach()
        _trainer_step(result, warm, steps)
    except Exception as exc:  # noqa: BLE001
        result.fail("bert trainer step", exc)


def _trainer_step(result, warm: int, steps: int) -> None:
    import transformers
    from transformers import BertConfig, BertForSequenceClassification

    import gpuwire
    from gpuwire.client import mirror

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2,
                     vocab_size=512)
    model = BertForSequenceClassification(cfg).to("gpuwire")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (8, 64), generator=g)
    mask = (torch.arange(64) < torch.randint(32, 65, (8, 1), generator=g)).long()
    labels = torch.randint(0, 2, (8,), generator=g)

    def step():
        loss = model(input_ids=ids.to("gpuwire"), attention_mask=mask.to("gpuwire"), labels=labels.to("gpuwire")).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return bool(torch.isnan(loss) or torch.isinf(loss))  # Trainer's logging_nan_inf_filter

    counts = {}
    for known in (True, False):
        enabled, mirror.ENABLED = mirror.ENABLED, known
        try:
            for _ in range(warm):
                step()
            before = gpuwire.stats()["round_trips"]
            for _ in range(steps):
                step()
            counts[known] = (gpuwire.stats()["round_trips"] - before) / steps
        finally:
            mirror.ENABLED = enabled
    result.add("bert (masked) trainer step: round trips / step", counts[True], "rt/step", counts[False],
               baseline_label="rt/step, GPUWIRE_KNOWN_VALUES=0", target="<= 1", ok=counts[True] <= 1,
               note="BERT 2 layers d=64, batch 8 x 64 tokens padded; mask check + isnan/isinf of the loss")
