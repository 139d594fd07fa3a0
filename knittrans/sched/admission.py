"""Admission policies: which finished groups form the next mini-batch (docs/explanation/admission.md)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

from knittrans.sched.types import AdmissionDecision, FinishedGroup, SourceBounds, StepState

__all__ = [
    "POLICIES",
    "AdmissionPolicy",
    "ConstraintPreservingPolicy",
    "VersionAwarePolicy",
    "composition_plan",
    "expired",
    "make_policy",
    "mini_batch_sizes",
    "quota_deficit",
    "remainder_feasible",
]

POLICIES: tuple[str, ...] = ("train_batch", "linear_target", "constraint_preserving", "version_aware")

_NO_BOUNDS = SourceBounds()


class AdmissionPolicy(Protocol):
    """One admission policy; ``select`` forms the next mini-batch of the step or returns None (wait)."""

    def select(self, state: StepState) -> AdmissionDecision | None:
        """Return the next mini-batch of the step, or None when it cannot be formed yet.

        Raises:
            ValueError: the state is inconsistent (unknown source, ``a > q``, step already complete,
                bounds that no supply can meet, admitted counts this policy's plan cannot reach).
        """
        ...


def mini_batch_sizes(train_batch_size: int, mini_batches_per_step: int) -> list[int]:
    """Groups per mini-batch: ``K`` sizes summing to ``G``, differing by at most one, larger first.

    Raises:
        ValueError: ``K < 1`` or ``K > G``.
    """
    g, k = train_batch_size, mini_batches_per_step
    if k < 1 or k > g:
        raise ValueError(f"mini_batches_per_step must be in 1..train_batch_size={g}, got {k}")
    base, extra = divmod(g, k)
    return [base + 1 if i < extra else base for i in range(k)]


def composition_plan(quotas: Mapping[str, int], mini_batches_per_step: int) -> list[dict[str, int]]:
    """Fixed per-mini-batch composition used by ``train_batch`` and ``linear_target``.

    Mini-batch ``k`` gets ``floor(q[s]/K)`` or ``ceil(q[s]/K)`` groups of each source (so any uniform
    bounds that can be met at all are met) and exactly ``b_k`` groups in total. The ``q[s] mod K``
    extra groups of each source go, mini-batch by mini-batch, first to sources that must take one now
    to finish their extras in time, then to the sources furthest behind their proportional share
    ``(k+1)·q[s]/K`` (ties: more extras left, then name). Any choice that takes the forced sources keeps
    the rest fillable (round-robin dealing), so the plan always exists; cumulative counts stay close to
    the proportional targets ``(k+1)·q[s]/K`` and equal them when ``K`` divides ``q[s]``.
    """
    cached = _composition_plan(tuple(sorted(quotas.items())), mini_batches_per_step)
    return [dict(row) for row in cached]


@functools.lru_cache(maxsize=256)
def _composition_plan(items: tuple[tuple[str, int], ...], mini_batches_per_step: int) -> list[dict[str, int]]:
    """Cached body of :func:`composition_plan` (callers get copies; rows must not be shared)."""
    quotas = dict(items)
    sources = sorted(quotas)
    k_total = mini_batches_per_step
    sizes = mini_batch_sizes(sum(quotas.values()), k_total)
    base = {s: quotas[s] // k_total for s in sources}
    left = {s: quotas[s] % k_total for s in sources}
    given = dict.fromkeys(sources, 0)
    plan: list[dict[str, int]] = []
    base_total = sum(base.values())
    for k, size in enumerate(sizes):
        rows_left = k_total - k
        extras = size - base_total
        ranked = sorted(
            (s for s in sources if left[s] > 0),
            key=lambda s: (
                left[s] < rows_left,
                -((k + 1) * (quotas[s] % k_total) / k_total - given[s]),
                -left[s],
                s,
            ),
        )
        chosen = set(ranked[:extras])
        row = {}
        for s in sources:
            extra = 1 if s in chosen else 0
            row[s] = base[s] + extra
            left[s] -= extra
            given[s] += extra
        plan.append(row)
    return plan


def expired(state: StepState, group: FinishedGroup) -> bool:
    """True when the group is past the staleness bound: ``current_version - version_start > η``."""
    return state.max_staleness is not None and state.current_version - group.version_start > state.max_staleness


def _bounds(state: StepState, source: str) -> SourceBounds:
    return state.bounds.get(source, _NO_BOUNDS)


def _usable(state: StepState) -> dict[str, list[FinishedGroup]]:
    """Non-expired finished groups per quota source, earliest first; ValueError on unknown sources."""
    usable: dict[str, list[FinishedGroup]] = {s: [] for s in state.quotas}
    for group in state.finished:
        bucket = usable.get(group.source)
        if bucket is None:
            raise ValueError(
                f"finished group {group.group_id!r} has source {group.source!r}, "
                f"which has no quota (sources: {sorted(state.quotas)})"
            )
        if not expired(state, group):
            bucket.append(group)
    for bucket in usable.values():
        bucket.sort(key=_finish_key)  # linear when already in finish order (timsort)
    return usable


def _finish_key(group: FinishedGroup) -> tuple[float, str]:
    return (group.finished_at, group.group_id)


def quota_deficit(state: StepState) -> dict[str, int]:
    """Groups of each source's remaining quota that finished (non-expired) plus pending supply cannot deliver.

    Sources without a deficit are omitted. A deficit is never hidden by changing the mix: it is for the
    control plane to report (and for rollout to regenerate).
    """
    usable = _usable(state)
    deficit = {}
    for s, q in state.quotas.items():
        missing = q - state.admitted.get(s, 0) - len(usable[s]) - state.pending.get(s, 0)
        if missing > 0:
            deficit[s] = missing
    return deficit


def _check_state(state: StepState) -> list[int]:
    """Validate what no supply can fix; return the mini-batch sizes."""
    g = state.train_batch_size
    for s, q in state.quotas.items():
        if q < 0:
            raise ValueError(f"quota of source {s!r} is negative: {q}")
    if g < 1:
        raise ValueError("quotas must sum to at least one group")
    sizes = mini_batch_sizes(g, state.mini_batches_per_step)
    k = state.mini_batch_index
    if not 0 <= k < len(sizes):
        raise ValueError(f"mini_batch_index {k} outside 0..{len(sizes) - 1}: the step is complete")
    unknown = sorted(set(state.admitted) - set(state.quotas))
    if unknown:
        raise ValueError(f"admitted counts for sources without a quota: {unknown}")
    if sum(state.admitted.values()) != sum(sizes[:k]):
        raise ValueError(
            f"admitted {sum(state.admitted.values())} groups before mini-batch {k}, expected {sum(sizes[:k])}"
        )
    r_left = state.mini_batches_left
    for s, q in state.quotas.items():
        a = state.admitted.get(s, 0)
        if a < 0 or a > q:
            raise ValueError(f"admitted {a} groups of source {s!r}, quota is {q}")
        b = _bounds(state, s)
        if (q - a) < r_left * b.lo or (b.hi is not None and (q - a) > r_left * b.hi):
            raise ValueError(
                f"source {s!r}: {q - a} groups left for {r_left} mini-batches cannot meet bounds "
                f"lo={b.lo}, hi={b.hi} per mini-batch"
            )
    return sizes


def remainder_feasible(state: StepState, counts: Mapping[str, int]) -> bool:
    """Whether the rest of the train batch can still be completed after admitting ``counts`` now.

    Checks, for every quota source with ``r = q - a - x`` and ``R' = R - 1``: ``x >= 0``, the quota cap
    ``r >= 0``, the bounds of the later mini-batches ``R'·lo <= r <= R'·hi``, the supply
    ``r <= F'[s] + P[s]`` (``F'`` = non-expired finished groups not taken now), and that the later
    mini-batch sizes are exactly what is left (``sum(r) == sum(b_{k+1..})``). With uniform bounds these
    conditions are also sufficient (docs/explanation/admission.md). ``O(|S|)`` plus one pass over ``finished``.

    Raises:
        ValueError: ``counts`` or a finished group names a source without a quota.
    """
    unknown = sorted(set(counts) - set(state.quotas))
    if unknown:
        raise ValueError(f"counts for sources without a quota: {unknown}")
    sizes = mini_batch_sizes(state.train_batch_size, state.mini_batches_per_step)
    later = sum(sizes[state.mini_batch_index + 1 :])
    r_after = state.mini_batches_left - 1
    usable = _usable(state)
    total_left = 0
    for s, q in state.quotas.items():
        x = counts.get(s, 0)
        rest = q - state.admitted.get(s, 0) - x
        b = _bounds(state, s)
        if x < 0 or rest < 0 or rest < r_after * b.lo:
            return False
        if b.hi is not None and rest > r_after * b.hi:
            return False
        if rest > len(usable[s]) - x + state.pending.get(s, 0):
            return False
        total_left += rest
    return total_left == later


def _decision(state: StepState, picked: list[FinishedGroup]) -> AdmissionDecision:
    counts = dict.fromkeys(state.quotas, 0)
    for group in picked:
        counts[group.source] += 1
    picked.sort(key=_finish_key)
    return AdmissionDecision(groups=tuple(picked), counts=counts)


def _plan_counts(state: StepState, name: str) -> dict[str, int]:
    """This mini-batch's counts under the fixed plan, checked against what was admitted."""
    plan = composition_plan(state.quotas, state.mini_batches_per_step)
    k = state.mini_batch_index
    counts = {}
    for s in state.quotas:
        before = sum(row[s] for row in plan[:k])
        if state.admitted.get(s, 0) != before:
            raise ValueError(
                f"{name}: admitted {state.admitted.get(s, 0)} groups of source {s!r} before mini-batch {k}, "
                f"its plan admits {before}; the step was not formed by this policy"
            )
        counts[s] = plan[k][s]
    return counts


