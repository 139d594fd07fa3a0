"""Staleness accounting: readings, architectural staleness, nearest-rank summaries, per-step reports."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from knittrans.sched.staleness import (
    READINGS,
    ConsumedGroup,
    RunningSummary,
    architectural_staleness,
    staleness,
    step_report,
    summarize_weighted,
    version_of,
)
from knittrans.sched.types import FinishedGroup


def _consumed(gid: str, source: str, n: int, v_train: int, k: int, vs: int, ve: int, vw: float) -> ConsumedGroup:
    return ConsumedGroup(
        group_id=gid,
        source=source,
        num_trajectories=n,
        v_train=v_train,
        mini_batch_index=k,
        step=0,
        version_start=vs,
        version_end=ve,
        version_weighted=vw,
    )


def test_readings_of_group_and_record() -> None:
    """version_of reads start/end/weighted from a FinishedGroup; unknown readings are refused."""
    group = FinishedGroup(
        group_id="g",
        source="s",
        trajectory_tokens=(1,),
        finished_at=0,
        version_start=3,
        version_end=5,
        version_weighted=4.25,
    )
    assert [version_of(group, r) for r in READINGS] == [3.0, 5.0, 4.25]
    with pytest.raises(ValueError, match="start, end, weighted"):
        version_of(group, "middle")


def test_staleness_and_architectural() -> None:
    """Mini-batch 2 trained at v=12 on data from v=10: staleness 2, architectural 0 (colocated gives 2)."""
    assert staleness(12, 10) == 2.0
    assert architectural_staleness(12, 10, 2) == 0.0
    assert architectural_staleness(12, 11.5, 2) == -1.5
    with pytest.raises(ValueError, match="mini_batch_index"):
        architectural_staleness(1, 0, -1)


def test_summarize_hand_case() -> None:
    """Values -1, 0, 2, 3, 10 (nearest rank): mean 2.8, p50 2, p99 10, max 10, positive-part mean 3."""
    stats = summarize_weighted([(3, 1), (-1, 1), (10, 1), (0, 1), (2, 1)])
    assert stats.count == 5
    assert stats.mean == pytest.approx(2.8)
    assert (stats.p50, stats.p99, stats.max) == (2, 10, 10)
    assert stats.pos_mean == pytest.approx(3.0)


def test_summarize_empty_is_nan() -> None:
    """No values: count 0 and NaN statistics; to_dict gives None for JSON."""
    stats = summarize_weighted([])
    assert stats.count == 0 and all(math.isnan(v) for v in (stats.mean, stats.p50, stats.p99, stats.max))
    assert stats.to_dict() == {"count": 0, "mean": None, "p50": None, "p99": None, "max": None, "pos_mean": None}


@given(st.lists(st.tuples(st.integers(-5, 20), st.integers(0, 6)), max_size=30))
def test_weighted_equals_expanded(pairs: list[tuple[int, int]]) -> None:
    """A weighted summary equals the nearest-rank summary of the values repeated by their weights."""
    expanded = sorted(float(v) for v, w in pairs for _ in range(w))
    a = summarize_weighted([(float(v), w) for v, w in pairs])
    assert a.count == len(expanded)
    if expanded:
        n = len(expanded)
        assert (a.p50, a.p99, a.max) == (
            expanded[math.ceil(0.5 * n) - 1],
            expanded[math.ceil(0.99 * n) - 1],
            expanded[-1],
        )
        assert a.mean == pytest.approx(sum(expanded) / len(expanded))
        ordered = sorted(expanded)
        assert a.p50 == ordered[math.ceil(0.5 * len(ordered)) - 1]


def test_step_report_weights_trajectories_and_splits_sources() -> None:
    """A group of 4 counts four times; by_source splits; the reading picks the version field."""
    consumed = [
        _consumed("g1", "math", 4, v_train=10, k=0, vs=8, ve=10, vw=9.0),
        _consumed("g2", "code", 1, v_train=11, k=1, vs=11, ve=11, vw=11.0),
    ]
    report = step_report(consumed, "start")
    assert report["reading"] == "start"
    assert report["staleness"].count == 5
    assert report["staleness"].mean == pytest.approx((4 * 2 + 0) / 5)
    assert report["architectural"].mean == pytest.approx((4 * 2 + (0 - 1)) / 5)
    assert report["architectural"].pos_mean == pytest.approx(8 / 5)
    assert sorted(report["by_source"]) == ["code", "math"]
    assert report["by_source"]["code"]["architectural"].max == -1
    assert step_report(consumed, "end")["staleness"].max == 0
    assert step_report(consumed, "weighted")["by_source"]["math"]["staleness"].p50 == 1
    with pytest.raises(ValueError, match="reading"):
        step_report(consumed, "late")
    with pytest.raises(ValueError, match="unknown version reading 'late'"):
        step_report([], "late")  # refused when the report is made, not at its first group


def test_bad_weights_and_records_are_refused() -> None:
    """A negative weight, trajectory count or mini-batch index is a ValueError naming it."""
    with pytest.raises(ValueError, match="weights must be >= 0, got -1"):
        summarize_weighted([(1.0, -1)])
    with pytest.raises(ValueError, match="num_trajectories must be >= 0, got -1"):
        _consumed("g", "math", -1, v_train=1, k=0, vs=0, ve=0, vw=0.0)
    with pytest.raises(ValueError, match="mini_batch_index must be >= 0, got -1"):
        _consumed("g", "math", 1, v_train=1, k=-1, vs=0, ve=0, vw=0.0)


def test_running_summary_bins_fractional_values_to_its_resolution() -> None:
    """With a resolution, fractional values land on its grid (the histogram stays as large as the range of
    values, however many are added); integers and a summary without resolution keep values as they are."""
    binned, exact = RunningSummary(0.25), RunningSummary()
    for i in range(1000):
        for summary in (binned, exact):
            summary.add(i / 997, 1)  # 1000 distinct values in [0, 1.003]
    assert len(binned.hist) <= 5 and len(exact.hist) == 1000
    assert set(binned.hist) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert binned.stats().count == 1000 and binned.stats().max == 1.0
    assert binned.stats().mean == pytest.approx(exact.stats().mean)  # the sums stay exact
    coarse = RunningSummary(0.5)
    coarse.add(0.3, 2)
    coarse.add(3.0, 1)
    assert (coarse.stats().p50, coarse.stats().max) == (0.5, 3.0)
