"""The control plane's HTTP listener authenticates first (#31): a real ``knittrans control-plane`` process
held by unauthenticated connections (idle, half-sent headers, a byte at a time, oversized) still serves
writers and readers; such connections are closed after ``unauthenticated_timeout_s``, capped in number,
and read no more than 64 KiB; JSON bodies are refused by size and depth before they are parsed."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import app_client, job_spec, rss_mib, server, single_group_units

from knittrans.api import Settings, create_app
from knittrans.procs import control_plane_args, free_port, knittrans_command, stop_process, wait_ready, wait_until
from knittrans.rlimits import raise_open_files_limit

ADMIN, WORKER = "admin-secret-token", "worker-secret-token"
TOKENS = ("--worker-token", WORKER, "--admin-token", ADMIN)
AUTH = {"authorization": f"Bearer {WORKER}"}
NODE = {"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes ``sock`` within ``wait_s`` (EOF or reset; whatever it answered is read)."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def _request(sock: socket.socket, path: str, token: str | None = WORKER) -> int:
    """One keep-alive GET on ``sock``; its status (the body read and dropped)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: cp\r\n{auth}\r\n".encode())
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    reader.read(length)
    reader.close()
    return status


@contextlib.contextmanager
def _held(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` unauthenticated connections: idle ones, and some that sent part of a request's headers."""
    held = []
    try:
        for i in range(count):
            sock = _connect(port)
            if i % 5 == 1:
                sock.sendall(b"POST /v1/jobs/job1/units HTTP/1.1\r\nHost: cp\r\nContent-Le")  # half-sent headers
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def _writer_and_reader(url: str, prefix: str) -> None:
    """A writer registers units; a reader reads the job and its status and long-polls a mini-batch's manifest."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        r = client.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"], prefix=prefix)})
        assert r.status_code == 200 and r.json()["registered"] == 2, r.text
        assert client.get("/v1/jobs/job1").json()["spec"]["name"] == "job1"
        assert client.get("/v1/jobs/job1/status").json()["counts"]["units"] >= 2
        assert client.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0.2}).status_code in (200, 204)


def _job(url: str) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(url + "/v1/jobs", json=job_spec(), headers=admin).status_code == 201
    assert httpx.post(url + "/v1/nodes", json=NODE, headers=AUTH).status_code == 200


@pytest.mark.timing
def test_500_unauthenticated_connections_leave_writers_and_readers_served_and_close_after_10_s(tmp_path: Path) -> None:
    """Default settings: 500 idle or half-sent unauthenticated connections held open; a writer and a reader
    (job, status, manifest long-poll) are still served, and the server closes all 500 (10 s after each opened)."""
    raise_open_files_limit()
    with server(tmp_path / "cp.db", *TOKENS) as srv:
        _job(srv.url)
        with _held(srv.port, 500) as held:
            _writer_and_reader(srv.url, "a")
            assert all(_closed_by_server(sock, 60) for sock in held)
        _writer_and_reader(srv.url, "b")


@pytest.mark.timing
def test_unauthenticated_connections_cannot_take_every_descriptor(tmp_path: Path) -> None:
    """A control plane limited to 400 open files, sent 1,000 unauthenticated connections at once, still
    accepts and serves a writer and a reader: unauthenticated connections may hold at most half its
    descriptors (the oldest beyond that are closed), so accepting never stops for good."""
    port = free_port()
    cmd = knittrans_command(*control_plane_args(tmp_path / "cp.db", port=port, log_level="WARNING", extra=TOKENS))

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit_files)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, lambda: httpx.get(url + "/v1/health", timeout=1).status_code == 200, timeout_s=30, what="cp")
        _job(url)
        with _held(port, 1000):
            _writer_and_reader(url, "d")
    finally:
        stop_process(proc)


def test_the_control_plane_raises_its_open_files_limit_to_the_hard_limit(tmp_path: Path) -> None:
    """``knittrans control-plane`` started with a soft RLIMIT_NOFILE below its hard limit serves at the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024, hard - 1), hard))  # what the server inherits
    try:
        with server(tmp_path / "cp.db") as srv:
            assert srv.proc is not None
            limits = Path(f"/proc/{srv.proc.pid}/limits").read_text()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    assert soft == hard, line


@pytest.mark.timing
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_idle_and_slow_connections_close_after_the_timeout_authenticated_ones_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, http: str
) -> None:
    """With a 1 s timeout: idle, half-sent and byte-at-a-time (slowloris) connections are closed; a connection
    whose first request authenticated is still served after the timeout, and one that only asked an open path
    (health) is closed like an idle one."""
    monkeypatch.setenv("KNITTRANS_UNAUTHENTICATED_TIMEOUT_S", "1")
    with server(tmp_path / "cp.db", *TOKENS, "--http", http) as srv:
        _job(srv.url)
        idle, half, slow, authed, health = (_connect(srv.port) for _ in range(5))
        half.sendall(b"GET /v1/jobs/job1 HTTP/1.1\r\nHost: cp\r\n")
        assert _request(authed, "/v1/jobs/job1") == 200
        assert _request(health, "/v1/health", token=None) == 200
        assert _closed_by_server(idle, 30)
        # past the 1 s (and within uvicorn's 5 s keep-alive): the authenticated connection is still served
        assert _request(authed, "/v1/jobs/job1") == 200
        slowloris_closed = False
        for byte in b"GET /v1/jobs/job1 HTTP/1.1\r\nHost: cp\r\nX-Slow: " + b"a" * 200:
            try:
                slow.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                slowloris_closed = True
                break
            time.sleep(0.05)
        assert slowloris_closed or _closed_by_server(slow, 30)
        for sock in (half, health):
            assert _closed_by_server(sock, 30)
        for sock in (idle, half, slow, authed, health):
            sock.close()


@pytest.mark.timing
def test_unauthenticated_connections_beyond_the_cap_close_the_oldest_never_an_authenticated_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cap of 50: 50 newer unauthenticated connections close the 50 older ones (open > 1 s); the
    authenticated connection opened before them all stays, and so do the newer ones."""
    monkeypatch.setenv("KNITTRANS_MAX_UNAUTHENTICATED_CONNECTIONS", "50")
    monkeypatch.setenv("KNITTRANS_UNAUTHENTICATED_TIMEOUT_S", "120")  # what closes them here is the cap
    with server(tmp_path / "cp.db", *TOKENS) as srv:
        _job(srv.url)
        authed = _connect(srv.port)
        assert _request(authed, "/v1/jobs/job1") == 200
        with _held(srv.port, 50) as older:
            time.sleep(1.5)  # the cap closes only connections open for a second or more
            with _held(srv.port, 50) as newer:
                assert all(_closed_by_server(sock, 30) for sock in older)
                assert not any(_closed_by_server(sock, 0.2) for sock in newer[:5])
                assert _request(authed, "/v1/jobs/job1") == 200
                _writer_and_reader(srv.url, "c")
        authed.close()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_body_is_read_only_after_its_token_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, http: str
) -> None:
    """A request declaring a 10 MB body without a token (to a route whose body FastAPI would parse before
    its dependencies) is answered 401 before the body is sent, and its connection closed; with a token, a body
    over 128 KiB sent in one piece with its headers is read in full and served."""
    with server(tmp_path / "cp.db", *TOKENS, "--http", http) as srv:
        _job(srv.url)
        sock = _connect(srv.port)
        sock.sendall(
            b"POST /v1/jobs/job1/supply HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000\r\n\r\n" + b'{"started": {"math": 1' + b" " * 1000
        )
        sock.settimeout(30)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # until the server closes the connection
        assert answer.startswith(b"HTTP/1.1 401") and b"needs the worker (or admin) bearer token" in answer, answer
        sock.close()
        units = single_group_units(["math", "code"] * 250, prefix="big")
        body = json.dumps({"units": units}).encode()
        assert len(body) > 128 << 10
        head = (
            "POST /v1/jobs/job1/units HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {WORKER}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        big = _connect(srv.port)
        big.sendall(head + body)
        reply = big.makefile("rb")
        assert reply.readline().startswith(b"HTTP/1.1 200"), reply.read(1000)
        reply.close()
        big.close()


@pytest.mark.timing
def test_headers_without_end_are_not_buffered_past_64_kib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 connections each sending 4 MiB of one header line (httptools, which sets no header limit of its
    own): the server reads about 64 KiB of each and pauses them, so its memory grows by far less than the
    160 MiB they sent."""
    monkeypatch.setenv("KNITTRANS_UNAUTHENTICATED_TIMEOUT_S", "120")  # what bounds them here is not the timeout
    with server(tmp_path / "cp.db", *TOKENS, "--http", "httptools") as srv:
        assert srv.proc is not None
        before = rss_mib(srv.proc.pid)
        chunk = b"a" * (256 << 10)
        floods = []
        for _ in range(40):
            sock = _connect(srv.port)
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: cp\r\nX-Flood: ")
            sock.setblocking(False)
            floods.append([sock, 4 << 20])
        for _ in range(200):  # send what each connection still takes, until none takes more
            progress = False
            for entry in floods:
                with contextlib.suppress(BlockingIOError, ConnectionResetError, BrokenPipeError):
                    while entry[1] > 0:
                        sent = entry[0].send(chunk[: entry[1]])
                        entry[1] -= sent
                        progress = True
            if not progress:
                break
            time.sleep(0.02)
        time.sleep(0.5)
        grown = rss_mib(srv.proc.pid) - before
        sent_mib = sum((4 << 20) - left for _, left in floods) / (1 << 20)
        assert grown < 48, f"the server grew by {grown:.0f} MiB while {sent_mib:.0f} MiB of headers were sent"
        for sock, _ in floods:
            sock.close()
        assert httpx.get(srv.url + "/v1/health").status_code == 200


def test_json_nested_too_deep_is_refused_before_parsing_naming_the_limit(tmp_path: Path) -> None:
    """A JSON body nested 100,000 deep (a model body and the units body a route parses itself) is a 422
    naming ``max_json_depth``; nesting at the limit passes the gate; a body over ``max_body_bytes`` is a 413
    naming the limit."""
    with app_client(tmp_path / "cp.db", max_json_depth=6, max_body_bytes=1 << 20) as client:
        deep = b"[" * 100_000 + b"]" * 100_000
        for path in ("/v1/jobs", "/v1/jobs/job1/units", "/v1/jobs/job1/supply"):
            r = client.post(path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 422, r.text
            assert r.json() == {
                "error": "invalid_request",
                "detail": "request JSON nests deeper than the 6 levels allowed (max_json_depth)",
            }
        assert client.post("/v1/jobs", json=job_spec()).status_code == 201
        at_limit = {"started": {"math": 1}, "x": [[[[{"deep": "[[[[[[[[["}]]]]}  # 6 levels; brackets in a string
        r = client.post("/v1/jobs/job1/supply", json=at_limit)
        assert r.status_code == 422 and "max_json_depth" not in r.text, r.text  # the model refuses "x" instead
        r = client.post("/v1/jobs/job1/supply", content=b" " * (2 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413 and str(1 << 20) in r.json()["detail"], r.text


def test_every_path_but_the_open_ones_needs_a_token_before_its_body(tmp_path: Path) -> None:
    """The paths served without a token are health, metrics, the dashboard page, the lookups of optional
    listeners and the OpenAPI documents; without a token, any request with a body is a 401 before its body
    is read, and every other documented operation is a 401 too; each 401 closes its connection (a 404 does not)."""
    app = create_app(Settings(db_path=str(tmp_path / "cp.db"), worker_token=WORKER, admin_token=ADMIN))
    gate = next(m for m in app.user_middleware if m.cls.__name__ == "RequestGate")
    allowed = {"/v1/health", "/metrics", "/ui", "/v1/lane", "/v1/plan-gateway"}
    allowed |= {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    assert {"/v1/health", "/metrics", "/openapi.json"} <= gate.kwargs["open_paths"] <= allowed
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        for path, ops in client.get("/openapi.json").json()["paths"].items():
            concrete = path.replace("{job}", "job1").replace("{rank}", "0").replace("{node}", "n0")
            concrete = concrete.replace("{unit}", "u0")
            for method in ops:
                r = client.request(method, concrete, content=b"[" * 1000)
                assert r.status_code == 401 and r.headers["connection"] == "close", (method, path, r.text)
                assert "needs the worker (or admin) bearer token" in r.json()["detail"]
                r = client.request(method, concrete)
                if path in gate.kwargs["open_paths"]:
                    assert r.status_code != 401, (method, path)
                else:
                    assert r.status_code == 401 and r.headers["connection"] == "close", (method, path, r.text)
        r = client.get("/v1/no-such-path")  # refused, but not for its token: the connection stays
        assert r.status_code == 404 and r.headers.get("connection") != "close", r.headers


def _bare_gate(app: Any) -> Any:
    """The request gate alone around ``app``: no token, bodies up to 100 bytes, JSON 4 levels deep."""
    from knittrans.api.auth import TokenCheck
    from knittrans.api.gate import RequestGate

    return RequestGate(
        app,
        tokens=TokenCheck(Settings(worker_token=None)),
        open_paths=frozenset(),
        max_body_bytes=100,
        max_json_depth=4,
    )


def test_the_gate_answers_nobody_gone_mid_body_and_passes_the_disconnect_on() -> None:
    """A client gone while sending its body gets no answer and reaches no route; after a whole body, the app's
    next receive gets what the connection says next (the disconnect), not the body again."""
    import asyncio

    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.extend([await receive(), await receive()])

    gate = _bare_gate(app)

    async def call(messages: list[dict[str, Any]]) -> list[Any]:
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/jobs", "headers": [(b"content-length", b"2")]}
        await gate(scope, receive, send)
        return sent

    assert asyncio.run(call([{"type": "http.disconnect"}])) == [] and seen == []
    body = {"type": "http.request", "body": b"{}", "more_body": False}
    assert asyncio.run(call([body, {"type": "http.disconnect"}])) == []
    assert seen == [body, {"type": "http.disconnect"}]


def test_the_gate_refuses_a_declared_length_over_the_limit_unread_and_passes_other_scopes_through() -> None:
    """A body declared longer than ``max_body_bytes`` is a 413 before a byte of it is received, one sent without a
    length is a 413 once more than that arrived (the app is not reached either time); a scope that is not HTTP
    (lifespan) goes to the app untouched."""
    import asyncio

    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    gate = _bare_gate(app)
    received: list[Any] = []

    async def receive() -> dict[str, Any]:
        received.append("receive")
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/jobs", "headers": [(b"content-length", b"101")]}
    asyncio.run(gate(scope, receive, send))
    assert sent[0]["status"] == 413 and received == [] and seen == []
    assert json.loads(sent[1]["body"])["error"] == "payload_too_large"
    chunked = {"type": "http", "path": "/v1/jobs", "headers": [(b"transfer-encoding", b"chunked")]}
    parts = [{"type": "http.request", "body": b" " * 60, "more_body": True}] * 2

    async def receive_parts() -> dict[str, Any]:
        return parts.pop(0)

    asyncio.run(gate(chunked, receive_parts, send))  # undeclared: refused once 101 bytes were received
    assert sent[2]["status"] == 413 and parts == [] and seen == []
    asyncio.run(gate({"type": "lifespan"}, receive, send))
    assert seen == ["lifespan"] and len(sent) == 4


@contextlib.contextmanager
def _guarded(app: Any, *, timeout_s: float, cap: int = 100) -> Iterator[int]:
    """A real uvicorn server (h11) in a thread serving ``app`` under the gate (worker token ``WORKER``; ``/slow``
    and ``/fast`` open) and a :class:`ConnectionGuard`; its port."""
    import threading

    import uvicorn

    from knittrans.api.auth import TokenCheck
    from knittrans.api.connguard import ConnectionGuard
    from knittrans.api.gate import RequestGate

    gate = RequestGate(
        app,
        tokens=TokenCheck(Settings(worker_token=WORKER)),
        open_paths=frozenset({"/slow", "/fast"}),
        max_body_bytes=1 << 20,
        max_json_depth=8,
    )
    guard = ConnectionGuard(timeout_s=timeout_s, max_unauthenticated=cap)
    config = uvicorn.Config(gate, log_level="warning", access_log=False, lifespan="off", http=guard.protocol("h11"))
    srv = uvicorn.Server(config)
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started, timeout_s=30, what="the guarded uvicorn server")
        yield int(sock.getsockname()[1])
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()


async def _slow_or_fast(scope: Any, receive: Any, send: Any) -> None:
    """``/slow`` answers after 3 s, everything else at once."""
    import asyncio

    if scope["path"] == "/slow":
        await asyncio.sleep(3)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_an_open_request_running_at_the_timeout_is_answered_then_its_connection_closes() -> None:
    """With a 2 s timeout, an unauthenticated request to an open path that takes 3 s is answered (it gets one
    more period), and its connection is closed as the answer leaves: a next request on it is not served."""
    with _guarded(_slow_or_fast, timeout_s=2) as port:
        sock = _connect(port)
        assert _request(sock, "/slow", token=None) == 200
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /fast HTTP/1.1\r\nHost: cp\r\n\r\n")
        sock.settimeout(30)
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
        assert answer == b"", answer  # closed, the next request not served (no answer in 30 s fails too)
        sock.close()


def test_a_burst_beyond_the_cap_is_read_first_and_the_oldest_close_a_second_later() -> None:
    """With a cap of 2, four connections opened at once are all served a request to an open path; the two oldest
    are closed once they are a second old, the two newest stay. Once those went, a second burst is trimmed too."""
    with _guarded(_slow_or_fast, timeout_s=120, cap=2) as port:
        for _ in range(2):
            burst = [_connect(port) for _ in range(4)]
            assert [_request(sock, "/fast", token=None) for sock in burst] == [200] * 4
            assert all(_closed_by_server(sock, 30) for sock in burst[:2])
            assert not any(_closed_by_server(sock, 0.2) for sock in burst[2:])
            for sock in burst:
                sock.close()


def test_a_connection_is_read_in_64_kib_pieces_until_it_authenticates() -> None:
    """Before a request on it authenticates, a connection is read at most 64 KiB at a time (so at most that much
    reaches the HTTP parser per read); after, in asyncio's own read size."""
    from knittrans.api.connguard import CONNECTION, PREAUTH_BYTES

    sizes: list[tuple[int, int]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        conn = CONNECTION.get()
        assert conn is not None and conn.transport is not None
        sizes.append((conn.transport.max_size, type(conn.transport).max_size))  # type: ignore[attr-defined]
        await _slow_or_fast(scope, receive, send)

    with _guarded(app, timeout_s=120) as port:
        sock = _connect(port)
        assert [_request(sock, "/fast", token=token) for token in (None, WORKER, None)] == [200] * 3
        sock.close()
    (before, default), *after = sizes
    assert before == PREAUTH_BYTES < default and after == [(default, default)] * 2


def test_what_arrives_past_64_kib_before_a_token_is_held_and_served_once_one_is_given() -> None:
    """A request to an open path without a token, then one with a token and a 100 KB body sent in one piece:
    what the connection sends past its first 64 KiB waits until that token is checked, and is then served (once)."""
    body = b"[" + b" " * 100_000 + b"]"
    head = f"POST /fast HTTP/1.1\r\nHost: cp\r\nAuthorization: Bearer {WORKER}\r\nContent-Length: {len(body)}\r\n\r\n"
    with _guarded(_slow_or_fast, timeout_s=120) as port:
        sock = _connect(port)
        assert _request(sock, "/fast", token=None) == 200
        sock.sendall(head.encode() + body)
        reply = sock.makefile("rb")
        assert reply.readline().startswith(b"HTTP/1.1 200")
        while reply.readline() not in (b"\r\n", b""):
            pass
        assert reply.read(2) == b"ok"
        reply.close()
        assert _request(sock, "/fast") == 200  # the body was taken once: the connection goes on
        sock.close()
