"""Control plane at scale, structurally: per-rank long-poll wake-ups and a status that does not grow with the job.

Real app (TestClient, real SQLite). No timings: what is checked is who gets woken (a probe counter on the
plan board) and what the status holds (the ledger's footprint, exact counts after a restart).
"""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, one_group_unit_body, single_group_units
from fastapi.testclient import TestClient

from knittrans.api import consumed
from knittrans.api.consumed import RECENT_STEPS, RESOLUTION, ConsumedLedger, RunningSummary
from knittrans.api.routes.deps import PlanBoard
from knittrans.plans import RankPlan
from knittrans.procs import wait_until
from knittrans.sched.staleness import ConsumedGroup, summarize_weighted

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


def test_only_concerned_ranks_are_woken(tmp_path: Path) -> None:
    """A registration that admits nothing, another rank's ack and a version report do not wake a rank
    waiting for its next plan; the admission of its next mini-batch does, once."""
    with app_client(tmp_path / "cp.db") as c:
        board: PlanBoard = c.app.state.board  # type: ignore[attr-defined]
        assert c.post("/v1/jobs", json=_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9000"})
        units = single_group_units(["math"] * 4, size=1)
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:2]}).json()["admitted"] == [0]
        plans = [
            RankPlan.from_json(c.get(f"/v1/jobs/{JOB}/ranks/{r}/next", params={"timeout_s": 0}).json()) for r in (0, 1)
        ]
        assert c.post(f"/v1/jobs/{JOB}/ranks/0/ack", json={"plan_id": str(plans[0].plan_id)}).status_code == 200

        got: dict[str, Any] = {}

        def wait_rank0() -> None:
            r = c.get(f"/v1/jobs/{JOB}/ranks/0/next", params={"timeout_s": 20})
            got["status"], got["body"] = r.status_code, r.json() if r.status_code == 200 else None

        before = board.probes[(JOB, 0)]
        waiter = threading.Thread(target=wait_rank0)
        waiter.start()
        # its first look: nothing yet, it waits
        wait_until(lambda: board.probes[(JOB, 0)] == before + 1, timeout_s=10, what="rank 0's first probe")
        # three changes of the job that do not change rank 0's next plan
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[2:3]})
        assert r.status_code == 200 and r.json()["admitted"] == [], r.text
        assert c.post(f"/v1/jobs/{JOB}/ranks/1/ack", json={"plan_id": str(plans[1].plan_id)}).json()["consumed"]
        assert c.post(f"/v1/jobs/{JOB}/versions", json={"rank": 1, "version": 1}).status_code == 200
        # no wait needed here: a spurious wake-up is counted whenever it happens, and the count after the
        # admission below (exactly one more probe) would include it
        assert board.probes[(JOB, 0)] == before + 1
        assert waiter.is_alive()
        # the admission of mini-batch 1 concerns every rank: rank 0 is woken and gets it
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units[3:]}).json()["admitted"] == [1]
        waiter.join(10)
        assert got["status"] == 200 and RankPlan.from_json(got["body"]).global_index == 1
        assert board.probes[(JOB, 0)] == before + 2


def test_job_wide_waiters_still_see_every_change(tmp_path: Path) -> None:
    """``/headroom?wait_s`` waits on the job-wide event: a registration that admits nothing still wakes it."""
    with app_client(tmp_path / "cp.db") as c:
        board: PlanBoard = c.app.state.board  # type: ignore[attr-defined]
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


def _run(c: TestClient, n: int, start: int) -> None:
    """Register, plan and ack mini-batches ``start .. n-1`` (one group each, generated at version ``n``)."""
    for i in range(start, n):
        u = single_group_units(["math"], size=1, start=i)[0]
        u["groups"][0]["version_start"] = u["groups"][0]["version_end"] = i
        u["groups"][0]["version_weighted"] = float(i)
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": [u]}).json()["admitted"] == [i]
        plan = RankPlan.from_json(c.get(f"/v1/jobs/{JOB}/ranks/0/next", params={"timeout_s": 0}).json())
        assert c.post(f"/v1/jobs/{JOB}/ranks/0/ack", json={"plan_id": str(plan.plan_id)}).json()["consumed"]


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
        foot40 = job.consumed.footprint()
        _run(c, 80, 40)
        status = c.get(f"/v1/jobs/{JOB}/status").json()
        size80 = len(json.dumps(status, separators=(",", ":")))
        assert abs(size80 - size40) <= 0.02 * size40  # digits of counters and timings only (O(n): +100 %)
        assert job.consumed.footprint() == foot40
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
        running = RunningSummary()
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
    assert ledger.groups == 3 * RECENT_STEPS and ledger.trajectories == 6 * RECENT_STEPS
    assert ledger.report("start")["staleness"].count == 6 * RECENT_STEPS


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"trajectory_tokens": [3]},
        {"version_end": 0},
        {"version_weighted": 2.5},
        {"row_start": 1},
        {"num_trajectories": 3, "trajectory_tokens": [1, 2, 3]},
    ],
)
def test_fast_descriptor_accepts_and_rejects_like_the_descriptor(changes: dict[str, Any]) -> None:
    """The registration hot path builds descriptors without their per-field checks (pydantic ran them):
    it must accept exactly what :class:`UnitDescriptor` accepts, and build the same descriptor."""
    from knittrans.api.models import UnitIn
    from knittrans.api.routes.units import to_descriptor
    from knittrans.descriptors import UnitDescriptor
    from knittrans.errors import InvalidRequest

    body = one_group_unit_body(**changes)
    try:
        want: UnitDescriptor | None = UnitDescriptor.from_dict(body)
    except InvalidRequest:
        want = None
    if want is None:
        with pytest.raises(InvalidRequest):
            to_descriptor(UnitIn.model_validate(body))
    else:
        got = to_descriptor(UnitIn.model_validate(body))
        assert got == want and got.to_dict() == want.to_dict()


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
