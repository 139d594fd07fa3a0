"""Store format 2: a batch of acks is one ``ack`` record per mini-batch; restarts read it and the old per-rank form.

Real app (TestClient, real SQLite, the real state thread and ack batcher), real database files.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, job_spec, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.records import Kind, ack_batch_key, parse_ack_key, rank_key
from knittrans.api.routes.deps import AckBatcher
from knittrans.api.store import STORE_FORMAT, RecordStore
from knittrans.errors import StateError
from knittrans.plans import RankPlan
from knittrans.sched.staleness import ConsumedGroup

JOB = "job1"


def _setup(c: TestClient) -> None:
    """World 4, one row per rank per mini-batch, two mini-batches admitted."""
    spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=4, micro_batch_size=1)
    assert c.post("/v1/jobs", json=spec).status_code == 201
    c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
    r = c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 4)})
    assert r.status_code == 200 and r.json()["admitted"], r.text


def _plan(c: TestClient, rank: int) -> RankPlan:
    r = c.get(f"/v1/jobs/{JOB}/ranks/{rank}/next", params={"timeout_s": 0})
    assert r.status_code == 200, r.text
    return RankPlan.from_json(r.json())


def _together(c: TestClient, acks: list[tuple[int, str]]) -> list[Any]:
    """The acks submitted at once: the batcher applies them in one state-thread call."""
    batcher: AckBatcher = c.app.state.acks  # type: ignore[attr-defined]
    before = batcher.batches

    async def submit() -> list[Any]:
        return await asyncio.gather(*(batcher.ack(JOB, rank, plan_id) for rank, plan_id in acks))

    assert c.portal is not None
    got = c.portal.call(submit)
    assert batcher.batches == before + 1
    return got


def _acks(db: Path) -> list[tuple[str, Any]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key, body FROM records WHERE kind=? ORDER BY key", (Kind.ACK.value,)).fetchall()
    return [(key, json.loads(body)) for key, body in rows]


def test_a_batch_of_acks_is_one_record_that_a_restart_reads(tmp_path: Path) -> None:
    """Ranks 2 and 0 acked together: one record (key from the lowest rank, ranks in arrival order); a lone
    ack is a batch of one. After a restart, with rank 1's ack in the per-rank form of format 1, all three
    acks hold, and the last ack consumes the mini-batch, removes both forms and writes its staleness rows."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c)
        plans = [_plan(c, rank) for rank in range(4)]
        got = _together(c, [(2, str(plans[2].plan_id)), (0, str(plans[0].plan_id))])
        assert [g["duplicate"] for g in got] == [False, False] and not any(g["consumed"] for g in got)
        assert _acks(db) == [(ack_batch_key(0, 0), {"attempt": 0, "ranks": [2, 0]})]
        r = c.post(f"/v1/jobs/{JOB}/ranks/1/ack", json={"plan_id": str(plans[1].plan_id)})
        assert r.status_code == 200, r.text  # through the batcher too: a batch of one
        assert [key for key, _ in _acks(db)] == [ack_batch_key(0, 0), ack_batch_key(0, 1)]
    with sqlite3.connect(db) as conn:  # rank 1's ack in the per-rank form of format 1 instead
        conn.execute("DELETE FROM records WHERE kind='ack' AND key=?", (ack_batch_key(0, 1),))
        conn.execute("INSERT INTO records VALUES ('ack', ?, ?, '{\"attempt\":0}')", (JOB, rank_key(0, 1)))
    with app_client(db) as c:
        assert c.app.state.service.jobs[JOB].minibatches[0].acks == {0, 1, 2}  # type: ignore[attr-defined]
        assert [_plan(c, rank).global_index for rank in range(4)] == [1, 1, 1, 0]
        (last,) = _together(c, [(3, str(plans[3].plan_id))])
        assert last["consumed"] is True
        assert _acks(db) == []
    with sqlite3.connect(db) as conn:  # the staleness rows of the consumed mini-batch: what asdict writes
        (body,) = conn.execute("SELECT body FROM records WHERE kind=?", (Kind.CONSUMED.value,)).fetchone()
    rows = json.loads(body)
    assert len(rows) == 2 and all(json.dumps(asdict(ConsumedGroup(**row))) == json.dumps(row) for row in rows)


def test_a_batch_that_consumes_one_mini_batch_records_only_the_next(tmp_path: Path) -> None:
    """One batch: the last two acks of mini-batch 0 (consuming it) and two acks of mini-batch 1. Mini-batch
    0 leaves no ack record; mini-batch 1's two acks are one record, restored after a restart."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c)
        first = [_plan(c, rank) for rank in range(4)]
        _together(c, [(0, str(first[0].plan_id)), (1, str(first[1].plan_id))])
        second = [_plan(c, rank) for rank in (0, 1)]
        got = _together(
            c,
            [
                (3, str(first[3].plan_id)),
                (1, str(second[1].plan_id)),
                (2, str(first[2].plan_id)),  # the W-th ack of mini-batch 0
                (0, str(second[0].plan_id)),
            ],
        )
        assert [(g["global_index"], g["consumed"]) for g in got] == [(0, False), (1, False), (0, True), (1, False)]
        assert _acks(db) == [(ack_batch_key(1, 0), {"attempt": 0, "ranks": [1, 0]})]
    with app_client(db) as c:
        job = c.app.state.service.jobs[JOB]  # type: ignore[attr-defined]
        assert job.first_unconsumed == 1 and job.minibatches[1].acks == {0, 1}


def test_parse_ack_key_reads_both_forms() -> None:
    """A per-rank key names its rank; a batch key's ranks are in the body."""
    assert parse_ack_key(rank_key(7, 12), {"attempt": 0}) == (7, [12])
    assert parse_ack_key(ack_batch_key(7, 3), {"attempt": 1, "ranks": [9, 3, 5]}) == (7, [9, 3, 5])


def _format(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return str(conn.execute("SELECT value FROM meta WHERE name='format'").fetchone()[0])


def test_a_format_1_database_is_read_and_marked_format_2(tmp_path: Path) -> None:
    """A database of format 1 (per-rank ack records only) opens, keeps its records, and is marked format 2
    so that a format-1 reader refuses it instead of misreading a batch record."""
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(
            "CREATE TABLE records (kind TEXT NOT NULL, job TEXT NOT NULL, key TEXT NOT NULL, body TEXT NOT NULL, "
            "PRIMARY KEY (kind, job, key)) WITHOUT ROWID;"
            "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "INSERT INTO meta VALUES ('format', '1');"
            f"INSERT INTO records VALUES ('ack', 'job1', '{rank_key(0, 3)}', '{{\"attempt\":0}}');"
        )
    store = RecordStore(str(db))
    assert store.load(Kind.ACK) == [("job1", rank_key(0, 3), {"attempt": 0})]
    store.close()
    assert STORE_FORMAT == "2" and _format(db) == "2"


@pytest.mark.parametrize("unknown", ["0", "3"])
def test_an_unknown_format_is_refused(tmp_path: Path, unknown: str) -> None:
    """A database of a format this version does not read is refused, naming both; it is left as it was."""
    db = tmp_path / "other.db"
    RecordStore(str(db)).close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value=? WHERE name='format'", (unknown,))
    with pytest.raises(StateError, match=rf"state format '{unknown}', this version reads 1, 2"):
        RecordStore(str(db))
    assert _format(db) == unknown