class _PlannedPolicy:
    """``train_batch`` and ``linear_target``: mini-batch ``k`` of the fixed plan (:func:`composition_plan`).

    ``train_batch`` waits until the whole train batch has finished (every source has ``q - a`` usable groups),
    then cuts the planned mini-batches; ``linear_target`` admits mini-batch ``k`` once every source reaches its
    cumulative planned target through ``k`` (the proportional ``ceil((k+1)·q[s]/K)`` reconciled so mini-batch
    ``k`` has exactly ``b_k`` groups).
    """

    def __init__(self, name: str, *, whole_step: bool) -> None:
        self.name = name
        self.whole_step = whole_step
        """Wait for the whole train batch (``train_batch``), not only the planned counts through ``k``."""

    def select(self, state: StepState) -> AdmissionDecision | None:
        """The planned mini-batch ``k`` once the policy's wait condition holds, else None."""
        _check_state(state)
        counts = _plan_counts(state, self.name)
        usable = _usable(state)
        if self.whole_step:
            needed = {s: q - state.admitted.get(s, 0) for s, q in state.quotas.items()}
        else:
            needed = counts
        if any(len(usable[s]) < n for s, n in needed.items()):
            return None
        return _decision(state, [g for s, n in counts.items() for g in usable[s][:n]])


