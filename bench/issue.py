"""The client's issue time of a GPT-2-small-deep training step, against a local step, on the CPU.

Why this figure: on a GPU the remote step keeps up with local only while the client issues a
step's ops faster than the GPU runs them (docs/performance.md, session 15: an H200 step of
GPT-2 small was 728 ops, 89 ms of GPU work, and 63-88 ms for the client to issue). That cost
does not depend on the GPU, so it is measured here, on any machine: GPT-2 with GPT-2 small's
depth (12 layers, so its op count and optimizer lists: 148 parameters) but a tiny width, batch
1×8, so the kernels are negligible on both sides. Remote: the time from the step's start until
its last op is queued (forward, backward, AdamW; the loss is read after the clock stops).
Local: the same step on the CPU, which is PyTorch's own per-op overhead plus tiny kernels.
The ratio is how much slower the client issues than PyTorch runs the same program; each phase
is reported too. Remote and local steps alternate; medians. The same step under bf16 autocast
too (session 15's H200 step was 2.57x local there: the casts add ~340 ops a step); the local
side runs CPU autocast, whose lists differ from CUDA's, so that ratio compares programs of
slightly different op counts (both printed).
"""

from __future__ import annotations

import torch

from .common import median

NAME = "issue"
DESCRIPTION = ("client issue time of a 12-layer GPT-2 step (d=64) / the same step on local CPU; "
               "predicts the GPU step ratio (the client must out-issue the GPU)")
GPT = dict(n_layer=12, n_head=2, n_embd=64, vocab_size=256, n_positions=64)
BATCH, SEQ = 1, 8


def run(ctx, result) -> None:
    rounds, steps = (3, 3) if ctx.quick else (9, 5)
    result.config.update({"model": f"GPT-2 {GPT}", "batch": BATCH, "seq": SEQ, "rounds": rounds,
                          "steps per round": steps, "optimizer": "AdamW (foreach, PyTorch's default)"})
    try:
        ctx.attach()
        for amp in (False, True):
            _measure(result, rounds, steps, amp)
    except Exception as exc:  # noqa: BLE001
        result.fail("issue", exc)


def _measure(result, rounds: int, steps: int, amp: bool) -> None:
    import gpuwire

    from .gpu import GptTrainer
    label = "12-layer GPT-2 step" + (" (bf16 autocast)" if amp else "")
    local = GptTrainer(torch.device("cpu"), GPT, BATCH, SEQ, amp)
    remote = GptTrainer(torch.device("gpuwire"), GPT, BATCH, SEQ, amp)
    for i in range(3):
        local.step(i)
        remote.step(i)
    samples = {"local": [], "remote": []}
    before = gpuwire.stats()
    for _ in range(rounds):
        for side, trainer in (("local", local), ("remote", remote)):
            for i in range(steps):
                samples[side].append(trainer.phased_step(i)[:3])  # (the loss is read after)
    after = gpuwire.stats()
    ops = (after["ops_sent"] - before["ops_sent"]) / (rounds * steps)

    def ms(side, k=None):
        return median([sum(s) if k is None else s[k] for s in samples[side]]) * 1e3
    remote_ms, local_ms = ms("remote"), ms("local")
    result.add(f"{label}: client issue time", remote_ms, "ms", local_ms, baseline_label="local CPU step ms",
               note=f"{ops:.0f} op messages a step: {remote_ms * 1e3 / ops:.0f} us an op")
    for k, phase in enumerate(("forward", "backward", "AdamW step")):
        result.add(f"{label}: {phase}", ms("remote", k), "ms", ms("local", k), baseline_label="local CPU ms")
