"""Control plane at scale, structurally: manifest long-poll wake-ups and a status that does not grow with the job.

Real app (TestClient, real SQLite). No timings: what is checked is who gets woken (the board's events) and
what the status holds (the ledger's footprint, exact counts after a restart).
"""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from api_support import ack, app_client, manifest, single_group_units
from fastapi.testclient import TestClient

from knittrans.api import consumed
from knittrans.api.board import ManifestBoard
from knittrans.api.consumed import RECENT_STEPS, RESOLUTION, ConsumedLedger
from knittrans.sched.staleness import ConsumedGroup, RunningSummary, summarize_weighted

JOB = "job1"


def _spec(**overrides: Any) -> dict[str, Any]:
    spec = {
        "name": JOB,
        "group_size": 1,
        "quotas": {"math": 2},
        "mini_batches_per_step": 1,
        "policy": "constraint_preserving",
        "world_size": 2,
        "micro_batch_size": 1,
        "lookahead": 64,
    }
    spec.update(overrides)
    return spec


@pytest.mark.timing
def test_only_changes_of_what_long_polls_answer_wake_them(tmp_path: Path) -> None:
    """A registration that admits nothing, one rank's ack and a version report do not wake the ranks waiting
    for the next manifest (the board keeps their event unset); the admission of that mini-batch does, and
    the waiting long-poll gets it."""
    with app_client(tmp_path / "cp.db") as c:
        board: ManifestBoard = c.app.state.board  # type: ignore[attr-defined]
        portal = c.portal
        assert portal is not None
        assert c.post("/v1/jobs", json=_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9000"})
        units = single_group_units(["math"] * 4, size=1)
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:2]}).json()["admitted"] == [0]
        m0 = manifest(c, JOB, 0)
        assert m0 is not None

        async def delivery_event() -> Any:
            return board.event(JOB, "delivery")

        async def flush() -> None:  # runs after every publication the state thread posted before it
            return None

        event = portal.call(delivery_event)  # what every long-poll of the job waits on now
        got: dict[str, Any] = {}

        def wait_for_1() -> None:
            r = c.get(f"/v1/jobs/{JOB}/minibatches/1", params={"timeout_s": 20})
            got["status"], got["body"] = r.status_code, r.content

        waiter = threading.Thread(target=wait_for_1)
        waiter.start()
        # three changes of the job that do not change what a manifest long-poll answers
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[2:3]})
        assert r.status_code == 200 and r.json()["admitted"] == [], r.text
        r = c.post(f"/v1/jobs/{JOB}/minibatches/0/ack", json={"attempt": 0, "ranks": [1]})
        assert r.status_code == 200 and not r.json()["consumed"], r.text
        assert c.post(f"/v1/jobs/{JOB}/versions", json={"rank": 1, "version": 1}).status_code == 200
        portal.call(flush)
        assert not event.is_set() and portal.call(delivery_event) is event
        assert waiter.is_alive()
        # rank 0's ack consumes mini-batch 0: the position moves (a poll of n = 0 would now be answered 409)
        assert ack(c, JOB, m0, ranks=[0])["consumed"]
        portal.call(flush)
        assert event.is_set()
        event = portal.call(delivery_event)
        # the admission of mini-batch 1 wakes the waiting poll, which gets its manifest
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units[3:]}).json()["admitted"] == [1]
        waiter.join(10)
        assert not waiter.is_alive() and event.is_set()
        assert got["status"] == 200 and manifest(c, JOB, 1) is not None
        assert got["body"] == c.get(f"/v1/jobs/{JOB}/minibatches/1", params={"timeout_s": 0}).content


@pytest.mark.timing
def test_job_wide_waiters_still_see_every_change(tmp_path: Path) -> None:
    """``/headroom?wait_s`` waits on the job-wide event: a registration that admits nothing still wakes it."""
    with app_client(tmp_path / "cp.db") as c:
        board: ManifestBoard = c.app.state.board  # type: ignore[attr-defined]
        assert c.post("/v1/jobs", json=_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9000"})
        woken = threading.Event()
        loop_events: list[Any] = []

        async def take() -> None:
            loop_events.append(board.event(JOB))

        portal = c.portal
        assert portal is not None
        portal.call(take)

        def wait() -> None:
            portal.call(loop_events[0].wait)
            woken.set()

        threading.Thread(target=wait, daemon=True).start()
        units = single_group_units(["math"], size=1)
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units}).json()["admitted"] == []
        assert woken.wait(10)


