"""Run and per-step metrics of a simulated run: staleness under each reading, quotas, idle time, throughput."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from knittrans.sched.staleness import READINGS, ConsumedGroup, StalenessStats, step_report, version_of
from knittrans.sim.engine import RunTrace

__all__ = [
    "ReadingStats",
    "RunMetrics",
    "StalenessSplit",
    "StepMetrics",
    "compute_metrics",
    "reading_stats",
    "staleness_split",
    "warmup_steps",
]


@dataclass(frozen=True, kw_only=True)
class ReadingStats:
    """Staleness and architectural staleness of consumed groups under one version reading (``step_report``)."""

    staleness: StalenessStats
    architectural: StalenessStats


def reading_stats(consumed: Sequence[ConsumedGroup]) -> dict[str, ReadingStats]:
    """Per-reading statistics of consumed groups, computed by ``sched.staleness.step_report``."""
    reports = {reading: step_report(consumed, reading) for reading in READINGS}
    return {
        r: ReadingStats(staleness=rep["staleness"], architectural=rep["architectural"]) for r, rep in reports.items()
    }


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One train step."""

    step: int
    readings: dict[str, ReadingStats]
    admitted_at: list[float]
    """Admission time of each mini-batch of the step (seconds)."""
    train_end: float
    counts: dict[str, int]
    quota_ok: bool
    mean_wait_s: float
    """Mean seconds a group of the step waited between finishing and admission."""
    mean_generation_s: float
    """Mean seconds a group of the step took to generate."""


@dataclass(frozen=True, kw_only=True)
class RunMetrics:
    """One run (workload, policy, seed, K, W); aggregates skip the first ``warmup_steps`` steps."""

    workload: str
    policy: str
    seed: int
    mini_batches_per_step: int
    window: int
    colocated: bool
    in_flight_updates: bool
    steps: int
    warmup_steps: int
    readings: dict[str, ReadingStats]
    quota_violations: int
    """Train batches whose per-source composition differs from the quotas (must be 0)."""
    trainer_idle: float
    rollout_idle: float
    trajectories_per_hour: float
    steps_per_hour: float
    makespan_s: float
    mean_wait_s: float
    """Mean seconds between a group finishing and its admission (after warm-up)."""
    mean_generation_s: float
    """Mean seconds a group took to generate (after warm-up)."""
    dropped: int
    """Groups dropped past the staleness bound."""
    events: int
    select_calls: int
    """Calls of the admission policy's ``select`` (the simulator calls it only when something changed)."""
    per_step: list[StepMetrics]

    def to_json(self, *, per_step: bool = True) -> dict[str, Any]:
        """JSON-ready dict (per-step detail optional; NaN becomes None)."""
        data = asdict(self)
        if not per_step:
            data.pop("per_step")
        cleaned: dict[str, Any] = _clean(data)
        return cleaned


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def warmup_steps(trace: RunTrace) -> int:
    """Steps left out of a run's aggregates: the first ``W`` (pipeline filling), at least one step kept."""
    return max(0, min(trace.workload.window, trace.steps - 1))


@dataclass(frozen=True, kw_only=True)
class StalenessSplit:
    """One consumed group's architectural staleness split at the moment it finished: ``generation + wait``."""

    group_id: str
    step: int
    mini_batch_index: int
    num_trajectories: int
    generation: float
    """Versions the trainer published between the group's tokens (under the reading) and its finish (>= 0)."""
    wait: float
    """Versions between its finish and the start of the step that trains it, ``step·K - n_finish``; negative
    (down to ``-mini_batch_index``) when it finished while its own step was training."""


def staleness_split(trace: RunTrace, reading: str = "weighted") -> list[StalenessSplit]:
    """Split of every group :func:`compute_metrics` aggregates (steps after warm-up) into generation and wait.

    ``n_finish`` is the trainer's version when the group finished: optimizer steps ended at or before that
    instant (the simulator handles an optimizer step ending before a group finishing at the same instant).
    ``generation + wait`` is the group's architectural staleness ``v_train - k - v_gen`` exactly.
    """
    ends = [m.train_end for m in trace.mini_batches if not math.isnan(m.train_end)]
    K = trace.workload.mini_batches_per_step
    warm = warmup_steps(trace)
    out = []
    for c in trace.consumed:
        if c.step < warm:
            continue
        n_finish = bisect.bisect_right(ends, trace.finished_at[c.group_id])
        out.append(
            StalenessSplit(
                group_id=c.group_id,
                step=c.step,
                mini_batch_index=c.mini_batch_index,
                num_trajectories=c.num_trajectories,
                generation=n_finish - version_of(c, reading),
                wait=float(c.step * K - n_finish),
            )
        )
    return out


def compute_metrics(trace: RunTrace) -> RunMetrics:
    """Metrics of a run; the first ``W`` steps (pipeline filling) are left out of aggregates."""
    w = trace.workload
    K = w.mini_batches_per_step
    warm = warmup_steps(trace)
    quotas = w.quotas
    by_step: list[list[ConsumedGroup]] = [[] for _ in range(trace.steps)]
    for c in trace.consumed:
        by_step[c.step].append(c)
    per_step: list[StepMetrics] = []
    for s in range(trace.steps):
        mbs = trace.mini_batches[s * K : (s + 1) * K]
        per_step.append(
            StepMetrics(
                step=s,
                readings=reading_stats(by_step[s]),
                admitted_at=[m.admitted_at for m in mbs],
                train_end=mbs[-1].train_end,
                counts=trace.step_counts[s],
                quota_ok=trace.step_counts[s] == quotas,
                mean_wait_s=sum(m.mean_wait_s for m in mbs) / len(mbs),
                mean_generation_s=sum(m.mean_generation_s for m in mbs) / len(mbs),
            )
        )
    kept = [c for c in trace.consumed if c.step >= warm]
    violations = sum(1 for counts in trace.step_counts if counts != quotas)
    span = trace.makespan_s
    hours = span / 3600.0
    steady = per_step[warm:]
    return RunMetrics(
        workload=w.name,
        policy=trace.policy,
        seed=trace.seed,
        mini_batches_per_step=K,
        window=w.window,
        colocated=trace.colocated,
        in_flight_updates=w.in_flight_updates,
        steps=trace.steps,
        warmup_steps=warm,
        readings=reading_stats(kept),
        quota_violations=violations,
        trainer_idle=1.0 - trace.trainer_busy_s / span,
        rollout_idle=1.0 - trace.rollout_busy_s / (span * w.rollout_slots),
        trajectories_per_hour=trace.steps * w.train_batch_groups * w.group_size / hours,
        steps_per_hour=trace.steps / hours,
        makespan_s=span,
        mean_wait_s=sum(x.mean_wait_s for x in steady) / len(steady),
        mean_generation_s=sum(x.mean_generation_s for x in steady) / len(steady),
        dropped=trace.dropped,
        events=trace.events,
        select_calls=trace.select_calls,
        per_step=per_step,
    )
