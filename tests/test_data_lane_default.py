"""The data lane by default: stores open it (not with TLS or ``--no-data-lane``), clients use it and fall back
to DoGet when it cannot be reached, and pooled receive buffers are reused only once nothing references them."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from data_support import make_groups

from knittrans.errors import Unavailable
from knittrans.flight import StoreClient, StoreServer, StoreServerConfig, cli, lane
from knittrans.flight.client import LANE_RETRY_S
from knittrans.flight.lane import LaneServer
from knittrans.flight.recv_pool import ReceivePool, size_class
from knittrans.schema import UnitTables, build_unit_tables
from knittrans.tickets import Ticket, UnitRead

Start = Callable[..., StoreServer]
TOKEN = "lane-default-token"
MiB = 1 << 20


def _whole(unit: str) -> Ticket:
    return Ticket(job="job", reads=(UnitRead(unit_id=unit),))


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _span(table: pa.Table) -> tuple[int, int]:
    """First and last byte address of the table's buffers (one received block for a lane answer)."""
    bufs = [b for col in table.columns for ch in col.chunks for b in ch.buffers() if b is not None and b.size]
    return min(b.address for b in bufs), max(b.address + b.size for b in bufs)


def _disjoint(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[1] <= b[0] or b[1] <= a[0]


def _store_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--dir", "/tmp/unused", *extra])


def test_default_store_opens_a_lane_and_a_default_client_reads_over_it(start_server: Start) -> None:
    """No lane option anywhere: the CLI's and the config's defaults open a lane, a default client reads over it."""
    args = _store_args()
    assert args.data_lane is True and args.data_lane_port is None
    assert cli._config(args).data_lane and StoreServerConfig().data_lane_port is None
    server = start_server(token=TOKEN)
    assert server.lane is not None and server.lane.port > 0
    t = build_unit_tables(make_groups(2, 3, seed=1))
    with StoreClient(server.endpoint, token=TOKEN) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        assert c.data_lane and c.lane_port() == server.lane.port
        assert c.get(_whole("u0")).equals(t.traj) and server.lane.served == 1
        assert pa.Table.from_batches(list(c.stream(_whole("u0")))).equals(t.traj) and server.lane.served == 2


def test_no_data_lane_store_reads_through_doget(start_server: Start) -> None:
    """``--no-data-lane`` opens no lane (the action answers null) and a default client reads through DoGet;
    a lane port together with ``data_lane=False`` is refused with a clear error."""
    args = _store_args("--no-data-lane")
    assert args.data_lane is False and cli._config(args).data_lane is False
    with pytest.raises(ValueError, match="data_lane_port given with data_lane=False"):
        cli._config(_store_args("--no-data-lane", "--data-lane-port", "0"))
    server = start_server(token=TOKEN, data_lane=False)
    assert server.lane is None
    t = build_unit_tables(make_groups(2, 3, seed=2))
    with StoreClient(server.endpoint, token=TOKEN) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        assert c.lane_port() is None and c.get(_whole("u0")).equals(t.traj)


@contextlib.contextmanager
def _squatter(port: int, answer: bytes | None) -> Iterator[None]:
    """Something else than a lane on ``port``: answers ``answer`` to each connection (None: closes it at once;
    empty: keeps it open and says nothing)."""
    srv = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                if answer is not None:
                    conn.recv(1 << 16)
                    conn.sendall(answer)
                if answer == b"":
                    stop.wait()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        srv.close()
        thread.join(5)


@pytest.mark.timing
@pytest.mark.parametrize("peer", ["refused", "closes", "http", "silent"])
def test_unreachable_lane_falls_back_to_doget_with_the_same_bytes(start_server: Start, peer: str) -> None:
    """A lane port that refuses connections, closes them, is another service or never answers: reads go through DoGet
    with DoGet's bytes, the lane is left alone for a while (no second try), and ``lane_get`` still raises."""
    server = start_server(token=TOKEN, batch_bytes=2048)
    t = build_unit_tables(make_groups(3, 4, seed=3))
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as plain:
        plain.put_unit("job", "u0", t.traj, t.media)
        want = plain.get(_whole("u0"))
    assert server.lane is not None
    port = server.lane.port
    server.lane.close()  # the store still advertises the port, as behind a firewall or a published Flight port
    answer = {"refused": None, "closes": None, "http": b"HTTP/1.1 400 Bad Request\r\n\r\n", "silent": b""}[peer]
    squat = contextlib.nullcontext() if peer == "refused" else _squatter(port, answer)
    with squat, StoreClient(server.endpoint, token=TOKEN, timeout_s=1 if peer == "silent" else 10) as c:
        assert c.lane_port() == port and c.lane_reachable()
        got = c.get(_whole("u0"))
        assert _ipc(got) == _ipc(want) and got.schema.equals(want.schema, check_metadata=True)
        assert not c.lane_reachable()  # remembered: the next reads do not try the lane
        assert pa.Table.from_batches(list(c.stream(_whole("u0")))).equals(want)
        with pytest.raises(Unavailable, match="data lane"):
            c.lane_get(_whole("u0"))
    assert server.lane.served == 0


@pytest.mark.timing
def test_pool_sizes_bound_and_reuse() -> None:
    """Size classes stay within 1/8 of the read (a 16 MiB read never takes a 256 MiB region), idle regions
    are reused per class, and idle bytes stay under the cap (least recently returned dropped first)."""
    assert size_class(16 * MiB) == 16 * MiB and size_class(16 * MiB + 1) == 18 * MiB
    assert all(n <= size_class(n) <= n + n // 8 + 4096 for n in (1, 5000, 3 * MiB + 7, 256 * MiB + 64))
    pool = ReceivePool(idle_bytes=40 * MiB)
    view, buf = pool.buffer(16 * MiB)
    view.release()
    del view, buf
    assert pool.idle_bytes == 16 * MiB and pool.mapped == 1
    view, buf = pool.buffer(15 * MiB + 1)  # same class: reused
    assert pool.reused == 1 and pool.idle_bytes == 0
    view.release()
    del view, buf
    a, abuf = pool.buffer(20 * MiB)
    b, bbuf = pool.buffer(24 * MiB)  # held together with a: two new regions
    assert pool.mapped == 3
    a.release()
    b.release()
    del a, abuf, b, bbuf  # 16 + 20 + 24 MiB over a 40 MiB cap: the oldest go first
    assert pool.idle_bytes == 24 * MiB
    small_view, small = pool.buffer(100)  # under min_bytes: Arrow's pool, not a region
    assert pool.mapped == 3 and len(small) == 100 and small_view.nbytes == 100
    big, bigbuf = pool.buffer(48 * MiB)  # a region larger than the whole cap is never kept idle
    big.release()
    del big, bigbuf
    assert pool.mapped == 4 and pool.idle_bytes == 24 * MiB
    with pytest.raises(ValueError, match="idle_bytes and min_bytes must be >= 0"):
        ReceivePool(idle_bytes=-1)


def test_pooled_lane_buffers_are_not_reused_while_a_table_or_tensor_lives(start_server: Start) -> None:
    """A kept lane table, and torch tensors made from its columns (``from_numpy``, DLPack), keep their bytes
    while later reads of the same size run; the region is reused only after the last of them is gone."""
    server = start_server(token=TOKEN)
    t = build_unit_tables(make_groups(3, 4, seed=4))
    other = t.traj.set_column(
        t.traj.schema.get_field_index("reward"), "reward", pc.add(t.traj.column("reward"), pa.scalar(1.0, pa.float32()))
    )
    pool = ReceivePool(min_bytes=0)
    with StoreClient(server.endpoint, token=TOKEN, recv_pool=pool) as c:
        c.put_unit("job", "ua", t.traj, t.media)
        c.put_unit("job", "ub", other, t.media)
        kept = c.get(_whole("ua"))
        snapshot = _ipc(kept)
        rewards = kept.column("reward").chunk(0)
        by_numpy = torch.from_numpy(rewards.to_numpy(zero_copy_only=True).copy())  # a copy, for comparing
        by_dlpack = torch.utils.dlpack.from_dlpack(rewards)
        assert by_dlpack.data_ptr() == rewards.buffers()[1].address  # zero-copy into the pooled region
        kept_span = _span(kept)
        for _ in range(4):  # same size class, other bytes: would overwrite ``kept`` if its region were reused
            got = c.get(_whole("ub"))
            assert got.equals(other) and _disjoint(_span(got), kept_span)
            del got
        assert pool.reused >= 3 and pool.mapped == 2
        assert _ipc(kept) == snapshot
        del kept, rewards
        for _ in range(2):  # the DLPack tensor still holds the region
            got = c.get(_whole("ub"))
            assert _disjoint(_span(got), kept_span)
            del got
        assert torch.equal(by_dlpack, by_numpy)
        del by_dlpack  # last reference: the region goes back and is the next one handed out
        got = c.get(_whole("ub"))
        assert _span(got)[0] == kept_span[0] and pool.mapped == 2
    assert server.lane is not None and server.lane.served == 8


@pytest.mark.timing
def test_pooled_lane_reads_from_many_threads_keep_their_bytes(start_server: Start) -> None:
    """Eight threads read two units of one size over one client and keep every table: none is overwritten."""
    server = start_server(token=TOKEN)
    t = build_unit_tables(make_groups(3, 4, seed=5))
    units = {
        "ua": t.traj,
        "ub": t.traj.set_column(
            t.traj.schema.get_field_index("reward"),
            "reward",
            pc.multiply(t.traj.column("reward"), pa.scalar(-1.0, pa.float32())),
        ),
    }
    pool = ReceivePool(min_bytes=0)
    with StoreClient(server.endpoint, token=TOKEN, recv_pool=pool) as c:
        for uid, traj in units.items():
            c.put_unit("job", uid, traj, t.media)
        names = ["ua", "ub"] * 20
        with ThreadPoolExecutor(8) as workers:
            kept = list(workers.map(lambda u: c.get(_whole(u)), names))
        for name, table in zip(names, kept, strict=True):
            assert table.equals(units[name])
        assert len({_span(x)[0] for x in kept}) == len(kept)  # all alive: all in distinct regions
        del kept
        assert pool.idle_bytes > 0
        arr = np.asarray(c.get(_whole("ua")).column("reward").chunk(0))
        assert pool.reused >= 1 and np.array_equal(arr, units["ua"].column("reward").to_numpy())


@pytest.mark.timing
def test_a_lane_that_comes_back_is_used_again_and_repeated_failures_back_off(start_server: Start) -> None:
    """Once the wait after a failed connect is over, the next read tries the lane again: a second failure
    in a row waits longer than the first, and a lane that answers again serves the reads (failures reset)."""
    server = start_server(token=TOKEN)
    t = build_unit_tables(make_groups(2, 3, seed=6))
    assert server.lane is not None
    port = server.lane.port
    server.lane.close()
    with StoreClient(server.endpoint, token=TOKEN, timeout_s=10) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        assert c.get(_whole("u0")).equals(t.traj)
        first_wait = c._lane_down_until - time.monotonic()
        assert 0 < first_wait <= LANE_RETRY_S
        c._lane_down_until = 0.0  # the wait is over
        assert c.get(_whole("u0")).equals(t.traj) and not c.lane_reachable()
        assert c._lane_down_until - time.monotonic() > LANE_RETRY_S  # doubled
        reopened = LaneServer("127.0.0.1", port, read=server.read_ticket, auth=server.auth)
        try:
            c._lane_down_until = 0.0
            assert c.get(_whole("u0")).equals(t.traj) and reopened.served == 1
            assert c._lane_failures == 0 and c.lane_reachable()
        finally:
            reopened.close()


def _server_with_u0(start_server: Start, *, seed: int) -> tuple[StoreServer, UnitTables]:
    """A store (default lane) holding unit ``u0`` of job ``job``, written with DoPut; and its tables."""
    server = start_server(token=TOKEN)
    t = build_unit_tables(make_groups(2, 3, seed=seed))
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as c:
        c.put_unit("job", "u0", t.traj, t.media)
    return server, t


@pytest.mark.timing
def test_a_store_restarted_with_its_lane_on_a_new_port_is_read_over_the_new_lane_at_once(start_server: Start) -> None:
    """The client knows the lane's old port; the store now advertises another (a restart on the same Flight
    port opens its lane on a free port): the failed connect makes the client ask again and read over the
    new lane in the same call, with no DoGet period and no failure remembered."""
    server, t = _server_with_u0(start_server, seed=7)
    assert server.lane is not None
    with StoreClient(server.endpoint, token=TOKEN, timeout_s=10) as c:
        old = c.lane_port()
        server.lane.close()
        server.lane = LaneServer("127.0.0.1", 0, read=server.read_ticket, auth=server.auth)
        assert server.lane.port != old
        assert c.get(_whole("u0")).equals(t.traj)
        assert server.lane.served == 1 and c.lane_port() == server.lane.port
        assert c._lane_failures == 0 and c.lane_reachable()


@pytest.mark.timing
def test_lane_warm_opens_one_pinged_connection_that_the_first_read_uses(start_server: Start) -> None:
    """``lane_warm`` opens one connection, checks it with a ping (no read served) and pools it; the next read
    goes over that very connection; a second warm-up opens nothing more. A lane that is something else,
    or a client without the lane, is not warmed and its reads still work."""
    server, t = _server_with_u0(start_server, seed=8)
    assert server.lane is not None
    with StoreClient(server.endpoint, token=TOKEN, timeout_s=10) as c:
        assert c.lane_warm() and server.lane.served == 0 and server.lane.open_connections == 1
        (warmed,) = c._lane_idle
        assert c.lane_warm() and c._lane_idle == [warmed] and server.lane.open_connections == 1
        assert c.get(_whole("u0")).equals(t.traj) and server.lane.served == 1
        assert c._lane_idle == [warmed] and server.lane.open_connections == 1  # the same connection, back in the pool
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as plain:
        assert not plain.lane_warm() and plain.get(_whole("u0")).equals(t.traj)
    port = server.lane.port
    server.lane.close()
    with (
        _squatter(port, b"HTTP/1.1 400 Bad Request\r\n\r\n"),
        StoreClient(server.endpoint, token=TOKEN, timeout_s=10) as c,
    ):
        assert not c.lane_warm() and c._lane_idle == []
        assert c.get(_whole("u0")).equals(t.traj)


@pytest.mark.timing
def test_a_ping_answered_with_an_error_warms_nothing(start_server: Start) -> None:
    """A ping the lane refuses (a wrong token) or answers with an error frame warms no connection: nothing is
    pooled, and reads say what is wrong or go through DoGet."""
    server = start_server(token=TOKEN)
    assert server.lane is not None
    port = server.lane.port
    with StoreClient(server.endpoint, token="wrong", timeout_s=10) as c:
        c._lane_port = port  # the data_lane action itself needs the right token
        assert not c.lane_warm() and c._lane_idle == [] and server.lane.served == 0
    server.lane.close()
    body = b"InvalidTicket: ticket is not valid"
    error_frame = lane.MAGIC + bytes([1]) + len(body).to_bytes(8, "big") + body
    with _squatter(port, error_frame), StoreClient(server.endpoint, token=TOKEN, timeout_s=10) as c:
        assert not c.lane_warm() and c._lane_idle == []
