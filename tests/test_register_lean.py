"""A writer's registration on the control client's kept-alive ``http.client`` connection (the put path's
hot request where the control plane's registration lane is not used: ``ControlClient(lane=False)``
here; tests/test_register_lane.py has the lane), against a real control-plane process: reuse, Nagle
off, error mapping, a dropped connection, https and a busy connection falling back to the pooled
httpx client."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from api_support import ServerProcess, job_spec, register_from_threads, server, single_group_units

from knittrans.controlclient import ControlClient
from knittrans.errors import InvalidRequest, NotFound, Unauthenticated


def _setup(admin: ControlClient) -> None:
    admin.create_job(job_spec(quotas={"math": 100, "code": 100}, mini_batches_per_step=1, world_size=1))
    admin.register_node("n0", "grpc://127.0.0.1:1", host="h0")


def test_registrations_ride_one_kept_alive_connection_with_nagle_off(tmp_path: Path) -> None:
    """Consecutive registrations go over the same open connection (no connect per call), with TCP_NODELAY set
    (``http.client`` sets it; the headers and the body are two writes, which with Nagle on would wait for a
    delayed ACK)."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url, lane=False) as client:
        _setup(client)
        client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
        assert client.status("job1")["counts"]["units"] == 2
        conn = client._lean_conn
        assert conn is not None and conn.sock is not None
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        local = conn.sock.getsockname()
        client.register_units("job1", single_group_units(["math", "code"], prefix="b"))
        assert client._lean_conn is conn and conn.sock is not None and conn.sock.getsockname() == local
        assert client.status("job1")["counts"]["units"] == 4
    assert client._lean_conn is None  # close() closed it


def test_registration_errors_keep_their_types_and_the_connection(tmp_path: Path) -> None:
    """Refusals answered on the lean connection are raised as the pooled client raises them (type and the
    server's words), and the next registration on the same client goes through."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt") as srv,
        ControlClient(srv.url, token="at", lane=False) as admin,
        ControlClient(srv.url, token="wt", lane=False) as worker,
        ControlClient(srv.url, token="nope", lane=False) as stranger,
    ):
        _setup(admin)
        with pytest.raises(Unauthenticated):
            stranger.register_units("job1", single_group_units(["math"]))
        with pytest.raises(NotFound, match="ghost"):
            worker.register_units("ghost", single_group_units(["math"], job="ghost"))
        bad = single_group_units(["math"])
        bad[0]["groups"][0]["version_start"] = -3
        with pytest.raises(InvalidRequest, match="version_start"):
            worker.register_units("job1", bad)
        worker.register_units("job1", single_group_units(["math", "code"]))
        assert admin.status("job1")["counts"]["units"] == 2 and worker._lean_conn is not None


def test_registration_after_a_restart_goes_again_on_a_fresh_connection(tmp_path: Path) -> None:
    """The kept-alive connection dies with the server (kill -9); the next registration, after a restart on the
    same port, is sent again by the pooled client (a repeat is a no-op) and succeeds."""
    srv = ServerProcess(tmp_path / "cp.db").start()
    try:
        with ControlClient(srv.url, lane=False) as client:
            _setup(client)
            client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
            dead = client._lean_conn
            assert dead is not None
            srv.kill()
            srv.start()
            client.register_units("job1", single_group_units(["math", "code"], prefix="b"))
            assert client.status("job1")["counts"]["units"] == 4
            assert client._lean_conn is not dead  # the dead one was dropped
            client.register_units("job1", single_group_units(["math", "code"], prefix="c"))
            assert client._lean_conn is not None and client._lean_conn.sock is not None
    finally:
        srv.stop()


def test_concurrent_registrations_and_https_take_the_pooled_client(tmp_path: Path) -> None:
    """Registrations from several threads at once all land (the one connection serves one at a time; the others
    go by httpx); an https control plane is never asked over the plain connection."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url, lane=False) as client:
        _setup(client)
        assert not register_from_threads(client, threads=4, each=5)
        assert client.status("job1")["counts"]["units"] == 4 * 5 * 2
    with ControlClient("https://127.0.0.1:1") as tls:
        assert tls._lean_at is None
