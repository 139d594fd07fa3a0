"""The persistence schema: record kinds and keys keep their on-disk spelling, and a database written
before the schema had its own module (tests/data/state_v1.sql) restores to the same job."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

from api_support import ack, app_client, job_spec, manifest, single_group_units

import knittrans.api.store as store_module
from knittrans.api.records import JOB_KINDS, Kind, index_key, version_key
from knittrans.api.store import CHECKPOINT_BYTES, RecordStore, Txn

DATA = Path(__file__).resolve().parent / "data"
OLD_KINDS = {
    "node",
    "job",
    "units",
    "group",
    "mb",
    "ack",
    "fetched",
    "version",
    "supply",
    "started",
    "request",
    "consumed",
    "lost",
}
"""The kinds the control plane wrote at commit 5262092 (bare strings then)."""


def _old_database(tmp_path: Path) -> str:
    """The old database, per-rank ack/fetch records (``<mb>.<rank>`` keys, ignored on load) included."""
    db = str(tmp_path / "cp.db")
    with sqlite3.connect(db) as conn:
        conn.executescript((DATA / "state_v1.sql").read_text())
        assert conn.execute("SELECT COUNT(*) FROM records WHERE key LIKE '%.%'").fetchone()[0] > 0
    return db


STATUS_ADDED = {"pool", "rollout_weights"}
"""Status fields newer than ``state_v1_status.json`` (``pool`` is checked against the rest of the status instead;
``rollout_weights`` lives in memory only, like admission peaks)."""


def _persisted(status: dict[str, Any]) -> dict[str, Any]:
    """What of a status follows from the records (admission timings and peaks live in memory only)."""
    out = {k: v for k, v in status.items() if k != "recent_admissions" and k not in STATUS_ADDED}
    out["timing"] = {k: v for k, v in status["timing"].items() if not k.startswith("peak_")}
    return out


def test_kinds_keep_their_on_disk_spelling() -> None:
    """Every kind is spelled as the old code wrote it; groups to regenerate (lost or expired) are ``lost``."""
    assert {k.value for k in Kind} == OLD_KINDS
    assert Kind.TO_REGENERATE.value == "lost"
    assert set(JOB_KINDS) == set(Kind) - {Kind.NODE}


def test_keys_are_built_and_parsed_by_one_pair() -> None:
    """Keys have the old layout, sort numerically as strings, and read back as integers (what restore does)."""
    assert index_key(7) == "000000000007" and int(index_key(7)) == 7
    assert version_key(5) == "5" and int(version_key(5)) == 5
    keys = [index_key(n) for n in (0, 9, 10, 100)]
    assert sorted(keys) == keys


def test_database_written_by_the_old_code_restores(tmp_path: Path) -> None:
    """The old database loads to the status the old code showed, and the job goes on from there."""
    db = _old_database(tmp_path)
    before = json.loads((DATA / "state_v1_status.json").read_text())
    with app_client(db) as c:
        status = c.get("/v1/jobs/job1/status").json()
        assert _persisted(status) == _persisted(before)
        assert sum(status["pool"]["by_node"].values()) == sum(status["counts"]["finished"].values())
        reasons = {r["group_id"]: r["reason"] for r in status["to_regenerate"]}
        assert reasons["late"] == "expired" and reasons["g2"] == "node n2 lost"  # both kept under kind "lost"
        progress = c.get("/v1/jobs/job1/minibatches").json()
        assert progress["position"] == 1
        assert [f["global_index"] for f in progress["in_flight"]] == [1]
        m = manifest(c, "job1", 1)
        assert m is not None and m.global_index == 1
        assert not ack(c, "job1", m, ranks=[0])["consumed"]
        assert ack(c, "job1", m, ranks=[1])["consumed"]  # rank 1's ack consumes it
        assert manifest(c, "job1", 2) is None
        assert c.get("/v1/jobs/job1/version").json()["by_rank"] == {"0": 1}
        status = c.get("/v1/jobs/job1/status").json()
    with contextlib.closing(sqlite3.connect(db)) as conn:  # closed: the next app takes the file alone
        kinds = {k for (k,) in conn.execute("SELECT DISTINCT kind FROM records")}
        acks = [k for (k,) in conn.execute("SELECT key FROM records WHERE kind='ack'")]
    assert kinds <= OLD_KINDS and not acks  # consumed: its acks are gone
    with app_client(db) as c:  # what today's code wrote reads back too
        assert _persisted(c.get("/v1/jobs/job1/status").json()) == _persisted(status)


def test_commits_leave_the_wal_copy_to_the_checkpoint_after_publishing(tmp_path: Path) -> None:
    """A commit never copies the WAL into the database (SQLite's automatic checkpoint would, at about 4 MiB, inside
    the commit of an admission a rank waits for); ``checkpoint_if_due`` does, once CHECKPOINT_BYTES were committed,
    and the WAL is written from its start again afterwards. Every record survives a reopen."""
    db = tmp_path / "cp.db"
    wal = Path(str(db) + "-wal")
    store = RecordStore(str(db))
    body = "x" * (100 << 10)

    def write(first: int, count: int) -> None:
        for i in range(first, first + count):
            txn = Txn()
            txn.put(Kind.UNITS, "job1", index_key(i), body)
            store.commit(txn)

    assert not store.checkpoint_if_due()
    write(0, 60)  # 6 MiB: past SQLite's automatic checkpoint, which would keep the WAL near 4 MiB
    assert wal.stat().st_size > 6 << 20 and CHECKPOINT_BYTES < 6 << 20
    assert store.checkpoint_if_due() and not store.checkpoint_if_due()
    size = wal.stat().st_size
    write(60, 30)  # after the copy the WAL is reused from its start: it does not grow
    assert wal.stat().st_size == size
    store.close()
    reopened = RecordStore(str(db))
    assert len(reopened.load(Kind.UNITS)) == 90
    reopened.close()


def test_the_service_checkpoints_after_its_changes(tmp_path: Path, monkeypatch: Any) -> None:
    """Through the app: with a 64 KiB checkpoint size, registering over 1 MiB of units keeps the WAL at a fraction
    of what was written (without the service's checkpoint it holds all of it)."""
    monkeypatch.setattr(store_module, "CHECKPOINT_BYTES", 64 << 10)
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        assert c.post("/v1/jobs", json=job_spec(quotas={"math": 100000, "code": 2})).status_code == 201
        assert c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
        for k in range(12):
            units = single_group_units(["math"] * 500, prefix=f"b{k}x")
            assert c.post("/v1/jobs/job1/units", json={"units": units}).status_code == 200
        size = Path(str(db) + "-wal").stat().st_size
    with contextlib.closing(sqlite3.connect(db)) as conn:
        written = conn.execute("SELECT SUM(LENGTH(body)) FROM records WHERE kind = 'units'").fetchone()[0]
    assert written > 1 << 20 and size < written / 4, (size, written)
