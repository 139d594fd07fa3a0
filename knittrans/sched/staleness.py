"""Staleness accounting: per-trajectory staleness and architectural staleness, per-step summaries."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from knittrans.sched.types import FinishedGroup

__all__ = [
    "READINGS",
    "ConsumedGroup",
    "RunningSummary",
    "StalenessReport",
    "StalenessStats",
    "architectural_staleness",
    "staleness",
    "step_report",
    "summarize_weighted",
    "version_of",
]

READINGS: tuple[str, ...] = ("start", "end", "weighted")

_FIELDS = {"start": "version_start", "end": "version_end", "weighted": "version_weighted"}


def _field(reading: str) -> str:
    name = _FIELDS.get(reading)
    if name is None:
        raise ValueError(f"unknown version reading {reading!r}; valid readings: {', '.join(READINGS)}")
    return name


def version_of(group: FinishedGroup | ConsumedGroup, reading: str) -> float:
    """The generating version of a group under ``reading`` (``start``, ``end``, ``weighted``); ValueError if unknown."""
    return float(getattr(group, _field(reading)))


def staleness(v_train: int, v_gen: float) -> float:
    """``v_train - v_gen``: optimizer steps between generation and consumption."""
    return float(v_train) - float(v_gen)


def architectural_staleness(v_train: int, v_gen: float, mini_batch_index: int) -> float:
    """Staleness minus the colocated staleness ``k`` of mini-batch ``k``; negative means fresher than colocated."""
    if mini_batch_index < 0:
        raise ValueError(f"mini_batch_index must be >= 0, got {mini_batch_index}")
    return staleness(v_train, v_gen) - mini_batch_index


@dataclass(frozen=True, kw_only=True)
class StalenessStats:
    """Summary of staleness values, every trajectory counted once."""

    count: int
    """Trajectories summarised."""
    mean: float
    """Mean (NaN when empty)."""
    p50: float
    """Nearest-rank median (NaN when empty)."""
    p99: float
    """Nearest-rank 99th percentile (NaN when empty)."""
    max: float
    """Largest value (NaN when empty)."""
    pos_mean: float
    """Mean of ``max(x, 0)``: stale tails a negative mean would hide (NaN when empty)."""

    def to_dict(self) -> dict[str, float | int | None]:
        """Plain dict for JSON; NaN becomes None."""
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(self).items()}


_EMPTY = StalenessStats(count=0, mean=math.nan, p50=math.nan, p99=math.nan, max=math.nan, pos_mean=math.nan)


class RunningSummary:
    """Weighted summary that takes values one at a time: exact running sums and a histogram of the values.

    ``resolution``: non-integer values are binned to this grid in the histogram (its size is then bounded by
    the range of values, not by how many were added; percentiles and max are within ``resolution``); None
    keeps every value as it is.
    """

    __slots__ = ("acc", "hist", "pos", "resolution", "total")

    def __init__(self, resolution: float | None = None) -> None:
        self.resolution = resolution
        self.total = 0
        self.acc = 0.0
        self.pos = 0.0
        self.hist: dict[float, int] = {}

    def add(self, value: float, weight: int) -> None:
        """Count ``value`` ``weight`` times (weights >= 0)."""
        if weight < 0:
            raise ValueError(f"weights must be >= 0, got {weight}")
        if weight == 0:
            return
        self.total += weight
        self.acc += value * weight
        self.pos += max(value, 0.0) * weight
        if self.resolution is not None and not value.is_integer():
            value = round(value / self.resolution) * self.resolution
        self.hist[value] = self.hist.get(value, 0) + weight

    def stats(self) -> StalenessStats:
        """The summary; nearest-rank percentiles."""
        if self.total == 0:
            return _EMPTY
        ordered = sorted(self.hist.items())
        seen = list(itertools.accumulate(weight for _, weight in ordered))

        def nearest_rank(fraction: float) -> float:
            return ordered[bisect.bisect_left(seen, max(1, math.ceil(fraction * self.total)))][0]

        return StalenessStats(
            count=self.total,
            mean=self.acc / self.total,
            p50=nearest_rank(0.50),
            p99=nearest_rank(0.99),
            max=ordered[-1][0],
            pos_mean=self.pos / self.total,
        )


def summarize_weighted(pairs: Sequence[tuple[float, int]]) -> StalenessStats:
    """Summary of ``(value, weight)`` pairs, each value counted ``weight`` times (weights >= 0)."""
    summary = RunningSummary()
    for value, weight in pairs:
        summary.add(value, weight)
    return summary.stats()


@dataclass(frozen=True, kw_only=True)
class ConsumedGroup:
    """A group as the trainer consumed it: where in the step, at which version, generated when."""

    group_id: str
    """Group id."""
    source: str
    """Data source."""
    num_trajectories: int
    """Trajectories in the group; each counts once in summaries."""
    v_train: int
    """Trainer policy version that consumed it (before the mini-batch's optimizer step)."""
    mini_batch_index: int
    """Mini-batch ``k`` (0-based) within its step."""
    step: int
    """Train step."""
    version_start: int
    """Smallest version that started a trajectory of the group."""
    version_end: int
    """Largest version that produced a token of the group."""
    version_weighted: float
    """Token-weighted mean version."""

    def __post_init__(self) -> None:
        if self.num_trajectories < 0:
            raise ValueError(f"num_trajectories must be >= 0, got {self.num_trajectories}")
        if self.mini_batch_index < 0:
            raise ValueError(f"mini_batch_index must be >= 0, got {self.mini_batch_index}")


class StalenessReport:
    """Staleness and architectural staleness of consumed groups under one reading, overall and by source,
    taken group by group (``resolution``: see :class:`RunningSummary`)."""

    def __init__(self, reading: str, resolution: float | None = None) -> None:
        _field(reading)
        self.reading = reading
        self.resolution = resolution
        self.parts: dict[str | None, tuple[RunningSummary, RunningSummary]] = {}
        """Per source (None: every source): the summaries of staleness and of architectural staleness."""

    def add(self, group: ConsumedGroup) -> float:
        """Count the group's trajectories; returns the group's staleness under this reading."""
        value = staleness(group.v_train, version_of(group, self.reading))
        arch, weight = value - group.mini_batch_index, group.num_trajectories
        for key in (None, group.source):
            pair = self.parts.get(key)
            if pair is None:
                pair = self.parts[key] = (RunningSummary(self.resolution), RunningSummary(self.resolution))
            pair[0].add(value, weight)
            pair[1].add(arch, weight)
        return value

    def report(self) -> dict[str, Any]:
        """``{"reading", "staleness", "architectural", "by_source": {source: {"staleness", "architectural"}}}``
        with :class:`StalenessStats` values, trajectory-weighted."""
        plain, arch = self.parts.get(None) or (RunningSummary(), RunningSummary())
        by_source = sorted((s, pair) for s, pair in self.parts.items() if s is not None)
        return {
            "reading": self.reading,
            "staleness": plain.stats(),
            "architectural": arch.stats(),
            "by_source": {s: {"staleness": p.stats(), "architectural": a.stats()} for s, (p, a) in by_source},
        }


def step_report(consumed: Sequence[ConsumedGroup], reading: str) -> dict[str, Any]:
    """Staleness and architectural staleness of consumed groups, overall and by source
    (:meth:`StalenessReport.report`)."""
    report = StalenessReport(reading)
    for group in consumed:
        report.add(group)
    return report.report()