def _feasible_counts(state: StepState) -> tuple[dict[str, int], dict[str, list[FinishedGroup]]] | None:
    """``constraint_preserving``'s counts ``x[s]`` for the next mini-batch, and the usable groups per source.

    The greedy earliest-first fill of the feasible count box (docs/explanation/admission.md): it takes a
    finish-order prefix of each source, and its counts are those of the earliest-finished feasible mini-batch.
    None: wait.
    """
    sizes = _check_state(state)
    size = sizes[state.mini_batch_index]
    usable = _usable(state)
    for s, q in state.quotas.items():
        if q - state.admitted.get(s, 0) > len(usable[s]) + state.pending.get(s, 0):
            return None  # a quota deficit: wait (and let the control plane report it)
    r_after = state.mini_batches_left - 1
    low: dict[str, int] = {}
    high: dict[str, int] = {}
    for s, q in state.quotas.items():
        rest = q - state.admitted.get(s, 0)
        b = _bounds(state, s)
        low[s] = b.lo if b.hi is None else max(b.lo, rest - r_after * b.hi)
        high[s] = min(rest - r_after * b.lo, len(usable[s]))
        if b.hi is not None:
            high[s] = min(high[s], b.hi)
        if low[s] > high[s]:
            return None
    need = sum(low.values())
    if need > size or sum(high.values()) < size:
        return None
    taken = dict.fromkeys(state.quotas, 0)
    candidates = [g for bucket in usable.values() for g in bucket]
    candidates.sort(key=_finish_key)
    slots = size
    for group in candidates:
        s = group.source
        x = taken[s]
        if x >= high[s]:
            continue
        if x < low[s]:
            need -= 1
        elif slots - 1 < need:
            continue
        taken[s] = x + 1
        slots -= 1
        if slots == 0:
            break
    return taken, usable


