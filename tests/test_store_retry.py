"""D1/D7/D9 regressions: store writes are safe to retry and to race, DoPut validates content, tickets are bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from data_support import make_groups

from knittrans.errors import Conflict, InvalidRequest, InvalidTicket
from knittrans.flight import StoreClient, StoreServer, cli
from knittrans.procs import wait_until
from knittrans.schema import UnitTables, build_unit_tables
from knittrans.tickets import Ticket, UnitRead

Start = Callable[..., StoreServer]
TESTS = Path(__file__).parent

_WRITER = textwrap.dedent("""
    import sys, time
    import pyarrow.flight as flight
    from data_support import make_groups
    from knittrans.schema import build_unit_tables
    traj = build_unit_tables(make_groups(3, 4, seed=1, prefix="g")).traj
    client = flight.FlightClient(sys.argv[1])
    writer, reader = client.do_put(flight.FlightDescriptor.for_path("job", "u-g0", "traj"), traj.schema)
    writer.write_batch(traj.to_batches(max_chunksize=4)[0])
    reader.read()  # the node acknowledged batch 1 of 3
    print("sent 1 of 3", flush=True)
    time.sleep(600)
""")


def _unit(seed: int) -> UnitTables:
    return build_unit_tables(make_groups(3, 4, seed=seed, prefix="g"))


def _retry_put(c: StoreClient, t: UnitTables, unit: str, deadline_s: float = 120.0) -> dict[str, object]:
    """What a restarted writer does: upload again, waiting while the node still sees the dead stream."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return c.put_unit("job", unit, t.traj, t.media)
        except Conflict:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def test_kill9_writer_mid_doput_then_retry_serves_exactly_the_retried_rows(start_server: Start) -> None:
    """A writer killed after 1 of 3 batches, retried with the same unit id, seals the 12 retried rows only."""
    server = start_server()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, server.endpoint], cwd=TESTS, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("sent 1 of 3")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    retried = _unit(2)
    with StoreClient(server.endpoint) as c:
        info = _retry_put(c, retried, "u-g0")
        assert info["num_rows"] == 12
        got = c.get(Ticket(job="job", reads=(UnitRead(unit_id="u-g0", row_ranges=((0, 12),)),)))
        assert got.equals(retried.traj)
        assert c.stats()["pending"] == 0


def test_completed_but_unsealed_part_is_replaced_not_appended(start_server: Start) -> None:
    """A part uploaded twice (the first writer died before seal) holds the second upload only."""
    server = start_server()
    first, second = _unit(1), _unit(2)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u0", first.traj, first.media, seal=False)
        info = c.put_unit("job", "u0", second.traj, second.media)
        assert info["num_rows"] == 12 and info["media_rows"] == second.media.num_rows
        assert c.get(Ticket(job="job", reads=(UnitRead(unit_id="u0"),))).equals(second.traj)


def test_concurrent_doput_to_one_part_is_refused_and_does_not_abort_the_owner(start_server: Start) -> None:
    """A second stream to a part being written gets Conflict; the first stream's unit is untouched."""
    server = start_server()
    t = _unit(1)
    batches = t.traj.to_batches(max_chunksize=4)
    desc = flight.FlightDescriptor.for_path("job", "u0", "traj")
    owner = flight.FlightClient(server.endpoint)
    w1, r1 = owner.do_put(desc, t.traj.schema)
    w1.write_batch(batches[0])
    r1.read()
    with StoreClient(server.endpoint) as c:
        with pytest.raises(Conflict, match="being written by another stream"):
            c.put_part("job", "u0", "traj", _unit(2).traj)
        for b in batches[1:]:
            w1.write_batch(b)
        w1.done_writing()
        while r1.read() is not None:
            pass
        w1.close()
        assert c.seal_units("job", [{"unit": "u0", "rows": 12}])[0]["num_rows"] == 12
        assert c.get(Ticket(job="job", reads=(UnitRead(unit_id="u0"),))).equals(t.traj)
    owner.close()


