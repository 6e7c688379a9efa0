"""Memory over a long run: client and node RSS across many training steps, and client memory
per live remote tensor.

Steady state: a fresh node and session train the MLP (``bench/models.py``) for 10,000 steps
(1,000 with --quick); the client's and the node's resident set size (``/proc/<pid>/statm``)
are sampled every 1/50 of the run. Reported: RSS at the end vs RSS after warm-up (the first
sample at or after 10 % of the steps), ratio end / warm-up (target: within 5 %), with the
smallest and largest sample after warm-up, and the live storages on both sides, in the note.

Per tensor: three batches of 10,000 small remote tensors (``x + 1`` on 4 float32, all kept
alive together) are created on a warm session; the figure is the median RSS growth of the
client per batch (KiB per 10,000), next to three such batches created on the local CPU in the
same process (baseline, kept alive too, so no batch reuses memory another freed). The node's
RSS growth per batch is reported too (its tensors hold 16 bytes of data each).
"""

from __future__ import annotations

import gc
import time

import torch

from .common import rss_bytes
from .models import DESCRIPTIONS, Workload

NAME = "memory"
DESCRIPTION = "client and node RSS over a long MLP training run (end vs after warm-up), client bytes per live tensor"

MiB = 1 << 20
LIVE_TENSORS = 10_000


def run(ctx, result) -> None:
    import gpuwire

    steps = 1000 if ctx.quick else 10_000
    every = max(1, steps // 50)
    warm = steps // 10
    result.config.update({"steps": steps, "sample_every": every, "warmup_steps": warm, "model": DESCRIPTIONS["mlp"],
                          "live_tensors": LIVE_TENSORS})
    try:
        _steady_state(ctx, result, gpuwire, steps, every, warm)
    except Exception as exc:  # noqa: BLE001 - record, go on with the other part
        result.fail("training run", exc)
    try:
        _per_tensor(ctx, result, gpuwire)
    except Exception as exc:  # noqa: BLE001
        result.fail("live tensors", exc)


def _steady_state(ctx, result, gpuwire, steps: int, every: int, warm: int) -> None:
    node = ctx.node("cpu", fresh=True)
    ctx.attach(node.address)
    w = Workload("mlp", torch.device("gpuwire"))
    samples = []  # (step, client rss, node rss, live storages)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        w.step()
        if i % every == 0:
            samples.append((i, rss_bytes(), node.rss, gpuwire.stats()["live_storages"]))
    elapsed = time.perf_counter() - t0
    node_storages = gpuwire.client.device.runtime().query("memory")["storages"]
    after = [s for s in samples if s[0] >= warm]
    first, last = after[0], after[-1]
    for label, col in (("client", 1), ("node", 2)):
        values = [s[col] for s in after]
        result.add(f"{label} RSS at step {last[0]:,}", last[col] / MiB, "MiB", first[col] / MiB,
                   baseline_label=f"MiB at step {first[0]:,} (after warm-up)", target="<= 1.05x warm-up",
                   ok=last[col] <= 1.05 * first[col],
                   note=f"after warm-up: min {min(values) / MiB:.1f}, max {max(values) / MiB:.1f} MiB over "
                        f"{len(values)} samples; live storages on the client {first[3]} -> {last[3]} (dead ones are "
                        "collected every 256 allocations, so the count moves within a step)"
                        + (f", on the node at the end {node_storages}" if label == "node" else "")
                        + f"; {steps:,} steps in {elapsed:.0f} s")
    gpuwire.detach()
    ctx.kill(node)


def _per_tensor(ctx, result, gpuwire) -> None:
    node = ctx.node("cpu", fresh=True)
    ctx.attach(node.address)
    dev = torch.device("gpuwire")
    x = torch.ones(4, device=dev)
    warm = [x + 1 for _ in range(200)]  # learn the op's layout, fill the caches
    del warm
    gpuwire.synchronize()
    x_cpu = torch.ones(4)
    kept = []  # everything stays alive until the end, so no batch reuses memory another freed

    def grow(make, pid=None):
        """RSS growth (this process, and ``pid``'s) per batch of LIVE_TENSORS, for 3 batches."""
        growth, other = [], []
        for _ in range(3):
            gc.collect()
            gpuwire.synchronize()  # the queued frames (and the replay log) go before measuring
            before, before_other = rss_bytes(), rss_bytes(pid) if pid else 0
            kept.append([make() for _ in range(LIVE_TENSORS)])
            gpuwire.synchronize()
            growth.append(rss_bytes() - before)
            if pid:
                other.append(rss_bytes(pid) - before_other)
        return sorted(growth)[1], (sorted(other)[1] if other else 0)

    live0 = gpuwire.stats()["live_storages"]
    client_growth, node_growth = grow(lambda: x + 1, node.pid)
    live1 = gpuwire.stats()["live_storages"]
    local_growth, _ = grow(lambda: x_cpu + 1)
    result.add(f"client RSS per {LIVE_TENSORS:,} live remote tensors", client_growth / 1024, "KiB",
               local_growth / 1024, baseline_label=f"KiB per {LIVE_TENSORS:,} local CPU tensors",
               note=f"{client_growth / LIVE_TENSORS:.0f} bytes per tensor (local {local_growth / LIVE_TENSORS:.0f}); "
                    f"median of 3 batches kept alive together; live storages {live0} -> {live1}")
    result.add(f"node RSS per {LIVE_TENSORS:,} live remote tensors", node_growth / 1024, "KiB",
               note=f"{node_growth / LIVE_TENSORS:.0f} bytes per tensor on the node, 16 of them data")
    kept.clear()
    gpuwire.synchronize()
    gpuwire.synchronize()  # frees are queued at a sync point and applied by the next
    freed = gpuwire.stats()["live_storages"]
    result.add("client live storages after freeing them", freed, "storages", live0, baseline_label="before",
               target="== before", ok=freed <= live0)
    gpuwire.detach()
    ctx.kill(node)
