"""The next mini-batch's manifest before the current one is acked, and the ``fetched`` report that guards a
step against node loss."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, drain, job_spec, manifest, rows_of, shares, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.records import Kind, index_key
from knittrans.api.store import RecordStore


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


def _post(c: TestClient, what: str, n: int, attempt: int, ranks: list[int] | None = None) -> Any:
    return c.post(f"/v1/jobs/job1/minibatches/{n}/{what}", json={"attempt": attempt, "ranks": ranks})


@pytest.mark.timing
def test_the_next_manifest_is_served_before_the_current_one_is_acked(tmp_path: Path) -> None:
    """Mini-batch n+1's manifest is there while n is un-acked (what prefetch reads), asking again gives the
    same bytes, it cannot be acked before n, and after the last one the job is done (204 + X-KnitTrans-Done)."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, sources=["math", "code", "math", "code"])
        m0, m1 = manifest(c, "job1", 0), manifest(c, "job1", 1)
        assert m0 is not None and m1 is not None and (m0.global_index, m1.global_index) == (0, 1)
        assert manifest(c, "job1", 1) == m1
        r = _post(c, "ack", 1, 0, [0])
        assert r.status_code == 409 and "mini-batch 0 before 1" in r.json()["detail"]
        assert _post(c, "ack", 0, 0).json()["consumed"]
        assert _post(c, "ack", 1, 0).json()["consumed"]
        r = c.get("/v1/jobs/job1/minibatches/2", params={"timeout_s": 5})
        assert r.status_code == 204 and r.headers["x-knittrans-done"] == "1"
        assert r.headers["x-knittrans-job-state"] == "completed"
        r = c.get("/v1/jobs/job1/minibatches/1", params={"timeout_s": 0})
        assert r.status_code == 409 and r.json()["error"] == "conflict" and "consumed" in r.json()["detail"]


@pytest.mark.timing
def test_the_next_manifest_waits_for_admission(tmp_path: Path) -> None:
    """Mini-batch n+1 answers 204 (not done) while it is not admitted, and its manifest once it is."""
    with app_client(tmp_path / "cp.db") as c:
        c.post(
            "/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, policy="linear_target")
        )
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 2}})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
        assert manifest(c, "job1", 0) is not None
        r = c.get("/v1/jobs/job1/minibatches/1", params={"timeout_s": 0.1})
        assert r.status_code == 204 and "x-knittrans-done" not in r.headers
        assert r.headers["x-knittrans-job-state"] == "running"
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"], start=1)})
        m1 = manifest(c, "job1", 1)
        assert m1 is not None and m1.global_index == 1


def test_withdrawn_mini_batch_is_410_for_fetched_and_ack(tmp_path: Path) -> None:
    """A node loss before every rank reported its share fetched withdraws the mini-batch: fetched and ack of
    that attempt say 410, and there is no manifest until it is planned again (also after a restart: the
    withdrawn mini-batches' records and fetched reports are deleted)."""
    db = str(tmp_path / "cp.db")
    with app_client(db) as c:
        _setup(c, sources=["math", "code", "math", "code"], node="n1")
        m0 = manifest(c, "job1", 0)
        assert m0 is not None
        r = _post(c, "fetched", 0, m0.attempt, [0])
        assert r.json() == {"global_index": 0, "attempt": 0, "fetched_ranks": 1, "held": False}
        # rank 1 has not fetched: the mini-batch still depends on n1
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [0, 1]}
        for r in (_post(c, "fetched", 0, m0.attempt, [1]), _post(c, "fetched", 0, m0.attempt), _post(c, "ack", 0, 0)):
            assert r.status_code == 410 and r.json()["error"] == "data_lost", r.text
        assert manifest(c, "job1", 0) is None  # nothing left to plan until the groups are regenerated
        assert c.get("/v1/jobs/job1/minibatches").json()["in_flight"] == []
    with app_client(db) as c:
        assert manifest(c, "job1", 0) is None
        assert c.get("/v1/jobs/job1/minibatches").json()["in_flight"] == []
        assert len(c.get("/v1/jobs/job1/status").json()["lost_groups"]) == 4  # not planned in a stale record
    store = RecordStore(db)
    try:
        assert store.load(Kind.MINI_BATCH) == store.load(Kind.FETCHED) == []
    finally:
        store.close()


def test_fully_fetched_mini_batch_survives_node_loss_and_restart(tmp_path: Path) -> None:
    """All ranks reported fetched (persisted): after a control-plane restart a node loss keeps the mini-batch,
    and withdraws the next one, which no rank held."""
    db = str(tmp_path / "cp.db")
    with app_client(db) as c:
        _setup(c, sources=["math", "code", "math", "code"], node="n1")
        m0, m1 = manifest(c, "job1", 0), manifest(c, "job1", 1)
        assert m0 is not None and m1 is not None
        for rank in (0, 1):
            r = _post(c, "fetched", 0, 0, [rank])
            assert r.status_code == 200 and r.json()["held"] == (rank == 1), r.text
        again = _post(c, "fetched", 0, 0, [1]).json()
        assert again["fetched_ranks"] == 2 and again["held"]  # idempotent
        assert _post(c, "fetched", 0, 0).json()["fetched_ranks"] == 2  # one request for every rank: the same
    with app_client(db) as c:
        assert manifest(c, "job1", 1) == m1  # the same manifest after the restart
        progress = c.get("/v1/jobs/job1/minibatches").json()["in_flight"]
        assert [(f["global_index"], f["fetched_ranks"]) for f in progress] == [(0, [[0, 2]]), (1, [])]
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [1]}  # 0 is held by every rank
        for rank in (0, 1):
            assert _post(c, "ack", 0, 0, [rank]).status_code == 200
        r = _post(c, "fetched", 1, m1.attempt, [0])
        assert r.status_code == 410  # the manifest of mini-batch 1 was withdrawn
        status = c.get("/v1/jobs/job1/status").json()
        assert sorted(x["group_id"] for x in status["to_regenerate"]) == ["g2", "g3"]
        c.post(
            "/v1/jobs/job1/supply", json={"group_ids": {"math": ["r2"], "code": ["r3"]}, "regenerates": ["g2", "g3"]}
        )
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"], prefix="r", start=2)})
        rest = drain(c, "job1")
    assert [p.plan_id for m in rest for p in shares(m)] == ["n1.a1.r0", "n1.a1.r1"]
    assert {g for g, _ in rows_of([p for m in rest for p in shares(m)])} == {"r2", "r3"}


