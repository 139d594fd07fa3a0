"""Random rollout draws per source and the weight-version timeline seen by rollout."""

from __future__ import annotations

import bisect
import math

import numpy as np

from knittrans.sim.workload import SourceProfile

__all__ = ["SourceStream", "VersionTimeline"]

_CHUNK = 1024


def _lognormal(rng: np.random.Generator, mean: float, cv: float, size: int | tuple[int, int]) -> np.ndarray:
    """Lognormal draws of ``mean`` and coefficient of variation ``cv`` (``mean`` itself, no draw, when ``cv`` is 0)."""
    if not cv > 0:
        return np.full(size, mean, dtype=np.float64)
    sigma2 = math.log1p(cv**2)
    return rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), size)


class SourceStream:
    """Durations and token counts of the successive groups of one source.

    Each source has its own generator seeded from ``(seed, source index)``, so the i-th group launched for a
    source has the same duration and tokens under every policy (common random numbers: policies are
    compared on identical rollouts, not on different luck).
    """

    def __init__(self, profile: SourceProfile, *, group_size: int, seed: int, index: int) -> None:
        self.profile = profile
        self.group_size = group_size
        self._rng = np.random.default_rng([seed, index, 0x5EED])
        self._durations: list[float] = []
        self._tokens: list[tuple[int, ...]] = []
        self._pos = 0

    def _refill(self) -> None:
        p = self.profile
        rng = self._rng
        durations = _lognormal(rng, p.duration_mean_s, p.duration_cv, _CHUNK)
        if p.tail_prob > 0:
            stragglers = rng.random(_CHUNK) < p.tail_prob
            pareto = (1.0 - rng.random(_CHUNK)) ** (-1.0 / p.tail_alpha)
            durations = np.where(stragglers, durations * p.tail_scale * pareto, durations)
        draws = _lognormal(rng, p.tokens_mean, p.tokens_cv, (_CHUNK, self.group_size))
        tokens = np.maximum(1, np.rint(draws)).astype(np.int64)
        self._durations = durations.tolist()
        self._tokens = [tuple(row) for row in tokens.tolist()]
        self._pos = 0

    def next_group(self) -> tuple[float, tuple[int, ...]]:
        """Duration (seconds) and per-trajectory tokens of the next group of this source."""
        if self._pos >= len(self._durations):
            self._refill()
        i = self._pos
        self._pos += 1
        return self._durations[i], self._tokens[i]


class VersionTimeline:
    """When each policy version becomes usable by rollout: version ``v`` at ``available_at[v]``.

    Version ``v`` is written by optimizer step ``v - 1`` (mini-batch number ``v - 1``) and reaches the
    rollout slots ``sync_delay`` seconds after that step ends. Times only grow, so lookups are bisections.
    """

    def __init__(self) -> None:
        self.available_at: list[float] = [0.0]

    @property
    def latest(self) -> int:
        """Newest version published so far (it may not be usable yet)."""
        return len(self.available_at) - 1

    def publish(self, available_at: float) -> int:
        """Record the next version, usable from ``available_at``; returns its number."""
        assert available_at >= self.available_at[-1], "versions must become available in order"
        self.available_at.append(available_at)
        return len(self.available_at) - 1

    def version_at(self, t: float) -> int:
        """Version rollout generates with at time ``t`` (a version arriving exactly at ``t`` counts)."""
        return bisect.bisect_right(self.available_at, t) - 1

    def span(self, start: float, end: float) -> tuple[int, int, float]:
        """``(version at start, last version that produced a token, time-weighted mean version over [start, end])``.

        Tokens are assumed to be generated at a steady rate, so the time-weighted mean is the
        token-weighted mean version of a group that switches weights in flight.
        """
        v0 = self.version_at(start)
        # the end reading is the largest version that produced a token: one arriving exactly at ``end``
        # produced none, so it is the version in force just before ``end`` (never below ``v0``; ``v0`` when
        # ``end <= start``, as bisect_left <= bisect_right)
        v1 = max(v0, bisect.bisect_left(self.available_at, end) - 1)
        if v1 == v0:
            return v0, v1, float(v0)
        total = 0.0
        t = start
        for v in range(v0, v1):
            nxt = self.available_at[v + 1]
            total += v * (nxt - t)
            t = nxt
        total += v1 * (end - t)
        return v0, v1, total / (end - start)
