"""The store's bulk data lane: same answer as DoGet, typed errors for bad input, auth, limits, fallback."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from data_support import make_groups

from knittrans.errors import InvalidRequest, InvalidTicket, NotFound, Unauthenticated, Unavailable
from knittrans.flight import StoreClient, StoreServer, StoreServerConfig, cli, lane
from knittrans.grants import sign_grant
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import wait_until
from knittrans.schema import UnitTables, build_unit_tables
from knittrans.store import StoreConfig
from knittrans.tickets import MAX_TICKET_BYTES, Ticket, UnitRead
from knittrans.trainer.client import TrainerClient, TrainerConfig
from knittrans.trainer.fetch import Fetcher
from tests.trainer_support import job_spec, mm_groups, write_and_register

Start = Callable[..., StoreServer]
TOKEN = "lane-token"


def _unit(seed: int, n: int = 3) -> UnitTables:
    return build_unit_tables(make_groups(n, 4, seed=seed, prefix=f"u{seed}g"))


def _rows(job: str, *reads: tuple[str, tuple[tuple[int, int], ...]], columns: tuple[str, ...] | None = None) -> Ticket:
    return Ticket(job=job, reads=tuple(UnitRead(unit_id=u, row_ranges=r) for u, r in reads), columns=columns)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches():
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def _filled(start: Start, **kw: object) -> tuple[StoreServer, dict[str, UnitTables]]:
    server = start(data_lane_port=0, batch_bytes=2048, token=TOKEN, **kw)
    units = {f"u{i}": _unit(i) for i in range(3)}
    with StoreClient(server.endpoint, token=TOKEN) as c:
        for uid, t in units.items():
            c.put_unit("job", uid, t.traj, t.media)
    return server, units


def _raw(server: StoreServer) -> socket.socket:
    assert server.lane is not None
    return socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)


def _request(conn: socket.socket, ticket: bytes, token: str | None = TOKEN) -> pa.Table:
    lane.send_request(conn, b"" if token is None else f"Bearer {token}".encode(), ticket)
    return lane.read_answer(conn)


def test_lane_answers_what_doget_answers_byte_for_byte(start_server: Start) -> None:
    """Row ranges over several units, column projections, whole units and media: the lane's table has DoGet's
    schema, batches and bytes (its IPC stream is identical), and the lane (not DoGet) served every read."""
    server, units = _filled(start_server)
    assert server.lane is not None
    hashes = tuple(h.hex() for h in units["u1"].media.column("media_hash").to_pylist())
    tickets = [
        _rows("job", ("u0", ())),
        _rows("job", ("u2", ((0, 2), (5, 6))), ("u0", ((11, 12),)), ("u1", ())),
        _rows("job", ("u1", ((3, 9),)), ("u2", ()), columns=("response_logprobs", "traj_id")),
        _rows("job", ("u0", ((0, 12),)), columns=("reward",)),
        Ticket(job="job", kind="media", media_hashes=hashes),
    ]
    with (
        StoreClient(server.endpoint, token=TOKEN, data_lane=False) as c,
        StoreClient(server.endpoint, token=TOKEN) as lc,
    ):
        for i, ticket in enumerate(tickets):
            want, got = c.get(ticket), lc.lane_get(ticket)
            assert got.schema.equals(want.schema, check_metadata=True)
            assert [b.num_rows for b in got.to_batches()] == [b.num_rows for b in want.to_batches()]
            assert _ipc(got) == _ipc(want) and got.num_rows > 0
            assert server.lane.served == i + 1  # a silent fallback to DoGet would not count here
        assert server.lane.served == len(tickets)


def test_lane_table_lives_in_one_received_buffer(start_server: Start) -> None:
    """The client's record batches are zero-copy views of the one buffer the answer was received into."""
    server, _units = _filled(start_server)
    with StoreClient(server.endpoint, token=TOKEN) as c:
        got = c.lane_get(_rows("job", ("u0", ()), ("u1", ())))
    _, nbytes = lane.ipc_parts(server.read_ticket(_rows("job", ("u0", ()), ("u1", ())).encode()))
    spans = [
        (b.address, b.address + b.size)
        for col in got.columns
        for chunk in col.chunks
        for b in chunk.buffers()
        if b is not None and b.size
    ]
    assert max(e for _, e in spans) - min(s for s, _ in spans) <= nbytes  # all inside one answer-sized block


