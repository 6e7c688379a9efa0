"""Placement: which GPU(s) a lease request goes to. Pure functions, no I/O.

Sits inside the pool's core: ``core`` builds a list of ``Gpu`` (capacity and what is already
placed on each) from the store, calls ``place`` and stores the ``Slot``s it returns.

A request is **whole** (``share == 1``: the GPU is the lease's alone, every byte of it unless
``memory`` says less) or **fractional** (``0 < share < 1``: a memory budget and a compute share
of one GPU, next to other fractional leases). The rules:

* a whole request takes only a GPU with nothing on it; fractional requests go first to
  GPUs that are **already shared** (the most used one that still fits: best fit), and
  open an empty GPU only when no shared one has room -- so whole GPUs stay free for whole
  requests and capacity is not stranded in many half-used GPUs;
* an empty GPU is taken from the node with the **fewest** empty GPUs (big free nodes stay
  whole for multi-GPU requests), and the smallest GPU that fits is preferred (best fit);
* a multi-GPU request goes to **one node** when one has enough empty GPUs (the one with the
  fewest that suffices), else it is spread over as few nodes as possible;
* ``model`` (a case-insensitive part of the GPU's name, e.g. ``"A100"``) and ``labels``
  (all must equal the node's labels; ``backend`` is always one) constrain the candidates;
* a GPU holds at most ``max_sessions`` leases (whole or fractional).

Ties are broken by node id then device index, so placement is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

EPSILON = 1e-9


@dataclass(frozen=True)
class Gpu:
    """One GPU of an alive node: its capacity and what is already placed on it."""
    node_id: str
    index: int
    name: str
    memory: int                      # bytes the node offers on this GPU
    backend: str = "cuda"
    labels: Mapping[str, str] = field(default_factory=dict)
    max_sessions: int = 8
    used_memory: int = 0
    used_share: float = 0.0
    sessions: int = 0                # leases on it (whole or fractional)
    exclusive: bool = False          # held whole by one lease

    @property
    def free_memory(self) -> int:
        return max(self.memory - self.used_memory, 0)

    @property
    def free_share(self) -> float:
        return max(1.0 - self.used_share, 0.0)

    @property
    def empty(self) -> bool:
        return self.sessions == 0 and not self.exclusive

    def emptied(self) -> "Gpu":
        return replace(self, used_memory=0, used_share=0.0, sessions=0, exclusive=False)


@dataclass(frozen=True)
class Request:
    gpus: int = 1
    memory: int | None = None        # per-GPU memory budget; None: all of it (whole) or share x memory
    share: float = 1.0
    model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError("gpus must be at least 1")
        if not (0.0 < self.share <= 1.0):
            raise ValueError("share must be in (0, 1]")
        if self.memory is not None and self.memory < 0:
            raise ValueError("memory must not be negative")
        if self.gpus > 1 and not self.whole:
            raise ValueError("a fractional lease (share < 1) is on one GPU; ask for gpus=1 or share=1")

    @property
    def whole(self) -> bool:
        return self.share >= 1.0 - EPSILON


@dataclass(frozen=True)
class Slot:
    """One GPU of a placed lease: where, and the budget it got there."""
    node_id: str
    index: int
    memory: int
    share: float


def matches(request: Request, gpu: Gpu) -> bool:
    """Does ``gpu`` satisfy the request's model and label constraints (capacity aside)?"""
    if request.model and request.model.lower() not in gpu.name.lower():
        return False
    labels = {"backend": gpu.backend, **dict(gpu.labels)}
    return all(labels.get(key) == value for key, value in dict(request.labels).items())


def budget(request: Request, gpu: Gpu) -> int:
    """The memory budget ``request`` gets on ``gpu``."""
    if request.memory is not None:
        return request.memory
    return gpu.memory if request.whole else int(request.share * gpu.memory)


def fits(request: Request, gpu: Gpu) -> bool:
    """Could one GPU's part of ``request`` go on ``gpu`` now?"""
    if not matches(request, gpu) or gpu.max_sessions < 1:
        return False
    need = budget(request, gpu)
    if request.whole:
        return gpu.empty and need <= gpu.memory
    return (not gpu.exclusive and gpu.sessions < gpu.max_sessions
            and gpu.used_share + request.share <= 1.0 + EPSILON and need <= gpu.free_memory)


def _empty_per_node(gpus: Sequence[Gpu]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu.node_id] = counts.get(gpu.node_id, 0) + (1 if gpu.empty else 0)
    return counts


