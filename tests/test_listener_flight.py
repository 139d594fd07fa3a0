"""The store's Flight listener within what gRPC lets us enforce (#31, #34): held by unauthenticated connections
it still serves a reader (``DoGet``) and a writer (``DoPut``); a call is authenticated before its handler
runs and a ``DoPut`` before any batch is read; tickets and action bodies are refused by size and nesting
depth before they are parsed; a refused ``DoPut`` gives its unit's budget back at once; a descriptor path
that is not UTF-8 is refused by the client (a typed error) or by gRPC, before any code of ours runs.

What gRPC does not let us enforce (``pyarrow.flight`` passes no gRPC channel arguments, and its middleware
runs per call, after the request message): a unary request (a ``DoGet`` ticket, an action body) is received
whole before the token is checked (Arrow lifts gRPC's 4 MiB message limit: a 256 MiB action body without a
token took 7.7 s and 120 MiB of the store's memory before its refusal); an idle or half-open TCP connection
is closed by gRPC after 60 s (measured: idle, preface only, half a preface), not 10 s; an unauthenticated
gRPC client that completed the HTTP/2 handshake keeps its connection as long as it likes (130 s and counting
in a measurement); there is no cap on unauthenticated connections (each costs gRPC a descriptor and a little
memory, no thread).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.flight as flight
import pytest
from data_support import make_groups

from knittrans.errors import InvalidName, InvalidRequest, OverBudget
from knittrans.flight import StoreClient, StoreServer
from knittrans.flight.server import MAX_ACTION_DEPTH
from knittrans.procs import knittrans_command, stop_process, wait_ready
from knittrans.rlimits import raise_open_files_limit
from knittrans.schema import TRAJECTORY_SCHEMA, UnitTables, build_unit_tables
from knittrans.tickets import MAX_TICKET_DEPTH, Ticket, UnitRead

Start = Callable[..., StoreServer]
TOKEN = "store-secret"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""HTTP/2's client preface and an empty SETTINGS frame: a connection gRPC takes as a client's."""


def _unit(seed: int, n: int = 3) -> UnitTables:
    return build_unit_tables(make_groups(n, 4, seed=seed, prefix=f"u{seed}g"))


