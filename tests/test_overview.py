"""Admin overview (``/v1/overview``), store usage on heartbeats, rank transfer on acks, ``knittrans status``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from api_support import ENDPOINT, USAGE, job_spec, populate, server, single_group_units
from fastapi.testclient import TestClient

from knittrans.api.app import create_app
from knittrans.api.observe import Observations
from knittrans.api.settings import Settings
from knittrans.controlclient import ControlClient
from knittrans.statusview import render

ADMIN, WORKER = "admin-secret", "worker-secret"


def _client(tmp_path: Path) -> TestClient:
    app = create_app(Settings(db_path=str(tmp_path / "cp.db"), admin_token=ADMIN, worker_token=WORKER))
    return TestClient(app, headers={"Authorization": f"Bearer {ADMIN}"})


def test_overview_needs_admin_token(tmp_path: Path) -> None:
    """/v1/overview answers 401 without a token and with the worker token; /ui serves the page with a CSP."""
    with _client(tmp_path) as c:
        assert c.get("/v1/overview", headers={"Authorization": ""}).status_code == 401
        assert c.get("/v1/overview", headers={"Authorization": f"Bearer {WORKER}"}).status_code == 401
        assert c.get("/v1/overview").status_code == 200
        page = c.get("/ui", headers={"Authorization": ""})
        assert page.status_code == 200 and "<title>KnitTrans control plane</title>" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert ADMIN not in page.text


@pytest.mark.parametrize("gathered", [False, True], ids=["each-rank", "gathered"])
def test_overview_reports_jobs_nodes_ranks(tmp_path: Path, gathered: bool) -> None:
    """Quota fill, staleness per step, consumed mini-batches, node usage and per-rank transfer sums, the same
    whether each rank acked with its own figures or one ack per mini-batch carried every rank's."""
    with _client(tmp_path) as c:
        populate(c, gathered=gathered)
        units = single_group_units(["math"], start=4)  # waits in the pool: step 1's mini-batch needs two groups
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == []
        view = c.get("/v1/overview").json()
    (job,) = view["jobs"]
    assert job["pool_by_node"] == {"n0": {"math": 1}}
    assert job["job"] == "job1" and job["state"] == "running" and job["step"] == 1
    assert job["consumed_mini_batches"] == 2 and job["consumed_groups"] == 4
    assert set(job["quota_fill"]) == {"math", "code"}
    assert [p["step"] for p in job["staleness"]["end"]["all"]] == [0]
    assert set(job["staleness"]["start"]) == {"all", "math", "code"}
    assert [a["global_index"] for a in job["admissions"]] == [0, 1]
    for rank in job["ranks"]:
        assert rank["mini_batches"] == 2
        assert rank["exposed_s"] == 0.5 and rank["row_bytes"] == 2000 and rank["media_physical_bytes"] == 400
        assert rank["last_ack"]["global_index"] == 1 and rank["last_ack"]["manifest_id"] == "n1.a0"
    nodes = {n["node_id"]: n for n in view["nodes"]}
    assert nodes["n0"]["usage"]["budget_used"] == 5000 and nodes["n0"]["usage"]["budget_bytes"] == 1 << 20
    assert nodes["n1"]["usage"] is None and nodes["n1"]["state"] == "alive"


@pytest.mark.parametrize("gathered", [False, True], ids=["each-rank", "gathered"])
def test_metrics_carry_usage_and_transfer(tmp_path: Path, gathered: bool) -> None:
    """/metrics exports the store usage and the rank transfer counters the overview shows."""
    with _client(tmp_path) as c:
        populate(c, gathered=gathered)
        weights = {"version": 3, "told": 4, "loads": 2, "late": 1, "wait_s": 0.5}
        assert c.post("/v1/jobs/job1/rollout/w0/weights", json=weights).status_code == 200
        text = c.get("/metrics").text
    worker = 'job_name="job1",worker="w0"'
    assert f"knittrans_rollout_weights_version{{{worker}}} 3.0" in text
    assert f"knittrans_rollout_weight_loads_total{{{worker}}} 2.0" in text
    assert f"knittrans_rollout_weights_late_total{{{worker}}} 1.0" in text
    assert f"knittrans_rollout_weights_wait_seconds_total{{{worker}}} 0.5" in text
    assert 'knittrans_store_budget_used_bytes{node="n0"} 5000.0' in text
    assert 'knittrans_store_budget_bytes{node="n0"} 1.048576e+06' in text
    assert 'knittrans_rank_exposed_transfer_seconds_total{job_name="job1",rank="1"} 0.5' in text
    assert 'knittrans_rank_logical_bytes_total{job_name="job1",rank="0"} 3600.0' in text
    assert 'knittrans_rank_physical_bytes_total{job_name="job1",rank="0"} 2400.0' in text
    assert 'knittrans_job_state{job_name="job1",state="running"} 1.0' in text
    assert 'knittrans_node_up{node="n1"} 1.0' in text


