"""Scheduling core (pure code, no I/O): admission policies, rank assignment, staleness accounting."""

from knittrans.sched.admission import (
    POLICIES,
    AdmissionPolicy,
    composition_plan,
    expired,
    make_policy,
    mini_batch_sizes,
    quota_deficit,
    remainder_feasible,
)
from knittrans.sched.assign import assign_mini_batch, lpt_assign
from knittrans.sched.staleness import (
    READINGS,
    ConsumedGroup,
    StalenessStats,
    architectural_staleness,
    staleness,
    step_report,
    summarize,
    summarize_weighted,
    version_of,
)
from knittrans.sched.types import (
    AdmissionDecision,
    FinishedGroup,
    MicroBatchPlan,
    NodeRead,
    RankPlan,
    SourceBounds,
    StepState,
    TrajectoryRef,
)

__all__ = [
    "POLICIES",
    "READINGS",
    "AdmissionDecision",
    "AdmissionPolicy",
    "ConsumedGroup",
    "FinishedGroup",
    "MicroBatchPlan",
    "NodeRead",
    "RankPlan",
    "SourceBounds",
    "StalenessStats",
    "StepState",
    "TrajectoryRef",
    "architectural_staleness",
    "assign_mini_batch",
    "composition_plan",
    "expired",
    "lpt_assign",
    "make_policy",
    "mini_batch_sizes",
    "quota_deficit",
    "remainder_feasible",
    "staleness",
    "step_report",
    "summarize",
    "summarize_weighted",
    "version_of",
]
