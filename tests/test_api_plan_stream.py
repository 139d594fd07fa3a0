"""A rank's plan stream (``GET|POST /v1/jobs/{job}/ranks/{rank}/plans``) against a real uvicorn server process:
order, reconnect, acks on the stream, withdrawal, auth, bad input, shutdown, and the clients' fallback to ``next``."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import ServerProcess, app_client, job_spec, server, single_group_units

from knittrans.controlclient import ControlClient, JobFinished, StreamUnsupported
from knittrans.plans import RankPlan
from knittrans.trainer.client import TrainerClient
from knittrans.trainer.config import TrainerConfig


def _setup(admin: ControlClient, **spec: Any) -> None:
    admin.create_job(job_spec(**spec))
    admin.register_node("n0", "grpc://127.0.0.1:1", host="h0")


class RawStream:
    """One plan stream on a plain socket (HTTP/1.1, chunked both ways for POST): what a client on the wire sees."""

    def __init__(self, port: int, path: str, *, method: str = "GET", token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.file = self.sock.makefile("rb")
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if token is not None:
            head += f"Authorization: Bearer {token}\r\n"
        if method == "POST":
            head += "Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n"
        self.sock.sendall((head + "\r\n").encode())
        self.status = int(self.file.readline().split()[1])
        self.headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            self.headers[name.strip().lower()] = value.strip()

    def body(self) -> bytes:
        """The whole body of a non-stream answer (an error)."""
        return self.file.read(int(self.headers["content-length"]))

    def line(self) -> dict[str, Any] | None:
        """The next line of the stream as JSON; None at its end."""
        size = int(self.file.readline(), 16)
        if size == 0:
            return None
        data = self.file.read(size + 2)[:-2]
        assert data.endswith(b"\n") and data.count(b"\n") == 1, data  # one line per chunk
        got: dict[str, Any] = json.loads(data)
        return got

    def plan(self) -> RankPlan:
        """The next plan line (keep-alive lines skipped)."""
        while (msg := self.line()) is not None:
            if "plan_id" in msg:
                return RankPlan.from_json(msg)
            assert msg.get("keepalive") is True, msg
        raise AssertionError("the stream ended without a plan")

    def send_line(self, data: bytes) -> None:
        self.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def ack(self, plan_id: object) -> None:
        self.send_line(json.dumps({"ack": str(plan_id)}).encode() + b"\n")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture(params=["h11", "httptools"])
def srv(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A real server with each of uvicorn's HTTP parsers (the stream reads a chunked body while it answers)."""
    with server(tmp_path / "cp.db", "--http", request.param) as proc:
        yield proc


def test_plans_arrive_in_order_one_line_each_after_each_ack(srv: ServerProcess) -> None:
    """GET stream: plan 0 at once, plan 1 only after plan 0 is acked (POST .../ack), then plan 2; each plan once."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 3, "code": 3}, mini_batches_per_step=3, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"] * 3))
        stream = RawStream(srv.port, "/v1/jobs/job1/ranks/0/plans?keepalive_s=0.2")
        try:
            assert stream.status == 200 and stream.headers["content-type"] == "application/x-ndjson"
            assert stream.headers["transfer-encoding"] == "chunked"
            seen = []
            for n in range(3):
                plan = stream.plan()
                assert plan.global_index == n and plan.rank == 0
                assert plan == client.next_plan("job1", 0, timeout_s=0)  # what next answers, the same bytes
                seen.append(plan.global_index)
                # un-acked: only keep-alive lines follow (two of them), not the same plan again
                assert [stream.line(), stream.line()] == [{"keepalive": True, "state": "running"}] * 2
                client.ack("job1", 0, str(plan.plan_id))
            assert seen == [0, 1, 2]
        finally:
            stream.close()


def test_a_new_stream_serves_the_unacked_plan_again(srv: ServerProcess) -> None:
    """Reconnect: the plan sent on a stream that went away before its ack is the first line of the next one."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=2)
        client.register_units("job1", single_group_units(["math", "code"] * 2))
        first = RawStream(srv.port, "/v1/jobs/job1/ranks/1/plans")
        held = first.plan()
        first.close()  # the rank's connection breaks before it acks
        second = RawStream(srv.port, "/v1/jobs/job1/ranks/1/plans")
        try:
            assert second.plan() == held
            client.ack("job1", 1, str(held.plan_id))
            assert second.plan().global_index == held.global_index + 1
        finally:
            second.close()
        # the client's reader reconnects by itself after a broken stream and gets the un-acked plan again
        reader = client.plan_stream("job1", 0, keepalive_s=0.2)
        plan = reader.next(timeout_s=5)
        assert plan is not None and plan.global_index == 0
        assert reader._response is not None
        reader._response.close()  # break it under the reader
        again = reader.next(timeout_s=5)
        assert again == plan and reader.opened == 2
        reader.close()


