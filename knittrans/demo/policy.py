"""The demo's tiny policy: a Qwen2 causal LM plus a small vision encoder whose output prefixes the prompt."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyVisionEncoder", "packed_response_logprobs", "prefix_embeddings"]


class TinyVisionEncoder(nn.Module):
    """Patchify a uint8 image, embed the patches, mean-pool into ``num_tokens`` prefix vectors."""

    def __init__(self, *, channels: int, hidden: int, patch: int = 16, num_tokens: int = 1) -> None:
        super().__init__()
        self.patch = patch
        self.num_tokens = num_tokens
        self.proj = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.out = nn.Linear(hidden, hidden * num_tokens)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` uint8 or float images → ``[B, num_tokens, hidden]`` features."""
        x = images.to(self.proj.weight.dtype) / 255.0 if not images.is_floating_point() else images
        x = self.proj(x).flatten(2).mean(dim=2)
        out: torch.Tensor = self.out(torch.tanh(x))
        return out.view(x.shape[0], self.num_tokens, -1)


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
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of every response token, flattened in row order (the layout of ``response_logprobs``).

    ``input_ids`` is right-padded ``[B, T]`` holding prompt then response of each row.
    """
    embed = model.get_input_embeddings()  # type: ignore[operator]
    embeds = prefix_embeddings(embed(input_ids), features, has_media)
    logits = model(inputs_embeds=embeds, attention_mask=attention_mask).logits  # type: ignore[operator]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    rows = torch.repeat_interleave(torch.arange(input_ids.shape[0]), response_lens)
    starts = torch.repeat_interleave(prompt_lens, response_lens)
    offsets = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(response_lens, 0) - response_lens, response_lens
    )
    pos = starts + offsets  # position of each response token
    return logp[rows, pos - 1, input_ids[rows, pos]]
