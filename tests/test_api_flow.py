"""Full control-plane flows on the real app: multi-source jobs under every policy, lost nodes, restart."""

from __future__ import annotations

import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from api_support import ack, app_client, drain, group, job_spec, manifest, rows_of, shares, single_group_units, unit
from fastapi.testclient import TestClient

from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings
from knittrans.api.spec import JobSpec
from knittrans.api.store import RecordStore
from knittrans.descriptors import UnitDescriptor
from knittrans.manifest import Manifest
from knittrans.sched.admission import POLICIES

QUOTAS = {"math": 4, "code": 2, "mm": 2}


def _groups_per_step(manifests: list[Manifest], source_of: dict[str, str]) -> dict[int, Counter[str]]:
    seen: dict[int, set[str]] = {}
    for m in manifests:
        seen.setdefault(m.step, set()).update(g.group_id for g in m.groups)
    return {step: Counter(source_of[g] for g in gids) for step, gids in seen.items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_full_flow_quotas_exact_and_exactly_once(tmp_path: Path, policy: str) -> None:
    """Skewed multi-source rollout: every step has exactly q per source, every row reaches one rank once."""
    rng = random.Random(7)
    steps, world = 3, 3
    spec = job_spec(
        quotas=QUOTAS,
        mini_batches_per_step=4,
        world_size=world,
        policy=policy,
        micro_batch_tokens=40,
        micro_batch_size=None,
        total_steps=steps,
    )
    finish: list[tuple[float, str, str]] = []
    for s, q in QUOTAS.items():
        speed = {"math": 1.0, "code": 3.0, "mm": 2.0}[s]
        finish += [(rng.expovariate(1 / speed) + i * 0.1, f"{s}-{i}", s) for i in range(q * steps)]
    finish.sort()
    source_of = {gid: s for _, gid, s in finish}
    hashes = {gid: [f"{i:064x}"] for i, (_, gid, s) in enumerate(finish) if s == "mm"}
    with app_client(tmp_path / "cp.db") as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        for n in range(3):
            c.post("/v1/nodes", json={"node_id": f"n{n}", "endpoint": f"grpc://127.0.0.1:{9000 + n}"})
        c.post("/v1/jobs/job1/supply", json={"started": {s: q * steps for s, q in QUOTAS.items()}})
        manifests: list[Manifest] = []
        i = 0
        while i < len(finish):
            batch = []
            for _ in range(rng.randint(1, 4)):
                take = finish[i : i + rng.randint(1, 3)]
                i += len(take)
                if take:
                    groups = [
                        group(
                            gid,
                            s,
                            finished_at=t,
                            tokens=[rng.randint(3, 30) for _ in range(2)],
                            media=hashes.get(gid, ()),
                        )
                        for t, gid, s in take
                    ]
                    batch.append(unit(f"u{i}", groups, node=f"n{rng.randrange(3)}"))
            r = c.post("/v1/jobs/job1/units", json={"units": batch})
            assert r.status_code == 200, r.text
            new = drain(c, "job1")
            manifests += new
            for m in new:
                for rank in range(world):
                    c.post("/v1/jobs/job1/versions", json={"version": m.global_index + 1, "rank": rank})
        status = c.get("/v1/jobs/job1/status").json()
        metrics = c.get("/metrics").text
    total_mb = steps * 4
    assert [m.global_index for m in manifests] == list(range(total_mb))
    assert all(m.world_size == world and m.attempt == 0 for m in manifests)
    plans = [p for m in manifests for p in shares(m)]
    assert len({p.plan_id for p in plans}) == total_mb * world
    rows = rows_of(plans)
    assert len(rows) == len(set(rows)) == len(finish) * 2  # every trajectory exactly once
    assert _groups_per_step(manifests, source_of) == {s: Counter(QUOTAS) for s in range(steps)}
    for p in plans:
        m = p.manifest
        assert m.policy_version == m.global_index and m.step == m.global_index // 4
        for micro in p.micro_batches:
            fetched = [
                (f.node_id, read.unit_id, row)
                for f in micro.fetches
                for read in f.ticket.reads
                for a, b in read.row_ranges
                for row in range(a, b)
            ]
            assert fetched == [(r.node_id, r.unit_id, r.row) for r in micro.rows]
            want = {h for r in micro.rows for h in hashes.get(r.group_id, ())}
            assert {x.hash for x in micro.media} == want
    assert status["state"] == "completed"
    assert status["counts"]["consumed_groups"] == len(finish)
    for reading in ("start", "end", "weighted"):
        assert status["staleness"]["overall"][reading]["staleness"]["count"] == len(finish) * 2
    assert set(status["staleness"]["by_step"]) == {"0", "1", "2"}
    assert 'knittrans_staleness_versions{job_name="job1",kind="architectural"' in metrics


def _job_on_two_nodes(c: TestClient, spec: dict[str, Any]) -> None:
    """Create the job of ``spec`` and register store nodes ``n0`` and ``n1``."""
    assert c.post("/v1/jobs", json=spec).status_code == 201
    for n in ("n0", "n1"):
        assert c.post("/v1/nodes", json={"node_id": n, "endpoint": "grpc://127.0.0.1:1"}).status_code == 200


def test_lost_node_replans_untouched_mini_batch(tmp_path: Path) -> None:
    """Rows on a lost node: the un-acked mini-batch is withdrawn whole, re-planned without them as the next
    attempt, never half-used."""
    spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=2)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 2, "code": 2}})
        units = single_group_units(["math", "code"], node="n1") + single_group_units(
            ["math", "code"], node="n0", start=2
        )
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0, 1]
        old = manifest(c, "job1", 0)
        assert old is not None and old.attempt == 0
        assert {n.node_id for n in old.nodes} == {"n1"}
        lost = c.post("/v1/nodes/n1/lost").json()
        assert lost["withdrawn"] == {"job1": [0, 1]}
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": old.attempt})
        assert r.status_code == 410 and r.json()["error"] == "data_lost"
        assert manifest(c, "job1", 0) is None  # withdrawn: nothing to serve until it is planned again
        status = c.get("/v1/jobs/job1/status").json()
        assert sorted(x["group_id"] for x in status["to_regenerate"]) == ["g0", "g1"]
        assert status["deficits"] == {"math": 1, "code": 1}
        assert status["quota_fill"]["math"]["admitted"] == 0
        supply = c.post(
            "/v1/jobs/job1/supply", json={"group_ids": {"math": ["r0"], "code": ["r1"]}, "regenerates": ["g0", "g1"]}
        ).json()
        assert supply["admitted"] == [0]  # the surviving groups can go once regeneration is under way
        regen = single_group_units(["math", "code"], node="n0", prefix="r")
        assert c.post("/v1/jobs/job1/units", json={"units": regen}).json()["admitted"] == [1]
        manifests = drain(c, "job1")
        assert c.get("/v1/jobs/job1/status").json()["to_regenerate"] == []
    plans = [p for m in manifests for p in shares(m)]
    assert all(r.node_id == "n0" for p in plans for micro in p.micro_batches for r in micro.rows)
    assert [(m.global_index, m.attempt) for m in manifests] == [(0, 1), (1, 1)]
    assert plans[0].plan_id != old.share(0).plan_id
    rows = rows_of(plans)
    assert len(rows) == len(set(rows)) == 8
    assert {g for g, _ in rows} == {"g2", "g3", "r0", "r1"}