@contextlib.contextmanager
def _held(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` unauthenticated connections: half idle, half having sent the HTTP/2 preface, none a call."""
    held = []
    try:
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 2:
                sock.sendall(PREFACE)
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def test_500_unauthenticated_connections_leave_doget_and_doput_served(start_server: Start) -> None:
    """500 held unauthenticated connections plus 20 gRPC clients whose calls were refused: a fresh writer's
    ``DoPut`` and a fresh reader's ``DoGet`` are served, and so are the clients opened before them."""
    raise_open_files_limit()
    server = start_server(token=TOKEN, data_lane=False)
    before = StoreClient(server.endpoint, token=TOKEN, data_lane=False)
    before.put_unit("job", "early", _unit(0).traj, _unit(0).media)
    refused = [flight.connect(server.endpoint) for _ in range(20)]
    for client in refused:
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.do_action(flight.Action("health", b"")))
    with _held(server.port, 500):
        with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as writer:
            t = _unit(1)
            assert writer.put_unit("job", "late", t.traj, t.media)["num_rows"] == t.traj.num_rows
        with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as reader:
            got = reader.get(Ticket(job="job", reads=(UnitRead(unit_id="late"), UnitRead(unit_id="early"))))
            assert got.num_rows == t.traj.num_rows + _unit(0).traj.num_rows
        assert before.get(Ticket(job="job", reads=(UnitRead(unit_id="early"),))).num_rows == _unit(0).traj.num_rows
    for client in refused:
        client.close()
    before.close()


def test_an_unauthenticated_doput_is_refused_before_its_batches_are_read(start_server: Start) -> None:
    """A ``DoPut`` without the token is refused at the call's start: no unit is begun, no budget taken."""
    server = start_server(token=TOKEN, data_lane=False)
    client = flight.connect(server.endpoint)
    t = _unit(2)
    with pytest.raises(flight.FlightUnauthenticatedError):
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("job", "u", "traj"), t.traj.schema)
        writer.write_table(t.traj)
        writer.close()
    assert server.store.stats()["pending"] == 0 and server.store.budget.used == 0
    client.close()


def test_tickets_and_action_bodies_nested_too_deep_are_refused_naming_the_limit(start_server: Start) -> None:
    """A ticket nested 100,000 deep is an InvalidTicket naming MAX_TICKET_DEPTH, an action body nested too
    deep an InvalidRequest naming its limit; the server goes on serving."""
    server = start_server(token=TOKEN, data_lane=False)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    client = flight.connect(server.endpoint)
    with pytest.raises(
        flight.FlightServerError, match=f"InvalidTicket: ticket JSON nests deeper than the {MAX_TICKET_DEPTH}"
    ):
        client.do_get(flight.Ticket(b"[" * 100_000 + b"]" * 100_000), options).read_all()
    body = b'{"job": "job", "units": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with pytest.raises(
        flight.FlightServerError,
        match=f"InvalidRequest: action 'seal_units': body JSON nests deeper than the {MAX_ACTION_DEPTH}",
    ):
        list(client.do_action(flight.Action("seal_units", body), options))
    assert [r.body.to_pybytes() for r in client.do_action(flight.Action("health", b""), options)]
    client.close()


def test_a_doput_refused_over_budget_gives_its_units_budget_back_at_once(start_server: Start) -> None:
    """A unit whose media part is refused with OverBudget is dropped whole at once (its trajectory part's
    bytes no longer count, nothing pending), so an upload that needs those bytes succeeds right away."""
    t = _unit(3)
    server = start_server(token=TOKEN, data_lane=False, budget_bytes=1 << 30, wait_timeout_s=0.2)
    with StoreClient(server.endpoint, token=TOKEN, data_lane=False) as client:
        client.put_part("job", "u", "traj", t.traj)
        held = server.store.budget.used
        assert held > 0
        server.store.budget.limit = held + 64  # no room for the media part
        with pytest.raises(OverBudget):
            client.put_part("job", "u", "media", t.media)
        assert server.store.budget.used == 0 and server.store.stats()["pending"] == 0
        client.put_part("job", "next", "traj", t.traj)  # would wait out the 0.2 s and fail if still held
        assert server.store.budget.used == held


def test_a_descriptor_path_that_is_not_utf8_is_a_typed_error(start_server: Start) -> None:
    """A name that cannot be UTF-8 is refused by the client as InvalidName before it is sent; one that gRPC
    refuses on the wire (raw bytes) leaves the server serving (gRPC's own untyped error: no code of ours
    sees that call)."""
    server = start_server(data_lane=False)
    with StoreClient(server.endpoint, data_lane=False) as client:
        with pytest.raises(InvalidName, match="job '\\\\udcff' is not a valid name"):
            client.unit_info("\udcff", "u")
        with pytest.raises(InvalidName, match="unit_id"):
            client.put_part("job", "u\udcff", "traj", _unit(5).traj)
        raw = flight.connect(server.endpoint)
        with pytest.raises(flight.FlightInternalError):
            raw.get_flight_info(flight.FlightDescriptor.for_path(b"\xff\xfe", b"u"))
        writer, _ = raw.do_put(flight.FlightDescriptor.for_path(b"\xff\xfe", b"u", b"traj"), TRAJECTORY_SCHEMA)
        with pytest.raises(flight.FlightServerError):  # a DoPut's path too: the server's do_put never runs
            writer.close()
        assert server.store.stats()["pending"] == 0
        raw.close()
        client.put_unit("job", "ok", _unit(5).traj, _unit(5).media)
        assert client.unit_info("job", "ok")["num_rows"] == _unit(5).traj.num_rows
        with pytest.raises(InvalidRequest, match="descriptor path must be"):
            client.unit_info("job", "ok", grant="extra")  # three parts on a store without a ticket key


def test_the_store_raises_its_open_files_limit_to_the_hard_limit(store_dir: Path, tmp_path: Path) -> None:
    """``knittrans store`` started with a soft RLIMIT_NOFILE below its hard limit serves at the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ready = tmp_path / "ready.json"

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024, hard - 1), hard))

    cmd = knittrans_command("store", "--dir", str(store_dir), "--port", "0", "--ready-file", str(ready))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lower)
    try:
        wait_ready(proc, ready.exists, timeout_s=30, what="store")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
    finally:
        stop_process(proc)
    (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
    assert line.split()[3] == line.split()[4], line
