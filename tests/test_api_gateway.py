"""The plan gateway (``knittrans control-plane --plan-gateway-port``): the plan stream served by a process of its
own, against a real server subprocess: same lines, acks on the stream applied once, tokens and bad input, the
gateway's death (503 on discovery, the server's own stream still serves), and its frames."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from api_support import ServerProcess, server, single_group_units
from test_api_plan_stream import RawStream, _setup, check_refused_streams

from knittrans.api.gatewaywire import FrameReader, frame, pack_index, unpack_index
from knittrans.controlclient import ControlClient
from knittrans.procs import control_plane_args, knittrans_command


def _gateway(srv: ServerProcess) -> tuple[int, int]:
    """``(port, pid)`` of the server's plan gateway, from ``GET /v1/plan-gateway``."""
    r = httpx.get(srv.url + "/v1/plan-gateway")
    assert r.status_code == 200, r.text
    body = r.json()
    return int(body["url"].rsplit(":", 1)[1]), int(body["pid"])


_TCP_CLOSE = 7  # tcpi_state of a connection the peer reset (Linux tcp_states.h)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by the server) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.02)


def test_the_gateway_streams_what_the_server_streams_and_applies_each_ack_once(tmp_path: Path) -> None:
    """Rank 0 on the gateway (POST, acks as lines), rank 1 on the server's own stream: the same plans as ``next``,
    in order; a refused ack and a malformed line answer an error line; a repeated ack does nothing; the acks were
    applied once (a later ack of the same plan is a duplicate); keep-alive lines when nothing changes."""
    with server(tmp_path / "cp.db", "--plan-gateway-port", "0") as srv, ControlClient(srv.url) as client:
        port, _ = _gateway(srv)
        _setup(client, quotas={"math": 3, "code": 3}, mini_batches_per_step=3, world_size=2, micro_batch_size=1)
        client.register_units("job1", single_group_units(["math", "code"] * 3))
        gw = RawStream(port, "/v1/jobs/job1/ranks/0/plans?keepalive_s=0.2", method="POST")
        own = RawStream(srv.port, "/v1/jobs/job1/ranks/1/plans")
        try:
            assert gw.status == 200 and gw.headers["content-type"] == "application/x-ndjson"
            assert gw.headers["x-knittrans-keepalive-s"] == "0.2"
            p0 = gw.plan()
            assert p0 == client.next_plan("job1", 0, timeout_s=0) and p0.global_index == 0
            assert gw.line() == {"keepalive": True, "state": "running"}  # un-acked: not sent again
            gw.ack(p0.plan_id)
            gw.ack(p0.plan_id)  # repeated: no line
            q0 = own.plan()
            client.ack("job1", 1, str(q0.plan_id))  # mini-batch 0 consumed: both ranks acked it
            p1 = gw.plan()
            assert p1.global_index == 1 and p1 == client.next_plan("job1", 0, timeout_s=0)
            gw.ack("n9.a0.r0")
            assert gw.line() == {
                "ack_error": "n9.a0.r0",
                "error": "not_found",
                "detail": "plan 'n9.a0.r0' was never issued",
            }
            gw.send_line(b'{"ack": 7}\n')
            bad = gw.line()
            assert bad is not None and bad["error"] == "invalid_request" and bad["ack_error"] is None
            gw.ack(p1.plan_id)
            client.ack("job1", 1, str(own.plan().plan_id))
            assert gw.plan().global_index == 2
            assert client.status("job1")["next_global_index"] == 3
        finally:
            gw.close()
            own.close()
        assert client.ack("job1", 0, str(p0.plan_id))["duplicate"]
        assert client.ack("job1", 0, str(p1.plan_id))["duplicate"]
        assert client.next_plan("job1", 0, timeout_s=0).global_index == 2  # rank 0 acked exactly 0 and 1


