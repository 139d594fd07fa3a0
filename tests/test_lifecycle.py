"""The job lifecycle table: what pause, resume and drain do from every state, and which states are final."""

from __future__ import annotations

import pytest
from api_support import job_spec

from knittrans.api.jobstate import JobState
from knittrans.api.spec import JobSpec
from knittrans.api.store import Txn
from knittrans.errors import Conflict
from knittrans.lifecycle import ADMITTING, GROUP_MOVES, GROUP_STATUSES, JOB_STATES, TERMINAL, JobAction, JobStatus

# (state, action) -> the state after it, or the states the Conflict says the action needs
EXPECTED: dict[tuple[JobStatus, JobAction], JobStatus | str] = {
    ("running", "pause"): "paused",
    ("paused", "pause"): "paused",
    ("draining", "pause"): "needs it to be running",
    ("drained", "pause"): "needs it to be running",
    ("completed", "pause"): "needs it to be running",
    ("running", "resume"): "running",
    ("paused", "resume"): "running",
    ("draining", "resume"): "needs it to be paused",
    ("drained", "resume"): "needs it to be paused",
    ("completed", "resume"): "needs it to be paused",
    ("running", "drain"): "draining",
    ("paused", "drain"): "draining",
    ("draining", "drain"): "draining",
    ("drained", "drain"): "needs it to be running or paused",
    ("completed", "drain"): "needs it to be running or paused",
}


@pytest.mark.parametrize(("state", "action"), sorted(EXPECTED))
def test_admin_actions_follow_the_lifecycle(state: JobStatus, action: JobAction) -> None:
    """Each admin action moves, keeps (already there: nothing written) or refuses the job as documented."""
    job = JobState(JobSpec.from_dict(job_spec()), endpoint=lambda n: "", node_state=lambda n: "alive")
    job.state = state
    txn = Txn()
    expected = EXPECTED[(state, action)]
    if expected in JOB_STATES:
        job.set_state(action, txn)
        assert job.state == expected
        assert bool(len(txn)) == (expected != state)  # a move is persisted, a no-op writes nothing
    else:
        with pytest.raises(Conflict, match=str(expected)):
            job.set_state(action, txn)
        assert job.state == state and not len(txn)


def test_final_and_admitting_states() -> None:
    """Drained and completed are the states no move leaves; running and draining admit."""
    assert {"drained", "completed"} == TERMINAL
    assert {"running", "draining"} == ADMITTING
    assert set(GROUP_MOVES) == set(GROUP_STATUSES)
    assert all(targets <= set(GROUP_STATUSES) for targets in GROUP_MOVES.values())
