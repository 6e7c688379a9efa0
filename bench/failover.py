"""What durability costs and how fast a job comes back (issue 8's figures).

1. Steady-state overhead: training-step time of each durability mode (``reconnect``,
   ``checkpoint`` at its default 60 s interval and at a 5 s interval) over ``none``, same node,
   short blocks of steps per mode, the modes alternating round after round (load drift on a
   shared machine hits all alike); medians. Plus the client memory the recovery state holds.
2. Recovery time: a pool and two CPU nodes on loopback; this process leases a GPU (checkpoint
   mode), trains, the node under it is SIGKILLed; figure: time from the kill to the next
   completed step (replacement lease + snapshot upload + replay), by model size.
3. Drain pause: ``gpuwire drain`` moves a session holding S MiB of live tensors node to node;
   figure: the pause the client measured, per GiB.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from .common import median
from .models import DESCRIPTIONS, Workload

NAME = "failover"
DESCRIPTION = "durability overhead per mode, recovery time after a node SIGKILL, drain pause per GiB"

MODES = (("none", None), ("reconnect", None), ("checkpoint", None), ("checkpoint", "5"))


def _set_mode(mode: str, interval: str | None) -> None:
    os.environ["GPUWIRE_DURABILITY"] = mode
    if interval is None:
        os.environ.pop("GPUWIRE_CHECKPOINT_INTERVAL", None)
    else:
        os.environ["GPUWIRE_CHECKPOINT_INTERVAL"] = interval


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run(ctx, result) -> None:
    keys = ("GPUWIRE_DURABILITY", "GPUWIRE_CHECKPOINT_INTERVAL", "GPUWIRE_POOL", "GPUWIRE_LEASE_ID",
            "GPUWIRE_API_KEY", "GPUWIRE_RECONNECT_GRACE")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        _overhead(ctx, result)
        _recovery_and_drain(ctx, result)
    finally:
        _restore_env(saved)


def _overhead(ctx, result) -> None:
    import gpuwire
    rounds, steps = (2, 8) if ctx.quick else (4, 12)
    labels = ("none", "reconnect", "checkpoint", "checkpoint@5s")
    for kind in ("cnn", "gpt2"):
        try:
            samples = {label: [] for label in labels}
            memory = {}
            for _ in range(rounds):  # modes alternate in short blocks, so load drift hits all alike
                for label, (mode, interval) in zip(labels, MODES):
                    _set_mode(mode, interval)
                    ctx.attach()
                    w = Workload(kind, torch.device("gpuwire"))
                    for _ in range(2):
                        w.step()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        w.step()
                        samples[label].append(time.perf_counter() - t0)
                    stats = gpuwire.stats()
                    memory[label] = (stats.get("recovery_snapshot_bytes", 0), stats.get("recovery_log_bytes", 0),
                                     stats.get("checkpoints", 0))
                    del w
            times = {label: median(xs) * 1e3 for label, xs in samples.items()}
            base = times["none"]
            for label in labels[1:]:
                target = "<= 1.05 (checkpoint at its default interval)" if label == "checkpoint" else None
                ok = times[label] / base <= 1.05 if label == "checkpoint" else None
                snap, log_bytes, checkpoints = memory[label]
                result.add(f"{kind}: step time, durability {label}", times[label], "ms", base,
                           baseline_label="durability none ms", target=target, ok=ok,
                           note=f"{DESCRIPTIONS[kind]}; {rounds} rounds x {steps} steps per mode, alternating; "
                                f"{checkpoints} checkpoint(s) in the last block; recovery state held by the client: "
                                f"snapshot {snap / 2**20:.2f} MiB + log {log_bytes / 2**20:.2f} MiB")
            snap, log_bytes, _ = memory["checkpoint@5s"]
            result.add(f"{kind}: client memory for recovery state (checkpoint)", (snap + log_bytes) / 2**20, "MiB",
                       note="snapshot of every live remote tensor + replay log since it (at the end of the block)")
        except Exception as exc:  # noqa: BLE001
            result.fail(f"overhead {kind}", exc)


def _recovery_and_drain(ctx, result) -> None:
    from gpuwire.pool.client import PoolClient

    from tests.pool.conftest import PoolProcess  # a real `gpuwire pool`, killed by pid at the end

    folder = tempfile.mkdtemp(prefix="gpuwire-bench-failover-")
    pool = PoolProcess(folder, "--heartbeat-interval", "0.5")
    url = pool.url
    admin = PoolClient(url, pool.admin_key)
    node_key = admin.create_key(role="node")["key"]
    admin.create_tenant("bench")
    tenant_key = admin.create_key(tenant="bench")["key"]
    nodes = {}

    def start_node(name: str):
        nodes[name] = ctx.spawn([sys.executable, "-m", "gpuwire", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--backend", "cpu", "--threads", str(ctx.threads), "--pool", url, "--node-id", name,
                                 "--pool-memory", "8GiB", "--log-level", "warning", "--exit-with-stdin"],
                                what=f"node {name}", env={"GPUWIRE_API_KEY": node_key, "GPUWIRE_POOL": ""})
        deadline = time.monotonic() + 30
        while not any(n["id"] == name and n["state"] == "alive" for n in admin.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name} did not join the pool")
            time.sleep(0.1)

    for name in ("b1", "b2"):
        start_node(name)
    tenant = PoolClient(url, tenant_key)
    import gpuwire
    try:
        for kind in ("mlp", "cnn", "gpt2"):
            try:
                lease = tenant.request_lease(memory="1GiB", share=0.5)
                lease.keep_alive()
                os.environ.update(GPUWIRE_POOL=url, GPUWIRE_LEASE_ID=lease.id, GPUWIRE_API_KEY=tenant_key,
                                  GPUWIRE_DURABILITY="checkpoint", GPUWIRE_CHECKPOINT_INTERVAL="60")
                gpuwire.attach(lease.address, token=lease.token)
                w = Workload(kind, torch.device("gpuwire"))
                step_times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    w.step()
                    step_times.append(time.perf_counter() - t0)
                stats = gpuwire.stats()
                state = stats["recovery_snapshot_bytes"] + stats["recovery_log_bytes"]
                victim = next(n for n, c in nodes.items() if c.address == lease.address)
                t_kill = time.perf_counter()
                ctx.kill(nodes[victim])
                w.step()
                recovered = time.perf_counter() - t_kill
                stats = gpuwire.stats()
                result.add(f"{kind}: recovery, kill to next completed step", recovered, "s",
                           median(step_times), baseline_label="one step, s",
                           note=f"{DESCRIPTIONS[kind]}; {stats.get('rebuilds')} rebuild(s); recovery state "
                                f"{state / 2**20:.2f} MiB; replay of {stats.get('ops_sent')} ops at most")
                gpuwire.detach()
                lease.release()
                start_node(victim)
            except Exception as exc:  # noqa: BLE001
                result.fail(f"recovery {kind}", exc)
        try:
            size = (64 if ctx.quick else 512) << 20
            lease = tenant.request_lease(memory="2GiB", share=0.5)
            lease.keep_alive()
            os.environ.update(GPUWIRE_POOL=url, GPUWIRE_LEASE_ID=lease.id, GPUWIRE_API_KEY=tenant_key,
                              GPUWIRE_DURABILITY="checkpoint", GPUWIRE_CHECKPOINT_INTERVAL="3600")
            gpuwire.attach(lease.address, token=lease.token)
            held = torch.ones(size // 4, device="gpuwire")
            held.sum().item()
            victim = next(n for n, c in nodes.items() if c.address == lease.address)
            admin.drain_node(victim)
            deadline = time.monotonic() + 120
            while gpuwire.stats().get("migrations", 0) < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the session did not move off the draining node")
                held.sum().item()  # a sync point: where the client learns of the drain and moves
                time.sleep(0.05)
            pause = gpuwire.stats()["last_migration_pause"]
            assert held.sum().item() == size // 4
            result.add("drain pause per GiB of live tensors", pause / (size / 2**30), "s/GiB",
                       note=f"{size >> 20} MiB moved node to node; pause {pause:.3f} s (replacement lease, copy, "
                            "switch-over)")
            gpuwire.detach()
            lease.release()
            admin.undrain_node(victim)
        except Exception as exc:  # noqa: BLE001
            result.fail("drain", exc)
    finally:
        try:
            gpuwire.detach()
        except Exception:  # noqa: BLE001
            pass
        tenant.close()
        admin.close()
        for child in nodes.values():
            ctx.kill(child)
        pool.kill()