@pytest.mark.timing
def test_if_none_match_waits_for_the_re_plan_of_a_withdrawn_mini_batch(tmp_path: Path) -> None:
    """A rank that failed to fetch asks again with the manifest's ETag: it is answered 304 while the
    mini-batch is unchanged, and the re-planned attempt (new ETag) as soon as a registration admits it."""
    spec = job_spec(quotas={"math": 2}, mini_batches_per_step=1, world_size=1)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        assert c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"] * 2, node="n1")}).json()[
            "admitted"
        ] == [0]
        first = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0})
        tag = first.headers["etag"]
        assert first.status_code == 200 and tag.startswith('"n0.a0.')
        again = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0})
        assert again.content == first.content and again.headers["etag"] == tag  # immutable: the same bytes
        r = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0.2}, headers={"If-None-Match": tag})
        assert r.status_code == 304 and r.headers["x-knittrans-job-state"] == "running" and not r.content
        r = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0}, headers={"If-None-Match": '"other"'})
        assert r.status_code == 200 and r.content == first.content  # another tag: answered at once
        got: dict[str, Any] = {}

        def wait() -> None:
            r = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 60}, headers={"If-None-Match": tag})
            got["status"], got["etag"], got["body"] = r.status_code, r.headers.get("etag"), r.content

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [0]}
        regen = single_group_units(["math"] * 2, node="n0", prefix="r")
        assert c.post("/v1/jobs/job1/units", json={"units": regen}).json()["admitted"] == [0]
        waiter.join(60)
        assert not waiter.is_alive()
    assert got["status"] == 200 and got["etag"] != tag and got["etag"].startswith('"n0.a1.')
    m = Manifest.decode(got["body"])
    assert (m.global_index, m.attempt) == (0, 1) and {g.group_id for g in m.groups} == {"r0", "r1"}


