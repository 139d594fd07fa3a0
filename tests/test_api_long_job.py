"""A long job keeps the control plane's memory flat: consumed mini-batches leave memory (not the database)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, drain, job_spec, single_group_units
from fastapi.testclient import TestClient

from knittrans.manifest import Manifest

STEPS = 40


def _run(c: TestClient, start: int, groups: int) -> list[Manifest]:
    """Register ``groups`` one-group units (math/code alternating) and let the trainer consume all it can."""
    sources = ["math", "code"] * (groups // 2)
    r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(sources, start=start)})
    assert r.status_code == 200, r.text
    return drain(c, "job1")


def _job(c: TestClient) -> Any:
    return c.app.state.service.jobs["job1"]  # type: ignore[attr-defined]


@pytest.mark.timing
def test_consumed_mini_batches_leave_memory_and_old_acks_still_answer(tmp_path: Path) -> None:
    """After 40 steps only the mini-batches a question can still need stay in memory (and their attempts);
    an ack or fetched of a long-consumed mini-batch is a duplicate, its manifest a conflict, and the job goes
    on; a restart restores the same state and keeps evicting."""
    spec = job_spec(quotas={"math": 1, "code": 1}, mini_batches_per_step=2, world_size=2, micro_batch_size=1)
    db = str(tmp_path / "cp.db")
    with app_client(db) as c:
        c.post("/v1/jobs", json=spec)
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        manifests = _run(c, 0, 2 * STEPS)
        assert [m.global_index for m in manifests] == list(range(2 * STEPS))
        job = _job(c)
        assert job.position == 2 * STEPS
        assert len(job.minibatches) <= 2 and len(job.attempts) <= 2, sorted(job.minibatches)
        assert job.evicted_below >= 2 * STEPS - 2
        # mini-batch 0: consumed and evicted long ago
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": 0, "ranks": [0]})
        assert r.status_code == 200 and r.json()["duplicate"] and r.json()["consumed"], r.text
        r = c.post("/v1/jobs/job1/minibatches/0/fetched", json={"attempt": 0})
        assert r.status_code == 200 and r.json()["held"], r.text
        r = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0})
        assert r.status_code == 409 and "consumed" in r.json()["detail"], r.text
        status = c.get("/v1/jobs/job1/status").json()
    with app_client(db) as c:
        job = _job(c)
        assert job.position == 2 * STEPS
        assert len(job.minibatches) <= 2
        assert c.get("/v1/jobs/job1/status").json()["staleness"] == status["staleness"]
        more = _run(c, 2 * STEPS, 8)
        assert [m.global_index for m in more] == list(range(2 * STEPS, 2 * STEPS + 8))
        assert len(_job(c).minibatches) <= 2
