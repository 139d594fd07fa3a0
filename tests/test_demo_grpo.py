"""The demo's GRPO loss: values derived by hand, accumulation equals one big batch."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from knittrans.demo.grpo import grpo_loss


def test_loss_clips_large_ratios() -> None:
    """a positive-advantage token whose ratio exceeds 1+eps contributes (1+eps)*A, no gradient."""
    lp = torch.tensor([1.0], requires_grad=True)
    loss = grpo_loss(lp, torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([1.0]), normaliser=1.0)
    assert_close(loss, torch.tensor(-2.4))
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().item() == 0.0


def test_accumulated_micro_batches_equal_one_batch() -> None:
    """summing micro-batch losses with a global normaliser equals the loss of the whole batch."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(40, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)
    adv = torch.randn(40, generator=g, dtype=torch.float64)
    mask = (torch.rand(40, generator=g) > 0.2).double()
    whole = grpo_loss(lp, old, adv, mask, normaliser=float(mask.sum()))
    parts = sum(
        grpo_loss(lp[i : i + 10], old[i : i + 10], adv[i : i + 10], mask[i : i + 10], normaliser=float(mask.sum()))
        for i in range(0, 40, 10)
    )
    assert_close(parts, whole)
