"""Engine-neutral generation results (``GeneratedGroup``: n responses to one prompt) and :func:`to_trajectory_group`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from knittrans.errors import InvalidRequest
from knittrans.schema import Media, TrajectoryGroup

__all__ = [
    "FinishReason",
    "GeneratedGroup",
    "GeneratedSample",
    "Prompt",
    "PromptRequest",
    "as_prompt_request",
    "to_trajectory_group",
]

FinishReason = Literal["stop", "length"]
"""``stop``: the sample ended with EOS (kept as its last token); ``length``: it hit ``max_new_tokens``."""


def _int32_1d(value: Any, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise InvalidRequest(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**31):
        raise InvalidRequest(f"{what} holds a token id outside [0, 2**31)")
    return arr.astype(np.int32, copy=False)


@dataclass(frozen=True, kw_only=True)
class PromptRequest:
    """One prompt: its token ids and the media it carries (e.g. the image a group shares)."""

    prompt_ids: np.ndarray
    """Prompt token ids (int32, 1-D, non-empty)."""
    media: tuple[Media, ...] = ()
    """Media of the prompt, copied into the resulting :class:`GeneratedGroup` unchanged."""

    def __post_init__(self) -> None:
        ids = _int32_1d(self.prompt_ids, "prompt_ids")
        if ids.size == 0:
            raise InvalidRequest("prompt_ids is empty; every prompt needs at least one token")
        object.__setattr__(self, "prompt_ids", ids)
        media = tuple(self.media)
        for m in media:
            if not isinstance(m, Media):
                raise InvalidRequest(f"media items must be knittrans.schema.Media, got {type(m).__name__}")
        object.__setattr__(self, "media", media)


Prompt = PromptRequest | Sequence[int] | np.ndarray
"""What engines accept per prompt: bare token ids or a :class:`PromptRequest` with media."""


def as_prompt_request(prompt: Prompt) -> PromptRequest:
    """Normalise a prompt (token ids or :class:`PromptRequest`) to a :class:`PromptRequest`."""
    if isinstance(prompt, PromptRequest):
        return prompt
    return PromptRequest(prompt_ids=np.asarray(prompt))


@dataclass(frozen=True, kw_only=True)
class GeneratedSample:
    """One sampled response: tokens, the sampling policy's logprob of each, why it ended."""

    response_ids: np.ndarray
    """Response token ids (int32); ends with EOS when ``finish_reason == "stop"``; no padding."""
    response_logprobs: np.ndarray
    """float32 logprob of each sampled token under the distribution it was drawn from."""
    finish_reason: FinishReason
    """``stop`` (EOS sampled) or ``length`` (``max_new_tokens`` reached)."""

    def __post_init__(self) -> None:
        ids = _int32_1d(self.response_ids, "response_ids")
        lp = np.asarray(self.response_logprobs, dtype=np.float32)
        if lp.shape != ids.shape:
            raise InvalidRequest(f"response_logprobs has shape {lp.shape}, response_ids has shape {ids.shape}")
        if self.finish_reason not in ("stop", "length"):
            raise InvalidRequest(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        object.__setattr__(self, "response_ids", ids)
        object.__setattr__(self, "response_logprobs", lp)

    @property
    def num_tokens(self) -> int:
        """Response tokens."""
        return int(self.response_ids.shape[0])


@dataclass(frozen=True, kw_only=True)
class GeneratedGroup:
    """The ``n`` responses an engine sampled for one prompt (a GRPO group before rewards)."""

    prompt_ids: np.ndarray
    """Prompt token ids (int32)."""
    samples: tuple[GeneratedSample, ...]
    """The ``n`` responses, in the engine's order."""
    media: tuple[Media, ...] = ()
    """Media carried over from the :class:`PromptRequest` (the engine never alters them)."""
    finished_at: float = field(default_factory=time.time)
    """Unix seconds at which the engine returned the group."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _int32_1d(self.prompt_ids, "prompt_ids"))
        samples = tuple(self.samples)
        if not samples:
            raise InvalidRequest("a generated group needs at least one sample")
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "media", tuple(self.media))

    @property
    def n(self) -> int:
        """Samples in the group."""
        return len(self.samples)


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
        response_ids=[s.response_ids for s in group.samples],
        response_logprobs=[s.response_logprobs for s in group.samples],
        rewards=r,
        version_start=version_start,
        version_end=version_end,
        version_weighted=version_weighted,
        loss_masks=loss_masks,
        media=group.media,
        finished_at=group.finished_at,
    )