def test_client_with_data_lane_uses_it_and_falls_back_to_doget_without_one(start_server: Start, tmp_path: Path) -> None:
    """``data_lane=True`` reads through the lane when the store has one, through DoGet when it has none;
    ``lane_get`` never falls back."""
    server, units = _filled(start_server)
    plain = start_server(token=TOKEN, root=tmp_path, data_lane=False)
    with StoreClient(plain.endpoint, token=TOKEN) as c:
        c.put_unit("job", "u0", units["u0"].traj, units["u0"].media)
    ticket = _rows("job", ("u0", ((2, 7),)))
    want = units["u0"].traj.slice(2, 5)
    assert server.lane is not None
    with StoreClient(server.endpoint, token=TOKEN, data_lane=True) as c:
        assert c.lane_port() == server.lane.port
        assert c.get(ticket).equals(want) and server.lane.served == 1
        assert pa.Table.from_batches(list(c.stream(ticket))).equals(want) and server.lane.served == 2
    with StoreClient(plain.endpoint, token=TOKEN, data_lane=True) as c:
        assert c.lane_port() is None
        assert c.get(ticket).equals(want)
        assert pa.Table.from_batches(list(c.stream(ticket))).equals(want)
        with pytest.raises(Unavailable, match="has no data lane"):
            c.lane_get(ticket)


def test_fetcher_with_data_lane_reads_a_joined_ticket_over_the_lane(start_server: Start) -> None:
    """A Fetcher with ``data_lane`` reads a node's joined ticket (a share's call) in one lane read, same as DoGet."""
    server, _units = _filled(start_server)
    ticket = _rows("job", ("u1", ((0, 4),)), ("u0", ((6, 8),)))
    with Fetcher(token=TOKEN, data_lane=False) as plain, Fetcher(token=TOKEN) as fast:
        want = pa.Table.from_batches(list(plain.stream("n0", server.endpoint, ticket)))
        assert server.lane is not None and server.lane.served == 0 and want.num_rows == 6
        got = pa.Table.from_batches(list(fast.stream("n0", server.endpoint, ticket)))
        assert got.equals(want) and server.lane.served == 1


def test_bad_lane_requests_get_named_errors_and_the_lane_keeps_serving(start_server: Start) -> None:
    """Bad ticket, unknown unit, bad range: the error DoGet raises, on a connection that stays usable; bad magic
    and oversize lengths: a named error, then the connection closes (tests/test_data_lane_auth.py: tokens). The
    store serves a good request after each."""
    server, units = _filled(start_server)
    good = _rows("job", ("u0", ((0, 3),)))
    want = units["u0"].traj.slice(0, 3)
    with _raw(server) as conn:
        with pytest.raises(InvalidTicket, match="ticket is not JSON"):
            _request(conn, b"{not json")
        with pytest.raises(InvalidTicket, match=r"unit_id '\.\./etc' is not a valid name"):
            _request(conn, b'{"v":1,"job":"job","reads":[{"unit":"../etc"}]}')
        with pytest.raises(NotFound, match="unit 'missing' of job 'job' is not on this node"):
            _request(conn, _rows("job", ("missing", ())).encode())
        with pytest.raises(InvalidRequest, match=r"row range \[0, 99\) is out of range"):
            _request(conn, _rows("job", ("u0", ((0, 99),))).encode())
        assert _request(conn, good.encode()).equals(want)  # same connection, still in step
    framing = {
        "bad magic": (b"HTTP" + struct.pack("!II", 0, 0), InvalidRequest, "starts with b'HTTP', not b'KTL1'"),
        "oversize ticket": (
            lane.MAGIC + struct.pack("!II", 0, MAX_TICKET_BYTES + 1),
            InvalidTicket,
            f"ticket is {MAX_TICKET_BYTES + 1} bytes, more than the {MAX_TICKET_BYTES} allowed",
        ),
        "oversize auth": (
            lane.MAGIC + struct.pack("!II", 1 << 20, 10),
            InvalidRequest,
            f"authorization of {1 << 20} bytes, more than {lane.MAX_AUTH_BYTES}",
        ),
    }
    for what, (head, kind, message) in framing.items():
        with _raw(server) as conn:
            conn.sendall(head)
            with pytest.raises(kind, match=message):
                lane.read_answer(conn)
            assert conn.recv(1) == b"", what  # closed: the stream cannot be resynchronised
        with StoreClient(server.endpoint, token=TOKEN) as c:
            assert c.lane_get(good).equals(want), what