def test_long_polls_for_jobs_that_do_not_exist_keep_nothing(tmp_path: Path) -> None:
    """Manifest and headroom polls naming a job that does not exist are 404s that leave no waiter behind (the
    board would otherwise keep one event per name it was ever asked for)."""
    with app_client(tmp_path / "cp.db") as c:
        board: ManifestBoard = c.app.state.board  # type: ignore[attr-defined]
        for i in range(20):
            assert c.get(f"/v1/jobs/ghost{i}/minibatches/0", params={"timeout_s": 0}).status_code == 404
            assert c.get(f"/v1/jobs/ghost{i}/headroom").status_code == 404
            weights = c.post(f"/v1/jobs/ghost{i}/rollout/w0/weights", json={"version": 1})
            assert weights.status_code == 404 and f"job 'ghost{i}' does not exist" in weights.json()["detail"]
        assert board._waiters == {}
    with app_client(tmp_path / "tokens.db", worker_token="wt") as c:  # no token: a 401, not whether the job exists
        assert c.get("/v1/jobs/ghost/minibatches/0", params={"timeout_s": 0}).status_code == 401
        assert c.get("/v1/jobs/ghost/headroom").status_code == 401


def _run(c: TestClient, n: int, start: int) -> None:
    """Register, plan and ack mini-batches ``start .. n-1`` (one group each, generated at version ``n``)."""
    for i in range(start, n):
        u = single_group_units(["math"], size=1, start=i)[0]
        u["groups"][0]["version_start"] = u["groups"][0]["version_end"] = i
        u["groups"][0]["version_weighted"] = float(i)
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": [u]}).json()["admitted"] == [i]
        m = manifest(c, JOB, i)
        assert m is not None and ack(c, JOB, m)["consumed"]


def _footprint(ledger: ConsumedLedger) -> int:
    """Items the ledger holds (histogram bins, recent groups, series cells): bounded, whatever the job's length."""
    bins = sum(len(s.hist) for report in ledger._readings.values() for pair in report.parts.values() for s in pair)
    recent = sum(len(groups) for groups in ledger._recent.values())
    cells = sum(len(per_source) for per_step in ledger._series.values() for per_source in per_step.values())
    return bins + recent + cells


