"""The data lane authenticates first and cannot be pinned by connections without a token; a lane that cannot serve
a read sends it through DoGet instead of failing it (in-process stores, and store processes under a flood of idle
unauthenticated connections while a reader, a writer and a trainer work)."""

from __future__ import annotations

import resource
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from data_support import make_groups

from knittrans.errors import InvalidRequest, Unauthenticated, Unavailable
from knittrans.flight import StoreClient, StoreServer, lane
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import wait_until
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import build_unit_tables
from knittrans.tickets import MAX_TICKET_BYTES, Ticket, UnitRead
from knittrans.trainer.client import TrainerClient, TrainerConfig
from knittrans.trainer.fetch import Fetcher
from tests.trainer_support import job_spec, mm_groups

Start = Callable[..., StoreServer]
TOKEN = "lane-auth-token"
BEARER = f"Bearer {TOKEN}".encode()


def _whole(unit: str, job: str = "job") -> Ticket:
    return Ticket(job=job, reads=(UnitRead(unit_id=unit),))


def _store(start: Start, **kw: object) -> tuple[StoreServer, pa.Table]:
    server = start(token=TOKEN, **kw)
    t = build_unit_tables(make_groups(3, 4, seed=1))
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as c:
        c.put_unit("job", "u0", t.traj, t.media)
    return server, t.traj


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _ended(sock: socket.socket) -> bool:
    """Whether the lane closed ``sock`` (waits for it; a reset counts: the lane left the rest of a request unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _closed(sock: socket.socket) -> bool:
    """Whether the lane closed ``sock`` (anything it answered first is read and dropped)."""
    try:
        while True:
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_the_token_is_checked_before_the_ticket_is_read_and_a_refused_one_closes_the_connection(
    start_server: Start,
) -> None:
    """A request declaring a ticket of the largest size with a wrong or no token is refused before a byte of the
    ticket is sent (it is never read), and the connection is closed; so is an admitted connection whose later
    request carries a wrong token. A good request is served after each."""
    server, want = _store(start_server)
    assert server.lane is not None
    port = server.lane.port
    for auth, words in ((b"Bearer nope", "wrong bearer token"), (b"", "missing bearer token")):
        with _connect(port) as conn:
            conn.sendall(lane.MAGIC + struct.pack("!II", len(auth), MAX_TICKET_BYTES) + auth)  # no ticket follows
            with pytest.raises(Unauthenticated, match=words):
                lane.read_answer(conn)
            assert _ended(conn)
    with _connect(port) as conn:
        lane.send_request(conn, BEARER, _whole("u0").encode())
        assert lane.read_answer(conn).equals(want)
        lane.send_request(conn, b"Bearer nope", _whole("u0").encode())
        with pytest.raises(Unauthenticated, match="wrong bearer token"):
            lane.read_answer(conn)
        assert _ended(conn)
    with StoreClient(server.endpoint, token=TOKEN) as c:
        assert c.lane_get(_whole("u0")).equals(want)
    assert server.lane.served == 2


def test_unauthenticated_connections_are_closed_within_ten_seconds(start_server: Start) -> None:
    """With the default settings a connection that sends nothing, half a header, or a header and part of its
    authorization is closed within 10 s (the last two told why)."""
    server, _ = _store(start_server)
    assert server.lane is not None
    conns = [_connect(server.lane.port) for _ in range(3)]
    conns[1].sendall(lane.MAGIC)
    conns[2].sendall(lane.MAGIC + struct.pack("!II", len(BEARER), 10) + BEARER[:3])
    assert conns[0].recv(1) == b""
    for conn, what in ((conns[1], "header"), (conns[2], "authorization")):
        with pytest.raises(InvalidRequest, match=f"{what} did not arrive within the time limit"):
            lane.read_answer(conn)
        assert conn.recv(1) == b""
    for conn in conns:
        conn.close()


@pytest.mark.timing
def test_a_full_lane_sends_reads_through_doget_and_later_ones_back_to_the_lane(start_server: Start) -> None:
    """While every admitted connection slot is taken, ``get``, ``stream`` and a Fetcher's reads are answered by
    DoGet (same bytes; ``lane_get`` says the lane is full); once a slot is free reads go over the lane again."""
    server, want = _store(start_server)
    assert server.lane is not None
    server.lane.max_connections = 2
    hogs = [_connect(server.lane.port) for _ in range(2)]
    for hog in hogs:
        lane.ping(hog, BEARER)

    def fetched(fetcher: Fetcher) -> pa.Table:
        return pa.Table.from_batches(list(fetcher.stream("node-0", server.endpoint, _whole("u0"))))

    with StoreClient(server.endpoint, token=TOKEN) as c, Fetcher(token=TOKEN) as fetcher:
        with pytest.raises(Unavailable, match="at most 2 connections"):
            c.lane_get(_whole("u0"))
        assert c.get(_whole("u0")).equals(want)
        assert pa.Table.from_batches(list(c.stream(_whole("u0")))).equals(want)
        assert fetched(fetcher).equals(want)
        assert server.lane.served == 0 and c.lane_reachable()  # DoGet served them; the lane is not written off
        for hog in hogs:
            hog.close()
        wait_until(lambda: server.lane is not None and server.lane.open_connections == 0, timeout_s=30, what="hogs")
        assert c.get(_whole("u0")).equals(want) and server.lane.served == 1
        assert fetched(fetcher).equals(want) and server.lane.served == 2


def _raise_open_files_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    assert hard >= 2048, f"this test holds 500 connections per store and needs more than {hard} open files"


class _Flood:
    """Keeps ``count`` idle connections without a token open to each of ``ports`` until stopped: each one the lane
    closes is opened again (at most ``rate`` a second per port, as a sustained attack would)."""

    def __init__(self, ports: list[int], count: int, rate: int = 100) -> None:
        self.closed_by_lane = 0
        self._selector = selectors.DefaultSelector()
        for port in ports:
            for _ in range(count):
                self._selector.register(_connect(port), selectors.EVENT_READ, port)
        self._rate = rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        owed: dict[int, int] = {}  # connections to open again, per port
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.01):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if _closed(sock):
                    self._selector.unregister(sock)
                    sock.close()
                    self.closed_by_lane += 1
                    owed[key.data] = owed.get(key.data, 0) + 1
            for port, n in owed.items():  # ~10 ms a round: ``rate`` a second
                for _ in range(min(n, max(1, self._rate // 100))):
                    self._selector.register(_connect(port), selectors.EVENT_READ, port)
                    owed[port] -= 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for key in list(self._selector.get_map().values()):
            assert isinstance(key.fileobj, socket.socket)
            key.fileobj.close()
        self._selector.close()


@pytest.fixture(scope="module")
def flooded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, _Flood]]:
    """Control plane and two store processes with tokens, each lane held by 500 idle connections without a token."""
    _raise_open_files_limit()
    config = ClusterConfig(work_dir=tmp_path_factory.mktemp("flood"), num_stores=2, worker_token=TOKEN)
    with LocalCluster(config) as cluster:
        ports = []
        for s in cluster.stores:
            with StoreClient(s.endpoint, token=TOKEN) as c:
                port = c.lane_port()
                assert port is not None
                ports.append(port)
        flood = _Flood(ports, 500)
        try:
            yield cluster, flood
        finally:
            flood.stop()


@pytest.mark.timing
def test_500_idle_unauthenticated_connections_leave_the_lane_to_a_reader_and_a_writer(
    flooded: tuple[LocalCluster, _Flood], tmp_path: Path
) -> None:
    """With 500 idle connections without a token held on its lane (the store process took them all: it closes
    those it cannot keep waiting), a writer stores a unit and a reader reads it over the lane itself."""
    cluster, flood = flooded
    wait_until(lambda: flood.closed_by_lane >= 2 * (500 - 256), timeout_s=60, what="the lanes to take the flood")
    store = cluster.stores[0]
    groups = make_groups(2, 4, seed=3, prefix="flood-w")
    with TrajectoryWriter(
        job="flood", node_id=store.node_id, endpoint=store.endpoint, store_dir=store.store_dir, token=TOKEN
    ) as writer:
        desc = writer.write_groups(groups)
    with StoreClient(store.endpoint, token=TOKEN) as reader:
        got = reader.lane_get(_whole(desc.unit_id, "flood"))  # the lane itself, no fallback
    assert got.num_rows == 8 and got.column("group_id").to_pylist()[0] == "flood-w0"


@pytest.mark.timing
def test_a_trainer_and_a_writer_finish_their_work_while_the_lanes_are_flooded(
    flooded: tuple[LocalCluster, _Flood],
) -> None:
    """Under the flood, writers with a control client store and register a train batch on both stores and a
    TrainerClient (data lane on) consumes every row of it exactly once."""
    cluster, _ = flooded
    control = cluster.control()
    control.create_job(job_spec("flooded", groups=4, group_size=2, k=2, world_size=1, micro_batch_size=2))
    writers = [
        TrajectoryWriter(
            job="flooded", node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir, token=TOKEN, control=control
        )
        for s in cluster.stores
    ]
    for k, w in enumerate(writers):
        w.write_units([mm_groups(f"f{k}-{i}-", 1, group_size=2, seed=k * 10 + i) for i in range(2)])
    for w in writers:
        w.close()
    config = TrainerConfig(
        control_url=cluster.control_url,
        job="flooded",
        rank=0,
        world_size=1,
        token=TOKEN,
        store_token=TOKEN,
        poll_timeout_s=5,
    )
    seen: list[str] = []
    with TrainerClient(config) as client:
        for mb in client.minibatches():
            seen += [r.group_id for m in mb for r in m.rows]
            mb.ack()
    assert sorted(seen) == sorted(f"f{k}-{i}-0" for k in range(2) for i in range(2) for _ in range(2))
    control.close()
