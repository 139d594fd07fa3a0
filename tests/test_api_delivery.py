"""Plan delivery at scale: plans published to the event loop, acks in one batch, ``next?ack=``.

Real app (TestClient, real SQLite, the real state thread). No timings: what is checked is what each
request answers, that acks arriving together go to the state thread as one batch, and that the
plans the loop serves follow every change of the state (withdrawal, a node's new endpoint, restart).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import app_client, job_spec, server, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.routes.deps import AckBatcher, PlanBoard
from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import Conflict, NotFound
from knittrans.plans import RankPlan

JOB = "job1"


def _setup(c: TestClient, *, world: int, sources: list[str], node: str = "n0", k: int = 2) -> None:
    half = len(sources) // 2
    assert c.post(
        "/v1/jobs",
        json=job_spec(
            quotas={"math": half, "code": half}, mini_batches_per_step=k, world_size=world, micro_batch_size=1
        ),
    ).status_code in (200, 201)
    for n in ("n0", "n1"):
        c.post("/v1/nodes", json={"node_id": n, "endpoint": f"grpc://127.0.0.1:{9100 + int(n[1])}"})
    r = c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(sources, node=node)})
    assert r.status_code == 200 and r.json()["admitted"], r.text


def _next(c: TestClient, rank: int, **params: Any) -> Any:
    return c.get(f"/v1/jobs/{JOB}/ranks/{rank}/next", params={"timeout_s": 0, **params})


def _plan(c: TestClient, rank: int, **params: Any) -> RankPlan:
    r = _next(c, rank, **params)
    assert r.status_code == 200, r.text
    return RankPlan.from_json(r.json())


def test_acks_arriving_together_are_one_batch_and_answer_each(tmp_path: Path) -> None:
    """Four acks in flight at once (one with another rank's plan, one out of order): one state-thread
    call; the good ones apply, the bad ones get their own error, and what was applied is persisted."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c, world=4, sources=["math", "code"] * 4)  # 4 rows per mini-batch: one per rank, two mini-batches
        p0 = [_plan(c, r) for r in range(4)]
        p1_rank3 = _plan(c, 3, after=str(p0[3].plan_id))
        acks: AckBatcher = c.app.state.acks  # type: ignore[attr-defined]
        batches = acks.batches

        async def together() -> list[Any]:
            return await asyncio.gather(
                acks.ack(JOB, 0, str(p0[0].plan_id)),
                acks.ack(JOB, 1, str(p0[0].plan_id)),  # rank 0's plan: not rank 1's
                acks.ack(JOB, 2, str(p0[2].plan_id)),
                acks.ack(JOB, 3, str(p1_rank3.plan_id)),  # mini-batch 1 before 0
                return_exceptions=True,
            )

        assert c.portal is not None
        got = c.portal.call(together)
        assert acks.batches == batches + 1  # one state-thread call, one transaction
        assert got[0] == {"plan_id": str(p0[0].plan_id), "global_index": 0, "consumed": False, "duplicate": False}
        assert isinstance(got[1], NotFound) and "not a plan of rank 1" in str(got[1])
        assert got[2]["duplicate"] is False and got[2]["consumed"] is False
        assert isinstance(got[3], Conflict) and "mini-batch 0 before 1" in str(got[3])
        # ranks 1 and 3 still owe mini-batch 0; the refused acks changed nothing
        assert _plan(c, 1).plan_id == p0[1].plan_id and _plan(c, 3).plan_id == p0[3].plan_id
        assert _plan(c, 0).global_index == 1  # rank 0's ack moved it on
    with app_client(db) as c:  # restarted: the applied acks were committed, the refused ones were not
        assert _plan(c, 0).global_index == 1 and _plan(c, 2).global_index == 1
        assert _plan(c, 1).global_index == 0 and _plan(c, 3).global_index == 0
        for r in (1, 3):
            a = c.post(f"/v1/jobs/{JOB}/ranks/{r}/ack", json={"plan_id": str(p0[r].plan_id)})
            assert a.status_code == 200 and a.json()["consumed"] == (r == 3), a.text


def test_ack_errors_over_http_are_per_request(tmp_path: Path) -> None:
    """POST .../ack answers each request with its own status (200, 404, 409, 410, duplicate)."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code", "math", "code"], node="n1")
        p0 = [_plan(c, r) for r in range(2)]
        p1 = _plan(c, 0, after=str(p0[0].plan_id))
        url = f"/v1/jobs/{JOB}/ranks/{{}}/ack"
        r = c.post(url.format(0), json={"plan_id": str(p1.plan_id)})
        assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
        r = c.post(url.format(1), json={"plan_id": str(p0[0].plan_id)})
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        # no rank holds mini-batch 0 (none fetched or acked it): the node loss withdraws it
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {JOB: [0, 1]}
        for rank in range(2):
            r = c.post(url.format(rank), json={"plan_id": str(p0[rank].plan_id)})
            assert r.status_code == 410 and r.json()["error"] == "data_lost", r.text
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 2, prefix="h")})
        again = _plan(c, 0)
        assert (again.global_index, again.plan_id.attempt) == (0, 1)  # re-planned on n0
        r = c.post(url.format(0), json={"plan_id": str(again.plan_id)})
        assert r.status_code == 200 and r.json()["duplicate"] is False
        r = c.post(url.format(0), json={"plan_id": str(again.plan_id)})
        assert r.status_code == 200 and r.json()["duplicate"] is True


def test_next_with_ack_acks_then_long_polls(tmp_path: Path) -> None:
    """``next?ack=<current plan>`` acks it and answers the next plan; a retry of the same request is safe;
    a refused ack answers its error (404, 409, 410) and acks nothing; ``ack`` with ``after`` is refused."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code"] * 4, node="n1", k=4)
        p0 = [_plan(c, r) for r in range(2)]
        p1 = _plan(c, 0, after=str(p0[0].plan_id))
        r = _next(c, 0, ack=str(p1.plan_id))  # mini-batch 1 before 0
        assert r.status_code == 409 and "mini-batch 0 before 1" in r.json()["detail"], r.text
        r = _next(c, 0, ack=str(p0[1].plan_id))  # rank 1's plan
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        r = _next(c, 0, ack="bogus")
        assert r.status_code == 404, r.text
        assert _plan(c, 0).plan_id == p0[0].plan_id  # nothing was acked
        r = _next(c, 0, ack=str(p0[0].plan_id), after=str(p0[0].plan_id))
        assert r.status_code == 409 and r.json()["error"] == "invalid_request" and "not both" in r.json()["detail"]
        assert _plan(c, 0, ack=str(p0[0].plan_id)) == p1  # acked 0, got 1
        assert _plan(c, 0, ack=str(p0[0].plan_id)) == p1  # the same request retried: a duplicate ack, same plan
        assert _plan(c, 1, ack=str(p0[1].plan_id)).global_index == 1  # rank 1's ack consumed mini-batch 0
        # rank 1 holds mini-batch 1 and never reported it fetched: the node loss withdraws it
        withdrawn = c.post("/v1/nodes/n1/lost").json()["withdrawn"][JOB]
        assert 1 in withdrawn
        r = _next(c, 0, ack=str(p1.plan_id))
        assert r.status_code == 410 and r.json()["error"] == "data_lost", r.text


