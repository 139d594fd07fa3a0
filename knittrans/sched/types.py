"""Plain value types shared by admission, assignment and staleness accounting (no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "AdmissionDecision",
    "FinishedGroup",
    "SourceBounds",
    "StepState",
]


@dataclass(frozen=True, kw_only=True)
class FinishedGroup:
    """A finished GRPO group waiting for admission, with where its rows live."""

    group_id: str
    """Group id, unique within the job."""
    source: str
    """Data source of the group's prompt."""
    trajectory_tokens: tuple[int, ...]
    """Tokens of each trajectory (prompt + response), in row order."""
    finished_at: float
    """Finish time; admission takes earliest-finished first, ties broken by ``group_id``."""
    version_start: int = 0
    """Smallest policy version at which a trajectory of the group started."""
    version_end: int = 0
    """Largest policy version that produced a token of the group."""
    version_weighted: float = 0.0
    """Token-weighted mean policy version."""
    unit_id: str = ""
    """Storage unit holding the group's rows."""
    node_id: str = ""
    """Store node owning that unit."""
    row_start: int = 0
    """First row of the group inside the unit."""

    @property
    def num_trajectories(self) -> int:
        """Rows in the group."""
        return len(self.trajectory_tokens)


@dataclass(frozen=True, kw_only=True)
class SourceBounds:
    """Per-mini-batch bounds ``lo <= x[s] <= hi`` on the groups of one source."""

    lo: int = 0
    """Fewest groups of the source in every mini-batch."""
    hi: int | None = None
    """Most groups of the source in every mini-batch; None for no bound."""

    def __post_init__(self) -> None:
        if self.lo < 0 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"bounds need 0 <= lo <= hi, got lo={self.lo}, hi={self.hi}")


@dataclass(frozen=True, kw_only=True)
class StepState:
    """Everything an admission policy may look at when forming the next mini-batch of a step."""

    quotas: Mapping[str, int]
    """``q[s]``: groups of each source per train batch; ``sum(q) == G``."""
    admitted: Mapping[str, int]
    """``a[s]``: groups of each source already admitted in this step."""
    finished: Sequence[FinishedGroup]
    """Finished, unadmitted groups of every source, in finish order."""
    pending: Mapping[str, int]
    """``P[s]``: groups started but not finished that this step may still use."""
    mini_batch_index: int
    """Index ``k`` (0-based) of the mini-batch being formed within the step."""
    mini_batches_per_step: int
    """``K``: mini-batches (optimizer steps) per train step."""
    bounds: Mapping[str, SourceBounds] = field(default_factory=dict)
    """Optional per-mini-batch per-source bounds; missing sources are unbounded."""
    current_version: int = 0
    """``v_train``: the version the mini-batch being formed trains at (its global index)."""
    max_staleness: int | None = None
    """``η``: groups with ``current_version - version_start > η`` are not admitted; None for no bound."""

    @property
    def train_batch_size(self) -> int:
        """``G``: groups per train batch."""
        return sum(self.quotas.values())

    @property
    def mini_batches_left(self) -> int:
        """``R``: mini-batches remaining in the step, the one being formed included."""
        return self.mini_batches_per_step - self.mini_batch_index


@dataclass(frozen=True, kw_only=True)
class AdmissionDecision:
    """The groups of one admitted mini-batch and their per-source counts."""

    groups: tuple[FinishedGroup, ...]
    """Admitted groups, in the order the policy chose them."""
    counts: Mapping[str, int]
    """``x[s]``: admitted groups per source (zero entries included for every quota source)."""
