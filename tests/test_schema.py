"""Schema, builder and validator of trajectory and media tables."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from data_support import make_groups
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.errors import InvalidRequest, SchemaMismatch
from knittrans.schema import (
    MEDIA_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TRAJECTORY_SCHEMA,
    Media,
    TrajectoryGroup,
    _TrajectoryRows,
    build_unit_tables,
    build_units_tables,
    check_schema,
    validate_media,
    validate_trajectories,
)


def test_every_column_holds_exactly_what_was_given() -> None:
    """Every trajectory column equals the builder's inputs, row by row."""
    groups = make_groups(3, 4)
    traj = build_unit_tables(groups).traj
    assert traj.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    rows = traj.to_pylist()
    r = 0
    for g in groups:
        for k in range(g.num_responses):
            row = rows[r]
            assert row["traj_id"] == f"{g.group_id}.{k}" and row["group_id"] == g.group_id
            assert row["source"] == g.source
            assert row["prompt_ids"] == g.prompt_ids.tolist()
            assert row["response_ids"] == g.response_ids[k].tolist()
            assert row["response_logprobs"] == g.response_logprobs[k].tolist()
            assert row["loss_mask"] == g.loss_masks[k].tolist()  # type: ignore[index]
            assert row["reward"] == pytest.approx(float(g.rewards[k]), abs=0)
            assert row["version_start"] == g.version_start and row["version_end"] == g.version_end[k]
            assert row["version_weighted"] == (g.version_start + g.version_end[k]) / 2
            assert row["media"] == [g.media[0].hash, g.response_media[k][0].hash]  # type: ignore[index]
            assert row["finished_at"].timestamp() == pytest.approx(g.finished_at, abs=1e-6)
            r += 1


def test_media_are_stored_once_per_unique_hash() -> None:
    """A group image used by four responses and two audio clips give three media rows per group."""
    groups = make_groups(2, 4)
    media = build_unit_tables(groups).media
    assert media.schema.equals(MEDIA_SCHEMA, check_metadata=True)
    assert media.num_rows == 2 + 2  # two images, two clips shared across both groups
    img = groups[0].media[0]
    row = media.to_pylist()[0]
    assert row["media_hash"] == img.hash and row["kind"] == "image"
    assert row["shape"] == [3, 4, 4] and row["dtype"] == "uint8"
    assert row["data"] == np.ascontiguousarray(img.data).tobytes()


def test_torch_and_list_inputs_build_the_same_table() -> None:
    """Tensors, numpy arrays and Python lists are interchangeable inputs."""
    kw = dict(group_id="g", source="math", rewards=[1.0, 0.5], version_start=2, version_end=3, finished_at=1.0)
    a = TrajectoryGroup(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=[torch.tensor([3, 4, 5]), torch.tensor([6])],
        response_logprobs=[torch.zeros(3), torch.full((1,), -0.5)],
        **kw,
    )  # type: ignore[arg-type]
    b = TrajectoryGroup(prompt_ids=[1, 2], response_ids=[[3, 4, 5], [6]], response_logprobs=[[0.0] * 3, [-0.5]], **kw)  # type: ignore[arg-type]
    assert build_unit_tables([a]).traj.equals(build_unit_tables([b]).traj)


def test_media_hash_depends_on_shape_dtype_and_bytes() -> None:
    """Equal bytes with another shape or kind hash differently; equal content hashes equally."""
    x = np.arange(6, dtype=np.uint8)
    assert Media(kind="image", data=x).hash == Media(kind="image", data=x.copy()).hash
    assert Media(kind="image", data=x).hash != Media(kind="image", data=x.reshape(2, 3)).hash
    assert Media(kind="image", data=x).hash != Media(kind="audio", data=x).hash
    assert Media(kind="image", data=torch.ones(2, dtype=torch.bfloat16)).dtype == "bfloat16"
    assert len(Media(kind="raw", data=b"abc").hex) == 64