def test_lane_refuses_without_the_token_like_flight(start_server: Start) -> None:
    """A store with a token refuses lane reads without it (and Flight refuses the lane discovery too)."""
    server, _ = _filled(start_server)
    ticket = _rows("job", ("u0", ()))
    with StoreClient(server.endpoint, token="wrong", data_lane=True) as c:
        with pytest.raises(Unauthenticated):
            c.get(ticket)
        assert server.lane is not None
        c._lane_port = server.lane.port  # skip the refused discovery: the lane itself must refuse
        with pytest.raises(Unauthenticated, match="wrong bearer token"):
            c.lane_get(ticket)
    with StoreClient(server.endpoint) as c:
        c._lane_port = server.lane.port
        with pytest.raises(Unauthenticated, match="missing bearer token"):
            c.lane_get(ticket)
    assert server.lane.served == 0


def test_signed_store_checks_the_lane_tickets_grants(start_server: Start) -> None:
    """On a store with a ticket key the lane serves a ticket its grant covers and refuses unsigned, widened
    and forged ones, as DoGet does."""
    key = "lane-key"
    server, units = _filled(start_server, ticket_key=key)
    grant = sign_grant(
        key.encode(), job="job", expires_at=time.time() + 60, reads={"u1": [(0, 6)]}, columns=None, media={}
    )
    ok = Ticket(job="job", reads=(UnitRead(unit_id="u1", row_ranges=((1, 5),)),), grants=(grant,))
    with StoreClient(server.endpoint, token=TOKEN) as c:
        assert c.lane_get(ok).equals(units["u1"].traj.slice(1, 4))
        with pytest.raises(Unauthenticated, match="no grant"):
            c.lane_get(dataclasses.replace(ok, grants=()))
        with pytest.raises(Unauthenticated, match="not granted"):
            c.lane_get(dataclasses.replace(ok, reads=(UnitRead(unit_id="u1", row_ranges=((1, 9),)),)))
        with pytest.raises(Unauthenticated, match="signature"):
            c.lane_get(dataclasses.replace(ok, grants=(grant[:-4] + "0000",)))
        assert c.lane_get(ok).num_rows == 4


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (end of stream, or a reset, is waiting to be read)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.timing
def test_slow_idle_and_excess_connections_cannot_pin_the_lane(start_server: Start) -> None:
    """A first request that stalls gets a named error after the token timeout, a later one after the request
    timeout; a connection that sends nothing is closed; an admitted idle connection is closed; connections over
    the limit are refused with Unavailable; a good read works after each, and a pooled connection the lane closed
    meanwhile is replaced transparently."""
    server, units = _filled(start_server)
    assert server.lane is not None
    server.lane.close()
    server.lane = lane.LaneServer(
        "127.0.0.1",
        0,
        read=server.read_ticket,
        auth=server.auth,
        auth_timeout_s=0.3,
        request_timeout_s=0.3,
        idle_timeout_s=0.5,
        max_connections=3,
    )
    lane_server = server.lane
    good = _rows("job", ("u2", ()))
    with StoreClient(server.endpoint, token=TOKEN) as c:
        assert c.lane_get(good).equals(units["u2"].traj)
        with _raw(server) as slow:
            slow.sendall(lane.MAGIC + b"\x00")  # then nothing
            with pytest.raises(InvalidRequest, match="header did not arrive within the time limit"):
                lane.read_answer(slow)
            assert slow.recv(1) == b""
        with _raw(server) as slow:
            _request(slow, good.encode())  # admitted; the next request stalls
            slow.sendall(lane.MAGIC + b"\x00")
            with pytest.raises(InvalidRequest, match="header did not arrive within the time limit"):
                lane.read_answer(slow)
        with _raw(server) as silent:
            assert silent.recv(1) == b""  # closed without a word after auth_timeout_s
        with _raw(server) as idle:
            lane.ping(idle, f"Bearer {TOKEN}".encode())  # admitted
            assert idle.recv(1) == b""  # closed after idle_timeout_s without a further request
        old = c._lane_idle.pop()  # c's connection of its first read
        fresh, pooled = c._lane_connection(server.lane.port)
        assert not pooled
        lane.ping(fresh, f"Bearer {TOKEN}".encode())
        for conn in (old, fresh):
            c._lane_release(conn, True)  # the first one and a fresh one: two idle connections in c's pool
        pooled = list(c._lane_idle)
        assert len(pooled) == 2
        wait_until(  # the lane closes them after idle_timeout_s
            lambda: all(_peer_closed(s) for s in pooled), timeout_s=10, what="the lane to close c's idle connections"
        )
        assert c.lane_get(good).equals(units["u2"].traj)  # stale ones dropped, retried on a fresh connection
        assert len(c._lane_idle) == 1
        with _raw(server) as a, _raw(server) as b:  # with c's pooled connection: 3 open
            assert _request(a, good.encode()).num_rows == _request(b, good.encode()).num_rows
            with _raw(server) as third, pytest.raises(Unavailable, match="at most 3 connections"):
                _request(third, good.encode())
        wait_until(lambda: lane_server.open_connections == 1, timeout_s=10, what="the lane to see a and b close")
        assert c.lane_get(good).equals(units["u2"].traj)


