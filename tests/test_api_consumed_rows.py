"""A consumed mini-batch's staleness records: written as ``dataclasses.asdict`` would write them."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from pathlib import Path

from api_support import app_client, job_spec, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.records import Kind
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


def test_a_consumed_mini_batchs_staleness_rows_are_what_asdict_writes(tmp_path: Path) -> None:
    """Every rank acks: the mini-batch is consumed and its staleness rows (one per group, built without
    ``asdict``'s recursive copy) are the JSON ``asdict`` writes, fields in order, and load back."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c)
        for rank in range(4):
            r = c.post(f"/v1/jobs/{JOB}/ranks/{rank}/ack", json={"plan_id": str(_plan(c, rank).plan_id)})
            assert r.status_code == 200, r.text
        assert r.json()["consumed"] is True
    with sqlite3.connect(db) as conn:
        (body,) = conn.execute("SELECT body FROM records WHERE kind=?", (Kind.CONSUMED.value,)).fetchone()
    rows = json.loads(body)
    assert len(rows) == 2 and all(json.dumps(asdict(ConsumedGroup(**row))) == json.dumps(row) for row in rows)
    with app_client(db) as c:  # and a restart reads them
        assert c.app.state.service.jobs[JOB].consumed_mini_batches == 1  # type: ignore[attr-defined]
