"""The batched put path: several units built as one table and published in one round trip.

Covers :func:`knittrans.schema.build_units_tables` (each unit equals the unit built alone, errors name
the unit and row), :meth:`UnitStore.seal_units` / :meth:`UnitStore.publish_units` (all or none), the
``seal_units`` / ``publish_units`` Flight actions (bad bodies refused with clear errors) and
:meth:`TrajectoryWriter.write_units` over a shared directory and over ``DoPut``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pyarrow.ipc as ipc
import pytest
import torch
from data_support import make_groups, unit_bytes

from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.errors import Conflict, InvalidName, InvalidRequest, KnitTransError, NotFound, OverBudget, SchemaMismatch
from knittrans.flight import StoreClient, StoreServer, StoreServerConfig
from knittrans.rollout.writer import TrajectoryWriter, describe_unit
from knittrans.schema import TrajectoryGroup, build_unit_tables, build_units_tables
from knittrans.store import MEDIA_FILE, TRAJ_FILE, SealSpec, StoreConfig, UnitStore, writer_temp_name
from knittrans.store.unit import write_table
from knittrans.tickets import Ticket, UnitRead
from knittrans.userfields import parse_user_fields

Start = Callable[..., StoreServer]


def _units(n_units: int = 3, seed: int = 0) -> list[list[TrajectoryGroup]]:
    return [make_groups(2 + k % 2, 3 + k, seed=seed + k, prefix=f"u{k}g") for k in range(n_units)]


def _replace(g: TrajectoryGroup, **changes: Any) -> TrajectoryGroup:
    return TrajectoryGroup(**{**{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}, **changes})


# --------------------------------------------------------------------------- builder


def test_each_unit_of_a_batch_is_the_unit_built_alone(tmp_path: Path) -> None:
    """Same rows, own source dictionary, own deduplicated media table, and IPC files of the same size that
    read back as the same tables (a batch's columns are slices of shared buffers: Arrow pads a slice with
    the bytes after it instead of zeros, so only the padding may differ)."""
    units = _units(4)
    together = build_units_tables(units)
    assert len(together) == 4
    for k, (groups, t) in enumerate(zip(units, together, strict=True)):
        alone = build_unit_tables(groups)
        assert t.traj.schema.equals(alone.traj.schema, check_metadata=True)
        assert t.traj.equals(alone.traj) and t.media.equals(alone.media)
        source = t.traj.column("source").chunk(0)
        rows = [g.source for g in groups for _ in range(g.num_responses)]
        assert source.equals(pa.array(rows).dictionary_encode())  # the unit's own dictionary, first-seen order
        assert t.media.num_rows == alone.media.num_rows > 0  # the group images and two audio clips, each once
        for name, table in (("traj", t.traj), ("media", t.media)):
            a, b = tmp_path / f"{k}-{name}-batch.arrow", tmp_path / f"{k}-{name}-alone.arrow"
            alone_table = getattr(alone, name)
            assert write_table(a, table) == write_table(b, alone_table)
            back = ipc.open_file(pa.memory_map(str(a))).read_all()
            assert back.equals(alone_table) and back.schema.equals(alone_table.schema, check_metadata=True)
            if name == "traj":  # the dictionary written is the unit's own, not the batch's
                assert back.column("source").chunk(0).dictionary.to_pylist() == list(dict.fromkeys(rows))


def test_batched_columns_hold_the_inputs_and_grpo_advantages() -> None:
    """List columns are the inputs concatenated; advantages are each group's normalised rewards unless given."""
    units = _units(2)
    given = np.array([0.5, -0.5, 0.25, 1.0], dtype=np.float32)
    units[1][0] = _replace(units[1][0], advantages=given)
    tables = build_units_tables(units)
    for groups, t in zip(units, tables, strict=True):
        flat = pc.list_flatten(t.traj.column("response_ids")).to_numpy()
        assert np.array_equal(flat, np.concatenate([r for g in groups for r in g.response_ids]))
        prompts = t.traj.column("prompt_ids").to_pylist()
        assert prompts == [g.prompt_ids.tolist() for g in groups for _ in range(g.num_responses)]
        adv = t.traj.column("advantage").to_numpy()
        row = 0
        for g in groups:
            n = g.num_responses
            r = np.asarray(g.rewards, dtype=np.float64)
            want = given if g.advantages is not None else ((r - r.mean()) / (r.std() + 1e-6)).astype(np.float32)
            np.testing.assert_allclose(adv[row : row + n], want, rtol=1e-6, atol=1e-6)
            row += n


def test_rows_given_as_lists_tensors_or_mixed_dtypes_build_the_same_columns() -> None:
    """The one-concatenate fast path and the row-by-row fallback give the same table."""
    (g,) = make_groups(1, 4, media=False)
    as_lists = _replace(
        g,
        prompt_ids=g.prompt_ids.tolist(),
        response_ids=[r.tolist() for r in g.response_ids],
        response_logprobs=[torch.from_numpy(x) for x in g.response_logprobs],
        loss_masks=[m.astype(bool) for m in g.loss_masks or ()],
    )
    mixed = _replace(g, response_ids=[r.astype(np.int64) if i % 2 else r for i, r in enumerate(g.response_ids)])
    column_rows = _replace(g, response_ids=[r.reshape(-1, 1) for r in g.response_ids])
    want = build_unit_tables([g]).traj
    for variant in (as_lists, mixed, column_rows):
        got = build_unit_tables([variant]).traj
        for name in ("prompt_ids", "response_ids", "response_logprobs", "loss_mask"):
            assert got.column(name).equals(want.column(name)), name