def test_status_pool_lists_waiting_groups_by_node_in_admission_order(tmp_path: Path) -> None:
    """Status shows which node holds the pool's groups, earliest finished first; a lost node's leave it."""
    spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=1)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        assert c.post("/v1/jobs/job1/pause").status_code == 200  # nothing is admitted: the pool keeps them
        units = single_group_units(["math", "code"], node="n1", start=3) + single_group_units(
            ["code", "math", "math"], node="n0"
        )
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == []
        pool = c.get("/v1/jobs/job1/status").json()["pool"]
        assert pool["by_node"] == {"n0": 3, "n1": 2}
        assert [(g["group_id"], g["source"], g["node_id"]) for g in pool["head"]] == [
            ("g0", "code", "n0"),
            ("g1", "math", "n0"),
            ("g2", "math", "n0"),
            ("g3", "math", "n1"),
            ("g4", "code", "n1"),
        ]
        assert [g["finished_at"] for g in pool["head"]] == [1000.0 + i for i in range(5)]
        c.post("/v1/nodes/n0/lost")
        pool = c.get("/v1/jobs/job1/status").json()["pool"]
        assert pool["by_node"] == {"n1": 2} and [g["group_id"] for g in pool["head"]] == ["g3", "g4"]


def test_lost_node_keeps_mini_batch_already_acked(tmp_path: Path) -> None:
    """A mini-batch some rank already acked was fully fetched: it is kept; later untouched ones are re-planned."""
    spec = job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=2, micro_batch_size=1)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "math"], node="n1")})
        m0 = manifest(c, "job1", 0)
        assert m0 is not None
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": m0.attempt, "ranks": [0]})
        assert r.status_code == 200 and not r.json()["consumed"], r.text
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [1]}
        kept = manifest(c, "job1", 0)
        assert kept == m0  # the same manifest, attempt 0
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": m0.attempt, "ranks": [1]})
        assert r.json()["consumed"]
        assert manifest(c, "job1", 1) is None  # withdrawn: nothing until its groups are regenerated
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"], node="n0", prefix="r")})
        manifests = drain(c, "job1")
    assert [(m.global_index, m.attempt) for m in manifests] == [(1, 1)]
    assert {g.group_id for m in manifests for g in m.groups} == {"r0"}


def test_lost_node_re_admits_every_withdrawn_mini_batch_the_survivors_fill_at_once(tmp_path: Path) -> None:
    """A node loss withdraws mini-batches 0-3; the live node's groups fill three of them again in the same
    change (admission runs until the policy forms nothing), before any further registration."""
    spec = job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=1)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        units = single_group_units(["math"], node="n1") + single_group_units(["math"] * 3, node="n0", start=1)
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0, 1, 2, 3]
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {"job1": [0, 1, 2, 3]}
        assert c.get("/v1/jobs/job1/status").json()["next_global_index"] == 3
        again = [manifest(c, "job1", n) for n in range(4)]
    assert [(m.global_index, m.attempt) for m in again if m is not None] == [(0, 1), (1, 1), (2, 1)]
    assert [g.group_id for m in again if m is not None for g in m.groups] == ["g1", "g2", "g3"]


