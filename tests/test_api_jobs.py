"""Control-plane job endpoints on the real app (TestClient): specs, quotas, lifecycle, auth, errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, drain, job_spec, manifest, single_group_units
from fastapi.testclient import TestClient

from knittrans.api import Settings, create_app
from knittrans.api.models import MAX_MINI_BATCHES_PER_STEP, JobCreate
from knittrans.api.spec import JobSpec


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with app_client(tmp_path / "cp.db") as c:
        yield c


@pytest.fixture
def node(client: TestClient) -> str:
    assert client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
    return "n0"


def test_create_and_get_job(client: TestClient) -> None:
    """A valid spec creates the job (201) and GET returns its spec, state and quotas."""
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201, r.text
    body = client.get("/v1/jobs/job1").json()
    assert body["state"] == "running"
    assert body["quotas"] == {"math": 4, "code": 2}
    assert body["spec"]["mini_batches_per_step"] == 3


def test_job_create_and_job_spec_list_the_same_fields() -> None:
    """JobCreate (the body: each field's range, 422) and JobSpec (the job: rules across fields, 409) are two
    lists of one job's fields: same names in the same order, and a body giving only what JobSpec requires
    becomes the JobSpec with the same defaults."""
    assert list(JobCreate.model_fields) == [f.name for f in dataclasses.fields(JobSpec)]
    required: dict[str, Any] = {
        "name": "j",
        "group_size": 1,
        "quotas": {"a": 1},
        "mini_batches_per_step": 1,
        "policy": "train_batch",
        "world_size": 1,
        "micro_batch_size": 1,
    }
    assert JobSpec.from_dict(JobCreate(**required).model_dump()) == JobSpec(**required)


def test_create_is_idempotent_for_the_same_spec_only(client: TestClient) -> None:
    """The identical spec again answers 200; a different spec under the same name is a 409."""
    assert client.post("/v1/jobs", json=job_spec()).status_code == 201
    assert client.post("/v1/jobs", json=job_spec()).status_code == 200
    r = client.post("/v1/jobs", json=job_spec(world_size=1))
    assert r.status_code == 409
    assert r.json()["error"] == "conflict"


@pytest.mark.parametrize(
    ("overrides", "status", "names"),
    [
        ({"mini_batches_per_step": 7}, 409, "mini_batches_per_step"),
        ({"policy": "fastest"}, 422, "policy"),
        ({"quotas": {}}, 422, "quotas"),
        ({"quotas": {"math": -1, "code": 2}}, 422, "quotas.math"),
        ({"quotas": {"math": 0}}, 409, "quotas"),
        ({"bounds": {"math": {"lo": 2}}}, 409, "bounds.math.lo"),
        ({"bounds": {"code": {"lo": 0, "hi": 0}}}, 409, "bounds.code.hi"),
        ({"bounds": {"math": {"lo": 3, "hi": 1}}}, 409, "bounds.math"),
        ({"bounds": {"poetry": {"lo": 0}}}, 409, "bounds.poetry"),
        ({"world_size": 0}, 422, "world_size"),
        ({"world_size": 5}, 409, "world_size"),
        ({"micro_batch_tokens": 100}, 409, "micro_batch_tokens"),
        ({"micro_batch_size": None}, 409, "micro_batch_size"),
        ({"group_size": 0}, 422, "group_size"),
        ({"name": "../etc"}, 422, "name"),
        ({"max_staleness": -1}, 422, "max_staleness"),
        ({"lookahead": -1}, 422, "lookahead"),
        ({"window": 0}, 422, "window"),
        ({"columns": []}, 422, "columns"),
        ({"quotas": {"math": "many"}}, 422, "quotas.math"),
        ({"surprise": 1}, 422, "surprise"),
        # an absurd K (found by the schemathesis run): planning its step took a minute of the event loop
        ({"mini_batches_per_step": 292675459, "quotas": {"math": 2147483647, "code": 1}}, 422, "mini_batches_per_step"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(
    client: TestClient, overrides: dict[str, Any], status: int, names: str
) -> None:
    """Each invalid spec gets a 4xx JSON error whose detail names the offending field."""
    r = client.post("/v1/jobs", json=job_spec(**overrides))
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "detail"}
    assert names in body["detail"], body
    assert client.get("/v1/jobs/job1").status_code == 404


def test_job_spec_refuses_more_mini_batches_than_the_maximum(client: TestClient) -> None:
    """K is capped at MAX_MINI_BATCHES_PER_STEP at the HTTP edge: the maximum is created, one more is a 422."""
    spec = job_spec(quotas={"math": 10_000, "code": 0}, world_size=1)
    r = client.post("/v1/jobs", json={**spec, "mini_batches_per_step": MAX_MINI_BATCHES_PER_STEP + 1})
    assert r.status_code == 422 and "mini_batches_per_step" in r.json()["detail"], r.text
    r = client.post("/v1/jobs", json={**spec, "mini_batches_per_step": MAX_MINI_BATCHES_PER_STEP})
    assert r.status_code == 201 and r.json()["spec"]["mini_batches_per_step"] == MAX_MINI_BATCHES_PER_STEP


def test_missing_field_is_named(client: TestClient) -> None:
    """A spec without world_size is a 422 naming body.world_size."""
    spec = job_spec()
    del spec["world_size"]
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 422 and "world_size" in r.json()["detail"]


def test_unknown_job_and_route_are_404_json(client: TestClient) -> None:
    """Unknown jobs and paths answer JSON errors with kind not_found."""
    r = client.get("/v1/jobs/nope/status")
    assert r.status_code == 404 and r.json()["error"] == "not_found" and "nope" in r.json()["detail"]
    assert client.get("/v1/nothing").json()["error"] == "not_found"


def test_quota_update_takes_effect_at_the_next_step(client: TestClient, node: str) -> None:
    """New quotas apply from the next train step; the current step keeps its own composition."""
    client.post("/v1/jobs", json=job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2))
    client.post("/v1/jobs/job1/supply", json={"started": {"math": 6, "code": 6}})
    r = client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"])})
    assert r.json()["admitted"] == [0]
    upd = client.put("/v1/jobs/job1/quotas", json={"quotas": {"math": 3, "code": 1}})
    assert upd.status_code == 200, upd.text
    assert upd.json()["effective_from_step"] == 1
    assert upd.json()["quotas"] == {"math": 2, "code": 2}  # step 0 still runs on the old quotas
    more = single_group_units(["math", "code", "math", "math", "math", "code"], start=2)
    client.post("/v1/jobs/job1/units", json={"units": more})
    by_step: dict[int, dict[str, int]] = {}
    src = {f"g{i}": s for i, s in enumerate(["math", "code", "math", "code", "math", "math", "math", "code"])}
    for m in drain(client, "job1"):
        for rank in range(m.world_size):
            for micro in m.share(rank).micro_batches:
                for row in micro.rows:
                    if row.row == 0:
                        by_step.setdefault(m.step, {}).setdefault(src[row.group_id], 0)
                        by_step[m.step][src[row.group_id]] += 1
    assert by_step == {0: {"math": 2, "code": 2}, 1: {"math": 3, "code": 1}}


def test_quota_update_is_validated(client: TestClient) -> None:
    """A quota update is checked like a spec: K > G and negative quotas are 422s naming the field."""
    client.post("/v1/jobs", json=job_spec())
    r = client.put("/v1/jobs/job1/quotas", json={"quotas": {"math": 1, "code": 1}})
    assert r.status_code == 409 and "mini_batches_per_step" in r.json()["detail"]
    r = client.put("/v1/jobs/job1/quotas", json={"quotas": {"math": -2, "code": 9}})
    assert r.status_code == 422 and "quotas.math" in r.json()["detail"]
    # quotas whose smallest mini-batch has fewer trajectories than the job has ranks: refused like such a spec
    client.post("/v1/jobs", json=job_spec(name="wide", world_size=4))
    r = client.put("/v1/jobs/wide/quotas", json={"quotas": {"math": 2, "code": 1}})
    assert r.status_code == 409 and "world_size" in r.json()["detail"], r.text
    assert client.get("/v1/jobs/wide").json()["quota_changes"] == [{"from_step": 0, "quotas": {"math": 4, "code": 2}}]
    assert client.post("/v1/jobs/wide/drain").json()["state"] == "drained"  # at a step boundary, nothing in flight
    r = client.put("/v1/jobs/wide/quotas", json={"quotas": {"math": 4, "code": 2}})
    assert r.status_code == 409 and "drained; its quotas can no longer change" in r.json()["detail"], r.text


@pytest.mark.timing
def test_pause_blocks_admission_and_resume_restarts_it(client: TestClient, node: str) -> None:
    """A paused job admits nothing; resuming admits what became possible meanwhile."""
    client.post("/v1/jobs", json=job_spec(quotas={"math": 1, "code": 1}, mini_batches_per_step=1, world_size=1))
    assert client.post("/v1/jobs/job1/pause").json()["state"] == "paused"
    r = client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"])})
    assert r.json()["admitted"] == []
    r = client.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0})
    assert (
        r.status_code == 204 and r.headers["X-KnitTrans-Job-State"] == "paused" and "X-KnitTrans-Done" not in r.headers
    )
    assert client.post("/v1/jobs/job1/resume").json()["next_global_index"] == 1
    assert manifest(client, "job1", 0) is not None


@pytest.mark.timing
def test_drain_finishes_the_step_and_cannot_be_resumed(client: TestClient, node: str) -> None:
    """Drain admits the rest of the current step, nothing after it; resume is then a 409."""
    client.post("/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1))
    client.post("/v1/jobs/job1/supply", json={"started": {"math": 5}})
    assert client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])}).json()["admitted"] == [0]
    assert client.post("/v1/jobs/job1/drain").json()["state"] == "draining"
    client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"] * 4, start=1)})
    assert [m.global_index for m in drain(client, "job1")] == [0, 1]
    assert client.get("/v1/jobs/job1").json()["state"] == "drained"
    r = client.get("/v1/jobs/job1/minibatches/2", params={"timeout_s": 5})
    assert r.status_code == 204 and r.headers["X-KnitTrans-Done"] == "1"
    assert r.headers["X-KnitTrans-Job-State"] == "drained"
    r = client.post("/v1/jobs/job1/resume")
    assert r.status_code == 409 and "drained" in r.json()["detail"]


def test_tokens_guard_worker_and_admin_endpoints(tmp_path: Path) -> None:
    """With tokens set: health is open, workers need a token, admin calls need the admin token."""
    settings = Settings(db_path=str(tmp_path / "a.db"), worker_token="wt", admin_token="at")
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/health").status_code == 200
        r = c.post("/v1/jobs", json=job_spec())
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated"
        assert c.post("/v1/jobs", json=job_spec(), headers={"Authorization": "Bearer wt"}).status_code == 401
        assert c.post("/v1/jobs", json=job_spec(), headers={"Authorization": "Bearer at"}).status_code == 201
        node = {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}
        assert c.post("/v1/nodes", json=node).status_code == 401
        assert c.post("/v1/nodes", json=node, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.post("/v1/nodes", json=node, headers={"Authorization": "Basic wt"}).status_code == 401
        assert c.post("/v1/nodes", json=node, headers={"Authorization": "Bearer wt"}).status_code == 200
        assert c.get("/v1/jobs/job1/status", headers={"Authorization": "Bearer at"}).status_code == 200
        assert c.post("/v1/nodes/n0/lost", headers={"Authorization": "Bearer wt"}).status_code == 401


def test_without_an_admin_token_admin_endpoints_take_the_worker_token(tmp_path: Path) -> None:
    """With only a worker token set, admin calls need that token (not none, not another); a bearer header is read
    case-blind in its scheme and with blanks around the token, and one that is not ``Bearer <token>`` is a 401
    naming the form."""
    settings = Settings(db_path=str(tmp_path / "a.db"), worker_token="wt")
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/jobs", json=job_spec()).status_code == 401
        assert c.post("/v1/jobs", json=job_spec(), headers={"Authorization": "Bearer at"}).status_code == 401
        assert c.post("/v1/jobs", json=job_spec(), headers={"Authorization": "bearer  wt "}).status_code == 201
        for header in ("Bearer   ", "Basic wt", "wt"):
            r = c.get("/v1/jobs/job1", headers={"Authorization": header})
            assert r.status_code == 401 and "must be 'Bearer <token>'" in r.json()["detail"], (header, r.text)


def test_metrics_are_per_app_instance(tmp_path: Path) -> None:
    """Two apps in one process keep separate Prometheus registries."""
    with (
        app_client(tmp_path / "1.db") as a,
        app_client(tmp_path / "2.db") as b,
    ):
        a.post("/v1/jobs", json=job_spec())
        assert 'knittrans_quota_fill_ratio{job_name="job1",source="math"}' in a.get("/metrics").text
        assert "job1" not in b.get("/metrics").text