class ConstraintPreservingPolicy:
    """``constraint_preserving``: the earliest-finished groups that keep the rest of the step feasible."""

    def select(self, state: StepState) -> AdmissionDecision | None:
        """Greedy earliest-first fill of the feasible count box (docs/explanation/admission.md)."""
        found = _feasible_counts(state)
        if found is None:
            return None
        counts, usable = found
        return _decision(state, [g for s, x in counts.items() for g in usable[s][:x]])


class VersionAwarePolicy:
    """``version_aware``: ``constraint_preserving``'s counts, and within each source the groups generated with
    the newest weights first, except groups at the age cap, which go first, oldest first.

    The counts ``x[s]`` (hence when each mini-batch is admitted and every quota) are exactly
    ``constraint_preserving``'s; only which ``x[s]`` groups of source ``s`` are taken differs. A group is *due*
    when its age ``current_version - version_start`` reaches the age cap; due groups are taken before any other
    group of their source, in finish order, so no group waits behind newer ones once it is due, and a group is
    never admitted past the staleness bound ``η`` (expired groups are not usable, as for every policy). Newer
    means a larger token-weighted version (then the end version, then finish order).
    """

    def __init__(self, age_cap: int | None = None) -> None:
        if age_cap is not None and age_cap < 0:
            raise ValueError(f"age_cap must be >= 0, got {age_cap}")
        self.age_cap = age_cap
        """Age in versions at which a group is due; None: ``η - K`` with a staleness bound ``η``, else ``2·K``."""

    def cap(self, state: StepState) -> int:
        """The age cap in force for ``state``."""
        if self.age_cap is not None:
            return self.age_cap
        k = state.mini_batches_per_step
        return max(0, state.max_staleness - k) if state.max_staleness is not None else 2 * k

    def select(self, state: StepState) -> AdmissionDecision | None:
        """Feasible counts as ``constraint_preserving``; per source, due groups oldest first, then newest first."""
        found = _feasible_counts(state)
        if found is None:
            return None
        counts, usable = found
        cap = self.cap(state)
        picked: list[FinishedGroup] = []
        for s, x in counts.items():
            if x == 0:
                continue
            due = [g for g in usable[s] if state.current_version - g.version_start >= cap]
            rest = [g for g in usable[s] if state.current_version - g.version_start < cap]
            rest.sort(key=_newest_key)
            picked += (due + rest)[:x]
        return _decision(state, picked)


def _newest_key(group: FinishedGroup) -> tuple[float, int, float, str]:
    return (-group.version_weighted, -group.version_end, group.finished_at, group.group_id)


def make_policy(name: str) -> AdmissionPolicy:
    """The admission policy called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name == "constraint_preserving":
        return ConstraintPreservingPolicy()
    if name == "version_aware":
        return VersionAwarePolicy()
    if name in ("train_batch", "linear_target"):
        return _PlannedPolicy(name, whole_step=name == "train_batch")
    raise ValueError(f"unknown admission policy {name!r}; valid policies: {', '.join(POLICIES)}")
