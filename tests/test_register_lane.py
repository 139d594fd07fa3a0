"""A writer's registration over the control plane's registration lane (``knittrans.api.lane``: a plain TCP
action beside HTTP), against real control-plane processes: the route's answers and refusals word for word,
frames that are no registration, the token check, no lane or an unreachable one (HTTP instead), a restart
on a new lane port, a store node that has not registered yet, and concurrent callers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import ServerProcess, job_spec, register_from_threads, server, single_group_units
from gc_support import assert_no_cycles_of_ours, cyclic_gc_off

from knittrans.controlclient import ControlClient
from knittrans.errors import InvalidName, InvalidRequest, NotFound, Unauthenticated
from knittrans.flight import lane
from knittrans.procs import wait_until


def _setup(admin: ControlClient) -> None:
    admin.create_job(job_spec(quotas={"math": 100, "code": 100}, mini_batches_per_step=1, world_size=1))
    admin.register_node("n0", "grpc://127.0.0.1:1", host="h0")


def _lane(url: str) -> dict[str, Any]:
    answer = httpx.get(url + "/v1/lane", timeout=10)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_registrations_go_over_the_lane_with_the_routes_answers(tmp_path: Path) -> None:
    """Registrations ride one kept lane connection (Nagle off) and answer what the HTTP route answers; a repeat
    is a no-op there too; ``GET /v1/lane`` names the port and counts them."""
    with (
        server(tmp_path / "cp.db") as srv,
        ControlClient(srv.url) as client,
        ControlClient(srv.url, lane=False) as plain,
    ):
        _setup(client)
        assert client.lane is not None and plain.lane is None
        first = client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
        over_http = plain.register_units("job1", single_group_units(["math", "code"], prefix="h"))
        assert first.keys() == over_http.keys() and first["registered"] == over_http["registered"] == 2
        sock = client.lane._sock
        assert sock is not None and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        local = sock.getsockname()
        again = client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
        assert (again["registered"], again["duplicates"]) == (0, 2)
        assert client.lane._sock is sock and sock.getsockname() == local
        assert client.status("job1")["counts"]["units"] == 4
        info = _lane(srv.url)
        assert info["served"] == client.lane.served == 2 and info["port"] == sock.getpeername()[1]
        assert info["max_bytes"] == lane.MAX_ACTION_BYTES
        assert client._lean_conn is None  # nothing went over the lean HTTP connection
    assert client.lane._sock is None  # close() closed it


def test_a_dropped_client_is_freed_by_reference_counting(tmp_path: Path) -> None:
    """A client that registered over the lane and HTTP, closed and dropped, leaves no reference cycle (one
    held the client through its lane's finder, so every dropped client waited for the cyclic GC, and a
    trainer's test that counts cycles failed when an earlier test's client was freed during it)."""
    with server(tmp_path / "cp.db") as srv, cyclic_gc_off():
        with ControlClient(srv.url) as client:
            _setup(client)
            client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
            assert client.lane is not None and client.lane.served == 1
        freed = weakref.ref(client)
        del client
        assert freed() is None
        assert_no_cycles_of_ours()


def test_lane_refusals_are_the_routes_refusals_and_keep_the_connection(tmp_path: Path) -> None:
    """Each refusal is raised with the type and the words the HTTP route gives (a bad token, a token scoped to
    another job, an unknown job, a bad body); nothing is registered by them and the same lane connection
    serves the next registration."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt") as srv,
        ControlClient(srv.url, token="at") as admin,
    ):
        _setup(admin)
        other = admin.mint_token("worker", job="job2")
        stranger = admin.mint_token("worker", job="job1")[:-4] + "0000"
        bad = single_group_units(["math"])
        bad[0]["groups"][0]["version_start"] = -3
        cases: list[tuple[str, str, list[dict[str, Any]], type[Exception]]] = [
            ("nope", "job1", single_group_units(["math"]), Unauthenticated),
            (stranger, "job1", single_group_units(["math"]), Unauthenticated),
            (other, "job1", single_group_units(["math"]), Unauthenticated),
            ("wt", "ghost", single_group_units(["math"], job="ghost"), NotFound),
            ("wt", "job1", bad, InvalidRequest),
        ]
        for token, job, units, error in cases:
            with (
                ControlClient(srv.url, token=token) as over_lane,
                ControlClient(srv.url, token=token, lane=False) as over_http,
            ):
                with pytest.raises(error) as by_lane:
                    over_lane.register_units(job, units, node_wait_s=0)
                with pytest.raises(error) as by_http:
                    over_http.register_units(job, units, node_wait_s=0)
                assert str(by_lane.value) == str(by_http.value)
                assert over_lane.lane is not None and over_lane.lane.served == 0
        assert "version_start" in str(by_lane.value)
        assert admin.status("job1")["counts"]["units"] == 0
        with ControlClient(srv.url, token="wt") as worker:
            with pytest.raises(InvalidRequest, match="version_start"):
                worker.register_units("job1", bad)
            assert worker.lane is not None
            kept = worker.lane._sock
            worker.register_units("job1", single_group_units(["math", "code"]))
            assert worker.lane._sock is kept is not None and worker.lane.served == 1
        assert admin.status("job1")["counts"]["units"] == 2