def test_status_does_not_grow_with_consumed_mini_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The status (and what the job keeps of consumed groups) is the same size after 40 and 80 consumed
    mini-batches; its counts are exact, and the same after a restart."""
    monkeypatch.setattr(consumed, "SERIES_STEPS", 24)  # the dashboard series window, full before 40 steps
    db = str(tmp_path / "cp.db")
    spec = _spec(quotas={"math": 1}, world_size=1)
    with app_client(db, recent_admissions=8) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9000"})
        job = c.app.state.service.jobs[JOB]  # type: ignore[attr-defined]  # between requests: the state is idle
        _run(c, 40, 0)
        size40 = len(json.dumps(c.get(f"/v1/jobs/{JOB}/status").json(), separators=(",", ":")))
        foot40 = _footprint(job.consumed)
        _run(c, 80, 40)
        status = c.get(f"/v1/jobs/{JOB}/status").json()
        size80 = len(json.dumps(status, separators=(",", ":")))
        assert abs(size80 - size40) <= 0.02 * size40  # digits of counters and timings only (O(n): +100 %)
        assert _footprint(job.consumed) == foot40
        assert len(status["staleness"]["by_step"]) == RECENT_STEPS
        assert status["counts"]["consumed_mini_batches"] == 80
        assert status["counts"]["groups_by_status"] == {"consumed": 80}
        assert status["staleness"]["overall"]["end"]["staleness"]["count"] == 80
        overview = c.get("/v1/overview").json()
    with app_client(db, recent_admissions=8) as c:
        again = c.get(f"/v1/jobs/{JOB}/status").json()
        assert again["counts"] == status["counts"]
        assert again["staleness"] == status["staleness"]
        assert c.get("/v1/overview").json()["jobs"][0]["staleness"] == overview["jobs"][0]["staleness"]


def test_running_summary_matches_the_exact_summary() -> None:
    """Integer staleness: identical to summarize_weighted; fractional: percentiles within RESOLUTION."""
    rng = random.Random(7)
    for fractional in (False, True):
        pairs = [((rng.randint(-3, 9) + (rng.random() if fractional else 0.0)), rng.randint(0, 5)) for _ in range(500)]
        running = RunningSummary(RESOLUTION)
        for v, w in pairs:
            running.add(float(v), w)
        got, want = running.stats(), summarize_weighted(pairs)
        assert got.count == want.count
        assert math.isclose(got.mean, want.mean, rel_tol=1e-12) and math.isclose(
            got.pos_mean, want.pos_mean, rel_tol=1e-12
        )
        tol = RESOLUTION if fractional else 0.0
        for name in ("p50", "p99", "max"):
            assert abs(getattr(got, name) - getattr(want, name)) <= tol, name


def test_ledger_keeps_the_latest_steps_only() -> None:
    ledger = ConsumedLedger()
    for step in range(3 * RECENT_STEPS):
        ledger.add(
            [
                ConsumedGroup(
                    group_id=f"g{step}",
                    source="math",
                    num_trajectories=2,
                    v_train=step,
                    mini_batch_index=0,
                    step=step,
                    version_start=step,
                    version_end=step,
                    version_weighted=float(step),
                )
            ]
        )
    assert sorted(ledger.recent_steps()) == list(range(2 * RECENT_STEPS, 3 * RECENT_STEPS))
    assert ledger.report("start")["staleness"].count == 6 * RECENT_STEPS


def test_consumed_units_are_forgotten_but_their_ids_are_not(tmp_path: Path) -> None:
    """Consumed groups and units leave memory; a retried registration of a consumed unit is still a duplicate,
    a new unit reusing a consumed group id is still refused, and removing a consumed unit is a conflict
    (before and after a restart)."""
    db = str(tmp_path / "cp.db")
    spec = _spec(quotas={"math": 1}, world_size=1)
    with app_client(db) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9000"})
        _run(c, 3, 0)
        job = c.app.state.service.jobs[JOB]  # type: ignore[attr-defined]  # between requests: the state is idle
        assert not job.units and not job.groups and len(job.retired_units) == 3
    for _ in range(2):  # the running process, then a restarted one
        with app_client(db) as c:
            old = single_group_units(["math"], size=1, start=0)[0]
            old["groups"][0]["version_start"] = old["groups"][0]["version_end"] = 0
            r = c.post(f"/v1/jobs/{JOB}/units", json={"units": [old]})
            assert r.status_code == 200 and r.json()["duplicates"] == 1 and r.json()["admitted"] == [], r.text
            reuse = single_group_units(["math"], size=1, start=0, prefix="g")[0]
            reuse["unit_id"] = "u-new"
            assert c.post(f"/v1/jobs/{JOB}/units", json={"units": [reuse]}).status_code == 409
            assert c.delete(f"/v1/jobs/{JOB}/units/u-g1").status_code == 409
            status = c.get(f"/v1/jobs/{JOB}/status").json()
            assert status["counts"]["units"] == 3 and status["counts"]["consumed_groups"] == 3
            assert status["next_global_index"] == 3


def test_ledger_series_has_each_steps_mean_max_and_count_of_architectural_staleness() -> None:
    """The dashboard series: per step and source (and ``all``), trajectory-weighted mean, max and count of
    staleness minus the mini-batch index."""

    def consumed_group(gid: str, source: str, n: int, version_start: int) -> ConsumedGroup:
        return ConsumedGroup(
            group_id=gid,
            source=source,
            num_trajectories=n,
            v_train=5,
            mini_batch_index=1,
            step=0,
            version_start=version_start,
            version_end=4,
            version_weighted=4.0,
        )

    ledger = ConsumedLedger()
    ledger.add([consumed_group("a", "math", 2, 1), consumed_group("b", "code", 1, 3)])  # 5 - 1 - 1 = 3, 5 - 3 - 1 = 1
    start = ledger.series()["start"]
    assert list(start) == ["all", "code", "math"]
    assert start["all"] == [{"step": 0, "mean": 7 / 3, "max": 3.0, "count": 3}]
    assert start["math"] == [{"step": 0, "mean": 3.0, "max": 3.0, "count": 2}]
    assert start["code"] == [{"step": 0, "mean": 1.0, "max": 1.0, "count": 1}]
