"""Control-plane node, unit and supply endpoints on the real app: registration rules and bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_support import group, job_spec, single_group_units, unit
from fastapi.testclient import TestClient

from knittrans.api import Settings, create_app
from knittrans.api.records import Kind
from knittrans.api.store import RecordStore
from knittrans.procs import wait_until


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(db_path=str(tmp_path / "cp.db"), max_body_bytes=200_000)
    with TestClient(create_app(settings)) as c:
        c.post("/v1/jobs", json=job_spec())
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1", "host": "h0"})
        yield c


@pytest.mark.timing
def test_nodes_register_heartbeat_list(client: TestClient) -> None:
    """Registered nodes are listed alive; heartbeats of unknown nodes are 404; bad endpoints 422."""
    assert client.post("/v1/nodes/n0/heartbeat").json()["state"] == "alive"
    assert client.post("/v1/nodes/zz/heartbeat").status_code == 404
    r = client.post("/v1/nodes", json={"node_id": "n1", "endpoint": "http://x"})
    assert r.status_code == 422 and "endpoint" in r.json()["detail"]
    r = client.post("/v1/nodes", json={"node_id": "a/b", "endpoint": "grpc://127.0.0.1:2"})
    assert r.status_code == 422 and "node_id" in r.json()["detail"]
    assert [n["node_id"] for n in client.get("/v1/nodes").json()] == ["n0"]


@pytest.mark.timing
def test_lost_node_needs_reregistration(client: TestClient) -> None:
    """A node declared lost answers 409 to heartbeats until it registers again."""
    r = client.post("/v1/nodes/n0/lost", json={"reason": "host died"})
    assert r.json()["state"] == "lost" and r.json()["lost_reason"] == "host died"
    assert client.post("/v1/nodes/n0/heartbeat").status_code == 409
    r = client.post("/v1/nodes/n0/lost", json={"reason": "again"})  # already lost: nothing changes
    assert r.json()["lost_reason"] == "host died" and r.json()["withdrawn"] == {}
    r = client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
    assert r.status_code == 409 and "lost" in r.json()["detail"]
    client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
    assert client.post("/v1/nodes/n0/heartbeat").status_code == 200


@pytest.mark.timing
def test_node_without_heartbeat_times_out(tmp_path: Path) -> None:
    """A node silent for longer than node_timeout_s is declared lost by the background sweeper.

    Waits on ``/metrics``, which reads node state without sweeping (``GET /v1/nodes`` sweeps on read), so
    the test fails if the sweeper task does not run.
    """
    settings = Settings(db_path=str(tmp_path / "t.db"), node_timeout_s=0.05, node_sweep_interval_s=0.02)
    with TestClient(create_app(settings)) as c:
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        wait_until(lambda: 'knittrans_node_up{node="n0"} 0.0' in c.get("/metrics").text, timeout_s=20, what="sweeper")
        node = c.get("/v1/nodes").json()[0]
        assert node["state"] == "lost" and "heartbeat" in node["lost_reason"]


@pytest.mark.timing
def test_a_failed_sweep_does_not_stop_the_sweeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep that fails (say, the state database refused the write) is logged; the next sweeps still run."""
    from knittrans.api.service import ControlPlane
    from knittrans.errors import Unavailable

    sweep, calls = ControlPlane.sweep, []

    def flaky(self: ControlPlane, **kwargs: float) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise Unavailable("the disk is full")
        sweep(self, **kwargs)

    monkeypatch.setattr(ControlPlane, "sweep", flaky)
    settings = Settings(db_path=str(tmp_path / "t.db"), node_timeout_s=0.05, node_sweep_interval_s=0.02)
    with TestClient(create_app(settings)) as c:
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        wait_until(lambda: 'knittrans_node_up{node="n0"} 0.0' in c.get("/metrics").text, timeout_s=20, what="sweeper")


