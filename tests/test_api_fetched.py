"""Prefetch across the ack (``next?after=``) and the ``fetched`` report that guards a step against node loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api_support import app_client, drain_ranks, job_spec, single_group_units
from fastapi.testclient import TestClient

from knittrans.plans import RankPlan


def _next(c: TestClient, rank: int, after: str | None = None) -> Any:
    params: dict[str, Any] = {"timeout_s": 0}
    if after is not None:
        params["after"] = after
    return c.get(f"/v1/jobs/job1/ranks/{rank}/next", params=params)


def _setup(c: TestClient, *, sources: list[str], node: str = "n0", world: int = 2, k: int = 2) -> None:
    c.post(
        "/v1/jobs",
        json=job_spec(
            quotas={"math": len(sources) // 2, "code": len(sources) // 2},
            mini_batches_per_step=k,
            world_size=world,
            total_steps=1,
        ),
    )
    for n in ("n0", "n1"):
        c.post("/v1/nodes", json={"node_id": n, "endpoint": f"grpc://127.0.0.1:{9100 + int(n[1])}"})
    c.post("/v1/jobs/job1/supply", json={"started": {"math": len(sources) // 2, "code": len(sources) // 2}})
    c.post("/v1/jobs/job1/units", json={"units": single_group_units(sources, node=node)})


def test_after_returns_the_next_plan_and_keeps_ack_order(tmp_path: Path) -> None:
    """after=<current plan> gives the rank's plan of n+1 before n is acked; stale or future ids are refused."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, sources=["math", "code", "math", "code"])
        p0 = RankPlan.from_json(_next(c, 0).json())
        assert p0.global_index == 0
        r = _next(c, 0, after=str(p0.plan_id))
        assert r.status_code == 200
        p1 = RankPlan.from_json(r.json())
        assert (p1.global_index, p1.rank) == (1, 0)
        assert p1 == RankPlan.from_json(_next(c, 0, after=str(p0.plan_id)).json())  # asking again: the same plan
        # acks stay in order: the prefetched plan cannot be acked (nor used as `after`) before n
        r = c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": str(p1.plan_id)})
        assert r.status_code == 409 and "mini-batch 0 before 1" in r.json()["detail"]
        r = _next(c, 0, after=str(p1.plan_id))
        assert r.status_code == 409 and "mini-batch 0 before 1" in r.json()["detail"]
        assert _next(c, 0, after="n0.a0.r1").status_code == 404  # another rank's plan
        assert _next(c, 0, after="n7.a0.r0").status_code == 404  # never issued
        assert _next(c, 0, after="bogus").status_code == 404
        assert c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": str(p0.plan_id)}).status_code == 200
        # n is acked: after=n is now the rank's current plan, what plain next gives (a poll in flight
        # across the ack goes on)
        assert (
            RankPlan.from_json(_next(c, 0, after=str(p0.plan_id)).json())
            == RankPlan.from_json(_next(c, 0).json())
            == p1
        )
        # the last mini-batch of the job: nothing will follow it
        r = _next(c, 0, after=str(p1.plan_id))
        assert r.status_code == 204 and r.headers["x-knittrans-done"] == "1"


def test_after_waits_for_admission(tmp_path: Path) -> None:
    """after= answers 204 (not done) while n+1 is not admitted, and the plan once it is."""
    with app_client(tmp_path / "cp.db") as c:
        c.post(
            "/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, policy="linear_target")
        )
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 2}})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
        p0 = RankPlan.from_json(_next(c, 0).json())
        r = _next(c, 0, after=str(p0.plan_id))
        assert r.status_code == 204 and "x-knittrans-done" not in r.headers
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"], start=1)})
        assert RankPlan.from_json(_next(c, 0, after=str(p0.plan_id)).json()).global_index == 1


def test_withdrawn_plan_is_410_for_after_and_fetched(tmp_path: Path) -> None:
    """A node loss before every rank reported its share fetched withdraws the plan: after= and fetched say 410."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, sources=["math", "code", "math", "code"], node="n1")
        p0 = RankPlan.from_json(_next(c, 0).json())
        assert (
            c.post("/v1/jobs/job1/ranks/0/fetched", json={"plan_id": str(p0.plan_id)}).json()["fetched_ranks"] == 1
        )  # rank 1 has not fetched: the mini-batch still depends on n1
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [0, 1]}
        for r in (
            _next(c, 0, after=str(p0.plan_id)),
            c.post("/v1/jobs/job1/ranks/0/fetched", json={"plan_id": str(p0.plan_id)}),
            c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": str(p0.plan_id)}),
        ):
            assert r.status_code == 410 and r.json()["error"] == "data_lost", r.text
        assert _next(c, 0).status_code == 204  # nothing left to plan until the groups are regenerated


def test_fully_fetched_mini_batch_survives_node_loss_and_restart(tmp_path: Path) -> None:
    """All ranks reported fetched (persisted): after a control-plane restart a node loss keeps the mini-batch."""
    db = str(tmp_path / "cp.db")
    with app_client(db) as c:
        _setup(c, sources=["math", "code", "math", "code"], node="n1")
        plans = [RankPlan.from_json(_next(c, r).json()) for r in (0, 1)]
        for r, p in enumerate(plans):
            assert c.post(f"/v1/jobs/job1/ranks/{r}/fetched", json={"plan_id": str(p.plan_id)}).status_code == 200
        again = c.post("/v1/jobs/job1/ranks/1/fetched", json={"plan_id": str(plans[1].plan_id)}).json()
        assert again["fetched_ranks"] == 2  # idempotent
        p1 = RankPlan.from_json(_next(c, 0, after=str(plans[0].plan_id)).json())
    with app_client(db) as c:
        assert RankPlan.from_json(_next(c, 0, after=str(plans[0].plan_id)).json()) == p1  # same plan after the restart
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [1]}  # 0 is held by every rank
        for r, p in enumerate(plans):
            assert c.post(f"/v1/jobs/job1/ranks/{r}/ack", json={"plan_id": str(p.plan_id)}).status_code == 200
        r = c.post("/v1/jobs/job1/ranks/0/fetched", json={"plan_id": str(p1.plan_id)})
        assert r.status_code == 410  # the prefetched plan of mini-batch 1 was withdrawn
        status = c.get("/v1/jobs/job1/status").json()
        assert sorted(x["group_id"] for x in status["to_regenerate"]) == ["g2", "g3"]
        c.post(
            "/v1/jobs/job1/supply", json={"group_ids": {"math": ["r2"], "code": ["r3"]}, "regenerates": ["g2", "g3"]}
        )
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"], prefix="r", start=2)})
        rest = drain_ranks(c, "job1", 2)
    assert sorted((str(p.plan_id)) for p in rest) == ["n1.a1.r0", "n1.a1.r1"]
    assert {r.group_id for p in rest for m in p.micro_batches for r in m.rows} == {"r2", "r3"}
