"""The pool's state: nodes, GPUs, leases (and the queue), tenants, API keys, settings.

Sits under ``core``: everything the pool must remember across a restart goes through the
``Store`` interface below, and nothing else is kept only in memory except heartbeat-grace
bookkeeping. ``SqlStore`` implements it on SQLAlchemy Core with portable SQL (no dialect
upserts, no SQLite-only types: JSON, BigInteger, Float, String), so the same class runs on
PostgreSQL given a ``postgresql+psycopg://`` URL; SQLite (WAL journal) is the default.

Concurrency: one pool process owns the database. ``core`` serialises mutations with a lock
and groups each decision (place + write) in ``transaction()``; methods called outside a
transaction run in one of their own.
"""

from __future__ import annotations

import abc
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import sqlalchemy as sa

SCHEMA_VERSION = "1"

# lease states
QUEUED, ACTIVE = "queued", "active"
RELEASED, EXPIRED, FAILED, CANCELLED = "released", "expired", "failed", "cancelled"
LIVE_STATES = (QUEUED, ACTIVE)
# node states
ALIVE, DEAD = "alive", "dead"
DRAINING, DRAINED = "draining", "drained"  # no new placements; DRAINED: every lease moved off
HEARTBEATING = (ALIVE, DRAINING, DRAINED)


@dataclass
class GpuRecord:
    index: int
    name: str
    memory: int
    backend: str = "cuda"
    max_sessions: int = 8


@dataclass
class NodeRecord:
    id: str
    address: str
    gpus: list[GpuRecord]
    state: str = ALIVE
    labels: dict = field(default_factory=dict)
    boot_id: str = ""
    version: str = ""
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    reason: str | None = None
    usage: dict = field(default_factory=dict)


@dataclass
class TenantRecord:
    name: str
    max_gpus: float | None = None
    max_memory: int | None = None
    created_at: float = 0.0


@dataclass
class ApiKeyRecord:
    id: str
    hash: str
    role: str                     # admin | tenant | node
    tenant: str | None = None
    name: str = ""
    created_at: float = 0.0
    revoked: bool = False


@dataclass
class Allocation:
    node_id: str
    device: int
    memory: int
    share: float


@dataclass
class LeaseRecord:
    id: str
    tenant: str
    state: str
    gpus: int
    share: float
    memory: int | None = None      # per-GPU budget asked for (None: the default for the share)
    model: str | None = None
    labels: dict = field(default_factory=dict)
    priority: int = 0
    ttl: float = 60.0
    seq: int = 0                   # FIFO order within a priority
    created_at: float = 0.0
    updated_at: float = 0.0
    expires_at: float | None = None
    wait_until: float | None = None
    reason: str | None = None
    quota_memory: int = 0          # bytes counted against the tenant's quota
    allocations: list[Allocation] = field(default_factory=list)


class Store(abc.ABC):
    """What the pool needs from a database. All methods are synchronous and thread-safe."""

    @abc.abstractmethod
    def transaction(self) -> Iterator[None]:
        """Context manager: every store call inside it commits (or rolls back) together."""

    # settings and counters
    @abc.abstractmethod
    def get_setting(self, key: str) -> str | None: ...
    @abc.abstractmethod
    def set_setting(self, key: str, value: str) -> None: ...
    @abc.abstractmethod
    def next_seq(self, name: str) -> int: ...

    # tenants and keys
    @abc.abstractmethod
    def add_tenant(self, tenant: TenantRecord) -> None: ...
    @abc.abstractmethod
    def get_tenant(self, name: str) -> TenantRecord | None: ...
    @abc.abstractmethod
    def list_tenants(self) -> list[TenantRecord]: ...
    @abc.abstractmethod
    def add_api_key(self, key: ApiKeyRecord) -> None: ...
    @abc.abstractmethod
    def get_api_key(self, key_id: str) -> ApiKeyRecord | None: ...
    @abc.abstractmethod
    def list_api_keys(self) -> list[ApiKeyRecord]: ...
    @abc.abstractmethod
    def revoke_api_key(self, key_id: str) -> bool: ...

    # nodes
    @abc.abstractmethod
    def save_node(self, node: NodeRecord) -> None:
        """Insert or replace a node and its GPUs."""
    @abc.abstractmethod
    def get_node(self, node_id: str) -> NodeRecord | None: ...
    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRecord]: ...
    @abc.abstractmethod
    def set_node_state(self, node_id: str, state: str, reason: str | None) -> None: ...
    @abc.abstractmethod
    def touch_node(self, node_id: str, when: float, usage: dict) -> None: ...

    # leases (the queue is the leases in state "queued", ordered by -priority, seq)
    @abc.abstractmethod
    def add_lease(self, lease: LeaseRecord) -> None: ...
    @abc.abstractmethod
    def save_lease(self, lease: LeaseRecord) -> None:
        """Update a lease's state, times, reason, quota and allocations."""
    @abc.abstractmethod
    def get_lease(self, lease_id: str) -> LeaseRecord | None: ...
    @abc.abstractmethod
    def list_leases(self, states: tuple[str, ...] | None = None, tenant: str | None = None,
                    limit: int | None = None) -> list[LeaseRecord]: ...

    def queue(self) -> list[LeaseRecord]:
        return sorted(self.list_leases((QUEUED,)), key=lambda l: (-l.priority, l.seq))

    def close(self) -> None:
        pass


