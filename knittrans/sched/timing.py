"""Admission timing: lookahead and rollout's window (docs/explanation/admission.md#timing-lookahead-and-window)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "HANDOVERS",
    "AdmissionTiming",
    "admitted_ahead",
    "launch_headroom",
    "launch_lead",
    "launch_order",
    "launchable",
    "staleness_bound",
]

DEFAULT_LOOKAHEAD = 1
"""``L`` unless a job or workload says otherwise: enough for the ``next?after=`` prefetch."""


@dataclass(frozen=True, kw_only=True)
class AdmissionTiming:
    """The timing rule of one job: admission lookahead ``L`` and off-policy window ``W``."""

    lookahead: int = DEFAULT_LOOKAHEAD
    """``L``: mini-batches that may be admitted beyond the trainer's position (0 = admit on demand)."""
    window: int = 1
    """``W``: groups launched but not in a mini-batch the trainer started stay ``<= W·G``."""

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead: {self.lookahead!r} must be an integer >= 0")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window: {self.window!r} must be an integer >= 1")

    def may_admit(self, next_index: int, position: int) -> bool:
        """Whether mini-batch ``next_index`` may be admitted with the trainer on ``position``: ``n <= p + L``."""
        return next_index <= position + self.lookahead

    def room(self, quotas: Mapping[str, int], untaken: Mapping[str, int]) -> int:
        """Groups rollout may still launch: ``W·G - sum(untaken)`` with ``G = sum(q)`` (negative when over,
        e.g. after a quota cut).

        ``untaken[s]``: groups of ``s`` launched and neither dropped nor taken by a mini-batch the trainer
        has started (generating + finished unadmitted + admitted beyond the trainer's position).
        """
        return self.window * sum(quotas.values()) - sum(untaken.values())


def admitted_ahead(next_index: int, position: int) -> int:
    """Admitted mini-batches beyond the one the trainer is on, when ``next_index`` is the next to admit."""
    return max(0, next_index - position - 1)


HANDOVERS: tuple[str, ...] = ("mini_batch", "step")
"""How a started mini-batch frees the window: its own groups, or (k = 0) the whole train batch."""


def launch_headroom(
    quotas: Mapping[str, int], room: int, allowed: Iterable[str], *, deficit: Mapping[str, int], trainer_idle: bool
) -> dict[str, int]:
    """Groups each source may launch now: the window's ``room`` for the sources in ``allowed`` (see
    :func:`launchable`), 0 for the others.

    Deadlock guard: when the trainer has nothing admitted left to start (``trainer_idle``) and a source's
    finished and pending groups cannot meet its quota of the open step (``deficit``, e.g. its groups were
    lost), that source may launch its deficit even with the window full; otherwise a window full of other
    sources' groups waits on a step that waits on this source, and neither moves.
    """
    permitted = set(allowed)
    headroom = {s: max(0, room) if s in permitted else 0 for s in quotas}
    if trainer_idle:
        for source, missing in deficit.items():
            headroom[source] = max(headroom.get(source, 0), missing)
    return headroom


def launchable(quotas: Mapping[str, int], launched: Mapping[str, float]) -> list[str]:
    """The sources that may launch next: those furthest behind their quota share of launches (all tied ones).

    Launching only these keeps every source's launches proportional to its quota, so the window ``W·G``
    always holds about ``W·q[s]`` groups of each source and no source can fill it and starve the others
    (with one worker per source, a worker that ignored this could take the whole window and stall the step
    on another source's quota).
    """
    shares = {s: launched.get(s, 0) / quotas[s] for s in launch_order(quotas, launched)}
    least = min(shares.values(), default=0.0)
    return [s for s, share in shares.items() if share <= least]


def launch_order(quotas: Mapping[str, int], launched: Mapping[str, float]) -> list[str]:
    """Quota sources, the one furthest behind its quota share of launches first (``launched[s] / q[s]``;
    ties in ``quotas`` order). ``launched[s]`` counts groups started and not dropped."""
    order = {s: i for i, s in enumerate(quotas)}
    live = [s for s, q in quotas.items() if q > 0]
    return sorted(live, key=lambda s: (launched.get(s, 0) / quotas[s], order[s]))


def launch_lead(
    quotas: Mapping[str, int], mean_duration_s: Mapping[str, float], groups_per_s: float
) -> dict[str, float]:
    """Groups each source should run ahead of (> 0) or behind (< 0) its quota share of launches so that its
    groups finish about as long before they are needed as every other source's: ``λ·q[s]/G·(D[s] - D̄)``.

    Little's law per source: a source consumed at ``λ_s = λ·q[s]/G`` groups per second whose groups take
    ``D[s]`` to generate needs ``λ_s·D[s]`` of them in flight. Quota-share launches (:func:`launch_order` with no
    lead) keep about ``W·q[s]`` untaken groups of every source, so each source's groups spend the same time in
    the window: fast sources' groups finish early and wait (their end reading ages), slow sources' groups arrive
    late and hold up their step. Shifting ``λ_s·(D[s] - D̄)`` launches (``D̄`` the quota-weighted mean duration;
    the leads sum to 0, so the window's total is unchanged) gives every source the same slack. Pass
    ``launched[s] - lead[s]`` to :func:`launch_order` and :func:`launchable`. A source without a duration
    estimate gets no lead.

    Raises:
        ValueError: a negative rate or duration.
    """
    if groups_per_s < 0 or any(d < 0 for d in mean_duration_s.values()):
        raise ValueError("groups_per_s and mean durations must be >= 0")
    g = sum(quotas.values())
    known = {s: d for s, d in mean_duration_s.items() if s in quotas and quotas[s] > 0}
    if g <= 0 or not known:
        return dict.fromkeys(quotas, 0.0)
    weight = sum(quotas[s] for s in known)
    mean = sum(quotas[s] * d for s, d in known.items()) / weight
    return {s: groups_per_s * quotas[s] / g * (known[s] - mean) if s in known else 0.0 for s in quotas}


def staleness_bound(
    *, mini_batches_per_step: int, window: int, train_batch_groups: int, quota: int, sync_lag: int = 0
) -> int:
    """Largest end-reading architectural staleness of a group of a source with quota ``q[s]``:
    ``ceil(W·G / q[s])·K + d`` (proof: ``docs/explanation/admission.md``).

    ``d`` (``sync_lag``) is how many optimizer steps' weights may still be on their way to rollout when a
    group makes its last token. It holds for every policy and every lookahead ``L``.
    """
    for name, value, least in (
        ("mini_batches_per_step", mini_batches_per_step, 1),
        ("window", window, 1),
        ("train_batch_groups", train_batch_groups, 1),
        ("quota", quota, 1),
        ("sync_lag", sync_lag, 0),
    ):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    return -(-window * train_batch_groups // quota) * mini_batches_per_step + sync_lag