def test_lost_node_withdrawing_back_into_an_earlier_step_keeps_its_quota_count(tmp_path: Path) -> None:
    """The consumed mini-batches of the step a withdrawal falls back into are still counted.

    With K = 3, once mini-batch 6 (step 2) was admitted and 0..4 consumed, the consumed records of step
    1 (mini-batch 3) were evicted; losing the node of mini-batch 5 set the next index back to 5, in step
    1, whose admitted count then missed mini-batch 3: the node loss failed (500, "admitted 1 groups
    before mini-batch 2, expected 2") at every sweep, and the node was never declared lost (CI's
    compose test)."""
    spec = job_spec(quotas={"math": 3}, mini_batches_per_step=3, world_size=1, micro_batch_size=2)
    with app_client(tmp_path / "cp.db") as c:
        _job_on_two_nodes(c, spec)
        units = single_group_units(["math"] * 5, node="n0") + single_group_units(["math"], node="n1", start=5)
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0, 1, 2, 3, 4, 5]
        for n in range(5):
            m = manifest(c, "job1", n)
            assert m is not None and m.global_index == n
            assert ack(c, "job1", m)["consumed"]
        lost = c.post("/v1/nodes/n1/lost")
        assert lost.status_code == 200, lost.text
        assert lost.json()["withdrawn"] == {"job1": [5]}
        assert c.get("/v1/nodes").json()[1]["state"] == "lost"
        fill = c.get("/v1/jobs/job1/status").json()["quota_fill"]["math"]
        assert fill["admitted"] == 2, fill  # step 1: mini-batches 3 and 4
        regen = single_group_units(["math"], node="n0", prefix="r")
        assert c.post("/v1/jobs/job1/units", json={"units": regen}).json()["admitted"] == [5]
        m = manifest(c, "job1", 5)
    assert m is not None and m.attempt == 1 and {g.group_id for g in m.groups} == {"r0"}


def test_staleness_bound_expires_old_groups(tmp_path: Path) -> None:
    """Groups older than max_staleness are never admitted and are listed to regenerate."""
    spec = job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, max_staleness=0)
    with app_client(tmp_path / "cp.db") as c:
        c.post("/v1/jobs", json=spec)
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 3}})
        assert c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])}).json()["admitted"] == [0]
        late = unit("u-late", [group("late", "math", version=0)])
        assert c.post("/v1/jobs/job1/units", json={"units": [late]}).json()["admitted"] == []
        status = c.get("/v1/jobs/job1/status").json()
        assert status["to_regenerate"][0]["group_id"] == "late"
        assert status["to_regenerate"][0]["reason"] == "expired"
        assert status["counts"]["groups_by_status"]["expired"] == 1 and status["pool"]["head"] == []
        fresh = unit("u-fresh", [group("fresh", "math", version=1)])
        assert c.post("/v1/jobs/job1/units", json={"units": [fresh]}).json()["admitted"] == [1]


@pytest.mark.timing
def test_restart_on_same_db_continues_exactly(tmp_path: Path) -> None:
    """A new app on the same SQLite file serves the same bytes for un-consumed mini-batches, keeps which
    ranks acked them, and admits nothing twice."""
    db = str(tmp_path / "cp.db")
    spec = job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=2)

    def rank_ack(c: TestClient, n: int, rank: int) -> dict[str, Any]:
        r = c.post(f"/v1/jobs/job1/minibatches/{n}/ack", json={"attempt": 0, "ranks": [rank]})
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result

    with app_client(db) as c:
        c.post("/v1/jobs", json=spec)
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 4, "code": 4}})
        r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code", "math", "code"])})
        assert r.json()["admitted"] == [0, 1]
        first = [manifest(c, "job1", n) for n in (0, 1)]
        held = c.get("/v1/jobs/job1/minibatches/1", params={"timeout_s": 0})
        rank_ack(c, 0, 0)
        assert rank_ack(c, 0, 1)["consumed"]
        rank_ack(c, 1, 0)  # mini-batch 0 consumed, rank 0 also done with 1
        c.post("/v1/jobs/job1/versions", json={"version": 2, "rank": 0})
    with app_client(db) as c:
        assert c.get("/v1/jobs/job1/status").json()["next_global_index"] == 2
        assert c.get("/v1/jobs/job1/version").json()["version"] == 2
        progress = c.get("/v1/jobs/job1/minibatches").json()
        assert progress["position"] == 1
        assert [(f["global_index"], f["acked_ranks"]) for f in progress["in_flight"]] == [(1, [[0, 1]])]
        assert c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0}).status_code == 409  # consumed
        again = c.get("/v1/jobs/job1/minibatches/1", params={"timeout_s": 0})
        assert again.content == held.content and again.headers["etag"] == held.headers["etag"]  # byte for byte
        assert rank_ack(c, 1, 0)["duplicate"]  # rank 0's ack survived the restart
        assert rank_ack(c, 1, 1)["consumed"]
        r = c.post("/v1/jobs/job1/units", json={"units": single_group_units(["code", "math", "code", "math"], start=4)})
        assert r.json()["admitted"] == [2, 3]
        rest = drain(c, "job1")
    assert [m.global_index for m in rest] == [2, 3]
    rows = rows_of([p for m in [*first, *rest] if m is not None for p in shares(m)])
    assert len(rows) == len(set(rows)) == 16