def test_the_gateway_checks_tokens_and_input_like_the_server(tmp_path: Path) -> None:
    """401 without or with a wrong token, 404 for an unknown job, rank or path, 422 for a bad rank or keep-alive,
    405 for another method, 400 for a request that is not HTTP; GET and POST; the right token streams."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt", "--plan-gateway-port", "0") as srv,
        ControlClient(srv.url, token="at") as admin,
    ):
        port, _ = _gateway(srv)
        _setup(admin, world_size=2)
        check_refused_streams(port, [("/v1/jobs/job1/ranks/0/next", "wt", 404, "not_found")])
        raw = RawStream(port, "/v1/jobs/job1/ranks/0/plans", method="PUT", token="wt")
        assert raw.status == 405
        raw.close()
        raw = RawStream(port, "/ HTTP/9\x00", token="wt")
        assert raw.status == 400 and json.loads(raw.body())["error"] == "invalid_request"
        raw.close()
        ok = RawStream(port, "/v1/jobs/job1/ranks/1/plans?keepalive_s=0.1", token="wt")
        try:
            assert ok.status == 200 and ok.line() == {"keepalive": True, "state": "running"}
        finally:
            ok.close()


def test_a_dead_gateway_is_reported_and_the_server_still_streams(tmp_path: Path) -> None:
    """SIGKILL of the gateway: its streams end, ``GET /v1/plan-gateway`` answers 503 saying it exited, and the
    server's own stream serves the un-acked plan again (the client's reader moves there by itself); stopping the
    server stops a running gateway; without one the discovery answers 404 and the reader uses the server."""
    with server(tmp_path / "cp.db", "--plan-gateway-port", "0") as srv, ControlClient(srv.url) as client:
        port, pid = _gateway(srv)
        _setup(client, quotas={"math": 1, "code": 1}, mini_batches_per_step=1, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"]))
        gw = RawStream(port, "/v1/jobs/job1/ranks/0/plans")
        held = gw.plan()
        reader = client.plan_stream("job1", 0, keepalive_s=0.2, gateway=True)
        assert reader.next(timeout_s=5) == held and reader.source == f"http://127.0.0.1:{port}"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises((ValueError, ConnectionError)):  # the chunk stream ends mid-response
            gw.line()
        gw.close()
        deadline = time.monotonic() + 30
        while (r := httpx.get(srv.url + "/v1/plan-gateway")).status_code == 200:
            assert time.monotonic() < deadline, "the server never noticed its gateway's death"
            time.sleep(0.02)
        assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
        assert "exited" in r.json()["detail"] and "own plan stream" in r.json()["detail"]
        own = RawStream(srv.port, "/v1/jobs/job1/ranks/0/plans")
        try:
            assert own.plan() == held
        finally:
            own.close()
        again = None
        while again is None:  # the reader's stream broke with the gateway: it reopens on the server
            again = reader.next(timeout_s=5)
        assert again == held and reader.opened == 2 and reader.source == srv.url
        reader.close()
    with server(tmp_path / "cp2.db", "--plan-gateway-port", "0") as srv:
        _, pid = _gateway(srv)
    _wait_gone(pid)
    with server(tmp_path / "cp3.db") as srv, ControlClient(srv.url) as client:
        r = httpx.get(srv.url + "/v1/plan-gateway")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
        assert client.plan_gateway() is None
        _setup(client, quotas={"math": 1, "code": 1}, mini_batches_per_step=1, world_size=1)
        client.register_units("job1", single_group_units(["math", "code"]))
        reader = client.plan_stream("job1", 0, gateway=True)
        plan = reader.next(timeout_s=5)
        assert plan is not None and plan.global_index == 0 and reader.source == srv.url
        reader.close()


def test_frames_survive_any_split_and_refuse_garbage() -> None:
    """Frames fed a byte at a time come out whole and in order; an answers index round-trips; a length no peer
    would send and a head that is not a message are refused."""
    index = [0, 5, 0, 1, -1, 1]
    data = frame({"t": "answers", "job": "j", "n": 2}, pack_index(index) + b"plan0") + frame({"t": "close"})
    reader = FrameReader()
    got = [f for i in range(len(data)) for f in reader.feed(data[i : i + 1])]
    assert [h["t"] for h, _ in got] == ["answers", "close"]
    flat, plans = unpack_index(got[0][1], 2)
    assert list(flat) == index and plans == b"plan0"
    with pytest.raises(ValueError, match="not a gateway peer"):
        FrameReader().feed(b"\xff" * 8)
    with pytest.raises(ValueError, match="not a message"):
        FrameReader().feed(frame({"no": "type"}))
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_index(b"\x00" * 11, 1)


def test_a_gateway_that_cannot_listen_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    """``--plan-gateway-port`` on a port already taken: the server does not start and says why."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = ["--plan-gateway-port", str(port)]
        args = control_plane_args(tmp_path / "cp.db", port=0, log_level="WARNING", extra=extra)
        done = subprocess.run(knittrans_command(*args), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"the plan gateway did not start on 127.0.0.1:{port}" in done.stderr, done.stderr[-2000:]
    assert "address already in use" in done.stderr


def test_a_client_that_does_not_read_is_dropped_and_the_gateway_keeps_serving(tmp_path: Path) -> None:
    """A POST stream whose client sends bad ack lines without reading the ``ack_error`` lines they cause is
    dropped once MAX_UNREAD bytes wait for it (reset, not a read that blocks); the gateway serves the next."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt", "--plan-gateway-port", "0") as srv,
        ControlClient(srv.url, token="at") as admin,
    ):
        port, _ = _gateway(srv)
        _setup(admin, world_size=2)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
            sock.settimeout(30)
            sock.connect(("127.0.0.1", port))
            head = (
                "POST /v1/jobs/job1/ranks/0/plans HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wt\r\n"
                "Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            sock.sendall(head.encode())
            lines = b"x\n" * 1000  # each answered with a ~130-byte ack_error line
            chunk = b"%x\r\n%s\r\n" % (len(lines), lines)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for _ in range(200):  # ~26 MB of answers: far past MAX_UNREAD plus both sockets' buffers
                    sock.sendall(chunk)
            # nothing read: wait (without reading) for the gateway's reset, TCP state CLOSE in TCP_INFO
            deadline = time.monotonic() + 60
            while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != _TCP_CLOSE:
                assert time.monotonic() < deadline, "the stream stayed open with megabytes of answers unread"
                time.sleep(0.05)
        ok = RawStream(port, "/v1/jobs/job1/ranks/1/plans?keepalive_s=0.1", token="wt")
        try:
            assert ok.status == 200 and ok.line() == {"keepalive": True, "state": "running"}
        finally:
            ok.close()
