"""Tiny randomly initialised Qwen2 policies for tests and the demo (built from a config, no downloads)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TinyQwen2Spec", "build_tiny_qwen2"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TinyQwen2Spec:
    """Shape of a tiny Qwen2 causal LM; vLLM on CPU needs ``head_dim == 64``."""

    vocab_size: int = 256
    """Token ids are ``[0, vocab_size)``; the last id is EOS (and pad)."""
    hidden: int = 128
    """Hidden size; must equal ``heads * head_dim``."""
    layers: int = 2
    """Decoder layers."""
    heads: int = 2
    """Attention heads (query and key/value: no grouped-query attention)."""
    head_dim: int = 64
    """Per-head size; vLLM's CPU attention backend rejects 16 or 32, 64 works."""
    intermediate: int = 256
    """MLP inner size."""
    max_positions: int = 2048
    """``max_position_embeddings`` (also vLLM's default ``max_model_len``)."""
    init_std: float = 0.02
    """Std of the normal weight initialisation; larger gives peakier, more varied policies."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "head_dim", "intermediate", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyQwen2Spec.{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ValueError("TinyQwen2Spec.vocab_size must be at least 2 (one id is EOS)")
        if self.hidden != self.heads * self.head_dim:
            raise ValueError(
                f"TinyQwen2Spec: hidden ({self.hidden}) must equal heads*head_dim "
                f"({self.heads}*{self.head_dim}); Qwen2 derives head_dim from them"
            )
        if self.init_std <= 0:
            raise ValueError(f"TinyQwen2Spec.init_std must be positive, got {self.init_std}")

    @property
    def eos_token_id(self) -> int:
        """EOS id (also used as pad id): the last id of the vocabulary."""
        return self.vocab_size - 1


def build_tiny_qwen2(
    directory: str | Path,
    *,
    vocab_size: int = 256,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    init_std: float = 0.02,
) -> Path:
    """Save a randomly initialised float32 ``Qwen2ForCausalLM`` with ``save_pretrained``.

    No tokenizer is written: engines take token-id prompts (vLLM with
    ``skip_tokenizer_init=True``). The same ``seed`` gives the same weights.

    Args:
        directory: Target directory (created if missing).
        vocab_size: Vocabulary size; id ``vocab_size - 1`` is EOS and pad.
        hidden: Hidden size, equal to ``heads * head_dim``.
        layers: Decoder layers.
        heads: Attention heads.
        head_dim: Per-head size (64 for vLLM on CPU).
        seed: Seed of the weight initialisation.
        init_std: Std of the normal initialisation.

    Returns:
        The directory, holding ``config.json``, ``generation_config.json`` and ``model.safetensors``.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = TinyQwen2Spec(
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        intermediate=2 * hidden,
        init_std=init_std,
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=spec.eos_token_id,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.eos_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen2ForCausalLM(config)
        model = model.float().eval()
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=spec.eos_token_id, pad_token_id=spec.eos_token_id, bos_token_id=spec.eos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    logger.info("saved tiny Qwen2 %s (seed %d) to %s", spec, seed, out)
    return out