def test_list_values_cast_as_astype_on_the_pooled_path() -> None:
    """Rows concatenated into a pooled buffer take ``astype``'s (unsafe) cast: int64 wraps to int32, floats
    truncate, Python lists and bools convert; a 2-D row still goes row by row; no rows give an empty column."""
    from knittrans.schema import _list_values

    wide, _ = _list_values(
        [np.array([1, 2**31 + 5], dtype=np.int64), np.array([-3], dtype=np.int64)], np.dtype(np.int32)
    )
    assert wide.dtype == np.int32 and wide.tolist() == [1, -(2**31) + 5, -3]
    rows: list[Any] = [np.array([2.9, -1.5]), [7, 8, 9], np.array([True])]
    values, offsets = _list_values(rows, np.dtype(np.int32))
    assert values.dtype == np.int32 and values.tolist() == [2, -1, 7, 8, 9, 1]
    assert offsets.tolist() == [0, 2, 5, 6]
    flat, flat_offsets = _list_values([np.arange(3).reshape(3, 1), np.arange(2)], np.dtype(np.int32))
    assert flat.tolist() == [0, 1, 2, 0, 1] and flat_offsets.tolist() == [0, 3, 5]
    square, square_offsets = _list_values([np.arange(4).reshape(2, 2), np.arange(1)], np.dtype(np.int32))
    assert square.tolist() == [0, 1, 2, 3, 0] and square_offsets.tolist() == [0, 4, 5]  # a row's values, not its len
    empty, empty_offsets = _list_values([], np.dtype(np.float32))
    assert empty.dtype == np.float32 and len(empty) == 0 and empty_offsets.tolist() == [0]


def test_tables_of_a_build_stay_intact_through_later_builds() -> None:
    """A build's columns live in buffers of Arrow's memory pool: freed pages go to later builds only once no
    table uses them, so a table kept (and read through a zero-copy view) never changes under later builds."""
    kept = build_units_tables(_units(3, seed=1))
    views = [t.traj.column("response_ids").chunk(0).values.to_numpy() for t in kept]  # zero-copy views
    before = [t.traj.to_pylist() for t in kept]
    snapshot = [v.copy() for v in views]
    for seed in range(2, 12):
        build_units_tables(_units(3, seed=seed))  # built and dropped: its buffers return to the pool
    assert [t.traj.to_pylist() for t in kept] == before
    for v, s in zip(views, snapshot, strict=True):
        np.testing.assert_array_equal(v, s)


def test_sender_threads_work_in_a_forked_child() -> None:
    """The writers' kept sender threads do not survive ``fork``: a child made after a put gets threads of its
    own (a copy of the parent's pool would take the task and never run it)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, signal
        from knittrans.rollout.writer import _send_async
        assert _send_async(os.getpid).result() == os.getpid()  # the parent's threads exist now
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a child stuck on a task that never runs dies of the alarm
            os._exit(0 if _send_async(os.getpid).result() == os.getpid() else 1)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_sender_threads_take_work_from_an_atexit_hook() -> None:
    """A put from an ``atexit`` hook (executors take no more work by then) runs its round trip in the calling
    thread instead of failing with "cannot schedule new futures after interpreter shutdown"."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import atexit, threading
        from knittrans.rollout.writer import _send_async
        _send_async(int).result()  # the sender threads exist
        atexit.register(lambda: print("sent", _send_async(threading.get_ident).result() == threading.get_ident()))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "sent True", done.stderr


def test_batch_errors_name_the_unit_and_its_row() -> None:
    """A bad row in the second unit is reported with that unit and the row within it; inputs are checked too."""
    units = _units(3)
    bad = units[1][1]
    units[1][1] = _replace(bad, response_ids=[np.array([-1, 2], np.int32), *bad.response_ids[1:]])
    units[1][1] = _replace(units[1][1], response_logprobs=[np.zeros(2, np.float32), *bad.response_logprobs[1:]])
    units[1][1] = _replace(units[1][1], loss_masks=[np.ones(2, np.uint8), *(bad.loss_masks or ())[1:]])
    row = units[1][0].num_responses  # first row of the second group of unit 1
    with pytest.raises(InvalidRequest, match=rf"^unit 1 \(of 3\): column 'response_ids' .* at row {row}$"):
        build_units_tables(units)
    with pytest.raises(InvalidRequest, match="a unit needs at least one group"):
        build_units_tables([units[0], []])
    g = units[0][0]
    with pytest.raises(InvalidRequest, match=r"group 'u0g0': rewards has 2 entries for 3 responses"):
        build_units_tables([[_replace(g, rewards=[1.0, 2.0])]])
    with pytest.raises(
        InvalidRequest, match=r"group 'u1g1': version_end 1099511627776.0 of response 2 is not a 32-bit"
    ):
        build_units_tables([units[0], [units[1][0], _replace(units[1][1], version_end=[0, 0, 2**40, 0])]])
    assert build_units_tables([]) == []


