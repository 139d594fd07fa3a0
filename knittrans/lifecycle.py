"""Lifecycles of a job, its groups and mini-batches: the states and the one table of their moves (stdlib only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, get_args

__all__ = [
    "ADMITTED",
    "ADMITTING",
    "GROUP_MOVES",
    "GROUP_STATUSES",
    "JOB_MOVES",
    "JOB_STATES",
    "REPLACEABLE",
    "TERMINAL",
    "GroupStatus",
    "JobAction",
    "JobEvent",
    "JobStatus",
    "MiniBatchStatus",
    "job_move",
]

# ---------------------------------------------------------------------------------------------- job
JobStatus = Literal["running", "paused", "draining", "drained", "completed"]
"""Lifecycle state of a job."""

JobAction = Literal["pause", "resume", "drain"]
"""What an admin may ask of a job (``POST /v1/jobs/{job}/{action}``)."""

JobEvent = Literal["pause", "resume", "drain", "drained", "completed"]
"""What moves a job: an admin action, or the control plane settling it once nothing is left to train
(``drained``: a draining job reached a step boundary with every mini-batch consumed; ``completed``:
``total_steps`` were admitted and consumed)."""

JOB_STATES: Final[tuple[JobStatus, ...]] = get_args(JobStatus)

JOB_MOVES: Final[Mapping[tuple[JobStatus, JobEvent], JobStatus]] = {
    ("running", "pause"): "paused",
    ("paused", "resume"): "running",
    ("running", "drain"): "draining",
    ("paused", "drain"): "draining",
    ("draining", "drained"): "drained",
    ("running", "completed"): "completed",
    ("paused", "completed"): "completed",  # acks of admitted mini-batches go on while paused
    ("draining", "completed"): "completed",
}
"""Every move of a job: ``(state, event) -> new state``. An event that leads to the state the job
is already in changes nothing; any other pair not listed is refused (admin actions) or ignored
(settling)."""

TERMINAL: Final[frozenset[JobStatus]] = frozenset(s for s in JOB_STATES if not any(f == s for f, _ in JOB_MOVES))
"""States no move leaves (``drained``, ``completed``): the job will never plan another mini-batch."""

ADMITTING: Final[frozenset[JobStatus]] = frozenset(("running", "draining"))
"""States in which mini-batches are admitted (a draining job only up to the end of its current step)."""


def job_move(state: JobStatus, event: JobEvent) -> JobStatus | None:
    """The state ``event`` moves a job in ``state`` to: ``state`` itself when it already is the target,
    None when :data:`JOB_MOVES` has no such move."""
    target = JOB_MOVES.get((state, event))
    if target is None and (state, event) in _ALREADY:
        return state
    return target


_ALREADY = frozenset((t, e) for (_, e), t in JOB_MOVES.items())
"""``(state, event)`` pairs where ``event`` leads to ``state`` itself (no-ops)."""

# ---------------------------------------------------------------------------------------------- groups
GroupStatus = Literal["finished", "planned", "consumed", "lost", "expired"]
"""Where a group is in its life: finished (in the pool), planned (in an admitted mini-batch), consumed
(its mini-batch acked by every rank), lost (its node was lost, or its unit removed by an admin),
expired (past the staleness bound before admission)."""

GROUP_STATUSES: Final[tuple[GroupStatus, ...]] = get_args(GroupStatus)

GROUP_MOVES: Final[Mapping[GroupStatus, frozenset[GroupStatus]]] = {
    "finished": frozenset(("finished", "planned", "lost", "expired")),  # finished -> finished: registration
    "planned": frozenset(("finished", "consumed")),  # withdrawn by a node loss / acked by every rank
    "consumed": frozenset(),
    "lost": frozenset(),  # lost and expired groups are replaced by a new registration of their id
    "expired": frozenset(),
}
"""Every move of a group: status -> the statuses it may move to."""

ADMITTED: Final[frozenset[GroupStatus]] = frozenset(("planned", "consumed"))
"""Statuses of groups in a mini-batch (their unit can no longer be removed)."""

REPLACEABLE: Final[frozenset[GroupStatus]] = frozenset(("lost", "expired"))
"""Statuses of retired groups whose id a new registration may take (the control plane stores these
statuses; planned and consumed follow from the mini-batch records)."""

# ---------------------------------------------------------------------------------------------- mini-batches
MiniBatchStatus = Literal["planned", "consumed"]
"""An admitted mini-batch is planned until every rank acked it (then consumed); a withdrawn one is dropped."""