def test_validation_names_column_and_row() -> None:
    """A logprob list shorter than its response is reported with column name and row index."""
    g = make_groups(1, 8, media=False)[0]
    bad = list(g.response_logprobs)
    bad[5] = np.zeros(len(g.response_ids[5]) + 1, np.float32)
    with pytest.raises(InvalidRequest, match=r"'response_logprobs' has length \d+ != response_ids length \d+ at row 5"):
        build_unit_tables([TrajectoryGroup(**{**g.__dict__, "response_logprobs": bad})])
    with pytest.raises(InvalidRequest, match=r"'version_end'.*at row 0"):
        build_unit_tables([TrajectoryGroup(**{**g.__dict__, "version_start": 5, "version_end": 4})])
    with pytest.raises(InvalidRequest, match="'traj_id' value 'x' is duplicated"):
        build_unit_tables([TrajectoryGroup(**{**g.__dict__, "traj_ids": ["x"] * 8})])
    with pytest.raises(InvalidRequest, match="rewards has 2 entries for 8 responses"):
        build_unit_tables([TrajectoryGroup(**{**g.__dict__, "rewards": [1.0, 2.0]})])


def test_schema_check_names_version_and_column() -> None:
    """A wrong schema version or a wrong column type is a SchemaMismatch saying which."""
    old = TRAJECTORY_SCHEMA.with_metadata({**TRAJECTORY_SCHEMA.metadata, SCHEMA_VERSION_KEY: b"0"})
    with pytest.raises(SchemaMismatch, match=f"version is 0, expected {SCHEMA_VERSION}"):
        check_schema(old)
    wrong = TRAJECTORY_SCHEMA.set(4, pa.field("response_ids", pa.list_(pa.int64())))
    with pytest.raises(SchemaMismatch, match="'response_ids' has type list<item: int64>"):
        check_schema(wrong)
    with pytest.raises(SchemaMismatch, match="missing \\['reward'\\]"):
        check_schema(TRAJECTORY_SCHEMA.remove(7))
    with pytest.raises(SchemaMismatch, match="tagged"):
        check_schema(MEDIA_SCHEMA, "trajectories")


def test_validators_check_the_schema_first() -> None:
    """``validate_trajectories`` / ``validate_media`` (public: a caller may not have checked the schema) refuse a
    table that lacks a column with SchemaMismatch naming it, though no row check reads that column; a media row
    repeated (its hash right) is refused naming the row."""
    t = build_unit_tables(make_groups(2, 4, seed=3))
    with pytest.raises(SchemaMismatch, match=r"trajectories columns differ: missing \['reward'\]"):
        validate_trajectories(t.traj.drop_columns(["reward"]))
    with pytest.raises(SchemaMismatch, match=r"media columns differ: missing \['kind'\]"):
        validate_media(t.media.drop_columns(["kind"]))
    twice = pa.concat_tables([t.media, t.media.slice(0, 1)])  # each row's hash is right; the last repeats row 0
    with pytest.raises(InvalidRequest, match=f"column 'media_hash' is duplicated at row {t.media.num_rows}$"):
        validate_media(twice)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=5), min_size=1, max_size=5), st.data())
def test_builder_round_trips_random_shapes(lengths: list[list[int]], data: st.DataObject) -> None:
    """For random group shapes the list offsets and values equal the inputs exactly."""
    groups = []
    for i, lens in enumerate(lengths):
        resp = [np.arange(n, dtype=np.int32) + 7 * k for k, n in enumerate(lens)]
        groups.append(
            TrajectoryGroup(
                group_id=f"g{i}",
                source="s",
                prompt_ids=np.arange(i + 1),
                response_ids=resp,
                response_logprobs=[np.full(n, -0.25, np.float32) for n in lens],
                rewards=[0.0] * len(lens),
                version_start=0,
                version_end=0,
            )
        )
    traj = build_unit_tables(groups).traj
    flat = [r for g in groups for r in g.response_ids]
    assert traj.column("response_ids").to_pylist() == [r.tolist() for r in flat]
    offsets = traj.column("response_ids").chunk(0).offsets.to_numpy()
    assert offsets.tolist() == np.concatenate([[0], np.cumsum([len(r) for r in flat])]).tolist()
    # corrupt one row's logprobs: the validator must point at exactly that row
    row = data.draw(st.integers(0, len(flat) - 1))
    lp = traj.column("response_logprobs").to_pylist()
    lp[row] = [*lp[row], 0.0]
    broken = traj.set_column(5, "response_logprobs", pa.array(lp, type=pa.list_(pa.float32())))
    with pytest.raises(InvalidRequest, match=f"'response_logprobs' .* at row {row}$"):
        validate_trajectories(broken)


