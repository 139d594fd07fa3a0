"""A consumed mini-batch's staleness records: written as ``dataclasses.asdict`` would write them."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
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
    with contextlib.closing(sqlite3.connect(db)) as conn:  # closed: the next app takes the file alone
        (body,) = conn.execute("SELECT body FROM records WHERE kind=?", (Kind.CONSUMED.value,)).fetchone()
    rows = json.loads(body)
    assert len(rows) == 2 and all(json.dumps(asdict(ConsumedGroup(**row))) == json.dumps(row) for row in rows)
    with app_client(db) as c:  # and a restart reads them
        assert c.app.state.service.jobs[JOB].consumed_mini_batches == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("apart", [True, False])
def test_the_consuming_ack_publishes_the_acking_ranks_plans_before_the_admission_it_allows(
    tmp_path: Path, apart: bool
) -> None:
    """The last ack of a mini-batch, with ``admit_apart`` (a plan gateway runs): the acking rank's next plan
    (admitted already) is committed and published first, the admission that the consumption allows comes
    right after, in a change of its own (every rank's answer published again); the ack's answer comes
    after both, so ``next`` sees the admission; a restart on the file has the same state. Without it: one
    change, one publication."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=4, micro_batch_size=1)
        spec.update(lookahead=1, window=2)
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 6)})
        assert r.status_code == 200, r.text
        service = c.app.state.service  # type: ignore[attr-defined]
        service.admit_apart = apart
        job = service.jobs[JOB]
        assert job.next_n == 2  # mini-batches 0 and 1 admitted (lookahead 1), 2 waits for 0's consumption
        plans = [_plan(c, rank) for rank in range(4)]
        for rank in range(3):
            assert c.post(f"/v1/jobs/{JOB}/ranks/{rank}/ack", json={"plan_id": str(plans[rank].plan_id)}).is_success
        published: list[tuple[Any, int]] = []
        notify = service.on_plans
        service.on_plans = lambda name, ranks: (published.append((ranks, job.next_n)), notify(name, ranks))
        r = c.post(f"/v1/jobs/{JOB}/ranks/3/ack", json={"plan_id": str(plans[3].plan_id)})
        assert r.status_code == 200 and r.json()["consumed"] is True, r.text
        service.on_plans = notify
        # apart: rank 3's plan of mini-batch 1 first, then the admission of 2
        assert published == ([({3}, 2), (None, 3)] if apart else [(None, 3)])
        assert _plan(c, 3).global_index == 1 and job.next_n == 3
    with app_client(db) as c:
        assert c.app.state.service.jobs[JOB].next_n == 3  # type: ignore[attr-defined]
        assert [_plan(c, rank).global_index for rank in range(4)] == [1, 1, 1, 1]


def test_the_app_admits_apart_exactly_when_it_runs_a_plan_gateway(tmp_path: Path) -> None:
    """``admit_apart`` follows ``plan_gateway_port``: on with a gateway (any port), off without one."""
    with_gateway = app_client(tmp_path / "a.db", plan_gateway_port=0).app
    without = app_client(tmp_path / "b.db").app
    assert with_gateway.state.service.admit_apart is True  # type: ignore[attr-defined]
    assert without.state.service.admit_apart is False  # type: ignore[attr-defined]