def test_frames_that_are_no_registration_are_refused_and_the_lane_keeps_serving(tmp_path: Path) -> None:
    """Another action type, a body without the job's NUL, an invalid job name, a read and an oversized frame
    get error frames naming what is wrong (a malformed frame also closes its connection); a ping is answered;
    afterwards registrations go through and nothing stored was lost."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client)
        client.register_units("job1", single_group_units(["math"], prefix="before"))
        port = _lane(srv.url)["port"]
        body = json.dumps({"units": single_group_units(["code"], prefix="x")}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            lane.ping(sock, b"")
            for kind, payload, error, words in [
                ("publish_units", b"job1\0" + body, InvalidRequest, "serves 'register_units' actions only"),
                ("register_units", body, InvalidRequest, "no NUL byte between the job's name and the body"),
                ("register_units", b"bad name!\0" + body, InvalidName, "job"),
                ("register_units", b"job1\0{not json", InvalidRequest, "body"),
            ]:
                lane.send_action(sock, b"", kind, payload)
                with pytest.raises(error, match=words):
                    lane.read_action_answer(sock)
            lane.send_request(sock, b"", b"a ticket")
            with pytest.raises(InvalidRequest, match="registrations only, not reads"):
                lane.read_answer(sock)
            lane.send_action(sock, b"", "register_units", b"job1\0" + body)  # the connection still serves
            assert json.loads(lane.read_action_answer(sock))["registered"] == 1
        for frame, words in [
            (b"GET / HTTP/1.1\r\n\r\n", "not b'KTL1'"),
            (b"KTA1" + (lane.MAX_AUTH_BYTES + 1).to_bytes(4, "big") + (1).to_bytes(4, "big"), "authorization of"),
            (b"KTA1" + (0).to_bytes(4, "big") + (lane.MAX_ACTION_BYTES + 1).to_bytes(4, "big"), "more than the"),
        ]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(frame)
                with pytest.raises(InvalidRequest, match=words):
                    lane.read_action_answer(sock)
                with contextlib.suppress(ConnectionResetError):  # closed (reset: it left our frame unread)
                    assert sock.recv(1) == b""
        client.register_units("job1", single_group_units(["math"], prefix="after"))
        assert client.status("job1")["counts"]["units"] == 3
        assert client.lane is not None and client.lane.served == 2


@contextlib.contextmanager
def _http_only_proxy(target_port: int) -> Iterator[str]:
    """A TCP forwarder on 127.0.0.2 to the control plane's HTTP port on 127.0.0.1: a control plane reached
    through an address where only its HTTP port is published (its lane port refuses there)."""
    listener = socket.create_server(("127.0.0.2", 0))
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        src.close()  # each socket is the source of one pump

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", target_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.2:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def test_no_lane_or_an_unreachable_one_means_http(tmp_path: Path) -> None:
    """``--no-lane``: ``GET /v1/lane`` answers 404 and registrations go over HTTP; a lane port that refuses
    (only the HTTP port reachable) is tried once, then HTTP for a while, every registration landing."""
    with server(tmp_path / "off.db", "--no-lane") as srv, ControlClient(srv.url) as client:
        _setup(client)
        assert httpx.get(srv.url + "/v1/lane", timeout=10).status_code == 404
        client.register_units("job1", single_group_units(["math", "code"]))
        assert client.lane is not None and client.lane.served == 0 and client._lean_conn is not None
        assert client.status("job1")["counts"]["units"] == 2
    with server(tmp_path / "on.db") as srv, _http_only_proxy(srv.port) as url, ControlClient(url) as client:
        _setup(client)
        for k in range(3):
            client.register_units("job1", single_group_units(["math", "code"], prefix=f"p{k}"))
        assert client.lane is not None and client.lane.served == 0 and client.lane._retry_at > time.monotonic()
        assert client.status("job1")["counts"]["units"] == 6 and _lane(srv.url)["served"] == 0


def test_a_restarted_control_plane_is_found_on_its_new_lane_port(tmp_path: Path) -> None:
    """The kept connection dies with the control plane (kill -9); after a restart on the same HTTP port its
    lane is on a new port, which the next registration finds and uses."""
    srv = ServerProcess(tmp_path / "cp.db").start()
    try:
        with ControlClient(srv.url) as client:
            _setup(client)
            client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
            old = _lane(srv.url)["port"]
            srv.kill()
            srv.start()
            new = _lane(srv.url)["port"]
            client.register_units("job1", single_group_units(["math", "code"], prefix="b"))
            assert client.lane is not None and client.lane.served == 2 and new != old
            assert _lane(srv.url)["served"] == 1 and client.status("job1")["counts"]["units"] == 4
    finally:
        srv.stop()


def test_units_of_a_node_that_has_not_registered_wait_for_it_over_the_lane(tmp_path: Path) -> None:
    """A registration naming a store node the control plane does not know yet waits for the node (or says so
    with ``node_wait_s=0``), the same over the lane as over HTTP."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client)
        with pytest.raises(NotFound, match="store node 'n9' has not registered"):
            client.register_units("job1", single_group_units(["math"], node="n9"), node_wait_s=0)
        timer = threading.Timer(0.3, lambda: client.register_node("n9", "grpc://127.0.0.1:9", host="h9"))
        timer.start()
        try:
            client.register_units("job1", single_group_units(["math"], node="n9"), node_wait_s=30)
        finally:
            timer.join()
        assert client.lane is not None and client.lane.served == 1
        assert client.status("job1")["counts"]["units"] == 1


def test_concurrent_registrations_all_land(tmp_path: Path) -> None:
    """Registrations from several threads of one client at once: the lane connection serves one at a time, the
    others go over HTTP, and every unit lands once."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        _setup(client)
        assert not register_from_threads(client, threads=4, each=5)
        wait_until(lambda: client.status("job1")["counts"]["units"] == 40, timeout_s=30, what="every unit")
        assert client.lane is not None and 1 <= client.lane.served <= 20