def _lose_n1_while_mini_batch_1_is_held(c: TestClient) -> None:
    """Two mini-batches of one group each (0 on n0, 1 on n1), world size 1; every rank reports 1 fetched, then n1
    is declared lost: 1 is kept (held), nothing is withdrawn."""
    c.post("/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, total_steps=1))
    for n in ("n0", "n1"):
        c.post("/v1/nodes", json={"node_id": n, "endpoint": f"grpc://127.0.0.1:{9100 + int(n[1])}"})
    c.post("/v1/jobs/job1/supply", json={"started": {"math": 2}})
    units = single_group_units(["math"], node="n0") + single_group_units(["math"], node="n1", start=1)
    assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0, 1]
    assert _post(c, "fetched", 1, 0).json()["held"]
    assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": []}


def test_groups_of_a_held_mini_batch_withdrawn_by_a_later_loss_are_lost_when_their_node_was(tmp_path: Path) -> None:
    """Mini-batch 1 (rows on n1) is held by every rank, so n1's loss keeps it; n0's loss then withdraws 0 and 1.
    The group of 1 on lost n1 is lost too and offered for regeneration (it was left finished: counted, never
    regenerated, and admitted again if n1 came back empty); nothing is planned from a lost node."""
    with app_client(tmp_path / "cp.db") as c:
        _lose_n1_while_mini_batch_1_is_held(c)
        assert c.post("/v1/nodes/n0/lost").json()["withdrawn"] == {"job1": [0, 1]}
        status = c.get("/v1/jobs/job1/status").json()
        regenerate = {x["group_id"]: x["reason"] for x in status["to_regenerate"]}
        assert regenerate == {"g0": "node n0 lost", "g1": "node n1 lost"}
        assert status["counts"]["groups_by_status"] == {"lost": 2}
        c.post("/v1/nodes", json={"node_id": "n1", "endpoint": "grpc://127.0.0.1:9101"})  # back, empty
        c.post("/v1/jobs/job1/supply", json={"group_ids": {"math": ["r0", "r1"]}, "regenerates": ["g0", "g1"]})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "math"], node="n1", prefix="r")})
        rest = drain(c, "job1")
    assert [m.global_index for m in rest] == [0, 1]
    assert {g for g, _ in rows_of([p for m in rest for p in shares(m)])} == {"r0", "r1"}


def test_groups_of_a_held_mini_batch_stay_lost_when_their_node_registers_again_before_the_withdrawal(
    tmp_path: Path,
) -> None:
    """As above, but n1 registers again (restarted, empty) before n0's loss, and the control plane restarts in
    between: the group of held mini-batch 1 on n1 is still lost when 1 is withdrawn (n1 being alive again
    does not bring its old rows back), and nothing is planned from it."""
    with app_client(tmp_path / "cp.db") as c:
        _lose_n1_while_mini_batch_1_is_held(c)
        c.post("/v1/nodes", json={"node_id": "n1", "endpoint": "grpc://127.0.0.1:9101"})  # back, empty
    with app_client(tmp_path / "cp.db") as c:
        assert c.post("/v1/nodes/n0/lost").json()["withdrawn"] == {"job1": [0, 1]}
        status = c.get("/v1/jobs/job1/status").json()
        regenerate = {x["group_id"]: x["reason"] for x in status["to_regenerate"]}
        assert regenerate == {"g0": "node n0 lost", "g1": "node n1 lost"}
        assert status["counts"]["groups_by_status"] == {"lost": 2}
        assert c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0}).status_code == 204


def test_a_previous_release_s_held_mini_batch_record_takes_the_nodes_lost_at_restart(tmp_path: Path) -> None:
    """A mini-batch record written before ``lost_nodes`` was persisted: at restart the held mini-batch takes the
    nodes of its groups that are lost then, so a later withdrawal loses its group on n1 (not ``finished`` again)."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _lose_n1_while_mini_batch_1_is_held(c)
    conn = sqlite3.connect(db)  # the record as the previous release wrote it: no lost_nodes
    (row,) = conn.execute("SELECT body FROM records WHERE kind='mb' AND key=?", (index_key(1),)).fetchall()
    old = json.loads(row[0])
    assert old.pop("lost_nodes") == ["n1"]
    with conn:
        conn.execute("UPDATE records SET body=? WHERE kind='mb' AND key=?", (json.dumps(old), index_key(1)))
    conn.close()
    with app_client(db) as c:
        assert c.post("/v1/nodes/n0/lost").json()["withdrawn"] == {"job1": [0, 1]}
        status = c.get("/v1/jobs/job1/status").json()
        assert {x["group_id"] for x in status["to_regenerate"]} == {"g0", "g1"}
        assert status["counts"]["groups_by_status"] == {"lost": 2}