def test_tls_store_refuses_a_data_lane(tmp_path: Path) -> None:
    """The lane is plain TCP: a TLS store configuration with an explicit lane port is refused, and so is the
    CLI (without one, a TLS store opens no lane: tests/test_tls.py)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    with pytest.raises(ValueError, match="data lane is plain TCP and this store serves TLS"):
        StoreServerConfig(tls_cert=cert, tls_key=key, data_lane_port=0)
    with pytest.raises(ValueError, match="data_lane_port must be in"):
        StoreServerConfig(data_lane_port=70000)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--dir", str(tmp_path), "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key), "--data-lane-port", "0"]
    )
    assert cli.run(args) == 2


@pytest.mark.timing
def test_shutdown_closes_the_lane(start_server: Start) -> None:
    """Stopping the store stops its lane and its Flight server: a client then gets Unavailable, not a hang."""
    server, _ = _filled(start_server)
    assert server.lane is not None
    port = server.lane.port
    with StoreClient(server.endpoint, token=TOKEN, timeout_s=5) as c:
        assert c.lane_get(_rows("job", ("u0", ()))).num_rows == 12
        server.shutdown()
        with pytest.raises(Unavailable):
            c.lane_get(_rows("job", ("u0", ())))
        with pytest.raises(Unavailable):
            c.health()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.fixture(scope="module")
def lane_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Control plane and two store processes with data lanes, signed tickets and a token."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KNITTRANS_TICKET_KEY", "lane-cluster-ticket-key-0123456789")
    try:
        config = ClusterConfig(
            work_dir=tmp_path_factory.mktemp("lane"), num_stores=2, worker_token="lane-worker"
        )  # stores open their lanes by default
        with LocalCluster(config) as c:
            yield c
    finally:
        mp.undo()


@pytest.mark.timing
def test_trainer_with_data_lane_reads_a_signed_plan_from_store_processes(lane_cluster: LocalCluster) -> None:
    """A rank with ``data_lane`` (eager and iter, through share streams) gets the same
    tensors and media as one reading through DoGet, from real store processes, over their lanes."""
    control = lane_cluster.control()
    control.create_job(job_spec("lane-train", groups=4, group_size=4, k=1, world_size=1, micro_batch_size=3))
    groups = mm_groups("lane-train", 4, group_size=4)
    write_and_register(control, "lane-train", lane_cluster.stores, groups, groups_per_unit=2, token="lane-worker")
    got_manifest = control.manifest("lane-train", 0, timeout_s=30)
    assert got_manifest is not None
    plan = got_manifest[0].share(0)
    results = {}
    for lane_on, mode in itertools.product((False, True), ("eager", "iter")):
        cfg = TrainerConfig(
            control_url=lane_cluster.control_url,
            job="lane-train",
            rank=0,
            world_size=1,
            token="lane-worker",
            store_token="lane-worker",
            fetch_mode=mode,  # type: ignore[arg-type]
            poll_timeout_s=5,
            data_lane=lane_on,
        )
        with TrainerClient(cfg) as client:
            got = list(client.minibatch(plan))
            ports = {e: c.lane_port() for e, c in client.fetcher._clients.items()}
        assert len(ports) == 2 and all(p is not None for p in ports.values())  # get/stream -> lane_get (no fallback)
        assert all(c.data_lane is lane_on for c in client.fetcher._clients.values())
        results[lane_on, mode] = got
    want = results[False, "eager"]
    assert sum(int(m.batch.num_rows) for m in want) == 16
    for key, got in results.items():
        assert len(got) == len(want), key
        for a, b in zip(got, want, strict=True):
            for name in ("response_ids", "response_logprobs", "loss_mask", "rewards", "prompt_ids"):
                x, y = getattr(a.batch, name), getattr(b.batch, name)
                assert (x is None and y is None) or torch.equal(x, y), (key, name)
            assert a.media.keys() == b.media.keys() and all(torch.equal(a.media[h], b.media[h]) for h in a.media)


def test_server_settings_that_do_not_go_together_are_refused_and_a_busy_lane_port_frees_the_flight_port(
    store_dir: Path,
) -> None:
    """A certificate without its key, a port out of range, a limit that is not positive, an empty token or a
    node id that is not a name are refused when the config is made; a lane port that is taken fails the
    server's start and gives its Flight port back (a retry on that port starts)."""
    for kw, why in [
        ({"tls_cert": store_dir / "cert.pem"}, "tls_cert and tls_key go together"),
        ({"port": 65536}, r"port must be in \[0, 65535\], not 65536"),
        ({"max_put_bytes": 0}, "max_put_bytes and batch_bytes must be positive"),
        ({"token": ""}, "token must be non-empty or None"),
        ({"node_id": "../node"}, "node_id '../node' is not a valid name"),
    ]:
        with pytest.raises(ValueError, match=why):
            StoreServerConfig(**kw)  # type: ignore[arg-type]
    store = StoreConfig(root=store_dir)
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        with pytest.raises(OSError):
            StoreServer(StoreServerConfig(store=store, port=port, data_lane_port=taken.getsockname()[1]))
    server = StoreServer(StoreServerConfig(store=store, port=port))
    try:
        assert server.port == port and server.lane is not None
    finally:
        server.shutdown()


