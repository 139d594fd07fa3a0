"""Consumed groups of a job, compacted: running staleness summaries plus a bounded recent window."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from knittrans.sched.staleness import READINGS, ConsumedGroup, StalenessReport

__all__ = ["RECENT_STEPS", "RESOLUTION", "SERIES_STEPS", "ConsumedLedger"]

RESOLUTION = 1.0 / 1024
"""Histogram bin of non-integer staleness values (versions); integers are kept exactly."""
RECENT_STEPS = 16
"""Consumed steps whose groups are kept as they are (``/status`` staleness by step)."""
SERIES_STEPS = 512
"""Consumed steps kept in the per-step series (the dashboard's staleness chart)."""


class ConsumedLedger:
    """What the control plane remembers of consumed groups (docs/reference/rest.md, Status)."""

    def __init__(self) -> None:
        self._readings = {r: StalenessReport(r, RESOLUTION) for r in READINGS}
        """Per reading: the binned summaries of every group consumed so far, overall and per source."""
        self._recent: dict[int, list[ConsumedGroup]] = {}
        self._series: dict[int, dict[str, dict[str, list[float]]]] = {}

    def add(self, records: Iterable[ConsumedGroup]) -> None:
        """Account for newly consumed groups (one mini-batch's, or a restart's replay)."""
        for c in records:
            self._recent.setdefault(c.step, []).append(c)
            series = self._series.get(c.step)
            if series is None:
                series = self._series[c.step] = {r: {} for r in READINGS}
            n = c.num_trajectories  # >= 1: a unit's groups are never empty (GroupRecord checks)
            for reading, report in self._readings.items():
                extra = report.add(c) - c.mini_batch_index
                per_step = series[reading]
                for key in ("all", c.source):
                    cell = per_step.get(key)
                    if cell is None:
                        cell = per_step[key] = [0.0, 0.0, -math.inf]
                    cell[0] += n
                    cell[1] += extra * n
                    if extra > cell[2]:
                        cell[2] = extra
        self._trim(self._recent, RECENT_STEPS)
        self._trim(self._series, SERIES_STEPS)

    @staticmethod
    def _trim(table: dict[int, Any], keep: int) -> None:
        if len(table) > keep:
            for step in sorted(table)[:-keep]:
                del table[step]

    def report(self, reading: str) -> dict[str, Any]:
        """Like :func:`knittrans.sched.staleness.step_report` over every group consumed so far."""
        return self._readings[reading].report()

    def recent_steps(self) -> dict[int, Sequence[ConsumedGroup]]:
        """The groups of the last :data:`RECENT_STEPS` consumed steps, by step."""
        return {s: self._recent[s] for s in sorted(self._recent)}

    def series(self) -> dict[str, dict[str, list[dict[str, float]]]]:
        """``{reading: {source: [{step, mean, max, count}]}}`` of architectural staleness, last
        :data:`SERIES_STEPS` steps (``source`` ``"all"``: every source together)."""
        out: dict[str, dict[str, list[dict[str, float]]]] = {r: {} for r in READINGS}
        for step in sorted(self._series):
            for reading, per_source in self._series[step].items():
                for source in sorted(per_source, key=lambda s: (s != "all", s)):
                    count, total, top = per_source[source]
                    out[reading].setdefault(source, []).append(
                        {"step": step, "mean": total / count, "max": top, "count": count}
                    )
        return out