def test_rank_transfer_sums_columns_by_rank_and_counts_a_repeat_once() -> None:
    """Columns add into the ranks they name (any subset, any order, ranks beyond those seen so far); a repeated
    ack moves each rank's last ack but adds nothing; a snapshot keeps its figures while the live table moves."""
    observed = Observations()
    cols = {"exposed_s": [0.5, 0.25], "fetch_s": [1.0, 2.0], "row_bytes": [10, 20]}
    cols |= {"media_logical_bytes": [3, 4], "media_physical_bytes": [1, 2]}
    ack = {"global_index": 0, "attempt": 0, "consumed": False, "duplicate": False}
    observed.record_ack("j", ack, [3, 1], cols, 100.0)
    frozen = observed.snapshot()
    observed.record_ack("j", ack | {"duplicate": True}, [3, 1], cols, 101.0)
    observed.record_ack("j", ack | {"global_index": 1, "attempt": 2, "consumed": True}, [1, 3], cols, 102.0)
    ranks = observed.job_ranks("j")
    assert sorted(ranks) == [1, 3] and observed.job_ranks("other") == {}
    assert ranks[3]["mini_batches"] == 2 and ranks[3]["exposed_s"] == 0.75 and ranks[3]["row_bytes"] == 30
    assert ranks[1]["fetch_s"] == 3.0 and ranks[1]["media_physical_bytes"] == 3 and type(ranks[1]["row_bytes"]) is int
    last = {"manifest_id": "n1.a2", "global_index": 1, "consumed": True, "at": 102.0}
    assert ranks[1]["last_ack"] == ranks[3]["last_ack"] == last
    before = frozen.job_ranks("j")
    assert before[3]["mini_batches"] == 1 and before[3]["row_bytes"] == 10 and before[3]["last_ack"]["at"] == 100.0


def test_heartbeat_usage_is_validated(tmp_path: Path) -> None:
    """Negative usage figures are a 422 naming the field; the node stays alive."""
    with _client(tmp_path) as c:
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": ENDPOINT.format(port=1)})
        bad = c.post("/v1/nodes/n0/heartbeat", json={**USAGE, "budget_used": -1})
        assert bad.status_code == 422 and "budget_used" in bad.text
        bad = c.post("/v1/jobs/x/minibatches/0/ack", json={"attempt": 0, "transfer": {"row_bytes": [-5]}})
        assert bad.status_code == 422 and "row_bytes" in bad.text
        bad = c.post("/v1/jobs/x/minibatches/0/ack", json={"attempt": 0, "transfer": {"r0": {"row_bytes": 5}}})
        assert bad.status_code == 422 and "transfer" in bad.text
        assert c.get("/v1/nodes").json()[0]["state"] == "alive"


def test_render_shows_the_facts(tmp_path: Path) -> None:
    """The terminal view names the job state, quota fill, ranks and nodes; --job filters."""
    with _client(tmp_path) as c:
        populate(c)
        view = c.get("/v1/overview").json()
    text = render(view)
    assert "job job1: RUNNING" in text and "math" in text and "code" in text
    assert "lost groups: 0" in text and "n0" in text and "ALIVE" in text and "4.9 KiB/1.0 MiB" in text
    assert "n1.a0" in text  # the ranks' last acked mini-batch
    assert "no job 'other'" in render(view, "other")


def test_client_ack_sends_seconds_to_the_microsecond(tmp_path: Path) -> None:
    """``ControlClient.ack`` rounds the gathered seconds to microseconds (a rank's ``perf_counter`` differences
    would be 17-digit floats, 2,048 of them per ack at 1,024 ranks, for the server to parse); byte counts go as
    they are. Through a real server: the overview shows the rounded sums."""
    with (
        server(tmp_path / "cp.db", "--admin-token", ADMIN, "--worker-token", WORKER) as cp,
        ControlClient(cp.url, token=ADMIN) as admin,
        ControlClient(cp.url, token=WORKER) as worker,
    ):
        admin.create_job(job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2))
        worker.register_node("n0", ENDPOINT.format(port=1))
        worker.register_units("job1", single_group_units(["math", "code", "math", "code"]))
        plan = worker.manifest("job1", 0, timeout_s=10)
        assert plan is not None
        ranks = [
            {"exposed_s": 0.123456789012, "fetch_s": 4e-7, "row_bytes": 123456789},
            {"exposed_s": 1.0000004999, "fetch_s": 2.5, "row_bytes": 1},
        ]
        worker.ack("job1", 0, plan[0].attempt, version=1, transfer=ranks)
        view = admin.overview()
    figures = [(r["exposed_s"], r["fetch_s"], r["row_bytes"]) for r in view["jobs"][0]["ranks"]]
    assert figures == [(0.123457, 0.0, 123456789), (1.0, 2.5, 1)]


def test_status_command_against_real_server(tmp_path: Path) -> None:
    """``knittrans status`` against a real control plane: the view with the admin token, a clear error without."""
    with server(tmp_path / "cp.db", "--admin-token", ADMIN, "--worker-token", WORKER) as cp:
        with ControlClient(cp.url, token=ADMIN) as admin:
            admin.create_job(job_spec())
            admin.pause("job1")
        env = {k: v for k, v in os.environ.items() if k != "KNITTRANS_ADMIN_TOKEN"}
        cmd = [sys.executable, "-m", "knittrans.cli", "status", "--control-url", cp.url]
        ok = subprocess.run(
            [*cmd, "--token", ADMIN, "--job", "job1"], capture_output=True, text=True, env=env, timeout=60
        )
        assert ok.returncode == 0, ok.stderr
        assert "job job1: PAUSED" in ok.stdout and "no store node registered" in ok.stdout
        denied = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert denied.returncode == 1 and "admin bearer token" in denied.stderr


def test_status_watch_redraws(tmp_path: Path) -> None:
    """``--watch`` keeps redrawing (here: at least twice) until interrupted."""
    with server(tmp_path / "cp.db", "--admin-token", ADMIN) as cp:
        with ControlClient(cp.url, token=ADMIN) as admin:
            admin.create_job(job_spec())
        cmd = [
            sys.executable,
            "-m",
            "knittrans.cli",
            "status",
            "--control-url",
            cp.url,
            "--token",
            ADMIN,
            "--watch",
            "--interval-s",
            "0.1",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            headers = 0
            for line in proc.stdout:
                headers += line.startswith("KnitTrans control plane - ")
                if headers == 2:
                    break
            assert headers == 2
        finally:
            proc.terminate()
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
