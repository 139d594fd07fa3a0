"""The train_batch baselines live: ``train_batch_handover`` ``step`` frees a whole train batch when its first
mini-batch starts, ``mini_batch`` (every policy's rule) only the started mini-batches' groups."""

from __future__ import annotations

from pathlib import Path

import pytest
from api_support import ack, app_client, job_spec, manifest, single_group_units
from fastapi.testclient import TestClient


def _untaken(c: TestClient) -> int:
    return sum(c.get("/v1/jobs/job1/headroom").json()["untaken"].values())


def _start(c: TestClient, handover: str) -> None:
    """A train_batch job (G = 3, K = 3, L = 1, quotas math 2 / code 1) on node n0, with 4 math and 2 code groups
    launched."""
    spec = job_spec(
        quotas={"math": 2, "code": 1},
        mini_batches_per_step=3,
        world_size=1,
        lookahead=1,
        policy="train_batch",
        train_batch_handover=handover,
    )
    assert c.post("/v1/jobs", json=spec).status_code == 201
    c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
    assert c.post("/v1/jobs/job1/supply", json={"started": {"math": 4, "code": 2}}).status_code == 200


def _ack_next(c: TestClient) -> None:
    m = manifest(c, "job1", c.get("/v1/jobs/job1/minibatches").json()["position"])
    assert m is not None
    ack(c, "job1", m)


@pytest.mark.parametrize(("handover", "expected"), [("step", (3, 0)), ("mini_batch", (5, 2))])
def test_train_batch_handover_frees_the_window(tmp_path: Path, handover: str, expected: tuple[int, int]) -> None:
    """G = 3, K = 3, L = 1, two steps finished: with mb0 started, "step" leaves only step 1's three groups untaken
    ("mini_batch": mb1's and the four unadmitted); after step 0's three acks, step 1 has started: 0 (vs 2)."""
    with app_client(tmp_path / "cp.db") as c:
        _start(c, handover)
        units = single_group_units(["math", "code", "math"] * 2)
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0, 1]
        assert _untaken(c) == expected[0]
        for _ in range(3):
            _ack_next(c)
        assert c.get("/v1/jobs/job1/headroom").json()["position"] == 3
        assert _untaken(c) == expected[1]
        assert c.get("/v1/jobs/job1").json()["spec"]["train_batch_handover"] == handover


def test_step_handover_is_train_batch_only(tmp_path: Path) -> None:
    """Another policy with handover "step" is refused, naming the field; an unknown handover too."""
    with app_client(tmp_path / "cp.db") as c:
        r = c.post("/v1/jobs", json=job_spec(train_batch_handover="step"))
        assert r.status_code == 409 and "train_batch_handover" in r.text  # a rule across fields
        r = c.post("/v1/jobs", json=job_spec(policy="train_batch", train_batch_handover="batch"))
        assert r.status_code == 422 and "train_batch_handover" in r.text
        assert c.post("/v1/jobs", json=job_spec(policy="version_aware")).status_code == 201


def test_step_handover_frees_nothing_before_the_step_starts(tmp_path: Path) -> None:
    """With "step", a step whose first mini-batch is not admitted (the trainer has not started it) hands over
    nothing: all six launched groups (four generating, two finished) are untaken."""
    with app_client(tmp_path / "cp.db") as c:
        _start(c, "step")
        units = single_group_units(["math", "code"])
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == []
        assert c.get("/v1/jobs/job1/headroom").json()["untaken"] == {"math": 4, "code": 2}
