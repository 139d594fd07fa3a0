"""Manifest delivery: manifests published to the event loop (the board), per-request progress errors, the
long-poll's documented parameters, and the control client against a real server.

Real app (TestClient, real SQLite, the real state thread). No timings: what is checked is what each
request answers, and that the manifests the loop serves follow every change of the state (admission,
withdrawal, a node's new endpoint, restart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import app_client, job_spec, server, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.board import ManifestBoard
from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import Conflict, DataLost, NotFound
from knittrans.manifest import Manifest

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


def _get(c: TestClient, n: int, **params: Any) -> Any:
    return c.get(f"/v1/jobs/{JOB}/minibatches/{n}", params={"timeout_s": 0, **params})


def _manifest(c: TestClient, n: int) -> Manifest:
    r = _get(c, n)
    assert r.status_code == 200, r.text
    return Manifest.decode(r.content)


def test_progress_errors_over_http_are_per_request(tmp_path: Path) -> None:
    """POST .../ack answers each request with its own status (200, 404, 409, 410, duplicate), and a refused
    request applies nothing of what it names."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code", "math", "code"], node="n1")
        url = f"/v1/jobs/{JOB}/minibatches/{{}}/ack"
        r = c.post(url.format(1), json={"attempt": 0, "ranks": [1]})
        assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
        r = c.post(url.format(0), json={"attempt": 1})
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        assert c.post(url.format(0), json={"attempt": 0, "ranks": [0]}).json()["consumed"] is False
        again = c.post(url.format(0), json={"attempt": 0, "ranks": [0]}).json()
        assert (again["consumed"], again["duplicate"]) == (False, True)  # rank 0's ack repeated
        # rank 0 acked mini-batch 0, rank 1 did not: a request for both on 1 is refused whole (rank 1 owes 0)
        r = c.post(url.format(1), json={"attempt": 0})
        assert r.status_code == 409 and "rank 1 must ack mini-batch 0 before 1" in r.json()["detail"], r.text
        assert c.get(f"/v1/jobs/{JOB}/minibatches").json()["in_flight"][1]["acked_ranks"] == []
        # rank 1 holds nothing of mini-batch 1 (none fetched or acked it): the node loss withdraws it
        assert c.post("/v1/nodes/n1/lost").json()["withdrawn"] == {JOB: [1]}
        r = c.post(url.format(1), json={"attempt": 0, "ranks": [0]})
        assert r.status_code == 410 and r.json()["error"] == "data_lost", r.text
        assert c.post(url.format(0), json={"attempt": 0, "ranks": [1]}).json()["consumed"] is True
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"], prefix="h")})
        again = _manifest(c, 1)
        assert (again.global_index, again.attempt) == (1, 1)  # re-planned on n0
        r = c.post(url.format(1), json={"attempt": 1})
        assert r.status_code == 200 and r.json() == {
            "global_index": 1,
            "attempt": 1,
            "consumed": True,
            "duplicate": False,
            "world_size": 2,
        }
        r = c.post(url.format(1), json={"attempt": 1})
        assert r.status_code == 200 and r.json()["duplicate"] is True and r.json()["consumed"] is True


