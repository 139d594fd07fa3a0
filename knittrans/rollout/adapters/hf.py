"""transformers ``generate()`` output → :class:`GeneratedGroup` (EOS/pad stripping, sampled-token logprobs)."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import numpy as np
import torch

from knittrans.errors import InvalidRequest
from knittrans.rollout.generated import FinishReason, GeneratedGroup, GeneratedSample, PromptRequest

__all__ = ["groups_from_generate_output", "sampled_logprobs"]


def sampled_logprobs(step_scores: Sequence[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logprob of ``tokens[:, t]`` under ``log_softmax(step_scores[t])`` for every step ``t``.

    Args:
        step_scores: ``T`` tensors of shape ``(rows, vocab)`` (processed scores or raw logits).
        tokens: ``(rows, T)`` generated token ids.

    Returns:
        float32 tensor ``(rows, T)``; ``-inf`` where a processor masked the token (e.g. pad rows).
    """
    if tokens.dim() != 2 or tokens.shape[1] != len(step_scores):
        raise InvalidRequest(f"tokens of shape {tuple(tokens.shape)} do not match {len(step_scores)} steps of scores")
    out = torch.empty(tokens.shape, dtype=torch.float32)
    for t, scores in enumerate(step_scores):
        lp = torch.log_softmax(scores.detach().to(torch.float32), dim=-1)
        out[:, t] = lp.gather(1, tokens[:, t : t + 1].to(lp.device).long()).squeeze(1).cpu()
    return out


def groups_from_generate_output(
    prompts: Sequence[PromptRequest],
    sequences: torch.Tensor,
    step_scores: Sequence[torch.Tensor],
    *,
    n: int,
    prompt_width: int,
    eos_token_ids: Collection[int],
) -> list[GeneratedGroup]:
    """Split a batched ``generate()`` result into one :class:`GeneratedGroup` per prompt.

    Args:
        prompts: The prompts, in the order they were batched (media are carried over).
        sequences: ``(len(prompts)*n, prompt_width + T)`` output ids, prompt-major (rows ``[i*n, (i+1)*n)``
            are prompt ``i``'s, left-padded to ``prompt_width``).
        step_scores: ``T`` score tensors the logprobs are taken from: ``scores`` (``output_scores=True``,
            processed logits) or ``logits`` (``output_logits=True``, raw: temperature 1).
        n: Samples per prompt (``num_return_sequences``).
        prompt_width: Padded prompt length (columns before the first generated token).
        eos_token_ids: Ids that end a response.

    Returns:
        Groups in prompt order, each with ``n`` samples in row order.
    """
    rows = len(prompts) * n
    if n <= 0:
        raise InvalidRequest(f"n must be positive, got {n}")
    if sequences.dim() != 2 or sequences.shape[0] != rows:
        raise InvalidRequest(f"sequences has shape {tuple(sequences.shape)}, expected ({rows}, ...)")
    generated = sequences[:, prompt_width:]
    logprobs = sampled_logprobs(step_scores, generated).numpy()  # checks one score step per generated column
    gen = generated.cpu().numpy().astype(np.int32)
    eos = np.asarray(sorted(eos_token_ids), dtype=np.int32)
    is_eos = np.isin(gen, eos)
    stamp = time.time()
    groups: list[GeneratedGroup] = []
    for i, prompt in enumerate(prompts):
        samples: list[GeneratedSample] = []
        for r in range(i * n, (i + 1) * n):
            hits = np.flatnonzero(is_eos[r])
            length = int(hits[0]) + 1 if hits.size else gen.shape[1]
            reason: FinishReason = "stop" if hits.size else "length"
            samples.append(
                GeneratedSample(
                    response_ids=gen[r, :length].copy(),
                    response_logprobs=logprobs[r, :length].copy(),
                    finish_reason=reason,
                )
            )
        groups.append(
            GeneratedGroup(prompt_ids=prompt.prompt_ids, samples=tuple(samples), media=prompt.media, finished_at=stamp)
        )
    return groups
