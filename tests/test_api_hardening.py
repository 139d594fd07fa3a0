"""D2/D4/D5 regressions against a real control-plane process: strict input, node authority, database faults."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from api_support import ack, app_client, group, job_spec, manifest, server, single_group_units, unit

from knittrans.procs import control_plane_args, knittrans_command

ADMIN, WORKER = "admin-secret-token", "worker-secret-token"


def _post(srv_url: str, path: str, body: object, token: str = WORKER) -> httpx.Response:
    return httpx.post(srv_url + path, json=body, headers={"authorization": f"Bearer {token}"}, timeout=30)


def _raw(srv_url: str, path: str, text: str) -> httpx.Response:
    return httpx.post(
        srv_url + path,
        content=text.encode(),
        timeout=30,
        headers={"authorization": f"Bearer {WORKER}", "content-type": "application/json"},
    )


def _tokens() -> tuple[str, ...]:
    return ("--worker-token", WORKER, "--admin-token", ADMIN)


def test_invalid_values_are_refused_and_the_job_and_metrics_keep_working(tmp_path: Path) -> None:
    """Negative tokens, NaN/Infinity, huge versions, negative bytes, schema 99, unknown sources, 'job\\n' -> 4xx."""
    with server(tmp_path / "cp.db", *_tokens()) as srv:
        assert _post(srv.url, "/v1/jobs", job_spec(), ADMIN).status_code == 201
        node = {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}
        assert _post(srv.url, "/v1/nodes", node).status_code == 200
        good = single_group_units(["math"])[0]
        bad_units = [
            unit("u1", [group("g1", "math", tokens=[-5, 3])]),
            {**unit("u2", [group("g2", "math")]), "num_bytes": -1},
            {**unit("u3", [group("g3", "math")]), "schema_version": 99},
            unit("u4", [{**group("g4", "math"), "version_start": 10**30, "version_end": 10**30}]),
            unit("u5", [group("g5", "poetry")]),
        ]
        for bad in bad_units:
            r = _post(srv.url, "/v1/jobs/job1/units", {"units": [bad]})
            assert 400 <= r.status_code < 500, (bad, r.text)
            assert set(r.json()) == {"error", "detail"}
        text = httpx.Request("POST", "/", json={"units": [good]}).content.decode()
        for literal in ('"version_weighted": NaN', '"finished_at": Infinity'):
            key = literal.split(":")[0]
            mutated = text.replace(f"{key}:0.0", literal.replace(": ", ":"), 1).replace(
                f"{key}:1000.0", literal.replace(": ", ":"), 1
            )
            assert mutated != text
            r = _raw(srv.url, "/v1/jobs/job1/units", mutated)
            assert r.status_code == 422, r.text
        r = _post(srv.url, "/v1/jobs/job1/supply", {"started": {"poetry": 1}})
        assert r.status_code == 409 and "poetry" in r.json()["detail"]
        r = _post(srv.url, "/v1/jobs", job_spec(name="job\n"), ADMIN)
        assert r.status_code == 422
        assert not (tmp_path / "job\n").exists()
        # the job still takes registrations and the whole control plane still reports metrics
        assert _post(srv.url, "/v1/jobs/job1/units", {"units": [good]}).json()["registered"] == 1
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        srv.kill()
        srv.start()
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200


def test_node_endpoint_moves_only_with_admin_token_or_its_own_key(tmp_path: Path) -> None:
    """A worker-token holder cannot repoint a registered node; the node's own key or the admin token can."""
    with server(tmp_path / "cp.db", *_tokens()) as srv:
        key = "k" * 32
        r = _post(srv.url, "/v1/nodes", {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1", "node_key": key})
        assert r.status_code == 200 and "node_key" not in r.text and "key_hash" not in r.text
        hijack = {"node_id": "n0", "endpoint": "grpc://127.0.0.1:6666"}
        assert _post(srv.url, "/v1/nodes", hijack).status_code == 401
        assert _post(srv.url, "/v1/nodes", {**hijack, "node_key": "x" * 32}).status_code == 401
        nodes = httpx.get(srv.url + "/v1/nodes", headers={"authorization": f"Bearer {WORKER}"}).json()
        assert nodes[0]["endpoint"] == "grpc://127.0.0.1:1"
        assert _post(srv.url, "/v1/nodes", {**hijack, "node_key": key}).status_code == 200
        # re-registrations at the same endpoint, keyless or with another key, leave the key bound: the other key
        # cannot move the node then, the bound one can
        moved = {**hijack, "endpoint": "grpc://127.0.0.1:7"}
        assert _post(srv.url, "/v1/nodes", hijack).status_code == 200
        assert _post(srv.url, "/v1/nodes", {**hijack, "node_key": "x" * 32}).status_code == 200
        assert _post(srv.url, "/v1/nodes", {**moved, "node_key": "x" * 32}).status_code == 401
        assert _post(srv.url, "/v1/nodes", {**moved, "node_key": key}).status_code == 200
        # the admin may bind a new key: from then on that key moves the node
        rekeyed = {**hijack, "endpoint": "grpc://127.0.0.1:8", "node_key": "n" * 32}
        assert _post(srv.url, "/v1/nodes", rekeyed, ADMIN).status_code == 200
        assert _post(srv.url, "/v1/nodes", {**rekeyed, "endpoint": "grpc://127.0.0.1:9"}).status_code == 200
        assert _post(srv.url, "/v1/nodes", {**hijack, "endpoint": "grpc://127.0.0.1:7"}, ADMIN).status_code == 200
        # re-registering at the same endpoint (a restarted store) needs no key
        assert _post(srv.url, "/v1/nodes", {**hijack, "endpoint": "grpc://127.0.0.1:7"}).status_code == 200
        # the admin's keyless move left the key bound: a worker's own key cannot claim the node and move it
        claim = {**hijack, "endpoint": "grpc://127.0.0.1:7", "node_key": "x" * 32}
        assert _post(srv.url, "/v1/nodes", claim).status_code == 200
        assert _post(srv.url, "/v1/nodes", {**claim, "endpoint": "grpc://127.0.0.1:6666"}).status_code == 401
        assert _post(srv.url, "/v1/nodes", {**rekeyed, "endpoint": "grpc://127.0.0.1:10"}).status_code == 200


def _start_cp(db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = knittrans_command(*control_plane_args(db, extra=extra))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_empty_or_foreign_database_is_refused_unless_init(tmp_path: Path) -> None:
    """A 0-byte or foreign SQLite file stops the control plane with a clear message; --init takes it."""
    empty = tmp_path / "empty.db"
    empty.touch()
    done = _start_cp(empty)
    assert done.returncode != 0 and "empty (0 bytes)" in done.stderr
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    done = _start_cp(foreign)
    assert done.returncode != 0 and "not a KnitTrans state database" in done.stderr
    with server(empty, "--init") as srv:
        assert httpx.get(srv.url + "/v1/health", timeout=30).status_code == 200


def test_a_damaged_job_record_or_another_state_format_stops_the_control_plane_naming_it(tmp_path: Path) -> None:
    """State this version cannot read is refused at start-up with a message naming what is wrong."""
    import shutil
    from contextlib import closing

    from knittrans.errors import StateError

    damaged, other = tmp_path / "damaged.db", tmp_path / "other.db"
    with app_client(damaged) as client:
        assert client.post("/v1/jobs", json=job_spec()).status_code == 201
    shutil.copy(damaged, other)
    with closing(sqlite3.connect(damaged)) as conn, conn:
        conn.execute("UPDATE records SET body='{}' WHERE kind='job'")
    with pytest.raises(StateError, match=r"the records of job 'job1' are damaged \(KeyError.*restore a backup"):
        app_client(damaged)
    with closing(sqlite3.connect(other)) as conn, conn:
        conn.execute("UPDATE meta SET value='0' WHERE name='format'")
    with pytest.raises(StateError, match="state format '0', this version reads '1'"):
        app_client(other)


@pytest.mark.parametrize("pragma, cause", [("max_page_count", "full"), ("query_only", "readonly")])
def test_database_write_failure_answers_503_with_cause_and_state_stays_consistent(
    tmp_path: Path, pragma: str, cause: str
) -> None:
    """Disk full / read-only SQLite -> 503 + Retry-After naming the cause; nothing half-applied; then recovers."""
    with app_client(tmp_path / "cp.db") as client:
        assert client.post("/v1/jobs", json=job_spec()).status_code == 201
        assert client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
        conn = client.app.state.service.store._conn  # type: ignore[attr-defined]
        if pragma == "max_page_count":
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={pages}")
            units = single_group_units(["math", "code"] * 200)  # needs new pages
        else:
            conn.execute("PRAGMA query_only=1")
            units = single_group_units(["math"])
        r = client.post("/v1/jobs/job1/units", json={"units": units})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1" and cause in r.json()["detail"]
        assert client.get("/v1/jobs/job1/status").json()["counts"]["units"] == 0
        conn.execute("PRAGMA max_page_count=1073741823" if pragma == "max_page_count" else "PRAGMA query_only=0")
        assert client.post("/v1/jobs/job1/units", json={"units": units}).json()["registered"] == len(units)


def test_immutable_state_files_answer_503_naming_them_and_the_control_plane_recovers(tmp_path: Path) -> None:
    """The database and its WAL made immutable (``chattr +i``, root) while a real control plane serves:
    a write is a 503 naming the files it cannot write (it used to die of SIGBUS on the mapped -shm file,
    logging nothing), the process keeps serving, and once the files are writable again writes succeed."""
    assert os.geteuid() == 0, "chattr +i needs root (CI runs as root)"
    db = tmp_path / "cp.db"
    with server(db, *_tokens()) as srv:
        assert _post(srv.url, "/v1/jobs", job_spec(), ADMIN).status_code == 201
        assert _post(srv.url, "/v1/nodes", {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
        files = sorted(str(p) for p in tmp_path.iterdir())
        subprocess.run(["chattr", "+i", *files], check=True)
        try:
            for i in range(3):
                r = _post(srv.url, "/v1/jobs/job1/units", {"units": single_group_units(["math"] * 20, prefix=f"i{i}x")})
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "not writable (read-only or immutable)" in r.json()["detail"] and f"{db}-wal" in r.text
        finally:
            subprocess.run(["chattr", "-i", *files], check=True)
        assert srv.proc is not None and srv.proc.poll() is None
        r = _post(srv.url, "/v1/jobs/job1/units", {"units": single_group_units(["math"] * 20, prefix="ok")})
        assert r.status_code == 200 and r.json()["registered"] == 20, r.text
        auth = {"authorization": f"Bearer {WORKER}"}
        assert httpx.get(srv.url + "/v1/jobs/job1/status", headers=auth).json()["counts"]["units"] == 20
    assert files == [str(db), f"{db}-wal"]  # no -shm file: the WAL index lives in the process's memory


def test_a_state_file_in_use_is_refused_to_a_second_control_plane(tmp_path: Path) -> None:
    """The control plane holds its state file alone (SQLite exclusive locking: no shared -shm mapping): a
    second store on the same file is refused at start-up, naming why; once the first closes it opens."""
    from knittrans.api.store import RecordStore
    from knittrans.errors import StateError

    first = RecordStore(str(tmp_path / "cp.db"))
    with pytest.raises(StateError, match="another process holds it: one control plane per state file"):
        RecordStore(str(tmp_path / "cp.db"))
    assert not (tmp_path / "cp.db-shm").exists()
    first.close()
    RecordStore(str(tmp_path / "cp.db")).close()


@pytest.mark.timing
@pytest.mark.slow  # ~30 s: waits out a slow control-plane restart by design
def test_default_retry_policy_outlasts_a_slow_control_plane_restart(tmp_path: Path) -> None:
    """D6: a ControlClient with the shared default policy (what rollout workers use) survives a 15 s outage."""
    import threading
    import time

    from knittrans.controlclient import ControlClient
    from knittrans.retry import DEFAULT_RETRY

    assert DEFAULT_RETRY.budget_s >= 120
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        client.create_job(job_spec())
        srv.kill()
        got: list[object] = []
        caller = threading.Thread(target=lambda: got.append(client.get_job("job1")["spec"]["name"]))
        t0 = time.monotonic()
        caller.start()
        while time.monotonic() - t0 < 15:  # longer than the old 10-retry schedule (~13 s)
            caller.join(0.5)
            assert caller.is_alive()  # still retrying, not given up
        srv.start()
        caller.join(120)
        assert got == ["job1"]


def test_admin_removes_a_bad_unit_and_its_groups_are_regenerated(tmp_path: Path) -> None:
    """DELETE /v1/jobs/{job}/units/{unit} (admin only) takes unadmitted groups out; admitted units are a 409."""
    with server(tmp_path / "cp.db", *_tokens()) as srv:
        assert (
            _post(
                srv.url, "/v1/jobs", job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2), ADMIN
            ).status_code
            == 201
        )
        _post(srv.url, "/v1/nodes", {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        units = single_group_units(["math", "code", "math"])
        assert _post(srv.url, "/v1/jobs/job1/units", {"units": units}).status_code == 200
        auth = {"authorization": f"Bearer {WORKER}"}
        status = httpx.get(srv.url + "/v1/jobs/job1/status", headers=auth).json()
        admitted = (
            {g for mb in status.get("in_flight", []) for g in mb.get("group_ids", [])}
            if isinstance(status.get("in_flight"), list)
            else set()
        )
        waiting = [u for u in units if u["groups"][0]["group_id"] not in admitted]
        url = srv.url + "/v1/jobs/job1/units/"
        assert httpx.delete(url + waiting[-1]["unit_id"], headers=auth).status_code == 401  # worker token: no
        r = httpx.delete(
            url + waiting[-1]["unit_id"], params={"reason": "bad rewards"}, headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code == 200, r.text
        gone = r.json()["removed_groups"]
        assert gone == [waiting[-1]["groups"][0]["group_id"]]
        assert httpx.delete(url + "u-nope", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
        srv.kill()
        srv.start()
        status = httpx.get(srv.url + "/v1/jobs/job1/status", headers=auth).json()
        assert gone[0] in {g["group_id"] for g in status["lost_groups"]}


def test_removing_an_admitted_unit_is_a_conflict(tmp_path: Path) -> None:
    """A unit whose group is already in a mini-batch cannot be removed (409 naming the mini-batch)."""
    with app_client(tmp_path / "cp.db") as client:
        client.post("/v1/jobs", json=job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=1))
        client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        r = client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])})
        assert r.json()["admitted"] == [0]
        r = client.delete("/v1/jobs/job1/units/u-g0")
        assert r.status_code == 409 and "mini-batch 0" in r.json()["detail"]


def test_removing_a_unit_whose_group_is_already_lost_removes_nothing(tmp_path: Path) -> None:
    """A unit whose group was lost with its node can still be removed: no group of it waits, so none is
    removed, and the lost group stays offered for regeneration with its own reason (not a 500)."""
    with app_client(tmp_path / "cp.db") as client:
        client.post("/v1/jobs", json=job_spec(quotas={"math": 2}, mini_batches_per_step=1, world_size=1))
        client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        assert client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math"])}).json()["admitted"] == []
        client.post("/v1/nodes/n0/lost")
        r = client.delete("/v1/jobs/job1/units/u-g0")
        assert r.status_code == 200 and r.json()["removed_groups"] == [], r.text
        status = client.get("/v1/jobs/job1/status").json()
        assert [(g["group_id"], g["reason"]) for g in status["to_regenerate"]] == [("g0", "node n0 lost")]


def test_removing_a_unit_regenerates_its_waiting_groups_and_refuses_a_partly_consumed_one(tmp_path: Path) -> None:
    """A unit whose groups wait in the pool is removed: they become lost and wait for regeneration (also after
    a restart); a unit one of whose groups was consumed already is a 409 naming that group."""
    spec = job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=1, total_steps=1)
    pair = unit("u-pair", [group("g0", "math", finished_at=1000.0), group("g1", "math", finished_at=1002.0)])
    (single,) = single_group_units(["math"], start=2)  # u-g2, finished between the pair's two groups
    single["groups"][0]["finished_at"] = 1001.0
    with app_client(tmp_path / "cp.db") as client:
        client.post("/v1/jobs", json=spec)
        client.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        assert client.post("/v1/jobs/job1/units", json={"units": [pair, single]}).json()["admitted"] == [0]
        first = manifest(client, "job1", 0)
        assert first is not None and [g.group_id for g in first.groups] == ["g0"]
        assert ack(client, "job1", first)["consumed"]
        r = client.delete("/v1/jobs/job1/units/u-pair")
        assert r.status_code == 409 and "'g0' was consumed" in r.json()["detail"], r.text
        r = client.delete("/v1/jobs/job1/units/u-g2", params={"reason": "bad rewards"})
        assert r.status_code == 200 and r.json()["removed_groups"] == ["g2"], r.text
    with app_client(tmp_path / "cp.db") as client:
        status = client.get("/v1/jobs/job1/status").json()
        assert [g["group_id"] for g in status["lost_groups"]] == ["g2"]
        assert [(g["group_id"], g["reason"]) for g in status["to_regenerate"]] == [
            ("g2", "unit u-g2 removed by an admin: bad rewards")
        ]


def test_descriptor_schema_version_is_the_arrow_schema_version() -> None:
    """The control plane's accepted schema version is the one the Arrow schema carries."""
    from knittrans import descriptors, schema

    assert descriptors.SCHEMA_VERSION == schema.SCHEMA_VERSION


def test_scoped_tokens_limit_a_credential_to_its_job_and_rank(tmp_path: Path) -> None:
    """D2: a rank token acks and reports only for its own rank of its own job; a job's worker token
    registers units only for that job; a store token only touches nodes; forged tokens are refused."""
    from knittrans.controlclient import ControlClient
    from knittrans.errors import Unauthenticated

    with server(tmp_path / "cp.db", *_tokens()) as srv, ControlClient(srv.url, token=ADMIN) as admin:
        admin.create_job(job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=2))
        admin.create_job(job_spec(name="job2", quotas={"math": 1}, mini_batches_per_step=1, world_size=2))
        store = admin.mint_token("store")
        worker = admin.mint_token("worker", job="job1")
        rank0 = admin.mint_token("rank", job="job1", rank=0)
        with ControlClient(srv.url, token=store, retries=0) as c:
            c.register_node("n0", "grpc://127.0.0.1:1")
            with pytest.raises(Unauthenticated):
                c.status("job1")
        with ControlClient(srv.url, token=worker, retries=0) as c:
            assert c.register_units("job1", single_group_units(["math"]))["admitted"] == [0]
            with pytest.raises(Unauthenticated, match="scoped to worker of job 'job1'"):
                c.register_units("job2", single_group_units(["math"], job="job2"))
            with pytest.raises(Unauthenticated):
                c.manifest("job1", 0, timeout_s=0)
        with ControlClient(srv.url, token=rank0, retries=0) as c:
            assert [n["node_id"] for n in c.list_nodes()] == ["n0"]  # to warm its Flight connections
            with pytest.raises(Unauthenticated):
                c.register_node("n9", "grpc://127.0.0.1:9")
            got = c.manifest("job1", 0, timeout_s=5)
            assert got is not None and got[0].share(0).rank == 0
            with pytest.raises(Unauthenticated):
                c.ack("job1", 0, got[0].attempt, [1])
            with pytest.raises(Unauthenticated):
                c.ack("job1", 0, got[0].attempt)  # every rank: more than its own
            assert c.fetched("job1", 0, got[0].attempt, [0])["fetched_ranks"] == 1
            with pytest.raises(Unauthenticated, match=r"that rank only, not ranks \[1\]"):
                c.report_version("job1", 3, rank=1)
            assert c.report_version("job1", 3, rank=0)["version"] == 3
            with pytest.raises(Unauthenticated):
                c.manifest("job2", 0, timeout_s=0)
        forged = worker[:-4] + ("0000" if not worker.endswith("0000") else "1111")
        with ControlClient(srv.url, token=forged, retries=0) as c, pytest.raises(Unauthenticated):
            c.status("job1")


def test_token_command_mints_offline_what_the_control_plane_mints(tmp_path: Path) -> None:
    """`knittrans token` (admin token from the environment) gives the same token as POST /v1/tokens; a rank
    token without --rank is the job's trainer (rank 0 of a collective group acks for every rank with it);
    without the admin token, or --rank on another role, it exits 2 naming what is wrong."""
    import os

    from knittrans.controlclient import ControlClient

    def cli(*args: str, admin: str | None = ADMIN) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "KNITTRANS_ADMIN_TOKEN"}
        if admin is not None:
            env["KNITTRANS_ADMIN_TOKEN"] = admin
        return subprocess.run(
            [sys.executable, "-m", "knittrans.cli", "token", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    offline = cli("--role", "rank", "--job", "job1", "--rank", "1")
    assert offline.returncode == 0, offline.stderr
    with server(tmp_path / "cp.db", *_tokens()) as srv, ControlClient(srv.url, token=ADMIN) as admin:
        admin.create_job(job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=2))
        assert offline.stdout.strip() == admin.mint_token("rank", job="job1", rank=1)
        with ControlClient(srv.url, token=offline.stdout.strip(), retries=0) as c:
            assert c.report_version("job1", 2, rank=1)["version"] == 2
    missing = cli("--role", "store", admin=None)
    assert missing.returncode == 2 and "KNITTRANS_ADMIN_TOKEN" in missing.stderr
    trainer = cli("--role", "rank", "--job", "job1")
    assert trainer.returncode == 0, trainer.stderr
    with server(tmp_path / "cp2.db", *_tokens()) as srv, ControlClient(srv.url, token=ADMIN) as admin:
        admin.create_job(job_spec(quotas={"math": 1}, mini_batches_per_step=1, world_size=2))
        assert trainer.stdout.strip() == admin.mint_token("rank", job="job1")
        admin.register_node("n0", "grpc://127.0.0.1:1")
        admin.register_units("job1", single_group_units(["math"]))
        with ControlClient(srv.url, token=trainer.stdout.strip(), retries=0) as c:
            got = c.manifest("job1", 0, timeout_s=5)
            assert got is not None
            assert c.fetched("job1", 0, got[0].attempt)["fetched_ranks"] == 2  # every rank, as the leader reports
    wrong = cli("--role", "worker", "--job", "job1", "--rank", "0")
    assert wrong.returncode == 2 and "--rank" in wrong.stderr


def test_a_token_scope_that_cannot_be_is_refused_naming_why(tmp_path: Path) -> None:
    """``POST /v1/tokens``: a worker or rank token without a job, a rank on another role or a negative rank is
    refused (409, like other rules across fields), naming what is wrong; a store token needs neither."""
    from knittrans.api.auth import Scope
    from knittrans.errors import InvalidRequest

    admin = {"authorization": f"Bearer {ADMIN}"}
    with app_client(tmp_path / "cp.db", worker_token=WORKER, admin_token=ADMIN) as client:
        refused = {
            "a worker token needs a job": {"role": "worker"},
            "a rank token needs a job": {"role": "rank", "rank": 0},
            "a rank (>= 0) is given only for rank tokens": {"role": "worker", "job": "job1", "rank": 0},
        }
        for why, body in [*refused.items(), ("a rank (>= 0)", {"role": "store", "rank": 1})]:
            r = client.post("/v1/tokens", json=body, headers=admin)
            assert r.status_code == 409 and r.json()["error"] == "invalid_request", (body, r.text)
            assert why in r.json()["detail"], (body, r.text)
        r = client.post("/v1/tokens", json={"role": "store"}, headers=admin)
        assert r.status_code == 200 and r.json()["job"] is None, r.text
    with pytest.raises(InvalidRequest, match=r"a rank \(>= 0\)"):  # what `knittrans token --rank -1` gives
        Scope(role="rank", job="job1", rank=-1)
