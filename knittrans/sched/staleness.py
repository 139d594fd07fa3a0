"""Staleness accounting: per-trajectory staleness and architectural staleness, per-step summaries.

``staleness = v_train - v_gen`` for a trajectory consumed at trainer version ``v_train``.
``architectural staleness`` subtracts what colocated execution would give the same slot: mini-batch
``k`` of a step trains at ``v0 + k`` on data generated at ``v0``, so its colocated staleness is ``k``.
With partial rollout ``v_gen`` has three readings (:data:`READINGS`): the version at the start, at the
end, and the token-weighted mean; every figure says which one it uses.

Summaries count every trajectory once (a group of ``n`` trajectories weighs ``n``). Percentiles are
nearest-rank: ``pXX`` is the smallest value with at least ``ceil(XX/100 · count)`` values at or below it.
An empty summary has ``count == 0`` and NaN for every statistic (no data is not zero staleness);
:meth:`StalenessStats.to_dict` turns NaN into None for JSON.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from knittrans.sched.types import FinishedGroup

__all__ = [
    "READINGS",
    "ConsumedGroup",
    "StalenessStats",
    "architectural_staleness",
    "staleness",
    "step_report",
    "summarize_weighted",
    "summary_of",
    "version_of",
]

logger = logging.getLogger(__name__)

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
        out: dict[str, float | int | None] = {"count": self.count}
        for name in ("mean", "p50", "p99", "max", "pos_mean"):
            value = getattr(self, name)
            out[name] = None if math.isnan(value) else value
        return out


_EMPTY = StalenessStats(count=0, mean=math.nan, p50=math.nan, p99=math.nan, max=math.nan, pos_mean=math.nan)


def summarize_weighted(pairs: Sequence[tuple[float, int]]) -> StalenessStats:
    """Summary of ``(value, weight)`` pairs, each value counted ``weight`` times (weights >= 0)."""
    total = 0
    acc = 0.0
    pos = 0.0
    for value, weight in pairs:
        if weight < 0:
            raise ValueError(f"weights must be >= 0, got {weight}")
        total += weight
        acc += value * weight
        pos += max(value, 0.0) * weight
    return summary_of(sorted((v, w) for v, w in pairs if w > 0), total=total, acc=acc, pos=pos)


def summary_of(ordered: Sequence[tuple[float, int]], *, total: int, acc: float, pos: float) -> StalenessStats:
    """Stats of ascending ``(value, weight)`` pairs of positive weights summing to ``total``, given the
    weighted sum ``acc`` and the weighted sum of positive parts ``pos``; nearest-rank percentiles."""
    if total == 0:
        return _EMPTY

    def nearest_rank(fraction: float) -> float:
        need = max(1, math.ceil(fraction * total))
        seen = 0
        for value, weight in ordered:
            seen += weight
            if seen >= need:
                return value
        return ordered[-1][0]

    return StalenessStats(
        count=total,
        mean=acc / total,
        p50=nearest_rank(0.50),
        p99=nearest_rank(0.99),
        max=ordered[-1][0],
        pos_mean=pos / total,
    )


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


def step_report(consumed: Sequence[ConsumedGroup], reading: str) -> dict[str, Any]:
    """Staleness and architectural staleness of consumed groups, overall and by source.

    Returns:
        ``{"reading": reading, "staleness": StalenessStats, "architectural": StalenessStats,
        "by_source": {source: {"staleness": StalenessStats, "architectural": StalenessStats}}}``,
        trajectory-weighted.
    """
    _field(reading)
    plain: list[tuple[float, int]] = []
    arch: list[tuple[float, int]] = []
    per_source: dict[str, tuple[list[tuple[float, int]], list[tuple[float, int]]]] = {}
    for group in consumed:
        v_gen = version_of(group, reading)
        value = staleness(group.v_train, v_gen)
        extra = value - group.mini_batch_index
        plain.append((value, group.num_trajectories))
        arch.append((extra, group.num_trajectories))
        mine = per_source.setdefault(group.source, ([], []))
        mine[0].append((value, group.num_trajectories))
        mine[1].append((extra, group.num_trajectories))
    return {
        "reading": reading,
        "staleness": summarize_weighted(plain),
        "architectural": summarize_weighted(arch),
        "by_source": {
            source: {"staleness": summarize_weighted(p), "architectural": summarize_weighted(a)}
            for source, (p, a) in sorted(per_source.items())
        },
    }
