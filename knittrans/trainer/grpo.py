"""GRPO pieces the demo trainer uses: group-normalised advantages and the clipped policy loss."""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "grpo_loss"]


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each trajectory: its reward minus its group's mean, over the group's std.

    Args:
        rewards: ``[N]`` float rewards.
        group_index: ``[N]`` int64 dense group ids (``0..num_groups-1``).
        eps: added to the std so single-reward groups get zero advantage, not NaN.
    """
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    ones = torch.ones_like(rewards)
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, ones)
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    var = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2) / count
    return centred / (var[group_index].sqrt() + eps)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    normaliser: float,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """PPO-clip surrogate summed over masked tokens and divided by a global token count.

    All tensors are per response token, flat or padded alike. ``normaliser`` is the
    same for every micro-batch of a mini-batch (e.g. its total response tokens across
    ranks), so gradient accumulation gives the gradient of the whole mini-batch.
    """
    if normaliser <= 0:
        raise ValueError(f"normaliser must be positive, got {normaliser}")
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    return (per_token * mask).sum() / normaliser
