"""Job specs: the plain, validated description of one training job the control plane schedules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from knittrans.errors import InvalidJobSpec
from knittrans.sched.admission import mini_batch_sizes
from knittrans.sched.timing import DEFAULT_LOOKAHEAD, AdmissionTiming
from knittrans.sched.types import SourceBounds
from knittrans.schema import TRAJECTORY_COLUMNS
from knittrans.userfields import parse_user_fields

__all__ = ["JobSpec", "check_quotas"]


def check_quotas(quotas: Mapping[str, int], *, mini_batches_per_step: int, bounds: Mapping[str, SourceBounds]) -> None:
    """Raise :class:`InvalidJobSpec` naming the field when ``quotas`` (each >= 0, as the HTTP edge checks) cannot
    run with ``K`` and ``bounds``."""
    total = sum(quotas.values())
    k = mini_batches_per_step
    if total < 1:
        raise InvalidJobSpec("quotas: the train batch is empty; give at least one source a positive quota")
    if k > total:
        raise InvalidJobSpec(
            f"mini_batches_per_step: K={k} is larger than the train batch G={total} groups "
            "(sum of quotas); every mini-batch needs at least one group"
        )
    # per source is enough: K·lo <= q and K·hi >= q summed over the sources put the lower bounds' sum at most
    # floor(G/K) and the upper bounds' (with q for no bound) at least ceil(G/K): the smallest and largest mini-batch
    for source, b in bounds.items():
        if source not in quotas:
            raise InvalidJobSpec(f"bounds.{source}: source has no quota; known sources: {sorted(quotas)}")
        q = quotas[source]
        if k * b.lo > q:
            raise InvalidJobSpec(
                f"bounds.{source}.lo: {b.lo} groups in each of K={k} mini-batches needs {k * b.lo} > quota {q}"
            )
        if b.hi is not None and k * b.hi < q:
            raise InvalidJobSpec(
                f"bounds.{source}.hi: at most {b.hi} groups in each of K={k} mini-batches cannot reach quota {q}"
            )


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One job: GRPO group size, per-source quotas, mini-batching, admission policy and trainer shape."""

    name: str
    """Job name (a safe identifier; appears in URLs, tickets and store paths)."""
    group_size: int
    """Trajectories per GRPO group; every registered group must have exactly this many."""
    quotas: Mapping[str, int]
    """``q[s]``: groups of each source per train batch; ``G = sum(q)``."""
    mini_batches_per_step: int
    """``K``: mini-batches (optimizer steps) per train step, ``1 <= K <= G``."""
    policy: str
    """Admission policy name (one of ``knittrans.sched.admission.POLICIES``)."""
    world_size: int
    """``W``: data-parallel trainer ranks sharing each mini-batch."""
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch (dynamic batch size); exclusive with ``micro_batch_size``."""
    micro_batch_size: int | None = None
    """Trajectories per micro-batch; exclusive with ``micro_batch_tokens`` (exactly one is given)."""
    bounds: Mapping[str, SourceBounds] = field(default_factory=dict)
    """Optional per-mini-batch per-source bounds ``lo <= x[s] <= hi``."""
    max_staleness: int | None = None
    """``η``: groups with ``v_train - version_start > η`` are never admitted; None for no bound."""
    total_steps: int | None = None
    """Train steps after which the job is complete; None to run until drained."""
    columns: tuple[str, ...] | None = None
    """Trajectory columns the ranks fetch; None for all."""
    lookahead: int = DEFAULT_LOOKAHEAD
    """``L``: mini-batches admitted beyond the trainer's position (0 = when the trainer asks for one)."""
    window: int = 1
    """``W``: groups launched but not in a mini-batch the trainer started stay ``<= W·G``."""
    train_batch_handover: str = "mini_batch"
    """How a started mini-batch frees the window (``knittrans.sched.timing.HANDOVERS``): ``mini_batch``
    (its own groups; every policy) or ``step`` (only with ``train_batch``: the step's first mini-batch frees the
    whole train batch, as a conventional trainer handed the whole batch would; a baseline to compare with)."""
    user_fields: Mapping[str, str] = field(default_factory=dict)
    """Per-job user fields ``{name: Arrow type string}`` written after the fixed columns (see
    :mod:`knittrans.userfields`); writers must give each of them for every group."""

    def __post_init__(self) -> None:
        """The rules across fields (each field's own range is checked at the HTTP edge, ``JobCreate``)."""
        if (self.micro_batch_tokens is None) == (self.micro_batch_size is None):
            raise InvalidJobSpec(
                "micro_batch_tokens / micro_batch_size: give exactly one (a token budget or trajectories "
                "per micro-batch)"
            )
        if self.train_batch_handover == "step" and self.policy != "train_batch":
            raise InvalidJobSpec(
                f"train_batch_handover: 'step' is the train_batch baseline's; policy {self.policy!r} hands the "
                "trainer one mini-batch at a time"
            )
        if self.columns is not None and len(set(self.columns)) != len(self.columns):
            raise InvalidJobSpec("columns: give a non-empty list of distinct column names, or null for all")
        declared = parse_user_fields(self.user_fields)
        if self.columns is not None:
            known = set(TRAJECTORY_COLUMNS) | {f.name for f in declared}
            unknown = [c for c in self.columns if c not in known]
            if unknown:
                raise InvalidJobSpec(
                    f"columns: {unknown} are neither trajectory columns nor declared user_fields "
                    f"({sorted(f.name for f in declared)})"
                )
        check_quotas(self.quotas, mini_batches_per_step=self.mini_batches_per_step, bounds=self.bounds)
        smallest = min(mini_batch_sizes(sum(self.quotas.values()), self.mini_batches_per_step))
        if smallest * self.group_size < self.world_size:
            raise InvalidJobSpec(
                f"world_size: W={self.world_size} ranks but the smallest mini-batch has only "
                f"{smallest * self.group_size} trajectories ({smallest} groups x group_size {self.group_size}); "
                "lower W or K, or raise the quotas"
            )

    @property
    def timing(self) -> AdmissionTiming:
        """The admission timing rule (``L``, ``W``) of the job."""
        return AdmissionTiming(lookahead=self.lookahead, window=self.window)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (inverse of :meth:`from_dict`)."""
        return {**asdict(self), "columns": list(self.columns) if self.columns is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        """Build from a plain dict (the checked ``JobCreate`` body, or the stored spec); raises
        :class:`InvalidJobSpec` naming a bad field."""
        body = dict(d)
        bounds = {}
        for source, b in (body.pop("bounds", None) or {}).items():
            try:
                bounds[source] = SourceBounds(lo=b.get("lo", 0), hi=b.get("hi"))
            except ValueError as exc:
                raise InvalidJobSpec(f"bounds.{source}: {exc}") from None
        columns = body.pop("columns", None)
        body["user_fields"] = body.pop("user_fields", None) or {}
        return cls(**body, bounds=bounds, columns=tuple(columns) if columns is not None else None)
