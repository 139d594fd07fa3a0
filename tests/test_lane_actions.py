"""``publish_units`` on the store's data lane: the same-host writer's round trip, its fallback to Flight,
and bad action requests answered with named errors while the lane keeps serving."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from data_support import make_groups

from knittrans.errors import Conflict, InvalidRequest, Unauthenticated
from knittrans.flight import StoreClient, StoreServer, lane
from knittrans.flight.lane import LaneServer
from knittrans.procs import wait_until
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup
from knittrans.tickets import Ticket, UnitRead

Start = Callable[..., StoreServer]
TOKEN = "action-token"


def _writer(server: StoreServer, store_dir: Path, token: str | None = TOKEN) -> TrajectoryWriter:
    return TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir, token=token)


def _units(tag: str, n: int = 2) -> list[list[TrajectoryGroup]]:
    return [make_groups(2, 4, seed=k, prefix=f"{tag}{k}g") for k in range(n)]


def _read_all(server: StoreServer, unit_id: str) -> int:
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as c:
        return int(c.get(Ticket(job="job", reads=(UnitRead(unit_id=unit_id),))).num_rows)


def _raw(server: StoreServer) -> socket.socket:
    assert server.lane is not None
    return socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)


def _closed(conn: socket.socket) -> bool:
    """Whether the store closed the connection (an end of stream, or a reset when it left bytes unread)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _act(conn: socket.socket, kind: str, body: bytes, token: str | None = TOKEN) -> dict[str, object]:
    lane.send_action(conn, f"Bearer {token}".encode() if token else b"", kind, body)
    answer: dict[str, object] = json.loads(lane.read_action_answer(conn))
    return answer


def test_same_host_writer_publishes_over_the_lane_and_over_flight_without_one(
    start_server: Start, store_dir: Path, tmp_path: Path
) -> None:
    """With a lane the writer's publish goes there (one action per call, nothing on Flight's publish); the
    units are sealed and read back whole. A store without a lane gets the same units over Flight."""
    server = start_server(token=TOKEN)
    assert server.lane is not None
    with _writer(server, store_dir) as w:
        descs = w.write_units(_units("a"))
        assert server.lane.actions_served == 1
        w.write_units(_units("b", 3))
        assert server.lane.actions_served == 2
    for d in descs:
        assert _read_all(server, d.unit_id) == d.num_rows == 8
        assert d.num_bytes > 0
    plain = start_server(root=tmp_path / "plain", data_lane=False, token=TOKEN)
    assert plain.lane is None
    with _writer(plain, tmp_path / "plain") as w:
        (d,) = w.write_units(_units("c", 1))
    assert _read_all(plain, d.unit_id) == 8


def test_a_lane_without_actions_is_answered_like_a_store_from_before_them(start_server: Start, store_dir: Path) -> None:
    """A lane that serves reads only refuses an action request by its magic and closes the connection;
    the client then publishes over Flight, and keeps to Flight for its later actions."""
    server = start_server(token=TOKEN)
    assert server.lane is not None
    server.lane._act = None  # what a store from before lane actions runs: the same lane without them
    with _raw(server) as conn:
        with pytest.raises(lane.NoLaneActions, match=r"starts with b'KTA1', not b'KTL1'"):
            _act(conn, "publish_units", b"{}")
        assert _closed(conn)
    with _writer(server, store_dir) as w:
        first = w.write_units(_units("a"))
        assert not w.client._lane_actions
        served = server.lane.served
        second = w.write_units(_units("b"))
    assert server.lane.actions_served == 0 and server.lane.served == served
    assert [_read_all(server, d.unit_id) for d in first + second] == [8, 8, 8, 8]


