"""The SQLite store: WAL, state survives reopening, transactions roll back together."""

import sqlite3

import pytest

from gpuwire.pool.store import (ACTIVE, QUEUED, Allocation, ApiKeyRecord, GpuRecord, LeaseRecord, NodeRecord, SqlStore,
                                TenantRecord, sqlite_url)


def fill(store: SqlStore) -> None:
    store.add_tenant(TenantRecord("team", max_gpus=2.0, max_memory=8 << 30, created_at=1.0))
    store.add_api_key(ApiKeyRecord(id="abcd1234", hash="h" * 64, role="tenant", tenant="team", created_at=1.0))
    store.save_node(NodeRecord(id="n1", address="127.0.0.1:7070", labels={"zone": "a"}, last_heartbeat=5.0,
                               gpus=[GpuRecord(0, "A100", 80 << 30), GpuRecord(1, "A100", 80 << 30)]))
    store.add_lease(LeaseRecord(id="l-1", tenant="team", state=ACTIVE, gpus=1, share=0.5, memory=1 << 30, ttl=30,
                                seq=1, expires_at=100.0, quota_memory=1 << 30, labels={"zone": "a"},
                                allocations=[Allocation("n1", 1, 1 << 30, 0.5)]))
    store.add_lease(LeaseRecord(id="l-2", tenant="team", state=QUEUED, gpus=2, share=1.0, seq=2, priority=5))


def test_state_survives_reopening(tmp_path):
    path = str(tmp_path / "pool.db")
    fill(SqlStore(sqlite_url(path)))
    store = SqlStore(sqlite_url(path))
    assert store.get_tenant("team").max_memory == 8 << 30
    assert store.get_api_key("abcd1234").tenant == "team"
    node = store.get_node("n1")
    assert [g.index for g in node.gpus] == [0, 1] and node.labels == {"zone": "a"}
    lease = store.get_lease("l-1")
    assert lease.allocations == [Allocation("n1", 1, 1 << 30, 0.5)] and lease.expires_at == 100.0
    assert [l.id for l in store.queue()] == ["l-2"]
    assert [l.id for l in store.list_leases((ACTIVE,), tenant="team")] == ["l-1"]
    assert store.next_seq("lease") == 1 and store.next_seq("lease") == 2


def test_wal_journal_and_private_file(tmp_path):
    path = tmp_path / "pool.db"
    SqlStore(sqlite_url(str(path)))
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert path.stat().st_mode & 0o077 == 0  # holds the signing key: owner only


def test_a_failed_transaction_stores_nothing(tmp_path):
    store = SqlStore(sqlite_url(str(tmp_path / "pool.db")))
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.add_tenant(TenantRecord("ghost", created_at=1.0))
            raise RuntimeError("decision failed half-way")
    assert store.get_tenant("ghost") is None


def test_save_node_replaces_its_gpus_and_save_lease_its_allocations(tmp_path):
    store = SqlStore(sqlite_url(str(tmp_path / "pool.db")))
    fill(store)
    node = store.get_node("n1")
    node.gpus = [GpuRecord(3, "H100", 80 << 30)]
    store.save_node(node)
    assert [g.index for g in store.get_node("n1").gpus] == [3]
    lease = store.get_lease("l-1")
    lease.state, lease.allocations = "released", []
    store.save_lease(lease)
    assert store.get_lease("l-1").allocations == [] and store.get_lease("l-1").state == "released"
