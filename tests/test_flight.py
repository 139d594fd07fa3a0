"""Store server over Arrow Flight: round trips, projections, many units per DoGet, typed errors, auth."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from data_support import make_groups

from knittrans.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SchemaMismatch,
    Unauthenticated,
    Unavailable,
)
from knittrans.flight import StoreClient, StoreServer
from knittrans.schema import TRAJECTORY_COLUMNS, UnitTables, build_unit_tables
from knittrans.tickets import Ticket, UnitRead

Start = Callable[..., StoreServer]


def _unit(seed: int, n: int = 3) -> UnitTables:
    return build_unit_tables(make_groups(n, 4, seed=seed, prefix=f"u{seed}g"))


def _rows(job: str, *reads: tuple[str, tuple[tuple[int, int], ...]], columns: tuple[str, ...] | None = None) -> Ticket:
    return Ticket(job=job, reads=tuple(UnitRead(unit_id=u, row_ranges=r) for u, r in reads), columns=columns)


def test_put_then_get_round_trips_every_column(start_server: Start) -> None:
    """A unit uploaded by DoPut comes back from DoGet bit-exact, media included."""
    server = start_server()
    t = _unit(0)
    with StoreClient(server.endpoint) as c:
        info = c.put_unit("job", "u0", t.traj, t.media)
        assert info["num_rows"] == 12 and info["media_rows"] == t.media.num_rows
        got = c.get(_rows("job", ("u0", ())))
        assert got.equals(t.traj) and got.schema.equals(t.traj.schema, check_metadata=True)
        hashes = tuple(h.hex() for h in t.media.column("media_hash").to_pylist())
        assert c.get(Ticket(job="job", kind="media", media_hashes=hashes)).equals(t.media)
        assert c.list_units("job") == [{"job": "job", "unit_id": "u0", "num_rows": 12, "num_bytes": info["num_bytes"]}]
        assert c.unit_info("job", "u0")["num_rows"] == 12
        assert c.health()["ok"] is True and c.stats()["units"] == 1


def test_many_units_row_ranges_and_projection_in_one_doget(start_server: Start) -> None:
    """One ticket over three units with row ranges and two columns returns exactly those cells in order."""
    server = start_server(batch_bytes=1024)  # forces several streamed batches
    units = {f"u{i}": _unit(i) for i in range(3)}
    with StoreClient(server.endpoint) as c:
        for uid, t in units.items():
            c.put_unit("job", uid, t.traj, t.media)
        cols = ("response_logprobs", "traj_id")
        ticket = _rows("job", ("u2", ((0, 2), (5, 6))), ("u0", ((11, 12),)), ("u1", ()), columns=cols)
        got = c.get(ticket)
        want = pa.concat_tables(
            [
                units["u2"].traj.slice(0, 2),
                units["u2"].traj.slice(5, 1),
                units["u0"].traj.slice(11, 1),
                units["u1"].traj,
            ]
        ).select(list(cols))
        assert got.column_names == list(cols) and got.equals(want)


def test_bad_requests_get_clear_errors_and_server_keeps_serving(start_server: Start) -> None:
    """Bad ticket bytes, unknown unit, wrong schema, bad ranges, unknown action: typed errors, then a good call."""
    server = start_server()
    t = _unit(0)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        raw = flight.connect(server.endpoint)
        with pytest.raises(flight.FlightServerError, match="InvalidTicket: ticket is not JSON"):
            raw.do_get(flight.Ticket(b"{not json")).read_all()
        with pytest.raises(flight.FlightServerError, match="InvalidTicket: ticket version 9 is not supported"):
            raw.do_get(flight.Ticket(b'{"v": 9, "job": "job", "reads": []}')).read_all()
        with pytest.raises(flight.FlightServerError, match="InvalidTicket: ticket has unknown fields"):
            raw.do_get(flight.Ticket(b'{"v":1,"job":"job","reads":[{"unit":"u0"}],"x":1}')).read_all()
        with pytest.raises(flight.FlightServerError, match=r"InvalidTicket: unit_id '\.\./etc' is not a valid name"):
            raw.do_get(flight.Ticket(b'{"v":1,"job":"job","reads":[{"unit":"../etc"}]}')).read_all()
        with pytest.raises(NotFound, match="unit 'missing' of job 'job' is not on this node"):
            c.get(_rows("job", ("missing", ())))
        with pytest.raises(InvalidRequest, match="row range \\[0, 99\\) is out of range"):
            c.get(_rows("job", ("u0", ((0, 99),))))
        wrong = t.traj.drop_columns(["reward"])
        with pytest.raises(SchemaMismatch, match="missing \\['reward'\\]"):
            c.put_part("job", "w", "traj", wrong)
        with pytest.raises(flight.FlightServerError, match="InvalidRequest: unknown action 'explode'"):
            list(raw.do_action(flight.Action("explode", b"")))
        with pytest.raises(NotFound):
            c.seal_units("job", [{"unit": "never-written"}])
        assert c.get(_rows("job", ("u0", ()))).equals(t.traj)  # still serving
        assert c.stats()["pending"] == 0


def test_oversized_put_is_refused_and_leaves_nothing(start_server: Start) -> None:
    """An upload above max_put_bytes is PayloadTooLarge; the pending unit is discarded; small puts work."""
    server = start_server(max_put_bytes=50_000)
    big, small = _unit(1, n=40), _unit(2)
    with StoreClient(server.endpoint, batch_bytes=8_000) as c:
        with pytest.raises(PayloadTooLarge, match="above the limit of 50000 bytes"):
            c.put_unit("job", "big", big.traj, big.media)
        assert c.stats()["pending"] == 0 and c.list_units() == []
        c.put_unit("job", "small", small.traj, small.media)
        assert c.get(_rows("job", ("small", ()))).equals(small.traj)


def test_bearer_token_is_required(start_server: Start) -> None:
    """Without or with a wrong token every call is Unauthenticated; the right token works afterwards; an empty
    token is no token to check against."""
    from knittrans.flight.auth import BearerTokenFactory

    with pytest.raises(ValueError, match="token must be a non-empty string"):
        BearerTokenFactory("")
    server = start_server(token="s3cret")
    t = _unit(0)
    with StoreClient(server.endpoint) as anon, pytest.raises(Unauthenticated, match="missing bearer token"):
        anon.health()
    with StoreClient(server.endpoint, token="guess") as wrong:
        with pytest.raises(Unauthenticated, match="wrong bearer token"):
            wrong.put_unit("job", "u", t.traj, t.media)
        with pytest.raises(Unauthenticated):
            wrong.get(_rows("job", ("u", ())))
    with StoreClient(server.endpoint, token="s3cret") as ok:
        ok.put_unit("job", "u", t.traj, t.media)
        assert ok.get(_rows("job", ("u", ()), columns=TRAJECTORY_COLUMNS)).equals(t.traj)


def test_delete_over_flight(start_server: Start) -> None:
    """Deleting a unit makes later reads NotFound and frees its listing; the action answers the unit deleted."""
    server = start_server()
    t = _unit(0)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u", t.traj, t.media)
        c.put_unit("job", "v", t.traj, t.media)
        c.delete("job", "u")
        raw = flight.connect(server.endpoint)
        answer = [r.body.to_pybytes() for r in raw.do_action(flight.Action("delete", b'{"job": "job", "unit": "v"}'))]
        raw.close()
        assert answer == [b'{"deleted": "v"}']
        assert c.list_units() == []
        with pytest.raises(NotFound):
            c.get(_rows("job", ("u", ())))


@pytest.mark.timing
def test_close_waits_for_calls_in_flight_and_refuses_new_ones(start_server: Start) -> None:
    """Closing a client under an open stream (a call in flight) defers the channel's close until the stream
    ends: the stream fails at its next batch with Unavailable, calls after close are refused; the server
    keeps serving."""
    server = start_server(batch_bytes=1024)  # several streamed batches
    t = _unit(1, n=8)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u1", t.traj, t.media)
    client = StoreClient(server.endpoint, data_lane=False)  # a DoGet stream (a lane read arrives whole)
    batches = client.stream(_rows("job", ("u1", ())))
    first = next(batches)
    assert first.num_rows > 0
    client.close()
    assert not client._closed and client._active == 1  # the open stream holds the channel
    with pytest.raises(Unavailable, match="closed"):
        client.health()
    with pytest.raises(Unavailable, match="closed"):
        list(batches)
    assert client._closed and client._active == 0  # the stream's end closed it
    client.close()  # again: nothing to do
    idle = StoreClient(server.endpoint)
    assert idle.health()["ok"] is True
    idle.close()
    assert idle._closed
    with StoreClient(server.endpoint) as c:
        assert c.get(_rows("job", ("u1", ()))).equals(t.traj)


def test_a_stream_closed_before_its_first_batch_ends_its_call(start_server: Start) -> None:
    """A DoGet stream closed (or dropped) before any batch was read cancels its call and stops counting as a
    call in flight, so the client's close closes the channel (a share whose node's media all came from the
    cache closes such streams unread)."""
    server = start_server(batch_bytes=1024)
    t = _unit(1, n=8)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u1", t.traj, t.media)
    client = StoreClient(server.endpoint, data_lane=False)
    batches = client.stream(_rows("job", ("u1", ())))
    assert client._active == 1
    batches.close()  # type: ignore[attr-defined]
    assert client._active == 0
    client.stream(_rows("job", ("u1", ())))  # dropped unread: garbage collected
    assert client._active == 0
    client.close()
    assert client._closed


def test_error_messages_name_only_knittrans_errors() -> None:
    """A message naming a KnitTrans error class comes back as that class; one naming another class of
    ``knittrans.errors`` (``StateError``, a RuntimeError) is no KnitTrans error: it stays a plain failure."""
    from knittrans.errors import KnitTransError, StateError
    from knittrans.flight.errors import from_error_message, from_flight_error

    assert isinstance(from_error_message("NotFound: no unit 'u'"), NotFound)
    assert from_error_message("StateError: the database is foreign") is None
    got = from_flight_error(flight.FlightServerError("StateError: the database is foreign"), "grpc://h:1")
    assert type(got) is KnitTransError and not isinstance(got, StateError)


def test_a_store_answers_a_full_disk_as_over_budget_and_malformed_arrow_as_a_bad_request() -> None:
    """What a store call raised becomes the error its client gets: a full or read-only store directory is
    OverBudget (retry elsewhere), Arrow refusing the client's data InvalidRequest, a KnitTrans error itself,
    anything else no KnitTrans error (an internal error)."""
    import errno

    from knittrans.errors import OverBudget
    from knittrans.flight.errors import refusal

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        full = refusal("DoPut", OSError(code, "no"))
        assert isinstance(full, OverBudget) and "cannot take the write" in str(full)
    bad = refusal("DoPut", pa.ArrowInvalid("dictionary changed"))
    assert isinstance(bad, InvalidRequest) and "invalid Arrow data: dictionary changed" in str(bad)
    known = NotFound("no unit")
    assert refusal("DoGet", known) is known
    assert refusal("DoGet", OSError(errno.EIO, "io")) is None and refusal("DoGet", RuntimeError("bug")) is None


def test_an_unexpected_failure_is_an_internal_error_naming_the_call(start_server: Start) -> None:
    """A store call failing in a way no KnitTrans error names (here: the unit's directory removed behind the
    store's back before a delete) answers FlightInternalError naming the call and the exception; the server
    goes on serving."""
    import shutil

    server = start_server()
    t = _unit(0)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        shutil.rmtree(server.store.get("job", "u0").path)
        raw = flight.connect(server.endpoint)
        with pytest.raises(flight.FlightInternalError, match="internal error in do_action: FileNotFoundError"):
            list(raw.do_action(flight.Action("delete", b'{"job": "job", "unit": "u0"}')))
        raw.close()
        assert c.health()["ok"] is True


def test_malformed_action_bodies_are_refused_naming_what_is_wrong(start_server: Start) -> None:
    """An action body over MAX_ACTION_BODY_BYTES is PayloadTooLarge; one that is no JSON, or JSON but no object
    with the keys the action needs, InvalidRequest; the server goes on serving."""
    from knittrans.flight.server import MAX_ACTION_BODY_BYTES

    server = start_server()
    raw = flight.connect(server.endpoint)
    big = b'{"job": "job", "units": [], "pad": "' + b"x" * MAX_ACTION_BODY_BYTES + b'"}'
    for kind, body, match in [
        ("seal_units", big, f"PayloadTooLarge: action 'seal_units': body is {len(big)} bytes, more than the"),
        ("delete", b"\xff{", "InvalidRequest: action 'delete': body is not JSON"),
        ("delete", b'["job", "u"]', r"InvalidRequest: action 'delete': body must be a JSON object with keys"),
        ("delete", b'{"job": "job"}', r"body must be a JSON object with keys \['job', 'unit'\]"),
    ]:
        with pytest.raises(flight.FlightServerError, match=match):
            list(raw.do_action(flight.Action(kind, body)))
    raw.close()
    with StoreClient(server.endpoint) as c:
        assert c.health()["ok"] is True


def test_list_flights_criteria_that_is_no_job_name_is_refused(start_server: Start) -> None:
    """ListFlights criteria of a store without a ticket key is a job name or empty: bytes that are not UTF-8,
    a grant after the job or a job that is not a name are InvalidRequest; the listing still works after."""
    server = start_server()
    t = _unit(0)
    raw = flight.connect(server.endpoint)
    for criteria, match in [
        (b"\xff", "ListFlights criteria must be UTF-8"),
        (b"job\nsome.grant", "this store has no ticket key: ListFlights criteria is a job name or empty"),
        (b"../job", "job '../job' is not a valid name"),
    ]:
        with pytest.raises(flight.FlightServerError, match=match):
            list(raw.list_flights(criteria))
    raw.close()
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        assert [u["unit_id"] for u in c.list_units("job")] == ["u0"] and c.list_units("other") == []


def test_doget_streams_record_batches_of_about_batch_bytes(start_server: Start, tmp_path: Path) -> None:
    """A read larger than ``batch_bytes`` streams as several record batches (together the rows read); a store
    with the default 4 MiB streams the same small unit as one."""
    small, default = start_server(batch_bytes=1024), start_server(root=tmp_path)
    t = _unit(0, n=8)
    for server, many in ((small, True), (default, False)):
        with StoreClient(server.endpoint) as c:
            c.put_unit("job", "u0", t.traj, t.media)
        raw = flight.connect(server.endpoint)
        batches = list(raw.do_get(flight.Ticket(_rows("job", ("u0", ())).encode())))
        raw.close()
        assert (len(batches) > 1) is many and t.traj.nbytes > 1024
        assert pa.Table.from_batches([b.data for b in batches]).equals(t.traj)


def test_doput_checks_its_path_and_schema_first_and_skips_metadata_only_messages(start_server: Start) -> None:
    """A DoPut path whose part is neither ``traj`` nor ``media`` is InvalidRequest, a stream whose schema is not
    the part's a SchemaMismatch before any batch (nothing left pending); a message carrying only app metadata
    is skipped: the batches around it make the part."""
    server = start_server()
    t = _unit(0)
    raw = flight.connect(server.endpoint)
    writer, _ = raw.do_put(flight.FlightDescriptor.for_path("job", "u0", "extra"), t.traj.schema)
    with pytest.raises(flight.FlightServerError, match=r"InvalidRequest: DoPut descriptor path must be \[job, unit"):
        writer.close()
    writer, _ = raw.do_put(flight.FlightDescriptor.for_path("job", "u0", "traj"), t.traj.schema.remove(0))
    with pytest.raises(flight.FlightServerError, match="SchemaMismatch"):
        writer.close()
    assert server.store.stats()["pending"] == 0
    writer, _ = raw.do_put(flight.FlightDescriptor.for_path("job", "u0", "traj"), t.traj.schema)
    batches = t.traj.to_batches(max_chunksize=6)
    writer.write_batch(batches[0])
    writer.write_metadata(pa.py_buffer(b"no batch here"))
    writer.write_batch(batches[1])
    writer.close()
    raw.close()
    with StoreClient(server.endpoint) as c:
        c.seal_units("job", [{"unit": "u0"}])
        assert c.get(_rows("job", ("u0", ()))).equals(t.traj)


def test_flight_errors_keep_their_kind_both_ways() -> None:
    """Server side, Unauthenticated and Unavailable keep their gRPC status (any other KnitTrans error is a
    server error), each message naming its class; client side, a failure whose message names no KnitTrans
    error becomes Unauthenticated or Unavailable by its status (unreachable, timed out, Arrow I/O), else a
    plain KnitTransError naming the store."""
    from knittrans.errors import KnitTransError
    from knittrans.flight.errors import from_flight_error, to_flight_error

    for error, status in [
        (Unauthenticated("no token"), flight.FlightUnauthenticatedError),
        (Unavailable("going away"), flight.FlightUnavailableError),
        (NotFound("no unit"), flight.FlightServerError),
    ]:
        mapped = to_flight_error(error)
        assert type(mapped) is status and str(mapped).startswith(f"{type(error).__name__}: {error}")
    where = "grpc://h:1"
    refused = from_flight_error(flight.FlightUnauthenticatedError("denied by a proxy"), where)
    assert type(refused) is Unauthenticated and str(refused) == "store grpc://h:1 refused the call: denied by a proxy"
    for transport in (flight.FlightUnavailableError("down"), flight.FlightTimedOutError("late"), pa.ArrowIOError("io")):
        gone = from_flight_error(transport, where)
        assert type(gone) is Unavailable and str(gone).startswith("store grpc://h:1 cannot be reached: ")
    other = from_flight_error(flight.FlightServerError("boom\nmore"), where)
    assert type(other) is KnitTransError and str(other) == "store grpc://h:1 failed: boom"