def place(request: Request, gpus: Sequence[Gpu]) -> list[Slot] | None:
    """Where ``request`` goes on ``gpus`` as they are now, or None if it does not fit."""
    empty_count = _empty_per_node(gpus)
    candidates = [g for g in gpus if fits(request, g)]
    if not candidates:
        return None
    if not request.whole:
        def fractional_key(g: Gpu):
            if not g.empty:  # already shared: the most used one that still fits
                return (0, g.free_share - request.share, g.free_memory - budget(request, g), 0, g.node_id, g.index)
            return (1, empty_count[g.node_id], g.memory, 0, g.node_id, g.index)
        best = min(candidates, key=fractional_key)
        return [Slot(best.node_id, best.index, budget(request, best), request.share)]

    def whole_key(g: Gpu):
        return (empty_count[g.node_id], g.memory, g.node_id, g.index)

    if request.gpus == 1:
        best = min(candidates, key=whole_key)
        return [Slot(best.node_id, best.index, budget(request, best), 1.0)]

    by_node: dict[str, list[Gpu]] = {}
    for gpu in candidates:
        by_node.setdefault(gpu.node_id, []).append(gpu)
    for node_gpus in by_node.values():
        node_gpus.sort(key=lambda g: (g.memory, g.index))
    single = [node for node, node_gpus in by_node.items() if len(node_gpus) >= request.gpus]
    if single:  # one node: the one with the fewest fitting GPUs that suffices
        node = min(single, key=lambda n: (len(by_node[n]), n))
        chosen = by_node[node][:request.gpus]
    else:  # spread over as few nodes as possible: biggest first
        if sum(len(v) for v in by_node.values()) < request.gpus:
            return None
        chosen = []
        for node in sorted(by_node, key=lambda n: (-len(by_node[n]), n)):
            chosen.extend(by_node[node][:request.gpus - len(chosen)])
            if len(chosen) == request.gpus:
                break
    return [Slot(g.node_id, g.index, budget(request, g), 1.0) for g in chosen]


def apply(gpus: Sequence[Gpu], slots: Sequence[Slot]) -> list[Gpu]:
    """The GPUs after ``slots`` are placed on them (to place several requests in a row)."""
    out = []
    for gpu in gpus:
        for slot in slots:
            if (slot.node_id, slot.index) == (gpu.node_id, gpu.index):
                whole = slot.share >= 1.0 - EPSILON
                gpu = replace(gpu, used_memory=gpu.used_memory + (gpu.memory if whole else slot.memory),
                              used_share=gpu.used_share + slot.share, sessions=gpu.sessions + 1,
                              exclusive=gpu.exclusive or whole)
        out.append(gpu)
    return out


def could_ever_fit(request: Request, gpus: Sequence[Gpu]) -> bool:
    """Would ``request`` fit if every lease on ``gpus`` ended? (False: waiting cannot help.)"""
    return place(request, [g.emptied() for g in gpus]) is not None


def free_summary(gpus: Sequence[Gpu]) -> dict:
    """What is free, for 409 replies and ``gpuwire smi --pool``."""
    rows = [{"node_id": g.node_id, "device": g.index, "name": g.name, "backend": g.backend,
             "memory": g.memory, "free_memory": 0 if g.exclusive else g.free_memory,
             "free_share": 0.0 if g.exclusive else round(g.free_share, 6),
             "sessions": g.sessions, "max_sessions": g.max_sessions, "whole_free": g.empty}
            for g in sorted(gpus, key=lambda g: (g.node_id, g.index))]
    shared = [r for r in rows
              if not r["whole_free"] and r["free_share"] > EPSILON and r["sessions"] < r["max_sessions"]]
    return {"gpus": rows, "whole_gpus_free": sum(1 for r in rows if r["whole_free"]),
            "largest_slice": max(({"share": r["free_share"], "memory": r["free_memory"], "node_id": r["node_id"],
                                   "device": r["device"]} for r in shared + [r for r in rows if r["whole_free"]]),
                                  key=lambda s: (s["share"], s["memory"]), default=None)}


def shortfall(request: Request, gpus: Sequence[Gpu]) -> str:
    """One sentence on why ``request`` does not fit now (for the 409 message)."""
    if not gpus:
        return "no alive node has registered a GPU with the pool"
    matching = [g for g in gpus if matches(request, g)]
    if not matching:
        wanted = []
        if request.model:
            wanted.append(f"model {request.model!r}")
        if request.labels:
            wanted.append("labels " + ",".join(f"{k}={v}" for k, v in dict(request.labels).items()))
        return f"no GPU matches {' and '.join(wanted)}"
    if request.whole:
        free = [g for g in matching if g.empty]
        big = [g for g in free if budget(request, g) <= g.memory]
        if len(big) < request.gpus:
            return (f"{len(big)} of the {len(matching)} matching GPUs are free as whole GPUs "
                    f"(asked for {request.gpus})")
        return "no placement found"
    room = [g for g in matching if not g.exclusive and g.sessions < g.max_sessions]
    if not room:
        return "every matching GPU is held whole or has its maximum number of sessions"
    best_share = max(g.free_share for g in room)
    if best_share + EPSILON < request.share:
        return f"the largest free compute share on a matching GPU is {best_share:g} (asked for {request.share:g})"
    best_memory = max(g.free_memory for g in room if g.free_share + EPSILON >= request.share)
    return (f"the most free memory on a matching GPU with share {request.share:g} free is {best_memory} bytes "
            f"(asked for {budget(request, room[0]) if request.memory is None else request.memory})")
