"""Identifier validation and unit descriptors: no path traversal, consistent row coverage."""

from __future__ import annotations

import pytest

from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.errors import InvalidName, InvalidRequest
from knittrans.names import check_name


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../x", "a..b", ".hidden", "x" * 129, "a b", "é", None, 3])
def test_unsafe_names_are_refused(bad: object) -> None:
    """names that could escape a directory or are not identifiers raise InvalidName."""
    with pytest.raises(InvalidName, match="not a valid name"):
        check_name(bad, "unit_id")


@pytest.mark.parametrize("good", ["u1", "job-2026.11_a", "A" * 128, "0"])
def test_safe_names_pass(good: str) -> None:
    """ordinary identifiers are returned unchanged."""
    assert check_name(good, "unit_id") == good


def _group(gid: str, row_start: int, n: int) -> GroupRecord:
    return GroupRecord(
        group_id=gid,
        source="math",
        row_start=row_start,
        num_trajectories=n,
        trajectory_tokens=tuple(range(10, 10 + n)),
        version_start=1,
        version_end=2,
        version_weighted=1.5,
        finished_at=100.0,
        media_hashes=("ab" * 32,),
    )


def test_descriptor_round_trips_through_dict() -> None:
    """to_dict/from_dict is lossless, tuples included."""
    d = UnitDescriptor(
        unit_id="u1",
        job="j",
        node_id="n1",
        endpoint="grpc://127.0.0.1:1",
        num_rows=5,
        num_bytes=123,
        schema_version=1,
        groups=(_group("g1", 0, 2), _group("g2", 2, 3)),
    )
    assert UnitDescriptor.from_dict(d.to_dict()) == d
    assert d.groups[1].trajectory_tokens == (10, 11, 12)


def test_descriptor_rejects_gaps_and_bad_counts() -> None:
    """groups must tile the unit's rows exactly; token counts must match the group size."""
    with pytest.raises(InvalidRequest, match="starts at row 3, expected 2"):
        UnitDescriptor(
            unit_id="u1",
            job="j",
            node_id="n1",
            endpoint="e",
            num_rows=5,
            num_bytes=1,
            schema_version=1,
            groups=(_group("g1", 0, 2), _group("g2", 3, 2)),
        )
    with pytest.raises(InvalidRequest, match="cover 2 rows, unit has 5"):
        UnitDescriptor(
            unit_id="u1",
            job="j",
            node_id="n1",
            endpoint="e",
            num_rows=5,
            num_bytes=1,
            schema_version=1,
            groups=(_group("g1", 0, 2),),
        )
    with pytest.raises(InvalidRequest, match="bad unit descriptor"):
        UnitDescriptor.from_dict({"unit_id": "u1"})


class _Count(int):
    """An ``int`` subclass (as an IntEnum member is): accepted as a token count like a plain int."""


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [
        ((10, 11, True), "True"),
        ((10, -1, 12), "-1"),
        ((10, 11, 2**31), str(2**31)),
        ((10, 11.0, 12), "11.0"),
        ((10, "11", 12), "'11'"),
    ],
)
def test_group_token_counts_are_checked_and_the_bad_one_named(tokens: tuple[object, ...], bad: str) -> None:
    """Token counts must be plain non-negative int32 integers (the check runs in C loops first and falls back
    to one value at a time only to name the bad value)."""
    with pytest.raises(InvalidRequest, match=rf"trajectory_tokens {bad} must be an integer in \[0, 2147483647\]"):
        GroupRecord(**{**_group("g1", 0, 3).__dict__, "trajectory_tokens": tokens})


def test_group_token_counts_accept_int_subclasses_and_the_int32_bounds() -> None:
    """0, 2**31 - 1 and an ``int`` subclass pass, as they did value by value."""
    g = GroupRecord(**{**_group("g1", 0, 3).__dict__, "trajectory_tokens": (0, 2**31 - 1, _Count(5))})
    assert sum(g.trajectory_tokens) == 2**31 + 4


