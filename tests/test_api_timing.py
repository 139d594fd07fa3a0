"""Admission timing through the real FastAPI app: lookahead L, admission on acks, the headroom long-poll."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from api_support import ack, app_client, job_spec, manifest, single_group_units
from fastapi.testclient import TestClient

from knittrans.manifest import Manifest


def _setup(c: TestClient, *, lookahead: int, k: int = 3, steps: int = 10, window: int = 1) -> None:
    spec = job_spec(
        quotas={"math": 2, "code": 1}, mini_batches_per_step=k, world_size=1, lookahead=lookahead, window=window
    )
    assert c.post("/v1/jobs", json=spec).status_code == 201
    c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
    sources = ["math", "code", "math"] * steps
    assert c.post("/v1/jobs/job1/supply", json={"started": {"math": 2 * steps, "code": steps}}).status_code == 200
    r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(sources)})
    assert r.status_code == 200, r.text
    c.registered = r.json()  # type: ignore[attr-defined]


def _ack_next(c: TestClient) -> Manifest:
    """Read the manifest at the trainer's position and ack it."""
    m = manifest(c, "job1", c.get("/v1/jobs/job1/minibatches").json()["position"])
    assert m is not None
    ack(c, "job1", m)
    return m


def test_registration_admits_only_up_to_the_lookahead(tmp_path: Path) -> None:
    """K=3, one rank, 10 train batches finished, nothing acked: L=1 admits mini-batches 0 and 1, not all 30."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=1)
        assert c.registered["admitted"] == [0, 1]  # type: ignore[attr-defined]
        status = c.get("/v1/jobs/job1/status").json()
        assert status["timing"]["position"] == 0 and status["timing"]["admitted_ahead"] == 1
        for n in range(5):  # every ack moves the trainer's position and admits exactly one more
            assert _ack_next(c).global_index == n
            status = c.get("/v1/jobs/job1/status").json()
            assert status["next_global_index"] == n + 3
            assert status["timing"]["position"] == n + 1
        assert status["timing"]["peak_admitted_ahead"] == 1
        assert [a["ahead"] for a in status["recent_admissions"]] == [0] + [1] * 6


def test_lookahead_zero_admits_when_the_trainer_asks(tmp_path: Path) -> None:
    """L=0: only the trainer's current mini-batch is ever admitted; the next one comes with the ack."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=0)
        assert c.registered["admitted"] == [0]  # type: ignore[attr-defined]
        m = manifest(c, "job1", 0)
        assert m is not None
        assert manifest(c, "job1", 1) is None  # nothing to prefetch with L = 0
        ack(c, "job1", m)
        assert c.get("/v1/jobs/job1/status").json()["next_global_index"] == 2
        assert manifest(c, "job1", 1) is not None


def test_headroom_counts_untaken_groups_and_opens_with_progress(tmp_path: Path) -> None:
    """Room = W·G - untaken; admission leaves it unchanged, an ack (trainer progress) opens it."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=1, steps=1, window=2)  # G = 3 groups, all finished; mini-batches 0, 1 admitted
        view = c.get("/v1/jobs/job1/headroom").json()
        # untaken: mini-batch 1 (admitted beyond the position) and the unadmitted group of mini-batch 2
        assert view["position"] == 0 and view["next_global_index"] == 2
        assert sum(view["untaken"].values()) == 2 and view["room"] == 2 * 3 - 2
        assert view["launch_order"] == ["math", "code"]  # equal shares of launches (2/2, 1/1): quota order
        _ack_next(c)  # position 1; mini-batch 2 is admitted beyond it and stays untaken
        view = c.get("/v1/jobs/job1/headroom").json()
        assert view["position"] == 1 and view["next_global_index"] == 3
        assert sum(view["untaken"].values()) == 1 and view["room"] == 5
        _ack_next(c)
        view = c.get("/v1/jobs/job1/headroom").json()
        assert sum(view["untaken"].values()) == 0 and view["room"] == 6


@pytest.mark.timing
def test_headroom_long_poll_answers_when_an_ack_frees_room(tmp_path: Path) -> None:
    """A rollout worker waiting on a full window is answered by the ack that frees room, not by a timeout."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=1, steps=1)  # W·G = 3, three groups untaken except mini-batch 0's
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 1}})  # fill the window: room 0
        assert c.get("/v1/jobs/job1/headroom").json()["room"] == 0
        result: dict[str, Any] = {}

        def wait() -> None:
            t0 = time.monotonic()
            result["view"] = c.get("/v1/jobs/job1/headroom", params={"wait_s": 60}).json()
            result["seconds"] = time.monotonic() - t0

        waiter = threading.Thread(target=wait)
        waiter.start()
        for _ in range(3):  # other requests are served while the poll is parked; it has nothing to answer yet
            assert c.get("/v1/jobs/job1/headroom").json()["room"] == 0
        assert waiter.is_alive()
        _ack_next(c)
        waiter.join(timeout=60)
        assert not waiter.is_alive()
        assert result["view"]["room"] > 0  # a poll that answered before the ack would have seen room 0
        assert result["seconds"] < 60  # answered by the ack, not by the long-poll's end