@pytest.mark.timing
def test_ack_and_version_rules(tmp_path: Path) -> None:
    """Acks go in order per rank, unknown mini-batches, attempts and ranks are 404, and policy versions never
    go back (nor through an ack)."""
    spec = job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1)
    with app_client(tmp_path / "cp.db") as c:
        c.post("/v1/jobs", json=spec)
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        assert c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "math"])}).json()[
            "admitted"
        ] == [0, 1]
        r = c.post("/v1/jobs/job1/minibatches/1/ack", json={"attempt": 0})
        assert r.status_code == 409 and "mini-batch 0 before 1" in r.json()["detail"]
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": 3})
        assert r.status_code == 404 and "never issued" in r.json()["detail"]
        assert c.post("/v1/jobs/job1/minibatches/7/ack", json={"attempt": 0}).status_code == 404
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": 0, "ranks": [3]})
        assert r.status_code == 404 and "world_size" in r.json()["detail"]
        assert c.post("/v1/jobs/job1/minibatches/0/fetched", json={"attempt": 0, "ranks": [1]}).status_code == 404
        assert c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": 0, "ranks": []}).status_code == 422
        assert c.get("/v1/jobs/nope/minibatches/0", params={"timeout_s": 0}).status_code == 404
        assert c.get("/v1/jobs/nope/minibatches").status_code == 404
        assert c.post("/v1/jobs/job1/versions", json={"version": 2, "rank": 0}).json()["version"] == 2
        r = c.post("/v1/jobs/job1/versions", json={"version": 1, "rank": 0})
        assert r.status_code == 409 and "never decrease" in r.json()["detail"]
        r = c.post("/v1/jobs/job1/minibatches/0/ack", json={"attempt": 0, "version": 1})
        assert r.status_code == 409 and "never decrease" in r.json()["detail"]
        assert c.get("/v1/jobs/job1/minibatches").json()["in_flight"][0]["acked_ranks"] == []  # nothing applied
        assert c.post("/v1/jobs/job1/versions", json={"version": 1, "rank": 5}).status_code == 404


def test_each_admitted_mini_batch_is_published_before_the_next_is_formed(tmp_path: Path) -> None:
    """Units enough for two mini-batches in one registration: the change that admits mini-batch 0 commits and
    publishes it on its own, before mini-batch 1 is formed (the ranks waiting for 0 do not wait for 1)."""
    seen: list[list[int]] = []
    store = RecordStore(str(tmp_path / "cp.db"))
    settings = Settings(db_path=store.path)
    svc = ControlPlane(store, settings, on_change=lambda job: seen.append(sorted(svc.published(job).manifests)))
    svc.create_job(JobSpec.from_dict(job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1)))
    svc.register_node("n0", "grpc://127.0.0.1:9000", "127.0.0.1")
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math", "math"])]
    seen.clear()
    assert svc.register_units("job1", units)["admitted"] == [0, 1]
    assert seen[:2] == [[0], [0, 1]], seen
    store.close()


