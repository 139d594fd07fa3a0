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