def test_seal_checks_expected_rows_and_bytes(start_server: Start) -> None:
    """seal_units with counts that differ from what was written drops the unit with a clear Conflict."""
    server = start_server()
    t = _unit(1)
    with StoreClient(server.endpoint) as c:
        c.put_part("job", "u0", "traj", t.traj)
        with pytest.raises(Conflict, match=r"rows 12 \(expected 16\)"):
            c.seal_units("job", [{"unit": "u0", "rows": 16}])
        assert c.stats()["pending"] == 0 and c.list_units("job") == []
        c.put_part("job", "u0", "traj", t.traj)
        with pytest.raises(Conflict, match="num_bytes"):
            c.seal_units("job", [{"unit": "u0", "rows": 12, "num_bytes": 1}])
        with pytest.raises(InvalidRequest, match="'rows' must be a non-negative integer"):
            c.seal_units("job", [{"unit": "u0", "rows": -1}])


def _bad_traj(column: str, mutate: Callable[[list[object]], object]) -> pa.Table:
    traj = _unit(1).traj
    values = traj.column(column).to_pylist()
    mutate(values)
    return traj.set_column(
        traj.schema.get_field_index(column),
        traj.schema.field(column),
        pa.array(values, type=traj.schema.field(column).type),
    )


def test_doput_validates_content_and_keeps_serving(start_server: Start) -> None:
    """Short loss masks, negative token ids and media whose bytes do not match their hash are refused."""
    server = start_server()
    short_mask = _bad_traj("loss_mask", lambda v: v.__setitem__(1, [1]))
    negative = _bad_traj("response_ids", lambda v: v.__setitem__(2, [-5] * len(v[2])))  # type: ignore[arg-type]
    media = _unit(1).media
    data = media.column("data").to_pylist()
    data[0] = data[0][:-1] + bytes([data[0][-1] ^ 1])
    forged = media.set_column(
        media.schema.get_field_index("data"),
        media.schema.field("data"),
        pa.array(data, type=media.schema.field("data").type),
    )
    with StoreClient(server.endpoint) as c:
        with pytest.raises(InvalidRequest, match="'loss_mask' has length 1"):
            c.put_part("job", "u0", "traj", short_mask)
        with pytest.raises(InvalidRequest, match="negative token id at row 2"):
            c.put_part("job", "u1", "traj", negative)
        with pytest.raises(InvalidRequest, match="not the SHA-256"):
            c.put_part("job", "u2", "media", forged)
        assert c.stats()["pending"] == 0
        good = _unit(3)
        assert c.put_unit("job", "ok", good.traj, good.media)["num_rows"] == 12


def test_tickets_are_bounded(start_server: Start) -> None:
    """A ticket repeating rows, nested deeply, or a non-UTF-8 ListFlights is refused with a typed error."""
    server = start_server()
    t = _unit(1)
    with StoreClient(server.endpoint) as c:
        c.put_unit("job", "u0", t.traj, t.media)
        with pytest.raises(InvalidTicket, match="read whole and again"):
            Ticket(job="job", reads=(UnitRead(unit_id="u0"),) * 2)
        repeated = json.dumps({"v": 1, "job": "job", "reads": [{"unit": "u0", "rows": [[0, 12]]}] * 1000})
        nested = b'{"v":1,"job":"job","reads":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        raw = flight.FlightClient(server.endpoint)
        for body, match in ((repeated.encode(), "read more than once"), (nested, "nests deeper than the 8 levels")):
            with pytest.raises(flight.FlightServerError, match=match):
                raw.do_get(flight.Ticket(body)).read_all()
        with pytest.raises(flight.FlightServerError, match="UTF-8"):
            list(raw.list_flights(b"\xff\xfe"))
        raw.close()
        assert c.get(Ticket(job="job", reads=(UnitRead(unit_id="u0", row_ranges=((0, 2), (5, 7))),))).num_rows == 4