def test_acks_as_lines_of_the_post_body(srv: ServerProcess) -> None:
    """POST stream: acks sent as body lines while plans stream back; refused or malformed acks answer an error line."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 3, "code": 3}, mini_batches_per_step=3, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"] * 3))
        stream = RawStream(srv.port, "/v1/jobs/job1/ranks/0/plans", method="POST")
        try:
            assert stream.status == 200
            p0 = stream.plan()
            stream.ack(p0.plan_id)
            p1 = stream.plan()
            assert (p0.global_index, p1.global_index) == (0, 1)
            stream.ack("n9.a0.r0")  # never issued
            assert stream.line() == {
                "ack_error": "n9.a0.r0",
                "error": "not_found",
                "detail": "plan 'n9.a0.r0' was never issued",
            }
            stream.send_line(b"not json\n")
            bad = stream.line()
            assert bad is not None and bad["error"] == "invalid_request" and bad["ack_error"] is None
            stream.ack(p0.plan_id)  # a repeated ack is a no-op: no line
            stream.ack(p1.plan_id)
            assert stream.plan().global_index == 2
            status = client.status("job1")
            assert status["next_global_index"] == 3
        finally:
            stream.close()
        # the acks were applied like POST .../ack: mini-batches 0 and 1 are consumed
        assert client.ack("job1", 0, str(p1.plan_id))["duplicate"]


def test_a_withdrawn_plan_is_followed_by_its_replan(srv: ServerProcess) -> None:
    """Node loss withdraws the un-fetched mini-batch; the stream pushes its re-plan (next attempt) when it is made."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 1, "code": 1}, mini_batches_per_step=1, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"]))
        stream = RawStream(srv.port, "/v1/jobs/job1/ranks/0/plans")
        try:
            first = stream.plan()
            assert (first.global_index, first.plan_id.attempt) == (0, 0)
            client.declare_lost("n0")
            client.register_node("n1", "grpc://127.0.0.1:2", host="h1")
            client.register_units("job1", single_group_units(["math", "code"], node="n1", prefix="h"))
            replan = stream.plan()
            assert (replan.global_index, replan.plan_id.attempt) == (0, 1)
            assert {r.group_id for m in replan.micro_batches for r in m.rows} == {"h0", "h1"}
        finally:
            stream.close()
        # the client's reader: both attempts' lines come; once the re-plan is acked (taken another way, as
        # the trainer's re-plan does), neither is handed out any more
        reader = client.plan_stream("job1", 0, keepalive_s=0.2)
        got = reader.next(timeout_s=5)
        assert got == replan
        client.ack("job1", 0, str(replan.plan_id))
        reader.acked(str(replan.plan_id))
        client.register_units("job1", single_group_units(["math", "code"], node="n1", prefix="i"))
        after = reader.next(timeout_s=5)
        assert after is not None and after.global_index == 1
        reader.close()
        assert reader.next(timeout_s=5) is None  # closed for good