metadata = sa.MetaData()

settings_t = sa.Table(
    "settings", metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False))

tenants_t = sa.Table(
    "tenants", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("max_gpus", sa.Float, nullable=True),
    sa.Column("max_memory", sa.BigInteger, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False))

api_keys_t = sa.Table(
    "api_keys", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("hash", sa.String(128), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.name"), nullable=True),
    sa.Column("name", sa.String(128), nullable=False, default=""),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked", sa.Boolean, nullable=False, default=False))

nodes_t = sa.Table(
    "nodes", metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("address", sa.String(256), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("labels", sa.JSON, nullable=False),
    sa.Column("boot_id", sa.String(64), nullable=False),
    sa.Column("version", sa.String(32), nullable=False),
    sa.Column("registered_at", sa.Float, nullable=False),
    sa.Column("last_heartbeat", sa.Float, nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("usage", sa.JSON, nullable=False))

gpus_t = sa.Table(
    "gpus", metadata,
    sa.Column("node_id", sa.String(128), sa.ForeignKey("nodes.id"), primary_key=True),
    sa.Column("device", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("name", sa.String(256), nullable=False),
    sa.Column("memory", sa.BigInteger, nullable=False),
    sa.Column("backend", sa.String(16), nullable=False),
    sa.Column("max_sessions", sa.Integer, nullable=False))

leases_t = sa.Table(
    "leases", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.name"), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("share", sa.Float, nullable=False),
    sa.Column("memory", sa.BigInteger, nullable=True),
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("labels", sa.JSON, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("ttl", sa.Float, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
    sa.Column("wait_until", sa.Float, nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("quota_memory", sa.BigInteger, nullable=False),
    sa.Index("ix_leases_state", "state"),
    sa.Index("ix_leases_tenant_state", "tenant", "state"))

allocations_t = sa.Table(
    "allocations", metadata,
    sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"), primary_key=True),
    sa.Column("node_id", sa.String(128), primary_key=True),
    sa.Column("device", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("memory", sa.BigInteger, nullable=False),
    sa.Column("share", sa.Float, nullable=False))


def sqlite_url(path: str) -> str:
    return "sqlite:///" + os.path.abspath(path)


class SqlStore(Store):
    """``Store`` on SQLAlchemy Core. ``url``: ``sqlite:///path`` (default, WAL) or another database."""

    def __init__(self, url: str):
        self.url = url
        self._local = threading.local()
        if url.startswith("sqlite"):
            path = sa.engine.make_url(url).database
            if path and path != ":memory:":
                folder = os.path.dirname(os.path.abspath(path))
                os.makedirs(folder, exist_ok=True)
                if not os.path.exists(path):  # it will hold the signing key and key hashes: owner only
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            self.engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
            _sqlite_setup(self.engine)
        else:
            self.engine = sa.create_engine(url, pool_pre_ping=True)
        metadata.create_all(self.engine)
        with self.transaction():
            if self.get_setting("schema_version") is None:
                self.set_setting("schema_version", SCHEMA_VERSION)

    # ------------------------------------------------------------ plumbing

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if getattr(self._local, "conn", None) is not None:
            yield  # nested: part of the outer transaction
            return
        with self.engine.begin() as conn:
            self._local.conn = conn
            try:
                yield
            finally:
                self._local.conn = None

    @contextmanager
    def _conn(self) -> Iterator[sa.Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ settings

    def get_setting(self, key: str) -> str | None:
        with self._conn() as c:
            return c.execute(sa.select(settings_t.c.value).where(settings_t.c.key == key)).scalar_one_or_none()

    def set_setting(self, key: str, value: str) -> None:
        with self._conn() as c:
            done = c.execute(settings_t.update().where(settings_t.c.key == key).values(value=value)).rowcount
            if not done:
                c.execute(settings_t.insert().values(key=key, value=value))

    def next_seq(self, name: str) -> int:
        with self.transaction():
            value = int(self.get_setting(f"seq:{name}") or 0) + 1
            self.set_setting(f"seq:{name}", str(value))
            return value

    # ------------------------------------------------------------ tenants and keys

    def add_tenant(self, tenant: TenantRecord) -> None:
        with self._conn() as c:
            c.execute(tenants_t.insert().values(name=tenant.name, max_gpus=tenant.max_gpus,
                                                max_memory=tenant.max_memory, created_at=tenant.created_at))

    def get_tenant(self, name: str) -> TenantRecord | None:
        with self._conn() as c:
            row = c.execute(sa.select(tenants_t).where(tenants_t.c.name == name)).mappings().first()
        return TenantRecord(**row) if row else None

    def list_tenants(self) -> list[TenantRecord]:
        with self._conn() as c:
            return [TenantRecord(**r) for r in c.execute(sa.select(tenants_t).order_by(tenants_t.c.name)).mappings()]

    def add_api_key(self, key: ApiKeyRecord) -> None:
        with self._conn() as c:
            c.execute(api_keys_t.insert().values(**key.__dict__))

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._conn() as c:
            row = c.execute(sa.select(api_keys_t).where(api_keys_t.c.id == key_id)).mappings().first()
        return ApiKeyRecord(**row) if row else None

    def list_api_keys(self) -> list[ApiKeyRecord]:
        with self._conn() as c:
            rows = c.execute(sa.select(api_keys_t).order_by(api_keys_t.c.created_at)).mappings()
            return [ApiKeyRecord(**r) for r in rows]

    def revoke_api_key(self, key_id: str) -> bool:
        with self._conn() as c:
            return bool(c.execute(api_keys_t.update().where(api_keys_t.c.id == key_id).values(revoked=True)).rowcount)

    # ------------------------------------------------------------ nodes

    def save_node(self, node: NodeRecord) -> None:
        values = dict(address=node.address, state=node.state, labels=node.labels, boot_id=node.boot_id,
                      version=node.version, registered_at=node.registered_at, last_heartbeat=node.last_heartbeat,
                      reason=node.reason, usage=node.usage)
        with self.transaction(), self._conn() as c:
            if not c.execute(nodes_t.update().where(nodes_t.c.id == node.id).values(**values)).rowcount:
                c.execute(nodes_t.insert().values(id=node.id, **values))
            c.execute(gpus_t.delete().where(gpus_t.c.node_id == node.id))
            if node.gpus:
                c.execute(gpus_t.insert(), [dict(node_id=node.id, device=g.index, name=g.name, memory=g.memory,
                                                 backend=g.backend, max_sessions=g.max_sessions) for g in node.gpus])

    def _nodes(self, where=None) -> list[NodeRecord]:
        with self._conn() as c:
            query = sa.select(nodes_t).order_by(nodes_t.c.id)
            if where is not None:
                query = query.where(where)
            rows = list(c.execute(query).mappings())
            gquery = sa.select(gpus_t).order_by(gpus_t.c.node_id, gpus_t.c.device)
            if where is not None:
                gquery = gquery.where(gpus_t.c.node_id.in_([r["id"] for r in rows]))
            gpus: dict[str, list[GpuRecord]] = {}
            for g in c.execute(gquery).mappings():
                gpus.setdefault(g["node_id"], []).append(GpuRecord(
                    index=g["device"], name=g["name"], memory=g["memory"], backend=g["backend"],
                    max_sessions=g["max_sessions"]))
        return [NodeRecord(gpus=gpus.get(r["id"], []), **r) for r in rows]

    def get_node(self, node_id: str) -> NodeRecord | None:
        found = self._nodes(nodes_t.c.id == node_id)
        return found[0] if found else None

    def list_nodes(self) -> list[NodeRecord]:
        return self._nodes()

    def set_node_state(self, node_id: str, state: str, reason: str | None) -> None:
        with self._conn() as c:
            c.execute(nodes_t.update().where(nodes_t.c.id == node_id).values(state=state, reason=reason))

    def touch_node(self, node_id: str, when: float, usage: dict) -> None:
        with self._conn() as c:
            c.execute(nodes_t.update().where(nodes_t.c.id == node_id).values(last_heartbeat=when, usage=usage))

    # ------------------------------------------------------------ leases

    _LEASE_FIELDS = ("tenant", "state", "gpus", "share", "memory", "model", "labels", "priority", "ttl", "seq",
                     "created_at", "updated_at", "expires_at", "wait_until", "reason", "quota_memory")

    def add_lease(self, lease: LeaseRecord) -> None:
        with self.transaction(), self._conn() as c:
            c.execute(leases_t.insert().values(id=lease.id, **{f: getattr(lease, f) for f in self._LEASE_FIELDS}))
            self._write_allocations(c, lease)

    def save_lease(self, lease: LeaseRecord) -> None:
        with self.transaction(), self._conn() as c:
            c.execute(leases_t.update().where(leases_t.c.id == lease.id)
                      .values(**{f: getattr(lease, f) for f in self._LEASE_FIELDS}))
            c.execute(allocations_t.delete().where(allocations_t.c.lease_id == lease.id))
            self._write_allocations(c, lease)

    @staticmethod
    def _write_allocations(c, lease: LeaseRecord) -> None:
        if lease.allocations:
            c.execute(allocations_t.insert(), [dict(lease_id=lease.id, node_id=a.node_id, device=a.device,
                                                    memory=a.memory, share=a.share) for a in lease.allocations])

    def _leases(self, where=None, limit: int | None = None) -> list[LeaseRecord]:
        with self._conn() as c:
            query = sa.select(leases_t).order_by(leases_t.c.created_at, leases_t.c.id)
            if where is not None:
                query = query.where(where)
            if limit:
                query = query.order_by(None).order_by(leases_t.c.created_at.desc(), leases_t.c.id).limit(limit)
            rows = list(c.execute(query).mappings())
            if limit:
                rows.reverse()
            allocs: dict[str, list[Allocation]] = {}
            if rows:
                ids = [r["id"] for r in rows]
                for i in range(0, len(ids), 500):
                    aquery = (sa.select(allocations_t).where(allocations_t.c.lease_id.in_(ids[i:i + 500]))
                              .order_by(allocations_t.c.lease_id, allocations_t.c.node_id, allocations_t.c.device))
                    for a in c.execute(aquery).mappings():
                        allocs.setdefault(a["lease_id"], []).append(
                            Allocation(node_id=a["node_id"], device=a["device"], memory=a["memory"], share=a["share"]))
        return [LeaseRecord(allocations=allocs.get(r["id"], []), **r) for r in rows]

    def get_lease(self, lease_id: str) -> LeaseRecord | None:
        found = self._leases(leases_t.c.id == lease_id)
        return found[0] if found else None

    def list_leases(self, states: tuple[str, ...] | None = None, tenant: str | None = None,
                    limit: int | None = None) -> list[LeaseRecord]:
        conditions = []
        if states is not None:
            conditions.append(leases_t.c.state.in_(list(states)))
        if tenant is not None:
            conditions.append(leases_t.c.tenant == tenant)
        return self._leases(sa.and_(*conditions) if conditions else None, limit=limit)


def _sqlite_setup(engine: sa.Engine) -> None:
    """WAL journal, and real BEGINs (pysqlite's own transaction handling is switched off)."""

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across process crashes
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN")