def _watched_one_rank_job(tmp_path: Path, k: int) -> tuple[ControlPlane, RecordStore, list[list[int]]]:
    """A control plane with job1 (math 2 per step, ``k`` mini-batches per step, L = 1) and a node, and the
    in-flight manifests it publishes at each notification (the list, cleared)."""
    seen: list[list[int]] = []
    store = RecordStore(str(tmp_path / "cp.db"))
    svc = ControlPlane(
        store, Settings(db_path=store.path), on_change=lambda job: seen.append(sorted(svc.published(job).manifests))
    )
    spec = job_spec(quotas={"math": 2}, mini_batches_per_step=k, world_size=1, lookahead=1, total_steps=3)
    svc.create_job(JobSpec.from_dict(spec))
    svc.register_node("n0", "grpc://127.0.0.1:9000", "127.0.0.1")
    seen.clear()
    return svc, store, seen


def test_admission_opens_no_extra_change_once_the_lookahead_is_reached(tmp_path: Path) -> None:
    """With L = 1 the registration admits mini-batches 0 and 1 in two changes and stops there: no third change
    (a commit and a wake-up of every headroom poll) only to find the lookahead reached."""
    svc, store, seen = _watched_one_rank_job(tmp_path, k=2)
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math"] * 4)]
    assert svc.register_units("job1", units)["admitted"] == [0, 1]
    assert seen == [[0], [0, 1]], seen
    store.close()


def test_an_admission_attempt_that_forms_nothing_writes_and_wakes_nothing(tmp_path: Path) -> None:
    """After mini-batch 0 is admitted, the attempt at mini-batch 1 (lookahead open, pool empty) forms nothing:
    it commits no record and notifies nobody (a headroom long-poll would wake for nothing)."""
    svc, store, seen = _watched_one_rank_job(tmp_path, k=1)
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math"] * 2)]
    commits: list[int] = []
    commit = store.commit
    store.commit = lambda txn: (commits.append(len(txn)), commit(txn))[1]  # type: ignore[method-assign]
    assert svc.register_units("job1", units)["admitted"] == [0]
    assert seen == [[0]], seen  # one notification: the registration's change
    assert commits[1:] == [0], commits  # the attempt at mini-batch 1 wrote nothing
    store.close()


def test_an_unexpected_error_inside_a_change_reloads_the_committed_state_and_notifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error that is not a refusal, struck after a change began mutating (here: admission after a unit
    registration; a node loss), leaves memory as committed: the state is reloaded and the jobs notified."""
    from knittrans.api.jobstate import JobState

    svc, store, seen = _watched_one_rank_job(tmp_path, k=1)
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math"] * 2)]

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(JobState, "admit", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            svc.register_units("job1", units)
    assert svc.jobs["job1"].units == {} and seen == [[]], seen  # the registration never happened
    assert svc.register_units("job1", units)["admitted"] == [0]
    seen.clear()
    with monkeypatch.context() as patch:
        patch.setattr(JobState, "node_lost", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            svc.declare_lost("n0")
    assert not svc.nodes["n0"].lost and seen == [[0]], seen  # reloaded: node alive, mini-batch 0 in flight
    store.close()


def test_a_repeated_registration_writes_and_wakes_nothing(tmp_path: Path) -> None:
    """Registering the same units again (a retry) changes nothing: no record is written, nobody is notified."""
    svc, store, seen = _watched_one_rank_job(tmp_path, k=1)
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math"])]
    assert svc.register_units("job1", units)["registered"] == 1
    seen.clear()
    commits: list[int] = []
    commit = store.commit
    store.commit = lambda txn: (commits.append(len(txn)), commit(txn))[1]  # type: ignore[method-assign]
    assert svc.register_units("job1", units)["duplicates"] == 1
    assert commits == [0] and seen == [], (commits, seen)
    store.close()


def test_a_reload_swaps_the_registries_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reloading the state (after a failed write) never shows the event loop's readers (heartbeats, the job
    check of the long-polls, health) a half-filled registry: jobs and nodes are swapped in whole."""
    import knittrans.api.service as service

    svc, store, _ = _watched_one_rank_job(tmp_path, k=1)
    svc.create_job(JobSpec.from_dict(job_spec(name="job2", quotas={"math": 2}, mini_batches_per_step=1, world_size=1)))
    seen: list[tuple[list[str], list[str]]] = []
    restore = service.restore_job

    def watched(job: Any, records: Any) -> None:
        seen.append((sorted(svc.jobs), sorted(svc.nodes)))
        restore(job, records)

    monkeypatch.setattr(service, "restore_job", watched)
    svc._load()
    assert seen == [(["job1", "job2"], ["n0"])] * 2, seen
    assert sorted(svc.jobs) == ["job1", "job2"]
    store.close()


