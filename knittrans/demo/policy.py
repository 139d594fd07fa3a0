"""Response logprobs of the trainer's policy: the tiny VLM (images at their ``<image>`` tokens) or a text LM."""

from __future__ import annotations

import torch
from torch import nn

from knittrans.rollout.vlm import VLMLayout, place_image_features

__all__ = ["TinyVisionEncoder", "packed_response_logprobs", "prefix_embeddings"]


class TinyVisionEncoder(nn.Module):
    """Side encoder of text-only checkpoints (benchmarks' Qwen2): 16x16 patches embedded, mean-pooled to one vector."""

    def __init__(self, *, channels: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, hidden, kernel_size=16, stride=16)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` uint8 or float images → ``[B, 1, hidden]`` features."""
        x = images.to(self.proj.weight.dtype) / 255.0 if not images.is_floating_point() else images
        x = self.proj(x).flatten(2).mean(dim=2)
        out: torch.Tensor = self.out(torch.tanh(x))
        return out.unsqueeze(1)


def prefix_embeddings(
    token_embeds: torch.Tensor, features: torch.Tensor | None, has_media: torch.Tensor | None
) -> torch.Tensor:
    """Add per-row media features to the first positions of ``token_embeds`` (rows without media unchanged).

    Adding instead of concatenating keeps positions identical to the rollout engine's, so the
    response logprobs line up token for token.
    """
    if features is None or has_media is None:
        return token_embeds
    n = features.shape[1]
    gate = has_media.to(token_embeds.dtype).view(-1, 1, 1)
    head = token_embeds[:, :n] + gate * features.to(token_embeds.dtype)
    return torch.cat([head, token_embeds[:, n:]], dim=1)


def packed_response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    response_lens: torch.Tensor,
    *,
    features: torch.Tensor | None = None,
    has_media: torch.Tensor | None = None,
    image_features: torch.Tensor | None = None,
    layout: VLMLayout | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of every response token, flattened in row order (the layout of ``response_logprobs``).

    ``input_ids`` is right-padded ``[B, T]`` holding prompt then response of each row. With a VLM
    ``layout``, ``image_features`` (``[images, tokens, hidden]``, the images of row 0, then row 1,
    ...) replace the prompts' ``<image>`` token embeddings, and the image-structure tokens are
    masked out of the softmax exactly as the rollout engines mask them. Without one, ``features``
    and ``has_media`` are the text path's side-encoder prefix (:func:`prefix_embeddings`).
    The log-softmax runs in the logits' dtype, upcast to float32 when narrower (float64 stays
    float64), and so does the result.
    """
    embed = model.get_input_embeddings()  # type: ignore[operator]
    embeds = embed(input_ids)
    if layout is not None:
        if image_features is not None and image_features.shape[0] > 0:
            embeds = place_image_features(embeds, input_ids, image_features, layout.image_token_id, prompt_lens)
    else:
        embeds = prefix_embeddings(embeds, features, has_media)
    logits = model(inputs_embeds=embeds, attention_mask=attention_mask).logits
    # the softmax in the model's dtype, at least float32 (a bf16/fp16 model's logits are upcast)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if layout is not None:
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        banned[list(layout.suppressed_token_ids)] = True
        logits = logits.masked_fill(banned, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    rows = torch.repeat_interleave(torch.arange(input_ids.shape[0]), response_lens)
    starts = torch.repeat_interleave(prompt_lens, response_lens)
    offsets = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(response_lens, 0) - response_lens, response_lens
    )
    pos = starts + offsets  # position of each response token
    return logp[rows, pos - 1, input_ids[rows, pos]]