def test_headroom_rejects_bad_input(tmp_path: Path) -> None:
    """A negative wait and an unknown job are refused with the problem named."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=1, steps=1)
        r = c.get("/v1/jobs/job1/headroom", params={"wait_s": -1})
        assert r.status_code == 422 and "wait_s" in r.text
        r = c.get("/v1/jobs/nope/headroom")
        assert r.status_code == 404 and "nope" in r.json()["detail"]
        r = c.post("/v1/jobs", json=job_spec(name="bad", lookahead=-1))
        assert r.status_code == 422 and "lookahead" in r.text


def test_a_source_in_deficit_may_launch_when_the_window_is_full(tmp_path: Path) -> None:
    """Window full of one source's groups while the step still needs another source (e.g. its groups were lost):
    that source gets headroom for its deficit, so the job cannot deadlock on the window."""
    with app_client(tmp_path / "cp.db") as c:
        spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=1, world_size=1, lookahead=1, window=1)
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        assert c.post("/v1/jobs/job1/supply", json={"started": {"math": 4}}).status_code == 200
        r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"] * 4)})
        assert r.status_code == 200 and r.json()["admitted"] == []
        view = c.get("/v1/jobs/job1/headroom").json()
        assert view["room"] == 0  # W·G = 4 groups untaken
        assert view["headroom"] == {"math": 0, "code": 2}
        assert c.post("/v1/jobs/job1/supply", json={"started": {"code": 2}}).status_code == 200
        assert c.get("/v1/jobs/job1/headroom").json()["headroom"]["code"] == 0  # deficit now covered by pending


@pytest.mark.timing
def test_the_version_an_ack_carries_is_recorded_with_the_window_it_frees(tmp_path: Path) -> None:
    """A rollout worker woken by the ack that frees the window already reads the policy version that ack
    carried (recorded in the same change, before the admission it allows); a repeated ack carries it again
    harmlessly, and a restart has both."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c, lookahead=1, steps=1)
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 1}})  # fill the window: room 0
        assert c.get("/v1/jobs/job1/headroom").json()["room"] == 0
        seen: dict[str, Any] = {}

        def rollout() -> None:
            seen["room"] = c.get("/v1/jobs/job1/headroom", params={"wait_s": 60}).json()["room"]
            seen["version"] = c.get("/v1/jobs/job1/version").json()["version"]

        waiter = threading.Thread(target=rollout)
        waiter.start()
        m = manifest(c, "job1", 0)
        assert m is not None
        assert ack(c, "job1", m, version=3)["consumed"]
        waiter.join(60)
        assert not waiter.is_alive() and seen == {"room": 1, "version": 3}
        assert ack(c, "job1", m, version=3)["duplicate"]
        status = c.get("/v1/jobs/job1/status").json()
        assert status["next_global_index"] == 3 and status["timing"]["position"] == 1
    with app_client(db) as c:
        assert c.get("/v1/jobs/job1/version").json() == {"version": 3, "by_rank": {"0": 3}}
        assert c.get("/v1/jobs/job1/minibatches").json()["position"] == 1


@pytest.mark.timing
def test_a_paused_job_keeps_its_room_and_the_long_poll_answers_at_once(tmp_path: Path) -> None:
    """Pause stops admission, not rollout: the headroom long-poll of a paused job with room answers at once
    (it waited for the resume before), and launches while paused count against the window as always."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, lookahead=1, steps=1, window=2)  # room 6 - 2 = 4, as in the test above
        assert c.post("/v1/jobs/job1/pause").json()["state"] == "paused"
        t0 = time.monotonic()
        view = c.get("/v1/jobs/job1/headroom", params={"wait_s": 60, "sources": "math"}).json()
        assert time.monotonic() - t0 < 30, "the paused job's long-poll waited instead of answering"
        assert view["state"] == "paused" and view["room"] == 4 and view["headroom"]["math"] == 4
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 4}})  # launched while paused: the window is full
        assert c.get("/v1/jobs/job1/headroom").json()["room"] == 0
        assert c.get("/v1/jobs/job1/status").json()["next_global_index"] == 2  # and nothing more was admitted