def _rows_group(i: int, **changes: Any) -> TrajectoryGroup:
    n = 4
    fields: dict[str, Any] = {
        "group_id": f"g{i}",
        "source": "s",
        "prompt_ids": np.arange(5, dtype=np.int32),
        "response_ids": [np.arange(3 + j, dtype=np.int32) for j in range(n)],
        "response_logprobs": [np.zeros(3 + j, np.float32) for j in range(n)],
        "rewards": [float(j) for j in range(n)],
        "version_start": 1,
        "version_end": 2,
        "traj_ids": [f"g{i}t{j}" for j in range(n)],
    }
    return TrajectoryGroup(**{**fields, **changes})


_BAD_SECOND_UNIT: dict[str, tuple[dict[str, Any], str]] = {
    "negative prompt token": (
        {"prompt_ids": np.array([1, -2, 3])},
        "column 'prompt_ids' holds a negative token id at row 0",
    ),
    "mask value 2": (
        {"loss_masks": [np.array([1, 2, 1], np.uint8), *(np.ones(k, np.uint8) for k in (4, 5, 6))]},
        "column 'loss_mask' holds a value other than 0 or 1",
    ),
    "version_weighted outside": (
        {"version_weighted": [1.5, 7.0, 1.5, 1.5]},
        r"column 'version_weighted' \(7.0\) is outside \[version_start, version_end\] at row 1",
    ),
    "version_weighted NaN": (
        {"version_weighted": [1.5, float("nan"), 1.5, 1.5]},
        r"column 'version_weighted' \(nan\) is outside",
    ),
    "logprobs length": (
        {"response_logprobs": [np.zeros(k, np.float32) for k in (3, 9, 5, 6)]},
        "column 'response_logprobs' has length 9 != response_ids length 4 at row 1",
    ),
    "traj_id repeated in the unit": (
        {"traj_ids": ["a", "b", "a", "c"]},
        r"column 'traj_id' value 'a' is duplicated \(first at row 0\)",
    ),
    "traj_id missing": ({"traj_ids": ["a", None, "c", "d"]}, "column 'traj_id' is null at row 1"),
    "finished_at NaN": ({"finished_at": [1.0, float("nan"), 2.0, 3.0]}, "column 'finished_at' is null at row 1"),
    "version_end before start": (
        {"version_start": [1, 5, 1, 1], "version_end": [2, 4, 2, 2]},
        r"column 'version_end' \(4\) < version_start \(5\) at row 1",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_SECOND_UNIT))
def test_build_units_refuses_a_bad_row_naming_unit_column_and_row(case: str) -> None:
    """Rows are checked on the numpy buffers first and, when that finds something, by the Arrow checks, which
    name the unit, the column and the row; each kind of bad row is refused with the same words as before
    the numpy check existed (and its verdict on those rows is: not plainly valid)."""
    changes, words = _BAD_SECOND_UNIT[case]
    units = [[_rows_group(0)], [_rows_group(1, **changes)]]
    assert not _TrajectoryRows([g for u in units for g in u], 0.0).plainly_valid()
    with pytest.raises(InvalidRequest, match=rf"^unit 1 \(of 2\): {words}"):
        build_units_tables(units)
    with pytest.raises(InvalidRequest, match=rf"^{words}"):
        build_units_tables(units[1:])


def test_build_units_plainly_valid_rows_and_a_traj_id_repeated_across_units() -> None:
    """Good rows pass the numpy check alone; a ``traj_id`` repeated across units (allowed) is not plainly valid,
    so the Arrow checks run per unit and accept it."""
    good = [[_rows_group(0)], [_rows_group(1)]]
    assert _TrajectoryRows([g for u in good for g in u], 0.0).plainly_valid()
    assert [t.traj.num_rows for t in build_units_tables(good)] == [4, 4]
    across = [[_rows_group(0, traj_ids=["a", "b", "c", "d"])], [_rows_group(1, traj_ids=["a", "x", "y", "z"])]]
    assert not _TrajectoryRows([g for u in across for g in u], 0.0).plainly_valid()
    assert [t.traj.column("traj_id")[0].as_py() for t in build_units_tables(across)] == ["a", "a"]


