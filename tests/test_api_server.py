"""The control plane as a real uvicorn process: long-poll wake-up, kill -9 and restart, ControlClient."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from api_support import ServerProcess, job_spec, rows_of, server, single_group_units

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import Conflict, InvalidJobSpec, NotFound, Unauthenticated, Unavailable
from knittrans.manifest import Manifest
from knittrans.retry import RetryPolicy


def _setup(admin: ControlClient, **spec: Any) -> None:
    admin.create_job(job_spec(**spec))
    admin.register_node("n0", "grpc://127.0.0.1:1", host="h0")


@pytest.mark.timing
def test_long_poll_wakes_when_a_mini_batch_is_admitted(tmp_path: Path) -> None:
    """A rank waiting for a manifest gets it when a registration admits the mini-batch; 204 -> None on timeout."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 1, "code": 1}, mini_batches_per_step=1, world_size=1)
        assert client.manifest("job1", 0, timeout_s=0.1) is None
        got: list[tuple[Manifest, str] | None] = []
        waiter = threading.Thread(target=lambda: got.append(client.manifest("job1", 0, timeout_s=20)))
        with ControlClient(srv.url) as writer:
            waiter.start()
            threading.Event().wait(0.3)
            assert not got  # still waiting
            writer.register_units("job1", single_group_units(["math", "code"]))
        waiter.join(10)
        found = got[0]
        assert found is not None and found[0].global_index == 0
        assert {g.group_id for g in found[0].groups} == {"g0", "g1"}


def test_client_maps_errors_to_knittrans_exceptions(tmp_path: Path) -> None:
    """ControlClient raises the errors.py exception matching each HTTP error."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt") as srv,
        ControlClient(srv.url, token="at") as admin,
        ControlClient(srv.url, token="wt") as worker,
    ):
        with pytest.raises(InvalidJobSpec, match="policy"):
            admin.create_job(job_spec(policy="nope"))
        with pytest.raises(Unauthenticated):
            worker.create_job(job_spec())
        _setup(admin)
        with pytest.raises(NotFound, match="ghost"):
            worker.heartbeat("ghost")
        admin.declare_lost("n0")
        with pytest.raises(Conflict):
            worker.heartbeat("n0")
        with pytest.raises(NotFound, match="never issued"):
            worker.ack("job1", 5, 0)
    with ControlClient(srv.url, retries=2, retry=RetryPolicy(first_backoff_s=0.01)) as gone, pytest.raises(Unavailable):
        gone.health()


@pytest.mark.timing
def test_kill_9_and_restart_continue_the_job(tmp_path: Path) -> None:
    """After SIGKILL and a restart on the same db: a rank's ack is kept, the un-consumed manifest is the same
    bytes, a waiting rank retries until the server is back, and nothing is admitted twice."""
    db = tmp_path / "cp.db"
    srv = ServerProcess(db).start()
    try:
        with ControlClient(srv.url) as client:
            _setup(client, quotas={"math": 2, "code": 2}, mini_batches_per_step=2, world_size=2)
            client.report_supply("job1", started={"math": 4, "code": 4})
            out = client.register_units("job1", single_group_units(["math", "code", "math", "code"]))
            assert out["admitted"] == [0, 1]
            delivered: list[Manifest] = []
            got = client.manifest("job1", 0, timeout_s=1)
            assert got is not None
            for rank in (0, 1):  # each rank for itself
                client.ack("job1", 0, got[0].attempt, [rank])
            delivered.append(got[0])
            held = client.manifest("job1", 1, timeout_s=1)  # mini-batch 1: rank 0 acked it, rank 1 not yet
            assert held is not None and held[0].global_index == 1
            client.ack("job1", 1, held[0].attempt, [0], version=1)
            srv.kill()
            result: list[tuple[Manifest, str] | None] = []
            # a rank asking while the control plane is down retries until it is back
            asker = threading.Thread(target=lambda: result.append(client.manifest("job1", 1, timeout_s=5)))
            asker.start()
            threading.Event().wait(0.3)
            srv.start()
            asker.join(30)
            assert result[0] == held  # the same manifest, the same ETag
            assert client.get_version("job1") == 1
            assert client.status("job1")["next_global_index"] == 2
            assert client.progress("job1")["in_flight"][0]["acked_ranks"] == [[0, 1]]
            assert client.ack("job1", 1, held[0].attempt, [0])["duplicate"]
            assert client.ack("job1", 1, held[0].attempt, [1])["consumed"]
            assert client.ack("job1", 1, held[0].attempt, [1])["duplicate"]  # a retried ack is a no-op
            delivered.append(held[0])
            out = client.register_units("job1", single_group_units(["code", "math", "math", "code"], start=4))
            assert out["admitted"] == [2, 3]
            for n in (2, 3):
                got = client.manifest("job1", n, timeout_s=1)
                assert got is not None
                assert client.ack("job1", n, got[0].attempt)["consumed"]
                delivered.append(got[0])
            assert client.manifest("job1", 4, timeout_s=0.1) is None
    finally:
        srv.stop()
    assert [m.global_index for m in delivered] == [0, 1, 2, 3]
    rows = rows_of([m.share(rank) for m in delivered for rank in (0, 1)])
    assert len(rows) == len(set(rows)) == 16


@pytest.mark.timing
def test_manifests_end_when_the_job_completes(tmp_path: Path) -> None:
    """Reading and acking mini-batch after mini-batch of a job with total_steps ends in JobFinished once it is
    complete."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client, quotas={"math": 2}, mini_batches_per_step=2, world_size=1, total_steps=1)
        client.register_units("job1", single_group_units(["math", "math", "math"]))
        seen = []
        with pytest.raises(JobFinished):
            for n in range(10):
                got = client.manifest("job1", n, timeout_s=2)
                assert got is not None
                seen.append(got[0].global_index)
                client.ack("job1", n, got[0].attempt)
        assert seen == [0, 1]
        assert client.get_job("job1")["state"] == "completed"


