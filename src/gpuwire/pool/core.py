"""The pool's logic: nodes, heartbeats, leases, the queue, quotas, keys. No HTTP here.

Sits between ``service`` (which turns HTTP requests into calls on ``Pool`` and ``Problem``s
into HTTP errors) and ``store`` (where every decision is written before it is answered).
``placement`` decides where a lease goes; ``tokens`` signs what the node will check.

Every mutation runs under one lock and in one store transaction, so a decision (read free
capacity, place, write the lease) is atomic. The reaper (``tick``, every half second or so)
marks nodes dead after missed heartbeats and fails their leases, expires leases that were
not renewed and queued requests that waited too long, and places queued requests as room
frees up.

Restart safety: nothing but the start time lives only in memory. After a restart, nodes get
one heartbeat timeout to heartbeat again before they are judged, and active leases get
``restart_grace`` seconds to be renewed (their clients' renewals failed while the pool was
down), so a pool restart fails no lease and no node that is really alive.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import placement
from .store import (ACTIVE, ALIVE, CANCELLED, DEAD, DRAINED, DRAINING, HEARTBEATING, EXPIRED, FAILED, LIVE_STATES, QUEUED, RELEASED, Allocation,
                    ApiKeyRecord, GpuRecord, LeaseRecord, NodeRecord, Store, TenantRecord)
from .tokens import Signer

log = logging.getLogger("gpuwire.pool")

ROLES = ("admin", "tenant", "node")
KEY_PATTERN = re.compile(r"^gpw_([0-9a-f]{8})_[A-Za-z0-9_-]{20,}$")
EPSILON = placement.EPSILON


class Problem(Exception):
    """A request the pool refuses: ``status`` (HTTP semantics), a short ``code``, a message."""

    def __init__(self, status: int, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra

    def as_dict(self) -> dict:
        return {"error": self.code, "message": self.message, **self.extra}


@dataclass(frozen=True)
class Caller:
    role: str                 # admin | tenant | node
    tenant: str | None
    key_id: str


@dataclass
class PoolConfig:
    heartbeat_interval: float = 2.0
    heartbeat_misses: int = 3
    lease_ttl: float = 60.0
    max_lease_ttl: float = 24 * 3600.0
    max_wait: float = 24 * 3600.0
    max_sessions_per_gpu: int = 8
    restart_grace: float | None = None   # default: max(2 x heartbeat timeout, 10 s)
    tick: float | None = None            # default: min(heartbeat_interval / 2, 0.5 s)

    @property
    def heartbeat_timeout(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses

    @property
    def grace(self) -> float:
        return self.restart_grace if self.restart_grace is not None else max(2 * self.heartbeat_timeout, 10.0)

    @property
    def tick_seconds(self) -> float:
        return self.tick if self.tick is not None else max(min(self.heartbeat_interval / 2, 0.5), 0.05)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str:
    """The id a key is stored under: its ``gpw_<id>_`` prefix, or a hash prefix for keys given by hand."""
    match = KEY_PATTERN.match(key)
    return match.group(1) if match else "x" + hash_key("id:" + key)[:15]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Pool:
    def __init__(self, store: Store, config: PoolConfig | None = None):
        self.store = store
        self.config = config or PoolConfig()
        self.started_at = time.time()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        # lease id -> nodes a replacement must avoid (a client could not reach them); in memory:
        # after a pool restart a client that still cannot reach a node reports it again
        self._avoid: dict[str, set[str]] = {}
        self._drains: dict[str, dict] = {}  # node id -> what its heartbeats tell it about the drain
        with store.transaction():
            pem = store.get_setting("signing_key")
            if pem is None:
                self.signer = Signer.generate()
                store.set_setting("signing_key", self.signer.private_pem())
            else:
                self.signer = Signer.from_pem(pem)

    # ------------------------------------------------------------ keys and callers

    def bootstrap(self, admin_key: str | None = None) -> str | None:
        """Make sure an admin key exists. Returns a new key's text when one was created."""
        with self._lock, self.store.transaction():
            if admin_key:
                kid = key_id_of(admin_key)
                existing = self.store.get_api_key(kid)
                if existing is None:
                    self.store.add_api_key(ApiKeyRecord(id=kid, hash=hash_key(admin_key), role="admin",
                                                        name="--admin-key", created_at=time.time()))
                elif existing.role != "admin" or not hmac.compare_digest(existing.hash, hash_key(admin_key)):
                    raise ValueError("the given admin key collides with a stored key of another role")
                return None
            if any(k.role == "admin" and not k.revoked for k in self.store.list_api_keys()):
                return None
            key, _ = self._new_key("admin", None, "first start")
            return key

    def _new_key(self, role: str, tenant: str | None, name: str) -> tuple[str, ApiKeyRecord]:
        while True:
            kid = secrets.token_hex(4)
            if self.store.get_api_key(kid) is None:
                break
        key = f"gpw_{kid}_{secrets.token_urlsafe(32)}"
        record = ApiKeyRecord(id=kid, hash=hash_key(key), role=role, tenant=tenant, name=name, created_at=time.time())
        self.store.add_api_key(record)
        return key, record

    def authenticate(self, key: str | None) -> Caller:
        if not key:
            raise Problem(401, "unauthorized", "an API key is required: send 'Authorization: Bearer <key>' "
                                               "(set GPUWIRE_API_KEY for the gpuwire CLI)")
        record = self.store.get_api_key(key_id_of(key))
        # compare even when no record was found, so timing does not tell which ids exist
        stored = record.hash if record is not None else hash_key("no such key")
        if not hmac.compare_digest(stored, hash_key(key)) or record is None or record.revoked:
            raise Problem(401, "unauthorized", "invalid or revoked API key")
        return Caller(role=record.role, tenant=record.tenant, key_id=record.id)

    @staticmethod
    def require(caller: Caller, *roles: str) -> None:
        if caller.role not in roles:
            raise Problem(403, "forbidden", f"this needs a{'n' if roles[0] == 'admin' else ''} {' or '.join(roles)} "
                                            f"key; the key given is a {caller.role} key")

    def create_key(self, caller: Caller, role: str, tenant: str | None, name: str = "") -> dict:
        self.require(caller, "admin")
        if role not in ROLES:
            raise Problem(422, "invalid", f"role must be one of {', '.join(ROLES)}")
        if role == "tenant" and not tenant:
            raise Problem(422, "invalid", "a tenant key needs a tenant: pass the tenant's name")
        if role != "tenant" and tenant:
            raise Problem(422, "invalid", f"a {role} key belongs to no tenant; leave tenant out")
        with self._lock, self.store.transaction():
            if tenant and self.store.get_tenant(tenant) is None:
                raise Problem(404, "not_found", f"no tenant {tenant!r}: create it first (gpuwire tenant create)")
            key, record = self._new_key(role, tenant, name)
        return {"key": key, **self.key_view(record)}

    @staticmethod
    def key_view(record: ApiKeyRecord) -> dict:
        return {"id": record.id, "role": record.role, "tenant": record.tenant, "name": record.name,
                "created_at": record.created_at, "revoked": record.revoked}

    def list_keys(self, caller: Caller) -> list[dict]:
        self.require(caller, "admin")
        return [self.key_view(k) for k in self.store.list_api_keys()]

    def revoke_key(self, caller: Caller, key_id: str) -> dict:
        self.require(caller, "admin")
        with self._lock, self.store.transaction():
            if not self.store.revoke_api_key(key_id):
                raise Problem(404, "not_found", f"no API key {key_id!r}")
            return self.key_view(self.store.get_api_key(key_id))

    # ------------------------------------------------------------ tenants

    def create_tenant(self, caller: Caller, name: str, max_gpus: float | None, max_memory: int | None) -> dict:
        self.require(caller, "admin")
        with self._lock, self.store.transaction():
            if self.store.get_tenant(name) is not None:
                raise Problem(409, "exists", f"tenant {name!r} already exists")
            self.store.add_tenant(TenantRecord(name=name, max_gpus=max_gpus, max_memory=max_memory,
                                               created_at=time.time()))
            return self.tenant_view(self.store.get_tenant(name))

    def tenant_view(self, tenant: TenantRecord, leases: list[LeaseRecord] | None = None) -> dict:
        if leases is None:
            leases = self.store.list_leases(LIVE_STATES, tenant=tenant.name)
        active = [l for l in leases if l.tenant == tenant.name and l.state == ACTIVE]
        queued = [l for l in leases if l.tenant == tenant.name and l.state == QUEUED]
        return {"name": tenant.name, "max_gpus": tenant.max_gpus, "max_memory": tenant.max_memory,
                "created_at": tenant.created_at, "active_leases": len(active), "queued_leases": len(queued),
                "used_gpus": round(sum(l.gpus * l.share for l in active), 6),
                "used_memory": sum(l.quota_memory for l in active)}

    def list_tenants(self, caller: Caller) -> list[dict]:
        leases = self.store.list_leases(LIVE_STATES)
        tenants = self.store.list_tenants()
        if caller.role == "tenant":
            tenants = [t for t in tenants if t.name == caller.tenant]
        elif caller.role != "admin":
            self.require(caller, "admin", "tenant")
        return [self.tenant_view(t, leases) for t in tenants]

    # ------------------------------------------------------------ nodes

    def register_node(self, caller: Caller, *, node_id: str, address: str, gpus: list[dict], labels: dict,
                      boot_id: str = "", version: str = "") -> dict:
        self.require(caller, "admin", "node")
        now = time.time()
        records = [GpuRecord(index=g["index"], name=g["name"], memory=g["memory"], backend=g.get("backend", "cuda"),
                             max_sessions=min(g.get("max_sessions") or self.config.max_sessions_per_gpu,
                                              self.config.max_sessions_per_gpu)) for g in gpus]
        with self._lock, self.store.transaction():
            old = self.store.get_node(node_id)
            if old is not None and old.state in HEARTBEATING:
                if old.boot_id and boot_id and old.boot_id != boot_id:
                    self._fail_node_leases(node_id, f"node {node_id} restarted: the sessions it held are gone")
                else:
                    kept = {(g.index, g.memory) for g in records}
                    gone = {g.index for g in old.gpus if (g.index, g.memory) not in kept}
                    if gone:
                        self._fail_node_leases(node_id, f"node {node_id} re-registered without GPU(s) "
                                                        f"{sorted(gone)} as they were", devices=gone)
            keep = old is not None and old.state in HEARTBEATING
            node = NodeRecord(id=node_id, address=address, gpus=records,
                              state=old.state if keep and old.state != DEAD else ALIVE, labels=dict(labels),
                              boot_id=boot_id, version=version,
                              registered_at=old.registered_at if keep else now,
                              last_heartbeat=now, reason=None, usage={})
            self.store.save_node(node)
            self._process_queue(now)
        log.info("node %s registered at %s with %d GPU(s)", node_id, address, len(records))
        return {"node": self.node_view(self.store.get_node(node_id)), **self.node_settings()}

    def node_settings(self) -> dict:
        return {"heartbeat_interval": self.config.heartbeat_interval,
                "heartbeat_timeout": self.config.heartbeat_timeout,
                "public_key": self.signer.public_pem(), "kid": self.signer.kid}

    def heartbeat(self, caller: Caller, node_id: str, boot_id: str = "", usage: dict | None = None) -> dict:
        self.require(caller, "admin", "node")
        now = time.time()
        with self._lock, self.store.transaction():
            node = self.store.get_node(node_id)
            if node is None:
                raise Problem(404, "unknown_node", f"no node {node_id!r} is registered: register first "
                                                   "(POST /v1/nodes)")
            if node.state == DEAD:
                raise Problem(409, "node_dead", f"node {node_id} was marked dead ({node.reason}); "
                                                "register again to rejoin")
            if node.boot_id and boot_id and node.boot_id != boot_id:
                raise Problem(409, "node_restarted", f"node {node_id} has restarted since it registered; "
                                                     "register again")
            self.store.touch_node(node_id, now, usage or {})
            leases = self._leases_on(node_id)
            state = node.state
            if state == DRAINING and not leases:
                state = DRAINED
                self.store.set_node_state(node_id, DRAINED, "drained: every session moved off")
                log.info("node %s drained: every lease moved off; it takes no new work until undrained", node_id)
            drain = self._drains.get(node_id) if state == DRAINING else None
        return {"state": state, "leases": leases, "drain": drain,
                **{k: v for k, v in self.node_settings().items() if k.startswith("heartbeat")}}

    def _leases_on(self, node_id: str) -> list[str]:
        return [lease.id for lease in self.store.list_leases((ACTIVE,))
                if any(a.node_id == node_id for a in lease.allocations)]

    # ------------------------------------------------------------ drain, failover

    def drain_node(self, caller: Caller, node_id: str, deadline: float | None = None, undo: bool = False) -> dict:
        """Stop placing on a node and ask its sessions to move away (at their next sync point);
        ``undo``: take it back into service."""
        self.require(caller, "admin")
        now = time.time()
        with self._lock, self.store.transaction():
            node = self.store.get_node(node_id)
            if node is None:
                raise Problem(404, "unknown_node", f"no node {node_id!r}")
            if undo:
                if node.state in (DRAINING, DRAINED):
                    self.store.set_node_state(node_id, ALIVE, None)
                    self._drains.pop(node_id, None)
                    self._process_queue(now)
                    log.info("node %s undrained", node_id)
            else:
                if node.state == DEAD:
                    raise Problem(409, "node_dead", f"node {node_id} is dead ({node.reason}); nothing to drain")
                if node.state == ALIVE:
                    self.store.set_node_state(node_id, DRAINING, "draining: sessions are moving off")
                self._drains[node_id] = {"reason": f"node {node_id} is being drained",
                                         "deadline": now + deadline if deadline else None, "since": now}
                log.info("node %s draining (%d lease(s) to move)", node_id, len(self._leases_on(node_id)))
            return self.node_view(self.store.get_node(node_id))

    def replace_lease(self, caller: Caller, lease_id: str, *, reason: str = "lost",
                      lost_address: str | None = None) -> dict:
        """Move a lease to another GPU with the same request: its node died, its client cannot
        reach it, or the node is draining. Placed now when something fits, else queued (ahead of
        newer requests); the lease keeps its id, so renewals go on."""
        if reason not in ("lost", "drain"):
            raise Problem(422, "invalid", "reason must be 'lost' or 'drain'")
        now = time.time()
        with self._lock:
            lease = self._owned(caller, lease_id)
            if lease.state == QUEUED:
                return self.lease_view(lease, tokens=True)
            if lease.state not in (ACTIVE, FAILED) or (lease.state == FAILED and not (lease.reason or "").startswith("node ")):
                raise Problem(409, "lease_ended", f"lease {lease_id} is {lease.state}"
                              + (f": {lease.reason}" if lease.reason else "") + "; ask for a new lease",
                              state=lease.state, reason=lease.reason)
            old_nodes = {a.node_id for a in lease.allocations}
            if lease.state == ACTIVE and lost_address is not None:
                addresses = {node.address for node in map(self.store.get_node, old_nodes) if node is not None}
                if lost_address not in addresses:
                    # already moved off the lost node (a drain or an earlier report): that is the answer
                    return self.lease_view(lease, tokens=True)
        if reason == "lost":  # probe outside the lock: a dead node costs up to a second
            for node_id in old_nodes:
                node = self.store.get_node(node_id)
                if node is not None and node.state != DEAD and not _answers(node.address):
                    with self._lock, self.store.transaction():
                        self._mark_dead(node_id, "unreachable: its client lost it and the pool could not connect")
        with self._lock, self.store.transaction():
            lease = self._owned(caller, lease_id)
            if lease.state in (ACTIVE, FAILED):
                self._avoid.setdefault(lease.id, set()).update(old_nodes)
                lease.state, lease.updated_at = QUEUED, now
                lease.reason = ("moving off a draining node" if reason == "drain"
                                else f"replacing a lost GPU on {', '.join(sorted(old_nodes)) or '?'}")
                lease.allocations, lease.wait_until = [], now + self.config.max_wait
                self.store.save_lease(lease)
                self._process_queue(now)
                lease = self.store.get_lease(lease_id)
                where = ", ".join(f"{a.node_id}/{a.device}" for a in lease.allocations) or "the queue"
                log.info("lease %s replaced (%s): now on %s", lease_id, reason, where)
            return self.lease_view(lease, tokens=True)

    def deregister_node(self, caller: Caller, node_id: str) -> dict:
        self.require(caller, "admin", "node")
        with self._lock, self.store.transaction():
            node = self.store.get_node(node_id)
            if node is None:
                raise Problem(404, "unknown_node", f"no node {node_id!r}")
            if node.state != DEAD:
                self._mark_dead(node_id, "deregistered (node shut down)")
            self._process_queue(time.time())
            return self.node_view(self.store.get_node(node_id))

    def node_view(self, node: NodeRecord, gpus: list[placement.Gpu] | None = None,
                  leases: list[LeaseRecord] | None = None) -> dict:
        now = time.time()
        if gpus is None:
            gpus = self._gpu_state([node]) if node.state == ALIVE else []
        if leases is None:
            leases = self.store.list_leases((ACTIVE,))
        by_gpu: dict[tuple[str, int], list[str]] = {}
        for lease in leases:
            for a in lease.allocations:
                by_gpu.setdefault((a.node_id, a.device), []).append(lease.id)
        state = {(g.node_id, g.index): g for g in gpus}
        rows = []
        for g in node.gpus:
            s = state.get((node.id, g.index))
            rows.append({"index": g.index, "name": g.name, "memory": g.memory, "backend": g.backend,
                         "max_sessions": g.max_sessions,
                         "used_memory": s.used_memory if s else 0, "used_share": round(s.used_share, 6) if s else 0.0,
                         "sessions": s.sessions if s else 0, "exclusive": s.exclusive if s else False,
                         "leases": by_gpu.get((node.id, g.index), [])})
        return {"id": node.id, "address": node.address, "state": node.state, "reason": node.reason,
                "labels": node.labels, "version": node.version, "registered_at": node.registered_at,
                "last_heartbeat": node.last_heartbeat, "heartbeat_age": round(now - node.last_heartbeat, 2),
                "usage": node.usage, "gpus": rows}

    def list_nodes(self, caller: Caller) -> list[dict]:
        self.require(caller, *ROLES)
        nodes = self.store.list_nodes()
        leases = self.store.list_leases((ACTIVE,))
        gpus = self._gpu_state(nodes, leases)
        return [self.node_view(n, gpus, leases) for n in nodes]

    def get_node(self, caller: Caller, node_id: str) -> dict:
        self.require(caller, *ROLES)
        node = self.store.get_node(node_id)
        if node is None:
            raise Problem(404, "unknown_node", f"no node {node_id!r}")
        return self.node_view(node)

    def _gpu_state(self, nodes: list[NodeRecord] | None = None,
                   active: list[LeaseRecord] | None = None) -> list[placement.Gpu]:
        """Every GPU of every alive node, with what the active leases hold on it."""
        nodes = self.store.list_nodes() if nodes is None else nodes
        active = self.store.list_leases((ACTIVE,)) if active is None else active
        used: dict[tuple[str, int], list[Allocation]] = {}
        for lease in active:
            for a in lease.allocations:
                used.setdefault((a.node_id, a.device), []).append(a)
        out = []
        for node in nodes:
            if node.state != ALIVE:
                continue
            for g in node.gpus:
                allocs = used.get((node.id, g.index), [])
                whole = any(a.share >= 1.0 - EPSILON for a in allocs)
                out.append(placement.Gpu(
                    node_id=node.id, index=g.index, name=g.name, memory=g.memory, backend=g.backend,
                    labels=node.labels, max_sessions=g.max_sessions,
                    used_memory=g.memory if whole else sum(a.memory for a in allocs),
                    used_share=sum(a.share for a in allocs), sessions=len(allocs), exclusive=whole))
        return out

    def _mark_dead(self, node_id: str, reason: str) -> None:
        self.store.set_node_state(node_id, DEAD, reason)
        failed = self._fail_node_leases(node_id, f"node {node_id} {reason}")
        log.warning("node %s marked dead: %s; %d lease(s) failed", node_id, reason, failed)

    def _fail_node_leases(self, node_id: str, reason: str, devices: set[int] | None = None) -> int:
        now, count = time.time(), 0
        for lease in self.store.list_leases((ACTIVE,)):
            if any(a.node_id == node_id and (devices is None or a.device in devices) for a in lease.allocations):
                lease.state, lease.reason, lease.updated_at = FAILED, reason, now
                self.store.save_lease(lease)
                count += 1
        return count

    # ------------------------------------------------------------ leases

    def request_lease(self, caller: Caller, *, gpus: int = 1, memory: int | None = None, share: float = 1.0,
                      model: str | None = None, labels: dict | None = None, wait: float = 0.0,
                      priority: int = 0, ttl: float | None = None) -> tuple[dict, bool]:
        """Place or queue a request. Returns (lease view, placed now?)."""
        self.require(caller, "tenant")
        try:
            request = placement.Request(gpus=gpus, memory=memory, share=share, model=model, labels=labels or {})
        except ValueError as exc:
            raise Problem(422, "invalid", str(exc)) from None
        ttl = self.config.lease_ttl if ttl is None else ttl
        if not (1.0 <= ttl <= self.config.max_lease_ttl):
            raise Problem(422, "invalid", f"ttl must be between 1 and {self.config.max_lease_ttl:g} seconds")
        if wait < 0 or wait > self.config.max_wait:
            raise Problem(422, "invalid", f"wait must be between 0 and {self.config.max_wait:g} seconds")
        now = time.time()
        with self._lock, self.store.transaction():
            tenant = self.store.get_tenant(caller.tenant)
            if tenant is None:
                raise Problem(403, "forbidden", f"tenant {caller.tenant!r} no longer exists")
            gpu_state = self._gpu_state()
            quota_memory = self._check_quota(tenant, request, gpu_state)
            if not placement.could_ever_fit(request, gpu_state) and wait <= 0:
                raise Problem(409, "no_capacity", "this request cannot fit in the pool even when it is empty: "
                              + placement.shortfall(request, [g.emptied() for g in gpu_state]),
                              free=placement.free_summary(gpu_state), queued=len(self.store.queue()))
            queue = self.store.queue()
            wanted = _candidates(request, gpu_state)
            ahead = [q for q in queue if q.priority >= priority and _candidates(_request_of(q), gpu_state) & wanted
                     and placement.could_ever_fit(_request_of(q), gpu_state)]
            slots = placement.place(request, gpu_state) if not ahead else None
            lease = LeaseRecord(id=self._new_lease_id(), tenant=tenant.name, state=QUEUED, gpus=gpus, share=share,
                                memory=memory, model=model, labels=dict(labels or {}), priority=priority, ttl=ttl,
                                seq=self.store.next_seq("lease"), created_at=now, updated_at=now,
                                quota_memory=quota_memory)
            if slots is not None:
                self._activate(lease, slots, now)
                self.store.add_lease(lease)
                log.info("lease %s for %s placed on %s", lease.id, tenant.name,
                         ", ".join(f"{s.node_id}/{s.index}" for s in slots))
                return self.lease_view(lease, tokens=True), True
            if wait <= 0:
                why = (f"{len(ahead)} request(s) for the same GPUs are queued ahead of it (ask with wait > 0 "
                       "to join the queue)"
                       if ahead else placement.shortfall(request, gpu_state))
                raise Problem(409, "no_capacity", f"no room for {self._describe(request)} now: {why}",
                              free=placement.free_summary(gpu_state), queued=len(queue))
            lease.wait_until = now + wait
            self.store.add_lease(lease)
            log.info("lease %s for %s queued (%s)", lease.id, tenant.name, self._describe(request))
            return self.lease_view(lease, tokens=True), False

    @staticmethod
    def _describe(request: placement.Request) -> str:
        what = f"{request.gpus} whole GPU(s)" if request.whole else f"share {request.share:g} of a GPU"
        if request.memory is not None:
            what += f" with {request.memory} bytes"
        if request.model:
            what += f" of model {request.model!r}"
        return what

    def _new_lease_id(self) -> str:
        while True:
            lease_id = "l-" + secrets.token_hex(6)
            if self.store.get_lease(lease_id) is None:
                return lease_id

    def _check_quota(self, tenant: TenantRecord, request: placement.Request, gpus: list[placement.Gpu]) -> int:
        """Refuse requests over the tenant's quota; returns the bytes the request counts for."""
        matching = [g.memory for g in gpus if placement.matches(request, g)]
        if request.memory is not None:
            per_gpu = request.memory
        else:  # the default budget, on the largest GPU it could get (an upper bound)
            biggest = max(matching, default=0)
            per_gpu = biggest if request.whole else int(request.share * biggest)
        memory = per_gpu * request.gpus
        gpu_units = request.gpus * request.share
        if tenant.max_gpus is not None and gpu_units > tenant.max_gpus + EPSILON:
            raise Problem(403, "quota", f"tenant {tenant.name!r} may hold at most {tenant.max_gpus:g} GPU(s); "
                                        f"this request alone asks for {gpu_units:g}")
        if tenant.max_memory is not None and memory > tenant.max_memory:
            raise Problem(403, "quota", f"tenant {tenant.name!r} may hold at most {tenant.max_memory} bytes of GPU "
                                        f"memory; this request alone asks for {memory}")
        live = self.store.list_leases(LIVE_STATES, tenant=tenant.name)
        used_gpus = sum(l.gpus * l.share for l in live)
        used_memory = sum(l.quota_memory for l in live)
        if tenant.max_gpus is not None and used_gpus + gpu_units > tenant.max_gpus + EPSILON:
            raise Problem(409, "quota_exceeded",
                          f"quota exceeded: tenant {tenant.name!r} holds or awaits {used_gpus:g} of its "
                          f"{tenant.max_gpus:g} GPU(s) and asks for {gpu_units:g} more; release a lease first",
                          used_gpus=used_gpus, max_gpus=tenant.max_gpus)
        if tenant.max_memory is not None and used_memory + memory > tenant.max_memory:
            raise Problem(409, "quota_exceeded",
                          f"quota exceeded: tenant {tenant.name!r} holds or awaits {used_memory} of its "
                          f"{tenant.max_memory} bytes of GPU memory and asks for {memory} more; release a lease first",
                          used_memory=used_memory, max_memory=tenant.max_memory)
        return memory

    def _activate(self, lease: LeaseRecord, slots: list[placement.Slot], now: float) -> None:
        lease.state, lease.updated_at, lease.wait_until = ACTIVE, now, None
        lease.expires_at = now + lease.ttl
        lease.allocations = [Allocation(node_id=s.node_id, device=s.index, memory=s.memory, share=s.share)
                             for s in slots]
        lease.quota_memory = sum(s.memory for s in slots)

    def _owned(self, caller: Caller, lease_id: str) -> LeaseRecord:
        self.require(caller, "admin", "tenant")
        lease = self.store.get_lease(lease_id)
        if lease is None or (caller.role == "tenant" and lease.tenant != caller.tenant):
            raise Problem(404, "not_found", f"no lease {lease_id!r}")
        return lease

    def get_lease(self, caller: Caller, lease_id: str) -> dict:
        return self.lease_view(self._owned(caller, lease_id), tokens=True)

    def list_leases(self, caller: Caller, states: tuple[str, ...] | None = LIVE_STATES,
                    limit: int | None = None) -> list[dict]:
        self.require(caller, "admin", "tenant")
        tenant = caller.tenant if caller.role == "tenant" else None
        leases = self.store.list_leases(states, tenant=tenant, limit=limit)
        nodes = {n.id: n for n in self.store.list_nodes()}
        queue = self.store.queue()
        return [self.lease_view(l, nodes=nodes, queue=queue) for l in leases]

    def renew(self, caller: Caller, lease_id: str, ttl: float | None = None) -> dict:
        now = time.time()
        with self._lock, self.store.transaction():
            lease = self._owned(caller, lease_id)
            if lease.state == QUEUED:
                return self.lease_view(lease, tokens=True)
            if lease.state != ACTIVE:
                raise Problem(409, "lease_ended", f"lease {lease_id} is {lease.state}"
                              + (f": {lease.reason}" if lease.reason else "") + "; ask for a new lease",
                              state=lease.state, reason=lease.reason)
            if ttl is not None:
                if not (1.0 <= ttl <= self.config.max_lease_ttl):
                    raise Problem(422, "invalid", f"ttl must be between 1 and {self.config.max_lease_ttl:g} seconds")
                lease.ttl = ttl
            lease.expires_at, lease.updated_at = now + lease.ttl, now
            self.store.save_lease(lease)
            return self.lease_view(lease, tokens=True)

    def release(self, caller: Caller, lease_id: str) -> dict:
        now = time.time()
        with self._lock, self.store.transaction():
            lease = self._owned(caller, lease_id)
            if lease.state in LIVE_STATES:
                lease.state = RELEASED if lease.state == ACTIVE else CANCELLED
                lease.reason = "released by its holder" if lease.state == RELEASED else "left the queue"
                lease.updated_at = now
                self.store.save_lease(lease)
                log.info("lease %s %s", lease.id, lease.state)
                self._process_queue(now)
            return self.lease_view(lease)

    def lease_view(self, lease: LeaseRecord, *, tokens: bool = False, nodes: dict[str, NodeRecord] | None = None,
                   queue: list[LeaseRecord] | None = None) -> dict:
        now = time.time()
        if nodes is None:
            nodes = {a.node_id: self.store.get_node(a.node_id) for a in lease.allocations}
        allocations = []
        for a in lease.allocations:
            node = nodes.get(a.node_id)
            gpu = next((g for g in node.gpus if g.index == a.device), None) if node else None
            item = {"node_id": a.node_id, "address": node.address if node else None, "device": a.device,
                    "gpu_name": gpu.name if gpu else None, "memory": a.memory, "share": a.share}
            if tokens and lease.state == ACTIVE:
                item["token"] = self.signer.issue(lease_id=lease.id, tenant=lease.tenant, node_id=a.node_id,
                                                  device=a.device, memory=a.memory, share=a.share,
                                                  expires_at=lease.expires_at, now=now,
                                                  address=node.address if node else None)
            allocations.append(item)
        first = allocations[0] if allocations else {}
        view = {"id": lease.id, "tenant": lease.tenant, "state": lease.state, "reason": lease.reason,
                "request": {"gpus": lease.gpus, "memory": lease.memory, "share": lease.share, "model": lease.model,
                            "labels": lease.labels, "priority": lease.priority},
                "created_at": lease.created_at, "updated_at": lease.updated_at, "ttl": lease.ttl,
                "expires_at": lease.expires_at,
                "expires_in": round(lease.expires_at - now, 2) if lease.expires_at and lease.state == ACTIVE else None,
                "wait_until": lease.wait_until, "position": None,
                "node_id": first.get("node_id"), "address": first.get("address"), "device": first.get("device"),
                "memory": first.get("memory"), "share": first.get("share", lease.share),
                "token": first.get("token"), "addresses": sorted({a["address"] for a in allocations if a["address"]}),
                "allocations": allocations}
        if lease.state == QUEUED:
            queue = self.store.queue() if queue is None else queue
            ids = [q.id for q in queue]
            view["position"] = ids.index(lease.id) + 1 if lease.id in ids else None
            if view["position"]:
                view["position_text"] = f"{_ordinal(view['position'])} in queue"
        return view

    # ------------------------------------------------------------ the queue and the reaper

    def _process_queue(self, now: float) -> int:
        """Place queued requests in order (priority, then FIFO) while they fit. Returns how many.

        A request that does not fit yet holds up every later request that could use one of the
        same GPUs (so big requests are not starved by small ones slipping past); requests for
        other GPUs (another model or labels) go on. A request no alive GPU could ever hold
        (it waits for a node that can) holds up nobody."""
        queue = self.store.queue()
        if not queue:
            return 0
        gpu_state = self._gpu_state()
        placed = 0
        blocked: set[tuple[str, int]] = set()
        for lease in queue:
            request = _request_of(lease)
            avoid = self._avoid.get(lease.id)
            usable = [g for g in gpu_state if g.node_id not in avoid] if avoid else gpu_state
            if not placement.could_ever_fit(request, usable):
                continue
            wanted = _candidates(request, usable)
            slots = placement.place(request, usable) if not wanted & blocked else None
            if slots is None:
                blocked |= wanted  # first in line for these GPUs: whoever wants them next waits behind it
                continue
            self._activate(lease, slots, now)
            self.store.save_lease(lease)
            gpu_state = placement.apply(gpu_state, slots)
            placed += 1
            log.info("queued lease %s placed on %s", lease.id, ", ".join(f"{s.node_id}/{s.index}" for s in slots))
        return placed

    def tick(self, now: float | None = None) -> None:
        """One reaper pass: dead nodes, expired leases, timed-out waits, then the queue."""
        now = time.time() if now is None else now
        timeout = self.config.heartbeat_timeout
        with self._lock, self.store.transaction():
            for node in self.store.list_nodes():
                if node.state in HEARTBEATING:
                    seen = max(node.last_heartbeat, self.started_at)
                    if now - seen > timeout:
                        self._mark_dead(node.id, f"missed heartbeats for {now - node.last_heartbeat:.1f}s "
                                                 f"(timeout {timeout:g}s)")
            grace_end = self.started_at + self.config.grace
            for lease in self.store.list_leases(LIVE_STATES):
                if lease.state == ACTIVE and now > max(lease.expires_at or 0.0, grace_end):
                    lease.state, lease.updated_at = EXPIRED, now
                    lease.reason = f"not renewed within its {lease.ttl:g}s ttl"
                    self.store.save_lease(lease)
                    log.info("lease %s expired", lease.id)
                elif lease.state == QUEUED and lease.wait_until is not None and now > lease.wait_until:
                    lease.state, lease.updated_at = EXPIRED, now
                    lease.reason = f"waited {now - lease.created_at:.0f}s in the queue; nothing that fits freed up"
                    self.store.save_lease(lease)
                    log.info("queued lease %s gave up waiting", lease.id)
            self._process_queue(now)

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_forever, name="gpuwire-pool-reaper", daemon=True)
            self._reaper.start()

    def _reap_forever(self) -> None:
        while not self._stop.wait(self.config.tick_seconds):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper pass failed")

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    # ------------------------------------------------------------ overview

    def status(self, caller: Caller) -> dict:
        """Everything ``gpuwire smi --pool`` shows, in one consistent read."""
        self.require(caller, *ROLES)
        with self.store.transaction():
            nodes = self.store.list_nodes()
            live = self.store.list_leases(LIVE_STATES)
            active = [l for l in live if l.state == ACTIVE]
            gpus = self._gpu_state(nodes, active)
            queue = self.store.queue()
            tenants = self.store.list_tenants()
        node_map = {n.id: n for n in nodes}
        visible = live if caller.role == "admin" else [l for l in live if l.tenant == caller.tenant]
        if caller.role == "tenant":
            tenants = [t for t in tenants if t.name == caller.tenant]
        elif caller.role == "node":
            tenants, visible = [], []
        free = placement.free_summary(gpus)
        return {"pool": {"version": _version(), "started_at": self.started_at, "queue_length": len(queue),
                         "heartbeat_interval": self.config.heartbeat_interval,
                         "heartbeat_timeout": self.config.heartbeat_timeout, "lease_ttl": self.config.lease_ttl,
                         "max_sessions_per_gpu": self.config.max_sessions_per_gpu},
                "nodes": [self.node_view(n, gpus, active) for n in nodes],
                "leases": [self.lease_view(l, nodes=node_map, queue=queue) for l in visible],
                "tenants": [self.tenant_view(t, live) for t in tenants],
                "free": {"whole_gpus": free["whole_gpus_free"], "largest_slice": free["largest_slice"],
                         "total_gpus": len(gpus), "free_share": round(sum(g["free_share"] for g in free["gpus"]), 6),
                         "free_memory": sum(g["free_memory"] for g in free["gpus"])}}


def _request_of(lease: LeaseRecord) -> placement.Request:
    return placement.Request(gpus=lease.gpus, memory=lease.memory, share=lease.share, model=lease.model,
                             labels=lease.labels)


def _candidates(request: placement.Request, gpus: list[placement.Gpu]) -> set[tuple[str, int]]:
    """The GPUs a request could ever use (model and labels match)."""
    return {(g.node_id, g.index) for g in gpus if placement.matches(request, g)}


def _answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at a node's address (the pool's own check of
    a client's report that the node is gone)."""
    import socket
    from ..client.probe import parse_address
    try:
        with socket.create_connection(parse_address(address), timeout=timeout):
            return True
    except OSError:
        return False


def _version() -> str:
    from .._version import __version__
    return __version__