def test_ranks_outside_the_world_and_a_lower_version_are_refused(tmp_path: Path) -> None:
    """fetched, ack and versions for a rank >= world_size are 404 naming it, and change nothing (an
    ack from rank 5 of 2 does not count toward consuming the mini-batch); an ack carrying a version below the
    rank's last report is 409 and the version stays."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code", "math", "code"])
        url = f"/v1/jobs/{JOB}/minibatches/0/{{}}"
        for r in (
            c.post(url.format("fetched"), json={"attempt": 0, "ranks": [5]}),
            c.post(url.format("ack"), json={"attempt": 0, "ranks": [0, 5]}),
            c.post(f"/v1/jobs/{JOB}/versions", json={"rank": 2, "version": 1}),
        ):
            assert r.status_code == 404 and "outside the job's world_size 2" in r.json()["detail"], r.text
        assert c.post(url.format("ack"), json={"attempt": 0, "ranks": [0], "version": 5}).json()["consumed"] is False
        r = c.post(url.format("ack"), json={"attempt": 0, "ranks": [1], "version": 7})
        assert r.json()["consumed"] is True, r.text
        r = c.post(f"/v1/jobs/{JOB}/minibatches/1/ack", json={"attempt": 0, "ranks": [0], "version": 3})
        assert r.status_code == 409 and "already reported version 5" in r.json()["detail"], r.text
        assert c.get(f"/v1/jobs/{JOB}/version").json()["by_rank"] == {"0": 5, "1": 7}


@pytest.mark.parametrize("each", [True, False], ids=["each-rank", "one-request"])
def test_fetched_and_ack_are_idempotent_from_every_rank_or_one_request(tmp_path: Path, each: bool) -> None:
    """Every rank reporting ``ranks: [r]`` for itself, or one request for all (``ranks: null``), each repeated:
    the same progress, the same records after a restart, one consumption and the next mini-batch's turn."""
    db = tmp_path / "cp.db"
    with app_client(db) as c:
        _setup(c, world=4, sources=["math", "code"] * 4)
        calls = [[r] for r in range(4)] if each else [None]
        for what in ("fetched", "ack"):
            answers = []
            for _ in range(2):
                for ranks in calls:
                    r = c.post(f"/v1/jobs/{JOB}/minibatches/0/{what}", json={"attempt": 0, "ranks": ranks})
                    assert r.status_code == 200, r.text
                    answers.append(r.json())
            if what == "fetched":
                assert answers[len(calls) - 1]["fetched_ranks"] == 4 and answers[len(calls) - 1]["held"]
                assert answers[-1] == answers[len(calls) - 1]  # a repeat: the same answer
                progress = c.get(f"/v1/jobs/{JOB}/minibatches").json()
                assert progress["in_flight"][0]["fetched_ranks"] == [[0, 4]]
            else:
                assert [a["consumed"] for a in answers] == [i >= len(calls) - 1 for i in range(len(answers))]
                assert [a["duplicate"] for a in answers] == [i >= len(calls) for i in range(len(answers))]
        progress = c.get(f"/v1/jobs/{JOB}/minibatches").json()
        assert progress["position"] == 1 and [f["global_index"] for f in progress["in_flight"]] == [1]
    with app_client(db) as c:
        assert c.get(f"/v1/jobs/{JOB}/minibatches").json() == progress
        assert c.app.state.service.jobs[JOB].position == 1  # type: ignore[attr-defined]