def test_units_register_idempotently(client: TestClient) -> None:
    """The same units again are no-ops; a changed descriptor under a known id is a 409."""
    units = single_group_units(["math", "code"])
    assert client.post("/v1/jobs/job1/units", json={"units": units}).json()["registered"] == 2
    again = client.post("/v1/jobs/job1/units", json={"units": units}).json()
    assert again["registered"] == 0 and again["duplicates"] == 2
    changed = dict(units[0], num_bytes=1)
    r = client.post("/v1/jobs/job1/units", json={"units": [changed]})
    assert r.status_code == 409 and "u-g0" in r.json()["detail"]


@pytest.mark.parametrize(
    ("bad", "status", "needle"),
    [
        (unit("u1", [group("g1", "math")], node="ghost"), 404, "ghost"),
        (unit("u1", [group("g1", "math")], job="other"), 409, "other"),
        (unit("u1", [group("g1", "poetry")]), 409, "poetry"),
        (unit("u1", [group("g1", "math", size=3)]), 409, "group_size"),
        (unit("u1", [group("g1", "math", media=["xyz"])]), 422, "media_hashes"),
        (unit("../u1", [group("g1", "math")]), 422, "unit_id"),
        ({**unit("u1", [group("g1", "math")]), "num_rows": 7}, 409, "rows"),
        ({**unit("u1", [group("g1", "math")]), "groups": "none"}, 422, "groups"),
        (unit("u1", [group("g0", "math")]), 409, "g0"),
        (unit("u-ok", [group("g-ok", "code")]), 409, "appears twice"),
        (unit("u2", [group("g-ok", "code")]), 409, "in unit 'u-ok'"),  # a group twice in one batch
    ],
)
def test_bad_units_are_refused_and_nothing_is_registered(
    client: TestClient, bad: dict[str, object], status: int, needle: str
) -> None:
    """A batch with one bad unit is refused as a whole, with a 4xx naming the problem."""
    client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
    good = unit("u-ok", [group("g-ok", "code")])
    r = client.post("/v1/jobs/job1/units", json={"units": [good, bad]})
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert client.get("/v1/jobs/job1/status").json()["counts"]["units"] == 1


def test_units_for_unknown_job_are_404(client: TestClient) -> None:
    """Units sent to a job that does not exist get 404 naming the job."""
    r = client.post("/v1/jobs/zzz/units", json={"units": single_group_units(["math"], job="zzz")})
    assert r.status_code == 404 and "zzz" in r.json()["detail"]


def test_supply_counts_once_per_request_id(client: TestClient) -> None:
    """Started groups raise P[s]; a repeated request_id is ignored; ids count once; finishing lowers P."""
    r = client.post("/v1/jobs/job1/supply", json={"started": {"math": 3}, "request_id": "r1"}).json()
    assert r["applied"] and r["pending"]["math"] == 3
    r = client.post("/v1/jobs/job1/supply", json={"started": {"math": 3}, "request_id": "r1"}).json()
    assert not r["applied"] and r["pending"]["math"] == 3
    r = client.post("/v1/jobs/job1/supply", json={"group_ids": {"code": ["a", "b", "a"]}}).json()
    assert r["pending"]["code"] == 2
    r = client.post("/v1/jobs/job1/supply", json={"group_ids": {"code": ["b", "c"]}, "dropped": {"math": 1}}).json()
    assert r["pending"] == {"code": 3, "math": 2}
    assert client.get("/v1/jobs/job1/status").json()["timing"]["peak_untaken"] == 5  # all pending, none admitted
    client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
    assert client.get("/v1/jobs/job1/status").json()["counts"]["pending"]["math"] == 1
    r = client.post("/v1/jobs/job1/supply", json={"started": {"math": -1}})
    assert r.status_code == 422 and "started.math" in r.json()["detail"]
    r = client.post("/v1/jobs/job1/supply", json={"dropped": {"poetry": 1}})
    assert r.status_code == 409 and "dropped.poetry: source has no quota" in r.json()["detail"]