def test_traj_ids_may_repeat_across_units_but_not_within_one() -> None:
    """Each unit is validated as a unit: the same trajectory id in two units is allowed, as before batching."""
    (g,) = make_groups(1, 3, media=False)
    twin = _replace(g, group_id="other")  # no traj_ids: ids derive from the group id, so set them equal
    same = [f"t{i}" for i in range(3)]
    tables = build_units_tables([[_replace(g, traj_ids=same)], [_replace(twin, traj_ids=same)]])
    assert [t.traj.column("traj_id").to_pylist() for t in tables] == [same, same]
    with pytest.raises(InvalidRequest, match=r"^unit 1 \(of 2\): column 'traj_id' value 't0' is duplicated"):
        build_units_tables([[g], [_replace(g, traj_ids=same), _replace(twin, traj_ids=same)]])


def test_user_fields_are_built_per_unit_with_unit_relative_rows() -> None:
    """Declared user fields travel with each unit; a bad value names its group, field and row in the unit."""
    fields = parse_user_fields({"ref": "list<float32>", "uid": "string"})

    def with_user(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        return [
            _replace(
                g,
                user_fields={"ref": [np.full(3, i, np.float32) for i in range(g.num_responses)], "uid": g.group_id},
                shared_user_fields=frozenset({"uid"}),
            )
            for g in groups
        ]

    units = [with_user(gs) for gs in _units(2)]
    tables = build_units_tables(units, user_fields=fields)
    for groups, t in zip(units, tables, strict=True):
        assert t.traj.equals(build_unit_tables(groups, user_fields=fields).traj)
        assert t.traj.column("uid").to_pylist() == [g.group_id for g in groups for _ in range(g.num_responses)]
    g = units[1][1]
    refs = g.user_fields["ref"]  # type: ignore[index]
    units[1][1] = _replace(g, user_fields={"ref": refs, "uid": [None, "a", "b", "c"]}, shared_user_fields=frozenset())
    with pytest.raises(InvalidRequest, match=r"^unit 1 \(of 2\): column 'uid' is null at row 4$"):
        build_units_tables(units, user_fields=fields)
    units[1][1] = _replace(g, user_fields={"ref": refs[:1], "uid": "x"})
    with pytest.raises(InvalidRequest, match=r"group 'u1g1': user field 'ref' has 1 values for 4 responses"):
        build_units_tables(units, user_fields=fields)


def test_descriptor_to_dict_is_asdict() -> None:
    """The hand-written ``to_dict`` gives exactly :func:`dataclasses.asdict`'s dict."""
    t = build_unit_tables(make_groups(2, 3))
    d = describe_unit(t, make_groups(2, 3), unit_id="u", job="j", node_id="n", endpoint="grpc://x:1", num_bytes=5)
    assert d.to_dict() == dataclasses.asdict(d)
    assert json.dumps(d.to_dict()) == json.dumps(dataclasses.asdict(d))


def test_trusted_descriptors_are_the_checked_ones() -> None:
    """``describe_unit`` (records without their per-field checks: the writer's own validated tables) gives
    records equal, field for field and in their JSON, to the checked ones, media hashes included; and a
    descriptor made from them checks like any other."""
    for units in (_units(3), [make_groups(4, 5, seed=7)]):
        for groups, t in zip(units, build_units_tables(units), strict=True):
            kw: dict[str, Any] = {"unit_id": "u", "job": "j", "node_id": "n", "endpoint": "grpc://x:1", "num_bytes": 5}
            trusted = describe_unit(t, groups, **kw)
            checked = dataclasses.replace(
                trusted, groups=tuple(GroupRecord(**dataclasses.asdict(g)) for g in trusted.groups)
            )
            assert trusted == checked and json.dumps(trusted.to_dict()) == json.dumps(checked.to_dict())
            assert all(type(g) is GroupRecord for g in trusted.groups) and any(g.media_hashes for g in trusted.groups)
            assert UnitDescriptor.from_dict(trusted.to_dict()) == trusted
            with pytest.raises(InvalidRequest, match="groups cover"):
                dataclasses.replace(trusted, num_rows=trusted.num_rows + 1)


# --------------------------------------------------------------------------- store


def _begin_and_write(store: UnitStore, ids: list[str], seed: int = 0) -> list[SealSpec]:
    """Units written the way ``DoPut`` writes them: begun, then each part written into the pending unit."""
    specs = []
    for uid, t in zip(ids, build_units_tables(_units(len(ids), seed=seed)), strict=True):
        pending = store.begin("job", uid)
        for part, table in (("traj", t.traj), ("media", t.media)):
            for batch in table.to_batches():
                pending.write(part, batch)  # type: ignore[arg-type]
        specs.append(SealSpec(unit_id=uid, rows=t.traj.num_rows, media_rows=t.media.num_rows))
    return specs


def test_store_seals_a_batch_and_checks_every_unit(store_dir: Path) -> None:
    """``seal_units`` publishes every pending unit; the counts of each are checked."""
    store = UnitStore(StoreConfig(root=store_dir))
    specs = _begin_and_write(store, ["a", "b", "c"])
    sealed = store.seal_units("job", specs)
    assert [u.unit_id for u in sealed] == ["a", "b", "c"]
    assert [u.num_rows for u in sealed] == [s.rows for s in specs]
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["a", "b", "c"]
    assert store.stats()["pending"] == 0 and store.budget.used == sum(u.num_bytes for u in sealed)


def test_store_seal_batch_is_all_or_none(store_dir: Path) -> None:
    """A unit whose counts do not match undoes the units sealed before it and aborts those after it."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=1 << 30))
    specs = _begin_and_write(store, ["a", "b", "c"])
    specs[1] = dataclasses.replace(specs[1], rows=(specs[1].rows or 0) + 1)
    with pytest.raises(Conflict, match=r"unit 'b' of job 'job' does not hold what its writer sent: rows"):
        store.seal_units("job", specs)
    assert store.units("job") == [] and store.stats()["pending"] == 0 and store.budget.used == 0
    assert list((store_dir / "job").iterdir()) == []
    with pytest.raises(InvalidRequest, match=r"unit ids repeat within one seal: \['x'\]"):
        store.seal_units("job", [SealSpec(unit_id="x"), SealSpec(unit_id="x")])


# --------------------------------------------------------------------------- Flight actions


class RecordingServer(StoreServer):
    """A store server that records the action types it is asked for (to count round trips; not
    ``data_lane``, the lane's lookup, once per client)."""

    def __init__(self, config: StoreServerConfig) -> None:
        super().__init__(config)
        self.actions: list[str] = []

    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        if action.type != "data_lane":
            self.actions.append(action.type)
        return super().do_action(context, action)  # type: ignore[no-any-return]


@pytest.fixture
def recording(store_dir: Path) -> Any:
    server = RecordingServer(StoreServerConfig(store=StoreConfig(root=store_dir), node_id="node-0"))
    yield server
    server.shutdown()


@pytest.mark.parametrize(
    ("kind", "body", "error", "match"),
    [
        ("seal_units", {"job": "job"}, InvalidRequest, r"body must be a JSON object with keys \['job', 'units'\]"),
        ("seal_units", {"job": "job", "units": []}, InvalidRequest, "'units' must be a list of 1 to 4096 objects"),
        ("seal_units", {"job": "job", "units": {"unit": "a"}}, InvalidRequest, "'units' must be a list"),
        ("seal_units", {"job": "job", "units": [["a", 5]]}, InvalidRequest, "an object with a 'unit' key"),
        ("seal_units", {"job": "job", "units": [{"unit": "../x"}]}, InvalidRequest, "unit_id"),
        ("seal_units", {"job": "job", "units": [{"unit": "a", "rows": -1}]}, InvalidRequest, "'rows' must be a non"),
        ("seal_units", {"job": "job", "units": [{"unit": "nope"}]}, NotFound, "no unit 'nope' of job 'job'"),
        ("seal_units", {"job": "job", "units": [{"unit": "a"}] * 5000}, InvalidRequest, "1 to 4096"),
    ],
)
def test_batched_actions_refuse_bad_bodies(
    recording: RecordingServer, kind: str, body: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Every malformed batched request is refused with a typed error that says what is wrong; nothing is left."""
    client = StoreClient(recording.endpoint)
    with pytest.raises(error, match=match):
        client._action(kind, body)
    assert recording.store.stats()["pending"] == 0
    client.close()


# --------------------------------------------------------------------------- writer


def test_write_units_uses_one_publish(recording: RecordingServer, store_dir: Path) -> None:
    """Same host: one ``publish_units`` round trip for the call; every unit is what it holds."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    units = _units(4)
    descs = writer.write_units(units)
    assert recording.actions == ["publish_units"]
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == sorted(d.unit_id for d in descs)
    assert [d.num_rows for d in descs] == [sum(g.num_responses for g in gs) for gs in units]
    for d, groups in zip(descs, units, strict=True):
        assert UnitDescriptor.from_dict(d.to_dict()) == d
        unit = recording.store.get("job", d.unit_id)
        assert d.num_bytes == unit.num_bytes
        alone = build_unit_tables(groups)
        assert unit.traj.drop_columns(["finished_at"]).equals(alone.traj.drop_columns(["finished_at"]))
        assert [g.group_id for g in d.groups] == [g.group_id for g in groups]
    assert writer.write_units([]) == [] and recording.actions == ["publish_units"]
    assert recording.store.budget.used == sum(d.num_bytes for d in descs)
    writer.close()


def test_write_units_over_doput_matches_the_shared_dir(recording: RecordingServer, store_dir: Path) -> None:
    """Over ``DoPut`` the units are put one by one and sealed in one call; descriptions match the local path."""
    local = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    remote = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint)
    units = _units(3)
    a = local.write_units(units)
    recording.actions.clear()
    b = remote.write_units(units)
    assert recording.actions == ["seal_units"]
    for x, y in zip(a, b, strict=True):
        assert x.groups == y.groups and x.num_rows == y.num_rows
        ta, tb = (recording.store.get("job", d.unit_id).traj.drop_columns(["finished_at"]) for d in (x, y))
        assert ta.equals(tb)
    local.close()
    remote.close()


def test_write_units_failure_leaves_nothing_on_the_node(recording: RecordingServer, tmp_path: Path) -> None:
    """A failure after the reservation (here: the node writes elsewhere) removes every unit of the call."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=tmp_path)
    with pytest.raises(Conflict, match="is the node on another host"):
        writer.write_units(_units(3))
    assert recording.store.stats()["pending"] == 0 and recording.store.units("job") == []
    assert recording.store.budget.used == 0
    recording.actions.clear()
    with pytest.raises(InvalidRequest, match="a unit needs at least one group"):
        writer.write_units([_units(1)[0], []])
    assert recording.actions == []  # refused before anything reached the node
    writer.close()


@pytest.mark.timing
def test_write_units_waits_for_budget_for_the_whole_batch(start_server: Start, store_dir: Path) -> None:
    """The batch stores all its units or none: with room for one unit only, a batch of two times out."""
    t = build_unit_tables(make_groups(20, 4))
    server = start_server(budget_bytes=int(unit_bytes(t) * 1.5))
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir, timeout_s=0.2)
    with pytest.raises(OverBudget, match="stayed full"):
        writer.write_units([make_groups(20, 4, prefix="a"), make_groups(20, 4, prefix="b")])
    assert server.store.stats()["pending"] == 0 and server.store.budget.used == 0
    (desc,) = writer.write_units([make_groups(20, 4, prefix="c")])
    assert server.store.get("job", desc.unit_id).num_rows == 80
    writer.close()


def test_units_of_a_batch_are_views_of_one_buffer_and_put_as_their_rows(recording: RecordingServer) -> None:
    """Each unit's token values are a view into one buffer for the batch (no copy per unit); ``put_unit``
    of such a unit stores exactly its rows."""
    client = StoreClient(recording.endpoint)
    tables = build_units_tables(_units(3))
    for name in ("prompt_ids", "response_ids", "response_logprobs", "loss_mask"):
        values = [t.traj.column(name).chunk(0).flatten() for t in tables]  # the unit's values: a slice
        width = values[0].type.byte_width

        def start(v: pa.Array) -> int:  # where the slice's first value lies
            return int(v.buffers()[1].address) + v.offset * width  # noqa: B023 (width: this name's)

        for a, b in itertools.pairwise(values):
            assert start(b) == start(a) + len(a) * width, name
    middle = tables[1]
    client.put_unit("job", "mid", middle.traj, middle.media)
    got = client.get(Ticket(job="job", reads=(UnitRead(unit_id="mid"),)))
    assert got.equals(middle.traj)
    client.close()


# --------------------------------------------------------------------------- publish_units (one round trip)


def _written(job_dir: Path, ids: list[str], seed: int = 0) -> list[tuple[SealSpec, Path]]:
    """Units written the way a same-host writer does: into its own temporaries under ``job_dir``."""
    from knittrans.store import writer_temp_name

    job_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for uid, t in zip(ids, build_units_tables(_units(len(ids), seed=seed)), strict=True):
        tmp = job_dir / writer_temp_name(uid)
        tmp.mkdir()
        size = write_table(tmp / TRAJ_FILE, t.traj) + write_table(tmp / MEDIA_FILE, t.media)
        out.append((SealSpec(unit_id=uid, rows=t.traj.num_rows, media_rows=t.media.num_rows, num_bytes=size), tmp))
    return out


def test_store_publish_charges_the_budget_and_is_all_or_none(store_dir: Path) -> None:
    """``publish_units`` seals every unit and charges their bytes; one bad unit leaves no unit and no temporary."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=1 << 30))
    sealed = store.publish_units("job", [(s, str(d)) for s, d in _written(store_dir / "job", ["a", "b"])])
    assert [u.unit_id for u in sealed] == ["a", "b"] and store.budget.used == sum(u.num_bytes for u in sealed)
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["a", "b"]
    units = _written(store_dir / "job", ["c", "d", "e"], seed=5)
    units[1] = (dataclasses.replace(units[1][0], media_rows=99), units[1][1])
    with pytest.raises(Conflict, match=r"unit 'd' of job 'job' does not hold what its writer sent: media_rows"):
        store.publish_units("job", [(s, str(d)) for s, d in units])
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["a", "b"]  # c undone, d and e removed
    assert store.stats()["pending"] == 0 and store.budget.used == sum(u.num_bytes for u in sealed)
    units = _written(store_dir / "job", ["f", "a"], seed=9)
    with pytest.raises(Conflict, match="unit 'a' of job 'job' already exists"):
        store.publish_units("job", [(s, str(d)) for s, d in units])
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["a", "b"]
    assert store.get("job", "a").num_rows == sealed[0].num_rows


def test_store_publish_refuses_what_is_not_a_writer_temporary(store_dir: Path, tmp_path: Path) -> None:
    """A directory elsewhere, a symlink, another unit's name or a missing one: refused, nothing sealed."""
    store = UnitStore(StoreConfig(root=store_dir))
    ((spec, good),) = _written(store_dir / "job", ["a"])
    ((_, elsewhere),) = _written(tmp_path / "job", ["a"])
    link = store_dir / "job" / f"{good.name}x"
    link.symlink_to(elsewhere)
    other = store_dir / "job" / good.name.replace(".tmp-a-", ".tmp-b-")
    for bad in (elsewhere, link, other, store_dir / "job" / ".tmp-a-wmissing", store_dir / "job" / "a"):
        with pytest.raises(Conflict, match="is not a writer's temporary in this node's directory"):
            store.publish_units("job", [(spec, str(bad))])
    assert store.units("job") == [] and store.stats()["pending"] == 0
    assert store.publish_units("job", [(spec, str(good))])[0].unit_id == "a"
    with pytest.raises(InvalidRequest, match=r"unit ids repeat within one publish: \['a'\]"):
        store.publish_units("job", [(spec, str(good)), (spec, str(good))])


def test_store_publish_refuses_a_job_or_unit_that_is_not_a_name(store_dir: Path) -> None:
    """A job spelled as a path is refused before the store looks at a directory: the dead writer's temporary
    beside the store's root (which a sweep of ``<root>/..`` would remove) stays, and nothing is published;
    a unit id spelled as a path is refused as such too (not as a directory that is no writer temporary)."""
    import os
    import time

    store = UnitStore(StoreConfig(root=store_dir / "root", pending_ttl_s=60))
    beside = store_dir / writer_temp_name("u")
    beside.mkdir()
    old = time.time() - 120
    os.utime(beside, (old, old))
    for job in ("..", "../job"):
        with pytest.raises(InvalidName, match="job"):
            store.publish_units(job, [])
    assert beside.is_dir()
    with pytest.raises(InvalidName, match=r"^unit_id '\.\./u'"):
        store.publish_units("job", [(SealSpec(unit_id="../u"), beside)])
    assert beside.is_dir() and store.units() == []


def test_store_publish_takes_its_own_temporary_however_the_path_is_spelled(store_dir: Path, tmp_path: Path) -> None:
    """A writer temporary named through a symlinked parent or a ``..`` is still this node's (the parent is
    resolved when it is not spelled as the node's resolved job directory)."""
    store = UnitStore(StoreConfig(root=store_dir))
    alias = tmp_path / "alias"
    alias.symlink_to(store_dir)
    ((spec_a, a),) = _written(store_dir / "job", ["a"])
    ((spec_b, b),) = _written(store_dir / "job", ["b"], seed=3)
    (store_dir / "job" / "sub").mkdir()
    spelled = [(spec_a, str(alias / "job" / a.name)), (spec_b, str(store_dir / "job" / "sub" / ".." / b.name))]
    assert [u.unit_id for u in store.publish_units("job", spelled)] == ["a", "b"]
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["a", "b", "sub"]


def test_store_publish_waits_for_budget_or_spills(store_dir: Path, tmp_path: Path) -> None:
    """A full budget: without a spill dir the publish waits, then fails and removes its temporaries;
    with one the unit moves there (and is served from it)."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=1 << 30))
    units = _written(store_dir / "job", ["a", "b"])
    room = max(s.num_bytes or 0 for s, _ in units) + 1  # room for either unit, not both
    store.budget.limit = room
    with pytest.raises(OverBudget, match="stayed full"):
        store.publish_units("job", [(s, str(d)) for s, d in units], timeout=0.1)
    assert list((store_dir / "job").iterdir()) == [] and store.budget.used == 0
    spill = tmp_path / "spill"
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=room, spill_dir=spill))
    units = _written(store_dir / "job", ["a", "b"])
    a, b = store.publish_units("job", [(s, str(d)) for s, d in units], timeout=0)
    assert not a.spilled and b.spilled and b.path == spill / "job" / "b" and store.budget.used == a.num_bytes
    assert [p.name for p in (store_dir / "job").iterdir()] == ["a"]
    assert store.read(Ticket(job="job", reads=(UnitRead(unit_id="b"),))).num_rows == b.num_rows


@pytest.mark.timing
def test_store_publish_sweeps_temporaries_of_dead_writers(store_dir: Path) -> None:
    """A writer temporary never published (its writer died) goes once it is older than ``pending_ttl_s``; a
    sealed unit as old stays."""
    import os
    import time

    first = UnitStore(StoreConfig(root=store_dir))  # the node before a restart
    ((spec, kept),) = _written(store_dir / "job", ["kept"])
    rows = first.publish_units("job", [(spec, str(kept))])[0].num_rows
    store = UnitStore(StoreConfig(root=store_dir, pending_ttl_s=60))
    ((_, stale),) = _written(store_dir / "job", ["dead"])
    old = time.time() - 120
    os.utime(stale, (old, old))
    os.utime(store_dir / "job" / "kept", (old, old))
    ((spec, fresh),) = _written(store_dir / "job", ["live"])
    store.publish_units("job", [(spec, str(fresh))])
    assert sorted(p.name for p in (store_dir / "job").iterdir()) == ["kept", "live"]
    assert store.get("job", "kept").num_rows == rows


def test_publish_action_refuses_bad_bodies(recording: RecordingServer, store_dir: Path) -> None:
    """``publish_units`` names what is wrong with a body; nothing is left behind."""
    client = StoreClient(recording.endpoint)
    for units, match in (
        ([{"unit": "a"}], "'dir' of unit 'a' must be a non-empty string"),
        ([{"unit": "a", "dir": 5}], "'dir' of unit 'a'"),
        ([{"unit": "a", "dir": "/x", "rows": "3"}], "'rows' must be a non-negative integer"),
    ):
        with pytest.raises(InvalidRequest, match=match):
            client.publish_units("job", units)
    with pytest.raises(InvalidRequest, match="'timeout_s' must be a number"):
        client.publish_units("job", [{"unit": "a", "dir": "/x"}], timeout_s=-1)
    with pytest.raises(Conflict, match="is the node on another host"):
        client.publish_units("job", [{"unit": "a", "dir": "/tmp/.tmp-a-wffff"}])
    assert recording.store.stats()["pending"] == 0 and recording.store.units() == []
    client.close()


@pytest.mark.timing
def test_writer_publish_failure_leaves_nothing(recording: RecordingServer, store_dir: Path) -> None:
    """A unit the node cannot take (no budget in time) fails the call: no unit, no temporary, no budget."""
    recording.store.budget.limit = 1000
    writer = TrajectoryWriter(
        job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir, timeout_s=0.1
    )
    with pytest.raises(OverBudget):
        writer.write_units(_units(2))
    assert list((store_dir / "job").iterdir()) == [] and recording.store.budget.used == 0
    assert recording.store.stats()["pending"] == 0
    writer.close()


def test_published_unit_without_media_has_no_media_file(recording: RecordingServer, store_dir: Path) -> None:
    """A unit without media is published without a media file; the node and a same-host reader both
    read its media as none, and a unit with media keeps its file."""
    from knittrans.store import LocalReader

    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    bare, rich = writer.write_units([make_groups(2, 3, media=False, prefix="bare"), make_groups(2, 3, prefix="rich")])
    assert not (store_dir / "job" / bare.unit_id / MEDIA_FILE).exists()
    assert (store_dir / "job" / rich.unit_id / MEDIA_FILE).exists()
    unit = recording.store.get("job", bare.unit_id)
    assert unit.media.num_rows == 0 and unit.num_bytes == (store_dir / "job" / bare.unit_id / TRAJ_FILE).stat().st_size
    assert bare.num_bytes == unit.num_bytes
    rows = Ticket(job="job", reads=(UnitRead(unit_id=bare.unit_id),))
    client = StoreClient(recording.endpoint)
    assert client.get(rows).equals(LocalReader([store_dir]).read(rows))
    hashes = list(dict.fromkeys(h for g in rich.groups for h in g.media_hashes))
    media = Ticket(
        job="job",
        reads=(UnitRead(unit_id=bare.unit_id), UnitRead(unit_id=rich.unit_id)),
        kind="media",
        media_hashes=tuple(hashes),
    )
    assert client.get(media).num_rows == len(hashes) == LocalReader([store_dir]).read(media).num_rows
    restarted = UnitStore(StoreConfig(root=store_dir))  # rescan recovers it as it is
    assert restarted.get("job", bare.unit_id).media.num_rows == 0
    client.close()
    writer.close()


def test_store_publish_refuses_a_file_that_is_not_the_unit_schema(store_dir: Path) -> None:
    """A same-host writer cannot publish what the store would not serve: a trajectory file with a column
    missing, or bytes that are not Arrow IPC, fail the call (naming the file) and leave nothing."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=1 << 30))
    units = _written(store_dir / "job", ["a", "b"])
    traj = build_units_tables(_units(2))[1].traj  # what was written, built again (the file is not mapped)
    size = write_table(units[1][1] / TRAJ_FILE, traj.drop_columns(["reward"]))
    size += (units[1][1] / MEDIA_FILE).stat().st_size
    units[1] = (dataclasses.replace(units[1][0], num_bytes=size), units[1][1])
    with pytest.raises(SchemaMismatch, match="missing \\['reward'\\]"):
        store.publish_units("job", [(s, str(d)) for s, d in units])
    units = _written(store_dir / "job", ["c"], seed=3)
    (units[0][1] / TRAJ_FILE).write_bytes(b"not arrow")
    with pytest.raises(SchemaMismatch, match="is not a readable Arrow IPC file"):
        store.publish_units("job", [(s, str(d)) for s, d in units])
    assert list((store_dir / "job").iterdir()) == [] and store.budget.used == 0
    assert store.stats()["pending"] == 0


def test_across_failure_while_staging_removes_what_the_earlier_nodes_stored(
    recording: RecordingServer, store_dir: Path
) -> None:
    """``write_units_across`` starts a node's publish as soon as its files are written; when a later
    writer then fails before its own publish (a bad group id), the units the earlier one published are
    removed and no temporary is left."""
    from knittrans.rollout.writer import write_units_across

    w0 = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    w1 = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    bad = _units(2, seed=4)
    bad[1][0] = _replace(bad[1][0], group_id="no spaces allowed")
    with pytest.raises(InvalidRequest, match="group_id"):
        write_units_across([(w0, _units(2)), (w1, bad)])
    assert "publish_units" in recording.actions  # w0's publish went out before w1 failed
    assert recording.store.units("job") == [] and list((store_dir / "job").iterdir()) == []
    assert write_units_across([]) == []
    with pytest.raises(InvalidRequest, match="one pair per writer"):  # refused before anything is written
        write_units_across([(w0, _units(1)), (w0, _units(1, seed=5))])
    assert recording.store.units("job") == []
    w0.close()
    w1.close()


def test_a_bad_source_is_refused_before_anything_reaches_the_node(recording: RecordingServer, store_dir: Path) -> None:
    """A group whose source is not a name is refused while staging: no round trip, nothing stored."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    groups = make_groups(2)
    groups[1] = _replace(groups[1], source="no spaces allowed")
    with pytest.raises(InvalidRequest, match="source"):
        writer.write_groups(groups)
    assert recording.actions == [] and recording.store.units("job") == []
    writer.close()


def test_across_writers_of_other_user_fields_build_each_its_own_units(
    recording: RecordingServer, store_dir: Path
) -> None:
    """``write_units_across`` builds the units of writers that declare other user fields with each writer's own."""
    from knittrans.rollout.writer import write_units_across

    kw: dict[str, Any] = {"job": "job", "node_id": "node-0", "endpoint": recording.endpoint, "store_dir": store_dir}
    tagged_writer = TrajectoryWriter(**kw, user_fields={"uid": "string"})
    plain_writer = TrajectoryWriter(**kw)
    tagged = [
        _replace(g, user_fields={"uid": g.group_id}, shared_user_fields=frozenset({"uid"})) for g in make_groups(2)
    ]
    [a], [b] = write_units_across([(tagged_writer, [tagged]), (plain_writer, [make_groups(2, seed=1)])])
    uids = recording.store.get("job", a.unit_id).traj.column("uid").to_pylist()
    assert uids == [g.group_id for g in tagged for _ in range(g.num_responses)]
    assert "uid" not in recording.store.get("job", b.unit_id).traj.column_names
    tagged_writer.close()
    plain_writer.close()


def test_across_writers_each_store_their_own_units(recording: RecordingServer, store_dir: Path) -> None:
    """``write_units_across`` builds the units of all its writers as one table, then stores each writer's own."""
    from knittrans.rollout.writer import write_units_across

    local = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    remote = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint)
    units = [_units(2), _units(2, seed=7)]
    stored = write_units_across([(local, units[0]), (remote, units[1])])
    for descs, groups_of in zip(stored, units, strict=True):
        for d, groups in zip(descs, groups_of, strict=True):
            traj = recording.store.get("job", d.unit_id).traj.drop_columns(["finished_at"])
            assert traj.equals(build_unit_tables(groups).traj.drop_columns(["finished_at"]))
    local.close()
    remote.close()


def test_write_tables_publishes_prepared_tables_through_the_shared_dir(
    recording: RecordingServer, store_dir: Path
) -> None:
    """A same-host writer stores prepared tables (``write_tables``, as the TransferQueue backend does) with one
    ``publish_units`` and returns the node's info; no units: no round trip."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    info = writer.write_tables("u1", build_unit_tables(make_groups(2, 4)))
    assert recording.actions == ["publish_units"]
    unit = recording.store.get("job", "u1")
    assert info["num_bytes"] == unit.num_bytes and unit.num_rows == 8
    assert writer.write_tables_many([]) == [] and recording.actions == ["publish_units"]
    writer.close()


def test_a_temporary_changed_before_its_publish_is_refused(recording: RecordingServer, store_dir: Path) -> None:
    """The writer tells the node what each temporary holds: one that holds something else by the time it is
    published is refused and removed."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=recording.endpoint, store_dir=store_dir)
    tables = build_unit_tables(make_groups(2, 4))
    [entry] = writer._write_temps([("u1", tables)])
    write_table(Path(entry["dir"]) / TRAJ_FILE, tables.traj.slice(0, 4))
    with pytest.raises(Conflict, match=r"does not hold what its writer sent: rows 4 \(expected 8\)"):
        writer._publish_temps([entry])
    assert recording.store.units("job") == [] and list((store_dir / "job").iterdir()) == []
    writer.close()


def test_a_failure_while_writing_temporaries_removes_those_written(store_dir: Path) -> None:
    """``_write_temps`` removes the temporaries it wrote when a later unit of the call fails."""
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint="grpc://127.0.0.1:1", store_dir=store_dir)
    good = build_unit_tables(make_groups(1, 4))
    with pytest.raises(AttributeError):
        writer._write_temps([("u1", good), ("u2", None)])  # type: ignore[list-item]
    assert list((store_dir / "job").iterdir()) == []
    writer.close()


class _LosingServer(StoreServer):
    """A store whose ``publish_units`` fails in transit: its request lost (``before`` the node acts) or its reply
    (after the node published)."""

    def __init__(self, config: StoreServerConfig, lose: str) -> None:
        super().__init__(config)
        self.lose = lose

    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        if action.type == "publish_units" and self.lose == "before":
            raise flight.FlightServerError("request lost")
        out = super().do_action(context, action)
        if action.type == "publish_units":
            raise flight.FlightServerError("reply lost")
        return out  # type: ignore[no-any-return]


@pytest.mark.parametrize("lose", ["before", "after"])
def test_a_publish_lost_in_transit_leaves_no_temporary_and_no_unit(store_dir: Path, lose: str) -> None:
    """A ``publish_units`` that fails other than by the node's refusal: the writer removes its temporaries (the
    node never saw them) and the units the node may have published."""
    server = _LosingServer(StoreServerConfig(store=StoreConfig(root=store_dir), node_id="node-0"), lose)
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir)
    with pytest.raises(KnitTransError, match=f"{'request' if lose == 'before' else 'reply'} lost"):
        writer.write_units(_units(2))
    assert server.store.units("job") == [] and list((store_dir / "job").iterdir()) == []
    writer.close()
    server.shutdown()
