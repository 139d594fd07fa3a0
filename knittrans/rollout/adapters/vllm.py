"""vLLM ``RequestOutput`` → :class:`GeneratedGroup`, and prompt → vLLM ``TokensPrompt`` dict (no ``import vllm``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from knittrans.errors import InvalidRequest
from knittrans.rollout.generated import FinishReason, GeneratedGroup, GeneratedSample, PromptRequest
from knittrans.rollout.vlm import VLMLayout, image_to_pil

__all__ = ["RequestOutputLike", "group_from_request_output", "vllm_prompt"]


class RequestOutputLike(Protocol):
    """The parts of ``vllm.RequestOutput`` the adapter reads (per sample: ``token_ids``, ``logprobs``,
    ``finish_reason``)."""

    request_id: str
    prompt_token_ids: Sequence[int] | None
    outputs: Sequence[Any]
    finished: bool


def vllm_prompt(prompt: PromptRequest, layout: VLMLayout | None = None) -> dict[str, Any]:
    """The ``TokensPrompt`` dict for ``LLM.generate``.

    Without a VLM ``layout`` (a text-only model) media stay out of the engine and are only carried
    into the group: vLLM raises ``ValueError: Multi-modal processor not available for text-only
    models`` for ``multi_modal_data``, and takes images only with a tokenizer, which only the tiny
    VLM starts with.

    With one, each image block of the prompt is sent as one ``<image>`` token (vLLM's Idefics3
    processor expands it back to the same block, so the prompt vLLM runs, and reports, is
    ``prompt_ids``) and the prompt's images go as RGB PIL images in ``multi_modal_data``; other
    media stay out, as in :class:`~knittrans.rollout.engines.HFEngine`.
    """
    if layout is None:
        return {"prompt_token_ids": prompt.prompt_ids.tolist()}
    out: dict[str, Any] = {"prompt_token_ids": layout.compact_ids(prompt.prompt_ids)}
    if images := [image_to_pil(m.data) for m in prompt.media if m.kind == "image"]:
        out["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
    return out


def _sampled_logprobs(logprobs: Any, token_ids: np.ndarray, where: str) -> np.ndarray:
    """The sampled token's logprob at every position, from either vLLM layout (list of dicts, ``FlatLogprobs``)."""
    if logprobs is None:
        raise InvalidRequest(f"{where}: no logprobs; request them with SamplingParams(logprobs=0)")
    if len(logprobs) != token_ids.shape[0]:
        raise InvalidRequest(f"{where}: {len(logprobs)} logprob positions for {token_ids.shape[0]} tokens")
    flat_ids = getattr(logprobs, "token_ids", None)
    starts = getattr(logprobs, "start_indices", None)
    if flat_ids is not None and starts is not None:  # FlatLogprobs: entry at start_indices[i] first
        ends = np.asarray(logprobs.end_indices, dtype=np.int64)
        st = np.asarray(starts, dtype=np.int64)
        ids = np.asarray(flat_ids, dtype=np.int64)
        vals = np.asarray(logprobs.logprobs, dtype=np.float64)
        out = np.empty(token_ids.shape[0], dtype=np.float32)
        for i, tok in enumerate(token_ids):
            hit = np.flatnonzero(ids[st[i] : ends[i]] == tok)
            if hit.size == 0:
                raise InvalidRequest(f"{where}: position {i} has no logprob for sampled token {tok}")
            out[i] = vals[st[i] + hit[0]]
        return out
    out = np.empty(token_ids.shape[0], dtype=np.float32)
    for i, (tok, pos) in enumerate(zip(token_ids.tolist(), logprobs, strict=True)):
        if not isinstance(pos, Mapping) or tok not in pos:
            raise InvalidRequest(f"{where}: position {i} has no logprob for sampled token {tok}")
        out[i] = pos[tok].logprob
    return out


def group_from_request_output(output: RequestOutputLike, prompt: PromptRequest) -> GeneratedGroup:
    """Convert one finished ``RequestOutput`` (``n`` samples of one prompt) into a group stamped now.

    ``prompt`` is the request it answers: its token ids must match and its media are carried over.

    Raises:
        InvalidRequest: unfinished or aborted samples, missing logprobs, a prompt mismatch.
    """
    where = f"vLLM request {getattr(output, 'request_id', '?')}"
    if not output.finished:
        raise InvalidRequest(f"{where} is not finished")
    if output.prompt_token_ids is not None and list(output.prompt_token_ids) != prompt.prompt_ids.tolist():
        raise InvalidRequest(f"{where}: prompt token ids differ from the request's")
    samples: list[GeneratedSample] = []
    for i, comp in enumerate(output.outputs):
        reason = comp.finish_reason
        if reason not in ("stop", "length"):
            raise InvalidRequest(f"{where} sample {i}: finish_reason {reason!r} (expected stop or length)")
        ids = np.asarray(comp.token_ids, dtype=np.int32)
        lp = _sampled_logprobs(comp.logprobs, ids, f"{where} sample {i}")
        fr: FinishReason = "stop" if reason == "stop" else "length"
        samples.append(GeneratedSample(response_ids=ids, response_logprobs=lp, finish_reason=fr))
    if not samples:
        raise InvalidRequest(f"{where} has no samples")
    return GeneratedGroup(prompt_ids=prompt.prompt_ids, samples=tuple(samples), media=prompt.media)