def test_done_line_ends_the_stream_and_the_reader(srv: ServerProcess) -> None:
    """A job that completes: the stream sends ``done`` and ends; the client's reader raises JobFinished."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 2}, mini_batches_per_step=2, world_size=1, total_steps=1)
        client.register_units("job1", single_group_units(["math"] * 4))
        reader = client.plan_stream("job1", 0)
        seen = []
        with pytest.raises(JobFinished):
            while True:
                plan = reader.next(timeout_s=5)
                assert plan is not None
                seen.append(plan.global_index)
                client.ack("job1", 0, str(plan.plan_id))
                reader.acked(str(plan.plan_id))
        assert seen == [0, 1]
        raw = RawStream(srv.port, "/v1/jobs/job1/ranks/0/plans")
        try:
            assert raw.line() == {"done": True, "state": "completed"}
            assert raw.line() is None
        finally:
            raw.close()


BAD_STREAMS = [
    ("/v1/jobs/job1/ranks/0/plans", None, 401, "unauthenticated"),
    ("/v1/jobs/job1/ranks/0/plans", "nope", 401, "unauthenticated"),
    ("/v1/jobs/job1/ranks/2/plans", "wt", 404, "not_found"),
    ("/v1/jobs/ghost/ranks/0/plans", "wt", 404, "not_found"),
    ("/v1/jobs/job1/ranks/x/plans", "wt", 422, "invalid_request"),
    ("/v1/jobs/job1/ranks/0/plans?keepalive_s=0", "wt", 422, "invalid_request"),
    ("/v1/jobs/job1/ranks/0/plans?keepalive_s=abc", "wt", 422, "invalid_request"),
]
"""Stream requests refused before the stream starts (path, token, status, error kind), for a job ``job1``
of 2 ranks with the worker token ``wt``."""


def check_refused_streams(port: int, extra: Sequence[tuple[str, str | None, int, str]] = ()) -> None:
    """Each of :data:`BAD_STREAMS` (and ``extra``), by GET and POST, gets its status and error body."""
    for method in ("GET", "POST"):
        for path, token, status, kind in [*BAD_STREAMS, *extra]:
            raw = RawStream(port, path, method=method, token=token)
            try:
                assert raw.status == status, (method, path, raw.status)
                assert json.loads(raw.body())["error"] == kind, (method, path)
            finally:
                raw.close()


def test_token_and_bad_input_answered_before_the_stream(tmp_path: Path) -> None:
    """401 without the worker token, 404 for an unknown job or rank, 422 for a bad rank or keep-alive, GET and POST."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt") as srv,
        ControlClient(srv.url, token="at") as admin,
    ):
        _setup(admin, world_size=2)
        check_refused_streams(srv.port)
        ok = RawStream(srv.port, "/v1/jobs/job1/ranks/1/plans?keepalive_s=0.1", token="wt")
        try:
            assert ok.status == 200 and ok.line() == {"keepalive": True, "state": "running"}
        finally:
            ok.close()
        with ControlClient(srv.url, token="nope", retries=0) as wrong:
            from knittrans.errors import NotFound, Unauthenticated

            with pytest.raises(Unauthenticated):
                wrong.plan_stream("job1", 0).next(timeout_s=1)
            with ControlClient(srv.url, token="wt") as worker, pytest.raises(NotFound, match="world_size"):
                worker.plan_stream("job1", 7).next(timeout_s=1)


def test_server_stops_with_streams_open(tmp_path: Path) -> None:
    """SIGTERM ends open streams (their response ends cleanly) instead of waiting for them forever."""
    srv = ServerProcess(tmp_path / "cp.db").start()
    try:
        with ControlClient(srv.url) as client:
            _setup(client, world_size=2)
        streams = [RawStream(srv.port, f"/v1/jobs/job1/ranks/{r}/plans") for r in (0, 1)]
        assert srv.proc is not None
        srv.proc.terminate()
        srv.proc.wait(30)  # uvicorn re-raises SIGTERM after its graceful shutdown: the code is -15
        for s in streams:
            while (msg := s.line()) is not None:  # keep-alive lines until the end of the stream
                assert msg.get("keepalive") is True
            s.close()
    finally:
        srv.stop()


def _stream_trainer(url: str) -> TrainerConfig:
    """Rank 0 of job1 on the plan stream (opt-in), without the early poll and warm-up (deterministic reads)."""
    return TrainerConfig(
        control_url=url, job="job1", rank=0, world_size=1, warm_connections=False, poll_early=False, plan_stream=True
    )


