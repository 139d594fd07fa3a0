"""A consumed mini-batch's staleness records: written as ``dataclasses.asdict`` would write them."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import asdict
from pathlib import Path

from api_support import app_client, job_spec, manifest, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.records import Kind
from knittrans.sched.staleness import ConsumedGroup

JOB = "job1"


def _setup(c: TestClient) -> None:
    """World 4, one row per rank per mini-batch, two mini-batches admitted."""
    spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=4, micro_batch_size=1)
    assert c.post("/v1/jobs", json=spec).status_code == 201
    c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
    r = c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 4)})
    assert r.status_code == 200 and r.json()["admitted"], r.text


def test_a_consumed_mini_batchs_staleness_rows_are_what_asdict_writes(tmp_path: Path) -> None:
    """Every rank acks: the mini-batch is consumed and its staleness rows (one per group, built without
    ``asdict``'s recursive copy) are the JSON ``asdict`` writes, fields in order, and load back."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c)
        for rank in range(4):
            r = c.post(f"/v1/jobs/{JOB}/minibatches/0/ack", json={"attempt": 0, "ranks": [rank]})
            assert r.status_code == 200, r.text
        assert r.json()["consumed"] is True
    with contextlib.closing(sqlite3.connect(db)) as conn:  # closed: the next app takes the file alone
        (body,) = conn.execute("SELECT body FROM records WHERE kind=?", (Kind.CONSUMED.value,)).fetchone()
    rows = json.loads(body)
    assert len(rows) == 2 and all(json.dumps(asdict(ConsumedGroup(**row))) == json.dumps(row) for row in rows)
    with app_client(db) as c:  # and a restart reads them
        assert c.app.state.service.jobs[JOB].position == 1  # type: ignore[attr-defined]


def test_the_consuming_ack_is_answered_after_the_admission_it_allows_is_published(tmp_path: Path) -> None:
    """The last ack of a mini-batch frees the lookahead: the admission it allows runs in the same change and
    its manifest is on the board before the ack's answer, so a long-poll right after it (timeout 0) gets it;
    a restart on the file has the same state."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=4, micro_batch_size=1)
        spec.update(lookahead=1, window=2)
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 6)})
        assert r.status_code == 200, r.text
        job = c.app.state.service.jobs[JOB]  # type: ignore[attr-defined]
        assert job.next_n == 2  # mini-batches 0 and 1 admitted (lookahead 1), 2 waits for 0's consumption
        assert manifest(c, JOB, 2) is None
        r = c.post(f"/v1/jobs/{JOB}/minibatches/0/ack", json={"attempt": 0, "ranks": [0, 1, 2]})
        assert r.status_code == 200 and r.json()["consumed"] is False, r.text
        assert job.next_n == 2
        r = c.post(f"/v1/jobs/{JOB}/minibatches/0/ack", json={"attempt": 0, "ranks": [3]})
        assert r.status_code == 200 and r.json()["consumed"] is True, r.text
        m2 = manifest(c, JOB, 2)
        assert m2 is not None and m2.global_index == 2 and job.next_n == 3
    with app_client(db) as c:
        assert c.app.state.service.jobs[JOB].next_n == 3  # type: ignore[attr-defined]
        assert manifest(c, JOB, 2) == m2
        assert c.get(f"/v1/jobs/{JOB}/minibatches").json()["position"] == 1