def test_polls_keep_their_connection() -> None:
    """Long-polls for one mini-batch after another travel on one kept connection (no connect per mini-batch,
    no ``Connection: close``), apart from the connection of ordinary calls. Seen on the wire by a recording
    socket that answers every request of a connection until the client ends it."""
    import socket

    seen: list[list[bytes]] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_connection(conn: socket.socket, heads: list[bytes]) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                heads.append(head.lower())
                if b"/minibatches/" in head:
                    conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
                else:
                    body = b'{"job": "job1", "version": 3}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                        + str(len(body)).encode()
                        + b"\r\n\r\n"
                        + body
                    )

    def serve() -> None:
        for _ in range(2):
            conn, _addr = listener.accept()
            heads: list[bytes] = []
            seen.append(heads)
            threading.Thread(target=serve_connection, args=(conn, heads), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with listener, ControlClient(f"http://127.0.0.1:{port}", retries=0) as client:
        for n in range(3):
            assert client.manifest("job1", n, timeout_s=1) is None
        assert client.get_version("job1") == 3
        thread.join(10)
    polls, plain = seen
    paths = [h.split(b" ")[1].decode() for h in polls]
    assert paths == [f"/v1/jobs/job1/minibatches/{n}?timeout_s=1" for n in range(3)]
    assert not any(b"connection: close" in h for h in polls)
    assert len(plain) == 1 and b"get /v1/jobs/job1/version" in plain[0]


def test_a_call_that_connects_after_close_closes_its_own_connection() -> None:
    """``close()`` while a call is already past the client's check but not yet connected (the trainer's
    early start calls ``list_nodes`` in its own thread): the pool the call connects through is closed and
    no longer closes anything, so the call closes its kept-alive connection itself. Seen by the server:
    the connection ends instead of staying open until garbage collection."""
    import socket

    import httpx

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ended = threading.Event()

    def serve() -> None:
        conn, _addr = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            body = b'{"status": "ok"}'
            head_out = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            conn.sendall(head_out.encode() + body)  # keep-alive: the client decides when it ends
            conn.settimeout(10)
            if conn.recv(1) == b"":
                ended.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with listener:
        client = ControlClient(f"http://127.0.0.1:{port}", retries=0)
        inner = client._http._transport

        class CloseFirst(httpx.BaseTransport):
            """The client is closed between the call's start and its connect."""

            def handle_request(self, request: httpx.Request) -> httpx.Response:
                client.close()
                return inner.handle_request(request)

            def close(self) -> None:
                inner.close()

        client._http._transport = CloseFirst()
        assert client.health()["status"] == "ok"
        assert ended.wait(10), "the connection opened after close() stayed open"
        thread.join(10)