@pytest.mark.timing
def test_publish_validates_timeout_and_a_put_abandoned_while_waiting_for_budget_is_dropped(
    start_server: Start,
) -> None:
    """timeout_s NaN/Infinity/negative is refused; an upload whose caller gave up waiting for budget is dropped."""
    server = start_server(budget_bytes=1 << 30)
    t = _unit(1)
    with StoreClient(server.endpoint, data_lane=False) as c:
        for bad in (float("nan"), float("inf"), -1.0, True):
            with pytest.raises(InvalidRequest, match="timeout_s"):
                c.publish_units("job", [{"unit": "u0", "dir": "/x"}], timeout_s=bad)
        c.put_part("job", "hog", "traj", t.traj)
        server.store.budget.limit = server.store.budget.used  # the hog holds the whole budget
        impatient = StoreClient(server.endpoint, timeout_s=0.5, data_lane=False)
        with pytest.raises(Exception):  # noqa: B017 - the client's deadline: any transport error
            impatient.put_part("job", "late", "traj", t.traj)
        impatient.close()
        # the node sees the call cancelled and stops waiting (while the budget is still full): only the hog is left
        wait_until(lambda: server.store.budget.waiting == 0, timeout_s=20, what="the abandoned put to stop waiting")
        assert c.stats()["pending"] == 1
        c.delete("job", "hog")  # budget frees up after the caller has left
        deadline = time.monotonic() + 60
        while c.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["pending"] == 0 and c.stats()["budget_used"] == 0
        assert c.put_unit("job", "next", t.traj)["num_rows"] == t.traj.num_rows


def test_same_host_writer_seals_with_counts(start_server: Start, store_dir: Path) -> None:
    """The same-host writer path seals with rows, media rows and file bytes the node checks."""
    from knittrans.rollout.writer import TrajectoryWriter

    server = start_server()
    groups = make_groups(2, 3, seed=4, prefix="s")
    with TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir) as w:
        desc = w.write_groups(groups, unit_id="u-s0")
    assert desc.num_rows == 6
    got = server.store.read(Ticket(job="job", reads=(UnitRead(unit_id="u-s0"),)))
    assert np.array_equal(got.column("reward").to_numpy(), build_unit_tables(groups).traj.column("reward").to_numpy())


def test_store_on_non_loopback_without_token_refuses_to_start(tmp_path: Path) -> None:
    """``knittrans store --host 0.0.0.0`` without a token exits with a clear error unless --insecure; only
    loopback addresses (and ``localhost``) count as loopback, a host name does not."""
    cmd = [
        sys.executable,
        "-m",
        "knittrans.cli",
        "store",
        "--dir",
        str(tmp_path / "s"),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "KNITTRANS_STORE_TOKEN"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and "--insecure" in done.stderr
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [*cmd, "--insecure", "--ready-file", str(ready)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
    finally:
        proc.kill()
        proc.wait(60)
    loopback = ["localhost", "127.0.0.1", "127.8.0.1", "::1", "[::1]"]
    assert [cli._loopback(h) for h in [*loopback, "0.0.0.0", "::", "store.example", "10.0.0.1"]] == [True] * 5 + [
        False
    ] * 4


def test_dictionary_change_within_a_doput_is_a_typed_error(start_server: Start) -> None:
    """Batches of one DoPut whose 'source' dictionary changes are refused as InvalidRequest, not internal."""
    server = start_server()
    traj = _unit(1).traj
    first, second = traj.slice(0, 4), traj.slice(4, 8)
    col = traj.schema.get_field_index("source")
    values = second.column("source").to_pylist()
    other = pa.DictionaryArray.from_arrays(pa.array([0] * len(values), pa.int32()), pa.array(["other-source"]))
    second = second.set_column(col, traj.schema.field("source"), other)
    raw = flight.FlightClient(server.endpoint)
    writer, reader = raw.do_put(flight.FlightDescriptor.for_path("job", "u0", "traj"), traj.schema)
    with pytest.raises(flight.FlightError, match=r"InvalidRequest|SchemaMismatch"):
        writer.write_batch(first.to_batches()[0])
        writer.write_batch(second.combine_chunks().to_batches()[0])
        writer.done_writing()
        while reader.read() is not None:
            pass
        writer.close()
    raw.close()
    with StoreClient(server.endpoint) as c:
        assert c.stats()["pending"] == 0
