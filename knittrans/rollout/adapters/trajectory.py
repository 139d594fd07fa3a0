""":class:`GeneratedGroup` (+ rewards and policy versions) → the writer's :class:`TrajectoryGroup`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knittrans.errors import InvalidRequest
from knittrans.rollout.generated import GeneratedGroup
from knittrans.schema import TrajectoryGroup

__all__ = ["to_trajectory_group"]


def to_trajectory_group(
    group: GeneratedGroup,
    *,
    group_id: str,
    source: str,
    rewards: Sequence[float] | np.ndarray,
    version_start: int | Sequence[int],
    version_end: int | Sequence[int],
    version_weighted: float | Sequence[float] | None = None,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> TrajectoryGroup:
    """Attach rewards (one finite value per sample) and policy versions to a generated group.

    The versions, ``version_weighted`` (None: mean of start and end) and ``loss_masks`` (None: all
    ones) are per sample or one value for all, as :class:`~knittrans.schema.TrajectoryGroup` takes
    them; the writer checks them when it builds the unit. The result's ``finished_at`` is the
    group's and its ``media`` are the prompt's (shared by every response).
    """
    r = np.asarray(rewards, dtype=np.float32)
    if r.shape != (group.n,):
        raise InvalidRequest(f"group {group_id!r}: {r.size} rewards for {group.n} samples")
    if not np.isfinite(r).all():
        raise InvalidRequest(f"group {group_id!r}: rewards must be finite, got {r.tolist()}")
    return TrajectoryGroup(
        group_id=group_id,
        source=source,
        prompt_ids=group.prompt_ids,
        response_ids=group.response_ids,
        response_logprobs=group.response_logprobs,
        rewards=r,
        version_start=version_start,
        version_end=version_end,
        version_weighted=version_weighted,
        loss_masks=loss_masks,
        media=group.media,
        finished_at=group.finished_at,
    )