def test_broken_lane_answers_are_refused_as_such() -> None:
    """What a client reads is checked: a ping answered with a body is no lane, an error message over the limit,
    an answer cut short, an answer that stops arriving and a body that is no Arrow IPC stream are Unavailable
    (its reads then go through DoGet)."""

    def answer(data: bytes, *, ping: bool = False, close: bool = True) -> None:
        client, peer = socket.socketpair()
        with client, peer:
            lane._socket_timeouts(client, 0.2)
            peer.sendall(data)
            if close:
                peer.shutdown(socket.SHUT_WR)
            if ping:
                lane.ping(client, b"")
            else:
                lane.read_answer(client)

    head = struct.Struct("!4sBQ")
    with pytest.raises(lane.NotALane, match="answered the ping with a 5-byte body"):
        answer(head.pack(lane.MAGIC, lane.OK, 5) + b"12345", ping=True)
    with pytest.raises(Unavailable, match=f"error message of {lane.MAX_ERROR_BYTES + 1} bytes"):
        answer(head.pack(lane.MAGIC, lane.ERROR, lane.MAX_ERROR_BYTES + 1))
    with pytest.raises(Unavailable, match="connection closed after 3 of 10 bytes of the record batches"):
        answer(head.pack(lane.MAGIC, lane.OK, 10) + b"abc")
    with pytest.raises(Unavailable, match="no data for the record batches within the timeout"):
        answer(head.pack(lane.MAGIC, lane.OK, 10) + b"abc", close=False)
    with pytest.raises(Unavailable, match="data lane: the answer is no Arrow IPC stream"):
        answer(head.pack(lane.MAGIC, lane.OK, 10) + b"0123456789")
