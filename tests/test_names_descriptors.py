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
    assert d.groups[1].num_tokens == 10 + 11 + 12


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
