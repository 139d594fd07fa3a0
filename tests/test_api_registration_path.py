"""The unit-registration path: errors name the field, the units record on disk is the descriptors' JSON,
and a restart rebuilds the same state. Real app (TestClient), real SQLite."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from api_support import app_client, job_spec, single_group_units

from knittrans.api.records import Kind
from knittrans.descriptors import GroupRecord, UnitDescriptor

JOB = "job1"


def test_hot_path_errors_name_the_field_over_http(tmp_path: Path) -> None:
    """Through the real app: a boolean token count is a 422 naming the field and saying why."""
    with app_client(tmp_path / "cp.db") as c:
        assert c.post("/v1/jobs", json=job_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        body = single_group_units(["math"])
        body[0]["groups"][0]["trajectory_tokens"] = [10, True]
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": body})
        assert r.status_code == 422, r.text
        assert (
            r.json()["detail"] == "body.units.0.groups.0.trajectory_tokens.1: Value error, a boolean is not an integer"
        )
        body[0]["groups"][0]["trajectory_tokens"] = ["10", 11.0]  # lax numbers: accepted as before
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": body})
        assert r.status_code == 200 and r.json()["registered"] == 1, r.text
        group = c.app.state.service.jobs[JOB].groups["g0"]  # type: ignore[attr-defined]  # between requests
        assert group.record.trajectory_tokens == (10, 11)


def _state(c: Any) -> dict[str, Any]:
    job = c.app.state.service.jobs[JOB]  # between requests: the state thread is idle
    return {
        "units": dict(job.units),
        "groups": {g: (e.record, e.unit_id, e.node_id, e.status, e.mini_batch, e.view) for g, e in job.groups.items()},
        "unadmitted": sorted(job.unadmitted),
        "counts": {k: v for k, v in job.group_counts.items() if v},
        "finished": dict(job.finished_count),
        "next_n": job.next_n,
        "batches": job.unit_batches,
    }


def test_units_record_and_restart_after_bulk_registration(tmp_path: Path) -> None:
    """A bulk registration (500 units, numbers in several forms, a retried batch) stores the same units
    record as ``json.dumps(u.to_dict())`` would, and a restarted control plane rebuilds exactly the same
    state."""
    db = tmp_path / "cp.db"
    spec = job_spec(quotas={"math": 4, "code": 2}, group_size=2, lookahead=1)
    sources = ["math", "math", "code"] * 167
    units = single_group_units(sources[:500], size=2)
    for i, u in enumerate(units):  # numbers in the forms a writer may send
        g = u["groups"][0]
        g["finished_at"] = 1000 + i if i % 3 else 1000.125 + i
        g["version_weighted"] = 0 if i % 2 else 0.0
        g["trajectory_tokens"] = [7, 2**31 - 1] if i % 5 == 0 else [1, 3]
    units[7]["groups"][0]["media_hashes"] = ["ab" * 32]
    with app_client(db) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units})
        assert r.status_code == 200 and r.json()["registered"] == 500, r.text
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:3]})  # a retried batch: all duplicates
        assert r.json()["registered"] == 0 and r.json()["duplicates"] == 3
        before = _state(c)
        svc = c.app.state.service  # type: ignore[attr-defined]
        records = [v for _, _, v in svc.store.load(Kind.UNITS)]
        job = svc.jobs[JOB]
        descriptors = [job.units[u["unit_id"]] for u in units if u["unit_id"] in job.units]
    assert len(records) == 1 and len(records[0]) == 500
    plain = json.loads(json.dumps([UnitDescriptor.from_dict(u).to_dict() for u in units]))
    assert records[0] == plain
    assert all(
        isinstance(g["version_weighted"], float) and isinstance(g["finished_at"], float)
        for u in records[0]
        for g in u["groups"]
    )
    assert all(d == UnitDescriptor.from_dict(u) for d, u in zip(descriptors, units, strict=False))
    with app_client(db) as c:
        after = _state(c)
        assert after == before
        for gid, (record, *_) in after["groups"].items():
            assert isinstance(record, GroupRecord) and math.isfinite(record.finished_at), gid
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:3]})  # still duplicates after the restart
        assert r.json()["duplicates"] == 3
        changed = json.loads(json.dumps(units[0]))
        changed["num_bytes"] += 1
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": [changed]})
        assert r.status_code == 409 and "different descriptor" in r.text
