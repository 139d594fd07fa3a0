"""The demo trainer's GRPO loss (advantages come with the rows: :func:`knittrans.schema.build_unit_tables`)."""

from __future__ import annotations

import torch

__all__ = ["grpo_loss"]


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