def test_supply_counts_survive_a_restart(tmp_path: Path) -> None:
    """Started, dropped and finished counts per source are persisted: a restarted control plane answers the
    same pending groups, finished counts and untaken groups (what the window frees)."""
    db = tmp_path / "cp.db"
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        c.post("/v1/jobs", json=job_spec())
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/supply", json={"started": {"math": 3, "code": 1}, "dropped": {"math": 1}})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
        counts = c.get("/v1/jobs/job1/status").json()["counts"]
        assert (counts["pending"], counts["finished"]) == ({"code": 1, "math": 1}, {"math": 1})
        untaken = c.get("/v1/jobs/job1/headroom").json()["untaken"]
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        again = c.get("/v1/jobs/job1/status").json()["counts"]
        assert (again["pending"], again["finished"]) == (counts["pending"], counts["finished"])
        assert c.get("/v1/jobs/job1/headroom").json()["untaken"] == untaken


def test_started_ids_and_claimed_regenerations_survive_a_restart(tmp_path: Path) -> None:
    """Group ids reported started, claimed regenerations and request ids are persisted: after a restart the same
    ids count no more, the pending count is the same, the claimed group is not offered for regeneration again
    and the report sent again is a repeat."""
    db = tmp_path / "cp.db"
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        c.post("/v1/jobs", json=job_spec())
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
        c.post("/v1/nodes/n0/lost")
        report = {"group_ids": {"math": ["r0", "r1"]}, "regenerates": ["g0"], "request_id": "rep-1"}
        pending = c.post("/v1/jobs/job1/supply", json=report).json()["pending"]
        assert pending["math"] == 1  # two started, one finished (g0, then lost)
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        status = c.get("/v1/jobs/job1/status").json()
        assert status["counts"]["pending"] == pending and status["to_regenerate"] == []
        assert c.post("/v1/jobs/job1/supply", json={"group_ids": {"math": ["r1"]}}).json()["pending"] == pending
        assert not c.post("/v1/jobs/job1/supply", json=report).json()["applied"]  # its request_id is remembered


def test_retried_supply_report_that_claimed_regenerations_is_a_repeat(client: TestClient) -> None:
    """A report claiming groups to regenerate, sent again under its request_id (the client retries a report
    whose answer it lost), is answered as a repeat, not refused because the claims are gone."""
    client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
    client.post("/v1/nodes/n0/lost")
    report = {"group_ids": {"math": ["r0"]}, "regenerates": ["g0"], "request_id": "claim-1"}
    assert client.post("/v1/jobs/job1/supply", json=report).json()["applied"]
    again = client.post("/v1/jobs/job1/supply", json=report)
    assert again.status_code == 200 and not again.json()["applied"], again.text
    assert client.get("/v1/jobs/job1/status").json()["to_regenerate"] == []


def test_supply_report_naming_a_claim_twice_claims_it_once(client: TestClient) -> None:
    """A group named twice in ``regenerates`` is claimed once (not a 500)."""
    client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
    client.post("/v1/nodes/n0/lost")
    r = client.post("/v1/jobs/job1/supply", json={"group_ids": {"math": ["r0"]}, "regenerates": ["g0", "g0"]})
    assert r.status_code == 200 and r.json()["applied"], r.text
    assert client.get("/v1/jobs/job1/status").json()["to_regenerate"] == []
    r = client.post("/v1/jobs/job1/supply", json={"group_ids": {"math": ["r1"]}, "regenerates": ["g0"]})
    assert r.status_code == 409 and "not groups waiting to be regenerated" in r.json()["detail"], r.text