def test_bad_lane_actions_get_named_errors_and_nothing_stored_is_lost(start_server: Start, store_dir: Path) -> None:
    """Wrong token, no type separator, an action the lane does not serve, a body that is no JSON or names no
    writer's temporary: the error Flight would raise, on a connection that stays usable; an oversize body:
    a named error, then the connection closes. Units stored before stay readable, and a writer publishes
    after each."""
    server = start_server(token=TOKEN)
    with _writer(server, store_dir) as w:
        kept = w.write_units(_units("k"))
    bad_dir = json.dumps({"job": "job", "units": [{"unit": "x1", "dir": str(store_dir / "job" / "x1")}]}).encode()
    with _raw(server) as conn:
        with pytest.raises(Unauthenticated, match="wrong bearer token"):
            _act(conn, "publish_units", b"{}", token="not-the-token")
        with pytest.raises(Unauthenticated, match="missing bearer token"):
            _act(conn, "publish_units", b"{}", token=None)
        auth = f"Bearer {TOKEN}".encode()
        conn.sendall(lane.ACTION_MAGIC + struct.pack("!II", len(auth), 5) + auth + b"stats")
        with pytest.raises(InvalidRequest, match="no NUL byte between the action's type and its body"):
            lane.read_action_answer(conn)
        with pytest.raises(InvalidRequest, match="action 'delete' is not served on the data lane"):
            _act(conn, "delete", b'{"job": "job", "unit": "x"}')
        with pytest.raises(InvalidRequest, match="action 'publish_units': body is not JSON"):
            _act(conn, "publish_units", b"{not json")
        with pytest.raises(InvalidRequest, match="body must be a JSON object with keys"):
            _act(conn, "publish_units", b'{"job": "job"}')
        with pytest.raises(Conflict, match="is not a writer's temporary"):
            _act(conn, "publish_units", bad_dir)
        with pytest.raises(InvalidRequest, match="'units' must be a list of 1 to"):
            _act(conn, "publish_units", b'{"job": "job", "units": []}')  # the same connection, still in step
    with _raw(server) as conn:
        conn.sendall(lane.ACTION_MAGIC + struct.pack("!II", 0, lane.MAX_ACTION_BYTES + 1))
        with pytest.raises(InvalidRequest, match=f"action of {lane.MAX_ACTION_BYTES + 1} bytes, more than"):
            lane.read_action_answer(conn)
        assert _closed(conn)
    with _writer(server, store_dir) as w:
        later = w.write_units(_units("l"))
    assert [_read_all(server, d.unit_id) for d in kept + later] == [8, 8, 8, 8]


def test_a_pooled_lane_connection_the_store_dropped_is_replaced(start_server: Start, store_dir: Path) -> None:
    """The store closes a lane connection idle past its limit; the writer's next publish finds its pooled
    connection closed before any answer (nothing was done) and sends it again on a fresh one."""
    server = start_server(token=TOKEN)
    assert server.lane is not None
    server.lane.idle_timeout_s = 0.2
    with _writer(server, store_dir) as w:
        w.write_units(_units("a", 1))
        lane_server = server.lane
        wait_until(
            lambda: lane_server.open_connections == 0, timeout_s=10, what="the lane dropping the idle connection"
        )
        assert server.lane.open_connections == 0  # the store dropped it; the writer still holds it pooled
        (d,) = w.write_units(_units("b", 1))
    assert server.lane.actions_served == 2
    assert _read_all(server, d.unit_id) == 8


def test_a_store_restarted_with_its_lane_on_a_new_port_takes_the_next_publish_there(
    start_server: Start, store_dir: Path
) -> None:
    """A store restarted on its Flight port opens its lane on a new port. The writer's pooled connection
    to the old lane is closed and the old port refuses: the writer asks the store for the port again
    and publishes over the new lane in the same call, with no failure and nothing sent over Flight."""
    server = start_server(token=TOKEN)
    assert server.lane is not None
    with _writer(server, store_dir) as w:
        w.write_units(_units("a", 1))  # the lane connection is now pooled
        old = server.lane.port
        server.lane.close()
        server.lane = LaneServer("127.0.0.1", 0, read=server.read_ticket, auth=server.auth, act=server.lane_act)
        assert server.lane.port != old
        (d,) = w.write_units(_units("b", 1))
        assert server.lane.actions_served == 1 and w.client.lane_port() == server.lane.port
        for conn in w.client._lane_idle:  # no pooled connection this time, only the port known
            conn.close()
        w.client._lane_idle.clear()
        old = server.lane.port
        server.lane.close()
        server.lane = LaneServer("127.0.0.1", 0, read=server.read_ticket, auth=server.auth, act=server.lane_act)
        (e,) = w.write_units(_units("c", 1))
        assert server.lane.actions_served == 1 and w.client._lane_failures == 0
    assert [_read_all(server, u.unit_id) for u in (d, e)] == [8, 8]