def test_next_with_ack_waits_for_the_next_admission(tmp_path: Path) -> None:
    """After the ack, ``next?ack=`` long-polls: 204 when nothing comes in time, the job-done header once
    the job is done (the ack itself still applied)."""
    with app_client(tmp_path / "cp.db") as c:
        c.post("/v1/jobs", json=job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=1, total_steps=2))
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math"])})
        p0 = _plan(c, 0)
        r = _next(c, 0, ack=str(p0.plan_id), timeout_s=0.2)
        assert r.status_code == 204 and "x-knittrans-done" not in r.headers
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math"], start=1)})
        p1 = _plan(c, 0)
        assert p1.global_index == 1
        r = _next(c, 0, ack=str(p1.plan_id), timeout_s=5)
        assert r.status_code == 204 and r.headers["x-knittrans-done"] == "1", r.headers
        assert c.get(f"/v1/jobs/{JOB}").json()["state"] == "completed"


def test_published_plans_follow_the_state(tmp_path: Path) -> None:
    """What the loop serves changes with the state: a node's new endpoint is in the next answer, a
    withdrawn plan is replaced by its next attempt, and a restarted app (nothing published yet)
    answers byte for byte what the running one did."""
    db = tmp_path / "cp.db"
    with app_client(db, admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        _setup(c, world=2, sources=["math", "code", "math", "code"], node="n1")
        board: PlanBoard = c.app.state.board  # type: ignore[attr-defined]
        first = _next(c, 0).content
        assert board.answer(JOB, 0) is not None and board.answer(JOB, 0)[0] == first  # type: ignore[index]
        assert _next(c, 0).content == first  # served again from the board, the same bytes
        r = c.post("/v1/nodes", json={"node_id": "n1", "endpoint": "grpc://127.0.0.1:9999"})
        assert r.status_code == 200, r.text
        moved = RankPlan.from_json(_next(c, 0).json())
        assert {f.endpoint for m in moved.micro_batches for f in m.fetches} == {"grpc://127.0.0.1:9999"}
        before_restart = _next(c, 1).content
    with app_client(db, admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        board = c.app.state.board  # type: ignore[attr-defined]
        assert board.answer(JOB, 1) is None  # a fresh board: the first look goes to the state thread
        assert _next(c, 1).content == before_restart
        assert c.post("/v1/nodes/n1/lost").status_code == 200
        r = _next(c, 1)
        assert r.status_code == 204  # withdrawn; nothing to plan until the groups are regenerated
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 2, prefix="h")})
        again = _plan(c, 1)
        assert (again.global_index, again.plan_id.attempt) == (0, 1)


