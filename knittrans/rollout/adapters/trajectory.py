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
    """Attach rewards and policy versions to a generated group for ``TrajectoryWriter``.

    Args:
        group: The engine's output for one prompt.
        group_id: Job-unique group id (a safe name, see :func:`knittrans.names.check_name`).
        source: Data source of the prompt.
        rewards: One reward per sample, in sample order.
        version_start: Policy version at which generation started (one int, or one per sample).
        version_end: Policy version of the last generated token (one int, or one per sample).
        version_weighted: Token-weighted version per sample; None: mean of start and end.
        loss_masks: Per-sample masks over response tokens; None: all ones.

    Returns:
        A :class:`knittrans.schema.TrajectoryGroup` whose ``finished_at`` is the group's and
        whose ``media`` are the prompt's (shared by every response).
    """
    r = np.asarray(rewards, dtype=np.float32)
    if r.shape != (group.n,):
        raise InvalidRequest(f"group {group_id!r}: {r.size} rewards for {group.n} samples")
    if not np.isfinite(r).all():
        raise InvalidRequest(f"group {group_id!r}: rewards must be finite, got {r.tolist()}")
    vs = np.broadcast_to(np.asarray(version_start, dtype=np.int64), (group.n,))
    ve = np.broadcast_to(np.asarray(version_end, dtype=np.int64), (group.n,))
    if (ve < vs).any():
        raise InvalidRequest(f"group {group_id!r}: version_end {ve.tolist()} < version_start {vs.tolist()}")
    if loss_masks is not None:
        if len(loss_masks) != group.n:
            raise InvalidRequest(f"group {group_id!r}: {len(loss_masks)} loss masks for {group.n} samples")
        for i, (mask, s) in enumerate(zip(loss_masks, group.samples, strict=True)):
            if np.asarray(mask).shape != s.response_ids.shape:
                raise InvalidRequest(
                    f"group {group_id!r}: loss mask {i} has shape {np.asarray(mask).shape}, "
                    f"response has {s.response_ids.shape}"
                )
    return TrajectoryGroup(
        group_id=group_id,
        source=source,
        prompt_ids=group.prompt_ids,
        response_ids=group.response_ids,
        response_logprobs=group.response_logprobs,
        rewards=r,
        version_start=[int(v) for v in vs],
        version_end=[int(v) for v in ve],
        version_weighted=version_weighted,
        loss_masks=loss_masks,
        media=group.media,
        finished_at=group.finished_at,
    )