def test_body_too_large_is_413(client: TestClient) -> None:
    """A request body above max_body_bytes is refused with 413 and the server keeps serving."""
    units = single_group_units(["math"] * 2000)
    r = client.post("/v1/jobs/job1/units", json={"units": units})
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
    assert client.get("/v1/health").status_code == 200
    # without a declared length (chunked), counted as it arrives
    raw = json.dumps({"units": units}).encode()
    r = client.post("/v1/jobs/job1/units", content=iter([raw]), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "payload_too_large", r.text


def test_a_lost_group_registered_again_under_its_id_replaces_the_lost_one(tmp_path: Path) -> None:
    """A lost group's id registered again (in a new unit, without a supply claim) replaces the lost incarnation:
    it leaves the lost groups and the groups to regenerate, and counts once as finished (also after a restart)."""
    db = tmp_path / "cp.db"
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        c.post("/v1/jobs", json=job_spec())
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/nodes", json={"node_id": "n1", "endpoint": "grpc://127.0.0.1:2"})
        assert c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])}).json()["registered"] == 1
        c.post("/v1/nodes/n0/lost")
        status = c.get("/v1/jobs/job1/status").json()
        assert [g["group_id"] for g in status["to_regenerate"]] == ["g0"]
        again = unit("u-again", [group("g0", "math", finished_at=2000.0)], node="n1")
        assert c.post("/v1/jobs/job1/units", json={"units": [again]}).json()["registered"] == 1
        before = c.get("/v1/jobs/job1/status").json()
    with TestClient(create_app(Settings(db_path=str(db)))) as c:
        after = c.get("/v1/jobs/job1/status").json()
    for status in (before, after):
        assert status["lost_groups"] == [] and status["to_regenerate"] == []
        assert status["counts"]["groups_by_status"] == {"finished": 1}
        assert [(g["group_id"], g["node_id"]) for g in status["pool"]["head"]] == [("g0", "n1")]
    store = RecordStore(str(db))
    try:
        assert store.load(Kind.GROUP) == []  # the lost incarnation's record left with it
    finally:
        store.close()


def test_a_late_sweep_gives_every_node_a_fresh_grace_period(tmp_path: Path) -> None:
    """A sweep that itself ran late (the control plane was paused) declares no node lost, since its heartbeats
    may be queued behind the pause: every node gets a fresh grace period; the next timely sweep judges again."""
    from knittrans.api.service import ControlPlane
    from knittrans.api.store import RecordStore

    store = RecordStore(str(tmp_path / "cp.db"))
    svc = ControlPlane(store, Settings(db_path=store.path, node_timeout_s=5.0), on_change=lambda job: None)
    svc.register_node("n0", "grpc://127.0.0.1:1", "h0")
    svc.nodes["n0"].last_heartbeat -= 60.0  # silent for a minute, as seen after the pause
    svc.sweep(paused_s=60.0)
    assert not svc.nodes["n0"].lost and svc.list_nodes()[0]["seconds_since_heartbeat"] < 5.0
    svc.nodes["n0"].last_heartbeat -= 60.0
    svc.sweep()
    assert svc.nodes["n0"].lost and "no heartbeat for 5s" in svc.nodes["n0"].lost_reason
    store.close()


def test_a_heartbeat_keeps_a_node_alive_and_a_listing_declares_the_silent_ones_lost(tmp_path: Path) -> None:
    """A heartbeat restarts a node's timeout; listing the nodes first declares the silent ones lost (their last
    heartbeats are set back here instead of waiting out ``node_timeout_s``); an unknown node cannot be lost."""
    from knittrans.api.service import ControlPlane
    from knittrans.errors import NotFound

    store = RecordStore(str(tmp_path / "cp.db"))
    svc = ControlPlane(store, Settings(db_path=store.path), on_change=lambda job: None)
    for i, node_id in enumerate(["n0", "n1"]):
        svc.register_node(node_id, f"grpc://127.0.0.1:{i + 1}", "h0")
        svc.nodes[node_id].last_heartbeat -= 2 * svc.settings.node_timeout_s
    assert svc.heartbeat("n0")["state"] == "alive"
    assert [(n["node_id"], n["state"]) for n in svc.list_nodes()] == [("n0", "alive"), ("n1", "lost")]
    with pytest.raises(NotFound, match="'zz' is not registered"):
        svc.declare_lost("zz")
    store.close()
    store = RecordStore(store.path)
    restarted = ControlPlane(store, Settings(db_path=store.path), on_change=lambda job: None)
    assert {n: node.lost for n, node in restarted.nodes.items()} == {"n0": False, "n1": True}  # the loss persisted
    store.close()


def test_the_units_registered_metric_counts_new_units_only(client: TestClient) -> None:
    """``knittrans_units_registered`` counts the units registered since start; a repeated registration adds none."""
    units = single_group_units(["math", "code"])
    for _ in range(2):
        assert client.post("/v1/jobs/job1/units", json={"units": units}).status_code == 200
        assert "knittrans_units_registered_total 2.0" in client.get("/metrics").text