def test_next_ack_is_in_the_openapi_schema(tmp_path: Path) -> None:
    """``ack`` is a documented query parameter of ``next``, with the errors it may answer."""
    with app_client(tmp_path / "cp.db") as c:
        op = c.get("/openapi.json").json()["paths"]["/v1/jobs/{job}/ranks/{rank}/next"]["get"]
    params = {p["name"]: p for p in op["parameters"]}
    assert {"ack", "after", "timeout_s"} <= set(params)
    assert "ack it" in params["ack"]["description"]
    assert {"404", "409", "410"} <= set(op["responses"])


@pytest.mark.parametrize("bad", ["", "x" * 65])
def test_next_ack_bad_values_are_refused(tmp_path: Path, bad: str) -> None:
    """An empty plan id is an unknown plan (404); one longer than 64 characters fails validation (422)."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code", "math", "code"])
        r = _next(c, 0, ack=bad)
        assert r.status_code == (404 if bad == "" else 422), r.text


def test_client_next_with_ack_against_a_real_server(tmp_path: Path) -> None:
    """The control client's ``next_plan(ack=...)`` on a real server process (uvicorn, loopback): one
    request acks and returns the next plan; a refused ack raises the client's error; the job runs out."""
    with server(tmp_path / "cp.db") as proc, ControlClient(proc.url, retries=0) as client:
        with httpx.Client(base_url=proc.url) as c:
            c.post("/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, total_steps=1))
            c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
            c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "math"])})
        p0 = client.next_plan(JOB, 0, 5)
        assert p0 is not None and p0.global_index == 0
        p1 = client.next_plan(JOB, 0, 5, after=str(p0.plan_id))
        assert p1 is not None and p1.global_index == 1
        with pytest.raises(Conflict, match="mini-batch 0 before 1"):
            client.next_plan(JOB, 0, 5, ack=str(p1.plan_id))
        assert client.next_plan(JOB, 0, 5, ack=str(p0.plan_id)) == p1
        with pytest.raises(JobFinished):
            client.next_plan(JOB, 0, 5, ack=str(p1.plan_id))
        assert client.get_job(JOB)["state"] == "completed"


def test_fast_path_serves_plain_next_and_leaves_the_rest_to_the_app(tmp_path: Path) -> None:
    """Plain ``next`` (``timeout_s``, ``ack``) is answered by the fast path; a bad token, an unknown job
    or rank, a refused ack, a malformed query and ``after`` are answered by the app, as documented."""
    with app_client(tmp_path / "cp.db", admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        _setup(c, world=2, sources=["math", "code"] * 4)
        counts: dict[str, int] = c.app.state.fast_next  # type: ignore[attr-defined]
        served, to_app = counts["served"], counts["to_app"]
        p0 = _plan(c, 0)
        assert _plan(c, 0, ack=str(p0.plan_id)).global_index == 1
        assert (counts["served"], counts["to_app"]) == (served + 2, to_app)
        cases = [
            (c.get(f"/v1/jobs/{JOB}/ranks/0/next", headers={"Authorization": "Bearer x"}), 401),
            (c.get("/v1/jobs/nope/ranks/0/next", params={"timeout_s": 0}), 404),
            (_next(c, 5), 404),
            (_next(c, 1, ack="n1.a0.r1"), 409),  # mini-batch 1 before 0
        ]
        for response, status in cases:
            assert response.status_code == status and response.json()["error"], response.text
        assert counts["to_app"] == to_app + 4 and counts["served"] == served + 2
        for params in ({"timeout_s": "-1"}, {"timeout_s": "x"}, {"ack": "y" * 65}, {"zzz": "1"}):
            r = c.get(f"/v1/jobs/{JOB}/ranks/1/next", params={"timeout_s": 0, **params})
            assert r.status_code in (200, 422), r.text  # never the fast path: the app validates
        assert counts["served"] == served + 2
        assert _next(c, 1, after=str(p0.plan_id)).status_code == 404  # rank 0's plan; after= is the app's
        assert counts["served"] == served + 2


def test_admission_publishes_every_rank_in_chunks(tmp_path: Path) -> None:
    """An admission renders and publishes every rank's plan before anyone asks (the registration's
    answer comes after the board has them), chunk by chunk; a rank's ``next`` is those bytes."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=5, sources=["math", "code"] * 5)  # two rows per rank per mini-batch
        board: PlanBoard = c.app.state.board  # type: ignore[attr-defined]
        published = {r: board.answer(JOB, r) for r in range(5)}
        assert all(a is not None and a[0] is not None for a in published.values()), published
        svc = c.app.state.service  # type: ignore[attr-defined]

        async def chunks() -> list[dict[int, Any]]:
            return await c.app.state.runner(lambda: list(svc.jobs[JOB].answer_chunks(None, size=2)))  # type: ignore[attr-defined]

        assert c.portal is not None
        got = c.portal.call(chunks)
        assert [sorted(chunk) for chunk in got] == [[0, 1], [2, 3], [4]]
        for chunk in got:
            for rank, answer in chunk.items():
                assert answer == published[rank]  # rendered once: the same bytes again
                assert _next(c, rank).content == answer[0]