def test_a_restart_admits_what_the_stopped_control_plane_left_unadmitted(tmp_path: Path) -> None:
    """A control plane that stopped between the two admissions of one registration (here its second commit
    fails, as a crash there would leave the database) admits the rest when it starts again."""
    svc, store, _ = _watched_one_rank_job(tmp_path, k=2)
    units = [UnitDescriptor.from_dict(u) for u in single_group_units(["math"] * 4)]
    commit, commits = store.commit, []

    def second_fails(txn: Any) -> None:
        commits.append(len(txn))
        if len(commits) == 2:
            raise RuntimeError("stopped")
        commit(txn)

    store.commit = second_fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stopped"):
        svc.register_units("job1", units)
    assert sorted(svc.jobs["job1"].published().manifests) == [0]
    store.close()
    store = RecordStore(store.path)
    restarted = ControlPlane(store, Settings(db_path=store.path), on_change=lambda job: None)
    assert sorted(restarted.jobs["job1"].published().manifests) == [0, 1]
    store.close()


def test_a_refused_write_whose_reload_fails_too_writes_the_job_record_at_the_next_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused write whose reload fails too (the database unreadable for a moment) leaves memory ahead of the
    database: the job record that change put was never written, so the next change of the job writes it."""
    from knittrans.errors import Unavailable

    svc, store, _ = _watched_one_rank_job(tmp_path, k=1)

    def refused(*_: Any) -> None:
        raise Unavailable("the database refused the write")

    with monkeypatch.context() as patch:
        patch.setattr(store, "commit", refused)
        patch.setattr(store, "load", refused)
        with pytest.raises(Unavailable):
            svc.set_state("job1", "pause")
    assert svc.jobs["job1"].state == "paused"  # memory is ahead of the database
    svc.register_units("job1", [UnitDescriptor.from_dict(u) for u in single_group_units(["math"])])
    store.close()
    store = RecordStore(store.path)
    restarted = ControlPlane(store, Settings(db_path=store.path), on_change=lambda job: None)
    assert restarted.jobs["job1"].state == "paused"
    store.close()


def test_a_node_that_moves_is_named_at_its_new_endpoint_in_the_published_manifests(tmp_path: Path) -> None:
    """Published manifests name a node's endpoint: when the node moves, they are built again naming the new one
    (a new ETag) and the waiting ranks are woken, so no rank fetches from the old address."""
    svc, store, seen = _watched_one_rank_job(tmp_path, k=1)
    svc.register_units("job1", [UnitDescriptor.from_dict(u) for u in single_group_units(["math"] * 2)])
    before = svc.jobs["job1"].published().manifests[0]
    seen.clear()
    svc.register_node("n0", "grpc://127.0.0.1:9001", "127.0.0.1", admin=True)
    etag, raw = svc.jobs["job1"].published().manifests[0]
    assert [(n.node_id, n.endpoint) for n in Manifest.decode(raw).nodes] == [("n0", "grpc://127.0.0.1:9001")]
    assert etag != before[0] and seen == [[0]], seen
    svc.register_node("n0", "grpc://127.0.0.1:9001", "127.0.0.1")  # the same endpoint again: nothing to rebuild
    assert svc.jobs["job1"].published().manifests[0] == (etag, raw) and seen == [[0]], seen
    store.close()


def test_status_first_declares_silent_nodes_lost(tmp_path: Path) -> None:
    """A job's status sweeps first: the groups of a node silent past ``node_timeout_s`` (its last heartbeat set
    back here) show as lost, not as waiting in the pool."""
    svc, store, _ = _watched_one_rank_job(tmp_path, k=1)
    svc.register_units("job1", [UnitDescriptor.from_dict(u) for u in single_group_units(["math"])])
    svc.nodes["n0"].last_heartbeat -= 2 * svc.settings.node_timeout_s
    assert [g["group_id"] for g in svc.status("job1")["lost_groups"]] == ["g0"]
    store.close()