def test_published_manifests_follow_the_state(tmp_path: Path) -> None:
    """What the loop serves changes with the state: a node's new endpoint is in the next answer (same
    attempt, new ETag), a withdrawn manifest is replaced by its next attempt, and a restarted app (nothing
    published yet) answers byte for byte what the running one did."""
    db = tmp_path / "cp.db"
    with app_client(db, admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        _setup(c, world=2, sources=["math", "code", "math", "code"], node="n1")
        board: ManifestBoard = c.app.state.board  # type: ignore[attr-defined]
        first = _get(c, 0)
        view = board.view(JOB)
        assert view is not None and view.manifests[0] == (first.headers["etag"], first.content)
        assert _get(c, 0).content == first.content  # served again from the board, the same bytes
        r = c.post("/v1/nodes", json={"node_id": "n1", "endpoint": "grpc://127.0.0.1:9999"})
        assert r.status_code == 200, r.text
        moved = _get(c, 0)
        assert moved.headers["etag"] != first.headers["etag"] and moved.headers["etag"].startswith('"n0.a0.')
        assert [n.endpoint for n in Manifest.decode(moved.content).nodes] == ["grpc://127.0.0.1:9999"]
        before_restart = _get(c, 1)
    with app_client(db, admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        board = c.app.state.board  # type: ignore[attr-defined]
        assert board.view(JOB) is None  # a fresh board: the first look goes to the state thread
        again = _get(c, 1)
        assert again.content == before_restart.content and again.headers["etag"] == before_restart.headers["etag"]
        assert c.post("/v1/nodes/n1/lost").status_code == 200
        assert _get(c, 0).status_code == 204  # withdrawn; nothing to plan until the groups are regenerated
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math", "code"] * 2, prefix="h")})
        m = _manifest(c, 0)
        assert (m.global_index, m.attempt) == (0, 1)


def test_progress_says_where_admission_ends(tmp_path: Path) -> None:
    """``final`` in progress: total_steps * K for a job with an end, None for one without, and the next index
    once a drained job admits nothing more (the long-poll then answers done)."""
    with app_client(tmp_path / "cp.db") as c:
        c.post("/v1/jobs", json=job_spec(total_steps=2))
        c.post("/v1/jobs", json=job_spec(name="job2"))
        assert c.get(f"/v1/jobs/{JOB}/minibatches").json()["final"] == 2 * 3
        assert c.get("/v1/jobs/job2/minibatches").json()["final"] is None
        assert c.post("/v1/jobs/job2/drain").json()["state"] == "drained"  # at a step boundary, nothing in flight
        progress = c.get("/v1/jobs/job2/minibatches").json()
        assert (progress["final"], progress["next_global_index"]) == (0, 0)
        r = c.get("/v1/jobs/job2/minibatches/0", params={"timeout_s": 0})
        assert r.status_code == 204 and r.headers["x-knittrans-done"] == "1"


def test_admission_publishes_the_manifest_before_the_registration_answers(tmp_path: Path) -> None:
    """An admission renders the manifest once and publishes it before anyone asks (the registration's answer
    comes after the board has it); every long-poll is those bytes."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=5, sources=["math", "code"] * 5)  # two rows per rank per mini-batch
        board: ManifestBoard = c.app.state.board  # type: ignore[attr-defined]
        view = board.view(JOB)
        assert view is not None and sorted(view.manifests) == [0, 1]
        for n, (etag, raw) in view.manifests.items():
            r = _get(c, n)
            assert r.content == raw and r.headers["etag"] == etag
            assert Manifest.decode(raw).world_size == 5


def test_manifest_long_poll_is_in_the_openapi_schema(tmp_path: Path) -> None:
    """``timeout_s`` and ``If-None-Match`` are documented parameters of the long-poll, with the answers it may
    give (200 with the manifest's schema, 204, 304, 409)."""
    with app_client(tmp_path / "cp.db") as c:
        op = c.get("/openapi.json").json()["paths"]["/v1/jobs/{job}/minibatches/{n}"]["get"]
    params = {p["name"]: p for p in op["parameters"]}
    assert {"job", "n", "timeout_s", "if-none-match"} <= set(params)
    assert params["if-none-match"]["in"] == "header"
    assert {"200", "204", "304", "404", "409"} <= set(op["responses"])
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ManifestOut")


@pytest.mark.parametrize(
    ("n", "params", "headers"),
    [
        ("-1", {}, {}),
        (str(1 << 53), {}, {}),
        ("x", {}, {}),
        ("0", {"timeout_s": "-1"}, {}),
        ("0", {"timeout_s": "x"}, {}),
        ("0", {}, {"If-None-Match": "x" * 257}),
    ],
)
def test_manifest_long_poll_bad_values_are_refused(
    tmp_path: Path, n: str, params: dict[str, str], headers: dict[str, str]
) -> None:
    """A negative, too large or non-numeric index, a bad timeout and an oversized If-None-Match are 422s."""
    with app_client(tmp_path / "cp.db") as c:
        _setup(c, world=2, sources=["math", "code", "math", "code"])
        r = c.get(f"/v1/jobs/{JOB}/minibatches/{n}", params={"timeout_s": 0, **params}, headers=headers)
        assert r.status_code == 422 and r.json()["error"], r.text


def test_control_client_against_a_real_server(tmp_path: Path) -> None:
    """The control client's ``manifest``/``fetched``/``ack``/``progress`` on a real server process (uvicorn,
    loopback): the manifest and its ETag, None for a wait that got nothing, a refused ack raises the
    client's error, a withdrawn attempt raises DataLost, and the job runs out (JobFinished)."""
    with server(tmp_path / "cp.db") as proc, ControlClient(proc.url, retries=0) as client:
        with httpx.Client(base_url=proc.url) as c:
            c.post("/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1, total_steps=1))
            for node in ("n0", "n1"):
                c.post("/v1/nodes", json={"node_id": node, "endpoint": "grpc://127.0.0.1:1"})
            c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math"])})
            c.post(f"/v1/jobs/{JOB}/units", json={"units": single_group_units(["math"], node="n1", start=1)})
        got = client.manifest(JOB, 0, 5)
        assert got is not None
        m0, tag = got
        assert m0.global_index == 0 and tag.startswith('"n0.a0.')
        assert client.manifest(JOB, 0, 0.2, etag=tag) is None  # unchanged within the wait
        m1 = client.manifest(JOB, 1, 5)
        assert m1 is not None
        with pytest.raises(Conflict, match="mini-batch 0 before 1"):
            client.ack(JOB, 1, m1[0].attempt)
        with pytest.raises(NotFound, match="never issued"):
            client.fetched(JOB, 0, 3)
        assert client.fetched(JOB, 0, m0.attempt, [0])["held"]
        assert client.ack(JOB, 0, m0.attempt, version=1)["consumed"]
        assert client.get_version(JOB) == 1
        with pytest.raises(Conflict, match="consumed"):
            client.manifest(JOB, 0, 0)
        assert client.progress(JOB)["position"] == 1
        client.declare_lost("n1")  # mini-batch 1 reads g1 on n1: withdrawn
        with pytest.raises(DataLost):
            client.ack(JOB, 1, m1[0].attempt)
        client.register_units(JOB, single_group_units(["math"], prefix="r"))
        again = client.manifest(JOB, 1, 5, etag=m1[1])
        assert again is not None and again[0].attempt == 1
        assert client.ack(JOB, 1, again[0].attempt)["consumed"]
        with pytest.raises(JobFinished):
            client.manifest(JOB, 2, 5)
        assert client.get_job(JOB)["state"] == "completed"


def test_a_rank_token_reports_for_its_own_rank_only(tmp_path: Path) -> None:
    """A token scoped to rank 1 reads the manifest and the progress, and reports fetched and ack only as
    ``ranks: [1]`` (not for another rank, not for every rank, not for several); its figures are its own."""
    with app_client(tmp_path / "cp.db", admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        _setup(c, world=2, sources=["math", "code", "math", "code"])
        token = c.post("/v1/tokens", json={"role": "rank", "job": JOB, "rank": 1}).json()["token"]
        c.headers["Authorization"] = f"Bearer {token}"
        assert _manifest(c, 0).world_size == 2
        assert c.get(f"/v1/jobs/{JOB}/minibatches").status_code == 200
        url = f"/v1/jobs/{JOB}/minibatches/0/{{}}"
        for what in ("fetched", "ack"):
            for ranks in ([0], None, [0, 1], [1, 1]):
                r = c.post(url.format(what), json={"attempt": 0, "ranks": ranks})
                assert r.status_code == 401 and "scoped to rank 1" in r.json()["detail"], (what, ranks, r.text)
        assert c.post(url.format("fetched"), json={"attempt": 0, "ranks": [1]}).json()["fetched_ranks"] == 1
        r = c.post(url.format("ack"), json={"attempt": 0, "ranks": [1], "transfer": _transfer(1)})
        assert r.status_code == 200 and r.json()["consumed"] is False, r.text
        c.headers["Authorization"] = "Bearer adm"
        progress = c.get(f"/v1/jobs/{JOB}/minibatches").json()["in_flight"][0]
        assert progress["acked_ranks"] == [[1, 2]] and progress["fetched_ranks"] == []
        ranks = {r["rank"]: r for r in c.get("/v1/overview").json()["jobs"][0]["ranks"]}
        assert ranks[1]["row_bytes"] == 5 and ranks.get(0, {}).get("row_bytes", 0) == 0


def _transfer(width: int, row_bytes: int = 5) -> dict[str, list[float]]:
    """Transfer columns for ``width`` ranks (one entry per rank the ack reports for)."""
    columns = ("exposed_s", "fetch_s", "media_logical_bytes", "media_physical_bytes")
    return {"row_bytes": [row_bytes] * width, **{name: [0] * width for name in columns}}


@pytest.mark.parametrize(
    ("token_rank", "ranks", "width", "detail"),
    [
        (1, [1], 2, "one entry per acked rank (1)"),
        (None, [0], 2, "one entry per acked rank (1)"),
        (None, None, 3, "ranks [[0, 3]] but this ack reports for ranks [[0, 2]]"),
        (None, None, 1, "ranks [[0, 1]] but this ack reports for ranks [[0, 2]]"),
    ],
    ids=["rank-token-for-another", "figures-beyond-ranks", "figures-beyond-world", "figures-short-of-world"],
)
def test_transfer_figures_only_for_the_ranks_the_ack_reports(
    tmp_path: Path, token_rank: int | None, ranks: list[int] | None, width: int, detail: str
) -> None:
    """An ack carries transfer figures of exactly the ranks it reports for (one column entry per reported rank,
    every rank when ``ranks`` is null): other entries (a rank token adding another rank's, an ack adding
    figures beyond ``ranks`` or the world size, or fewer than the world size for every rank) refuse the whole
    ack, naming what was wrong, and neither the ack nor any figure is recorded."""
    with app_client(tmp_path / "cp.db", admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        _setup(c, world=2, sources=["math", "code", "math", "code"])
        if token_rank is not None:
            token = c.post("/v1/tokens", json={"role": "rank", "job": JOB, "rank": token_rank}).json()["token"]
            c.headers["Authorization"] = f"Bearer {token}"
        body = {"attempt": 0, "ranks": ranks, "transfer": _transfer(width)}
        r = c.post(f"/v1/jobs/{JOB}/minibatches/0/ack", json=body)
        assert r.status_code == 409 and r.json()["error"] == "invalid_request", r.text
        assert detail in r.json()["detail"], r.text
        c.headers["Authorization"] = "Bearer adm"
        assert c.get(f"/v1/jobs/{JOB}/minibatches").json()["in_flight"][0]["acked_ranks"] == []
        assert all(rank["mini_batches"] == 0 for rank in c.get("/v1/overview").json()["jobs"][0]["ranks"])
        assert "knittrans_rank_logical_bytes_total{" not in c.get("/metrics").text