def test_group_inputs_that_do_not_fit_are_named() -> None:
    """A group without responses, with a count that differs from its responses or values that are not one
    number per response is refused naming the group and what; a None entry of a defaulted per-response
    value takes that default (``version_end``: the row's ``version_start``)."""
    kw: dict[str, Any] = dict(group_id="g", source="math", prompt_ids=[1], rewards=[1.0, 0.0], finished_at=1.0)
    two: dict[str, Any] = dict(response_ids=[[3, 4], [5]], response_logprobs=[[0.0, 0.0], [0.0]])
    with pytest.raises(InvalidRequest, match="group 'g' has no responses"):
        TrajectoryGroup(**{**kw, "response_ids": [], "response_logprobs": []})
    with pytest.raises(InvalidRequest, match="group 'g': 1 logprob lists for 2 responses"):
        TrajectoryGroup(**{**kw, **two, "response_logprobs": [[0.0, 0.0]]})
    with pytest.raises(InvalidRequest, match="group 'g': traj_ids has the wrong number of entries"):
        build_unit_tables([TrajectoryGroup(**kw, **two, traj_ids=["a"])])
    with pytest.raises(InvalidRequest, match="group 'g': rewards must be numbers, one per response"):
        build_unit_tables([TrajectoryGroup(**{**kw, **two, "rewards": ["high", "low"]})])
    with pytest.raises(InvalidRequest, match=r"group 'g': rewards must be one number per response, got shape \(2, 2\)"):
        build_unit_tables([TrajectoryGroup(**{**kw, **two, "rewards": [[1.0, 0.0], [0.0, 1.0]]})])
    traj = build_unit_tables([TrajectoryGroup(**kw, **two, version_start=[2, 1], version_end=[None, 3])]).traj
    assert traj.column("version_end").to_pylist() == [2, 3]


def test_a_trajectory_schema_with_a_bad_user_column_name_is_refused() -> None:
    """Columns after the fixed ones must be valid, unique user field names."""
    for extra in ("not a name", "reward", "x"):
        names = [extra, extra] if extra == "x" else [extra]
        schema = pa.schema(
            [*TRAJECTORY_SCHEMA, *(pa.field(n, pa.int8()) for n in names)], metadata=TRAJECTORY_SCHEMA.metadata
        )
        with pytest.raises(SchemaMismatch, match=f"user column '{extra}' is not a valid, unique user field name"):
            check_schema(schema)


def test_a_torch_media_tensor_hashes_as_its_numpy_array() -> None:
    """A torch tensor (not bfloat16) is stored as the numpy array of the same values: same dtype, shape and hash."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = Media(kind="image", data=torch.from_numpy(x.copy()))
    assert (m.dtype, m.shape, m.payload) == ("float32", (2, 3), x.tobytes())
    assert m.hash == Media(kind="image", data=x).hash


def test_media_of_raw_bytes_grad_tensors_and_one_byte_tensors_store_their_values() -> None:
    """Raw bytes are stored as they are (dtype ``bytes``, shape ``(len,)``); a tensor that requires grad and a
    one-byte tensor of odd length are stored as the numpy arrays of their values."""
    raw = Media(kind="raw", data=b"abc")
    assert (raw.dtype, raw.shape, raw.payload) == ("bytes", (3,), b"abc")
    grad = Media(kind="x", data=torch.ones(3, requires_grad=True))
    assert (grad.dtype, grad.payload) == ("float32", np.ones(3, np.float32).tobytes())
    odd = np.array([1, 2, 3], dtype=np.uint8)
    assert Media(kind="x", data=torch.from_numpy(odd)).hash == Media(kind="x", data=odd).hash


def test_group_media_without_response_media_reach_the_media_table_and_no_units_give_no_tables() -> None:
    """A group's shared media are stored (and referenced by every row) when it has no per-response media;
    rewards given as a tensor that requires grad build as their values; no units build no tables."""
    (g,) = make_groups(1, 2, media=False)
    img = Media(kind="image", data=np.zeros((2, 2), np.uint8))
    tables = build_unit_tables([replace(g, media=[img], rewards=torch.tensor([1.0, 0.0], requires_grad=True))])
    assert tables.media.column("media_hash").to_pylist() == [img.hash]
    assert tables.traj.column("media").to_pylist() == [[img.hash], [img.hash]]
    assert tables.traj.column("reward").to_pylist() == [1.0, 0.0]
    assert build_units_tables([]) == []
