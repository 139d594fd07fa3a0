"""Scheduling core (pure code, no I/O): admission policies and timing, rank assignment, staleness accounting."""

from knittrans.sched.admission import (
    POLICIES,
    AdmissionPolicy,
    VersionAwarePolicy,
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
    summarize_weighted,
    version_of,
)
from knittrans.sched.timing import (
    DEFAULT_LOOKAHEAD,
    AdmissionTiming,
    admitted_ahead,
    launch_order,
    launchable,
    staleness_bound,
)
from knittrans.sched.types import (
    AdmissionDecision,
    FinishedGroup,
    SourceBounds,
    StepState,
)

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "POLICIES",
    "READINGS",
    "AdmissionDecision",
    "AdmissionPolicy",
    "AdmissionTiming",
    "ConsumedGroup",
    "FinishedGroup",
    "SourceBounds",
    "StalenessStats",
    "StepState",
    "VersionAwarePolicy",
    "admitted_ahead",
    "architectural_staleness",
    "assign_mini_batch",
    "composition_plan",
    "expired",
    "launch_order",
    "launchable",
    "lpt_assign",
    "make_policy",
    "mini_batch_sizes",
    "quota_deficit",
    "remainder_feasible",
    "staleness",
    "staleness_bound",
    "step_report",
    "summarize_weighted",
    "version_of",
]
