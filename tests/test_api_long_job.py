"""A long job keeps the control plane's memory flat: consumed mini-batches leave memory (not the database)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api_support import app_client, drain_ranks, job_spec, single_group_units
from fastapi.testclient import TestClient

from knittrans.plans import RankPlan

STEPS = 40


def _run(c: TestClient, start: int, groups: int) -> list[RankPlan]:
    """Register ``groups`` one-group units (math/code alternating) and let both ranks consume all they can."""
    sources = ["math", "code"] * (groups // 2)
    r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(sources, start=start)})
    assert r.status_code == 200, r.text
    return drain_ranks(c, "job1", 2)


def _job(c: TestClient) -> Any:
    return c.app.state.service.jobs["job1"]  # type: ignore[attr-defined]


def test_consumed_mini_batches_leave_memory_and_old_plan_ids_still_answer(tmp_path: Path) -> None:
    """After 40 steps only the mini-batches a question can still need stay in memory (and their attempts);
    an ack of a long-consumed plan is a duplicate, ``after`` it is a conflict, ``next`` goes on; a restart
    restores the same state and keeps evicting."""
    spec = job_spec(quotas={"math": 1, "code": 1}, mini_batches_per_step=2, world_size=2, micro_batch_size=1)
    db = str(tmp_path / "cp.db")
    with app_client(db) as c:
        c.post("/v1/jobs", json=spec)
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        plans = _run(c, 0, 2 * STEPS)
        assert len(plans) == 2 * STEPS * 2  # every mini-batch reached both ranks
        job = _job(c)
        assert job.first_unconsumed == 2 * STEPS and job.consumed_mini_batches == 2 * STEPS
        assert len(job.minibatches) <= 2 and len(job.attempts) <= 2, sorted(job.minibatches)
        assert job.evicted_below >= 2 * STEPS - 2
        old = str(plans[0].plan_id)  # mini-batch 0, rank 0: consumed and evicted long ago
        r = c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": old})
        assert r.status_code == 200 and r.json()["duplicate"] and r.json()["consumed"], r.text
        r = c.get("/v1/jobs/job1/ranks/0/next", params={"timeout_s": 0, "after": old})
        assert r.status_code == 409 and "already acked" in r.json()["detail"], r.text
        status = c.get("/v1/jobs/job1/status").json()
    with app_client(db) as c:
        job = _job(c)
        assert (job.first_unconsumed, job.consumed_mini_batches) == (2 * STEPS, 2 * STEPS)
        assert len(job.minibatches) <= 2
        assert c.get("/v1/jobs/job1/status").json()["staleness"] == status["staleness"]
        more = _run(c, 2 * STEPS, 8)
        assert sorted({p.global_index for p in more}) == list(range(2 * STEPS, 2 * STEPS + 8))
        assert len(_job(c).minibatches) <= 2