def test_group_times_media_hashes_and_the_schema_version_are_checked() -> None:
    """A finish time that is not a finite non-negative Unix time, a media hash that is not 64 lower-case hex
    characters and a schema version other than the store's are refused naming the group or unit."""
    g = _group("g1", 0, 2).__dict__
    for bad in (float("nan"), -1.0, "noon"):
        with pytest.raises(InvalidRequest, match=r"group 'g1': finished_at .* must be a finite non-negative Unix time"):
            GroupRecord(**{**g, "finished_at": bad})
    with pytest.raises(InvalidRequest, match=r"group 'g1': media hash 'AB.*' is not 64 lower-case hex characters"):
        GroupRecord(**{**g, "media_hashes": ("AB" * 32,)})
    unit = dict(
        unit_id="u1", job="j", node_id="n1", endpoint="e", num_rows=2, num_bytes=1, groups=(_group("g1", 0, 2),)
    )
    with pytest.raises(InvalidRequest, match="unit 'u1': schema_version 2 is not supported"):
        UnitDescriptor(**unit, schema_version=2)  # type: ignore[arg-type]


def test_group_fields_are_checked_naming_the_group_and_field() -> None:
    """Unsafe ids, a token-count list that does not match the group size, versions that are no int32 or run
    backwards, a row start below 0 and a weighted version outside ``[version_start, version_end]`` (beyond
    1e-3) are refused naming the group and the field."""
    g = _group("g1", 0, 2).__dict__
    for bad, why in [
        ({"group_id": "a/b"}, "group_id 'a/b' is not a valid name"),
        ({"source": ".."}, "source '..' is not a valid name"),
        ({"num_trajectories": 0, "trajectory_tokens": ()}, "num_trajectories=0 but 0 token counts"),
        ({"trajectory_tokens": (1, 2, 3)}, "num_trajectories=2 but 3 token counts"),
        ({"version_start": 3, "version_end": 2, "version_weighted": 2.5}, "version_end < version_start"),
        ({"row_start": -1}, r"row_start -1 must be an integer in \[0, 2147483647\]"),
        ({"version_start": 1.5, "version_weighted": 1.75}, "version_start 1.5 must be an integer"),
        ({"version_end": 2**31, "version_weighted": 2.0}, f"version_end {2**31} must be an integer"),
        ({"version_weighted": 2.5}, r"version_weighted 2.5 must be a finite number in .* = \[1, 2\]"),
        ({"version_weighted": float("nan")}, "version_weighted nan must be a finite number"),
        ({"version_weighted": "1.5"}, "version_weighted '1.5' must be a finite number"),
    ]:
        with pytest.raises(InvalidRequest, match=why):
            GroupRecord(**{**g, **bad})
    assert GroupRecord(**{**g, "version_weighted": 2.0005}).version_weighted == 2.0005  # within the 1e-3 slack


def test_unit_ids_and_byte_count_are_checked() -> None:
    """A unit, job or node id that is no safe name and a byte count outside ``[0, 2**53 - 1]`` are refused."""
    unit = dict(
        unit_id="u1",
        job="j",
        node_id="n1",
        endpoint="e",
        num_rows=2,
        num_bytes=1,
        schema_version=1,
        groups=(_group("g1", 0, 2),),
    )
    for bad, why in [
        ({"unit_id": ".."}, "unit_id '..' is not a valid name"),
        ({"job": "a b"}, "job 'a b' is not a valid name"),
        ({"node_id": ""}, "node_id '' is not a valid name"),
        ({"num_bytes": -1}, r"unit 'u1': num_bytes -1 must be an integer in \[0, 9007199254740991\]"),
        ({"num_bytes": 2**53}, f"num_bytes {2**53} must be an integer"),
    ]:
        with pytest.raises(InvalidRequest, match=why):
            UnitDescriptor(**{**unit, **bad})  # type: ignore[arg-type]
    assert UnitDescriptor(**{**unit, "num_bytes": 2**53 - 1}).num_bytes == 2**53 - 1  # type: ignore[arg-type]