def test_clients_fall_back_to_next_without_the_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server without the stream (KNITTRANS_PLAN_STREAM=0) answers 404 as for an unknown path; the reader says
    StreamUnsupported and the trainer client long-polls ``next`` instead, getting the same plans."""
    monkeypatch.setenv("KNITTRANS_PLAN_STREAM", "0")
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"] * 2))
        r = httpx.get(srv.url + "/v1/jobs/job1/ranks/0/plans")
        assert r.status_code == 404 and r.json() == {"error": "not_found", "detail": "Not Found"}
        with pytest.raises(StreamUnsupported):
            client.plan_stream("job1", 0).next(timeout_s=1)
        config = _stream_trainer(srv.url)
        with TrainerClient(config) as trainer:
            assert trainer._stream is not None
            plan = trainer.next_plan()
            assert plan is not None and plan.global_index == 0
            assert trainer._stream is None  # fell back for good
            client.ack("job1", 0, str(plan.plan_id))
            nxt = trainer.next_plan()
            assert nxt is not None and nxt.global_index == 1


def test_trainer_client_reads_the_stream_and_skips_acked_lines(srv: ServerProcess) -> None:
    """With the stream: the trainer client's plans come from one stream; a line of a plan acked meanwhile is skipped."""
    with ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 3, "code": 3}, mini_batches_per_step=3, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"] * 3))
        config = _stream_trainer(srv.url)
        with TrainerClient(config) as trainer:
            p0 = trainer.next_plan()
            assert p0 is not None and p0.global_index == 0
            # mini-batch 1 taken another way (the prefetch's next?after=) and acked: its stream line is stale
            p1 = client.next_plan("job1", 0, timeout_s=1, after=str(p0.plan_id))
            assert p1 is not None and p1.global_index == 1
            client.ack("job1", 0, str(p0.plan_id))
            assert trainer._stream is not None
            trainer._stream.acked(str(p0.plan_id))
            client.ack("job1", 0, str(p1.plan_id))
            trainer._stream.acked(str(p1.plan_id))
            p2 = trainer.next_plan()
            assert p2 is not None and p2.global_index == 2
            assert trainer._stream is not None and trainer._stream.opened == 1


def test_fast_path_answers_plain_acks_and_leaves_the_rest_to_the_app(tmp_path: Path) -> None:
    """A plain ``POST .../ack`` (JSON body, no query) is answered before FastAPI's routing, transfer figures
    included; a bad token, a refused ack, a bad body or another content type are answered by the app as before."""
    with app_client(tmp_path / "cp.db", admin_token="adm", worker_token="wrk") as c:
        c.headers["Authorization"] = "Bearer adm"
        assert c.post("/v1/jobs", json=job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2)).is_success
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"] * 2)})
        counts: dict[str, int] = c.app.state.fast_next  # type: ignore[attr-defined]
        plan = RankPlan.from_json(c.get("/v1/jobs/job1/ranks/0/next", params={"timeout_s": 0}).json())
        served, to_app = counts["served"], counts["to_app"]
        transfer = {
            "exposed_s": 0.5,
            "fetch_s": 1.0,
            "row_bytes": 7,
            "media_logical_bytes": 0,
            "media_physical_bytes": 0,
        }
        r = c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": str(plan.plan_id), "transfer": transfer})
        assert r.status_code == 200 and r.json() == {
            "plan_id": str(plan.plan_id),
            "global_index": 0,
            "consumed": False,
            "duplicate": False,
        }
        assert (counts["served"], counts["to_app"]) == (served + 1, to_app)
        metrics = c.get("/metrics").text  # the transfer figures were recorded
        assert 'knittrans_rank_exposed_transfer_seconds_total{job_name="job1",rank="0"} 0.5' in metrics
        cases = [
            (
                c.post(
                    "/v1/jobs/job1/ranks/0/ack", json={"plan_id": "n0.a0.r0"}, headers={"Authorization": "Bearer x"}
                ),
                401,
            ),
            (c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": "n7.a0.r0"}), 404),
            (c.post("/v1/jobs/job1/ranks/1/ack", json={"plan_id": "n1.a0.r1"}), 409),  # 1 before 0
            (c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": ""}), 422),
            (c.post("/v1/jobs/job1/ranks/0/ack", content=b"{nope", headers={"Content-Type": "application/json"}), 422),
            (c.post("/v1/jobs/job1/ranks/9/ack", json={"plan_id": "n0.a0.r9"}), 404),
        ]
        for response, status in cases:
            assert response.status_code == status and response.json()["error"], response.text
        # the wrong token never reaches the fast path: the request gate in front of it answers 401
        assert counts["to_app"] == to_app + 5 and counts["served"] == served + 1
        text = c.post("/v1/jobs/job1/ranks/0/ack", content=json.dumps({"plan_id": str(plan.plan_id)}).encode())
        assert text.status_code == 422  # no JSON content type: never the fast path, and the app refuses it
        again = c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": str(plan.plan_id)})
        assert again.status_code == 200 and again.json()["duplicate"] and counts["served"] == served + 2
