"""Tiny randomly initialised Qwen2 policies for tests and the demo (built from a config, no downloads)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_tiny_qwen2"]

logger = logging.getLogger(__name__)


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
        vocab_size: Vocabulary size (>= 2); id ``vocab_size - 1`` is EOS and pad.
        hidden: Hidden size, equal to ``heads * head_dim``; the MLP inner size is ``2 * hidden``.
        layers: Decoder layers.
        heads: Attention heads (query and key/value: no grouped-query attention).
        head_dim: Per-head size (vLLM's CPU attention backend rejects 16 or 32, 64 works).
        seed: Seed of the weight initialisation.
        init_std: Std of the normal initialisation; larger gives peakier, more varied policies.

    Returns:
        The directory, holding ``config.json``, ``generation_config.json`` and ``model.safetensors``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for name, value in (("hidden", hidden), ("layers", layers), ("heads", heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"build_tiny_qwen2: {name} must be positive, got {value}")
    if vocab_size < 2:
        raise ValueError(f"build_tiny_qwen2: vocab_size must be at least 2 (one id is EOS), got {vocab_size}")
    if hidden != heads * head_dim:
        raise ValueError(
            f"build_tiny_qwen2: hidden ({hidden}) must equal heads*head_dim ({heads}*{head_dim}); "
            "Qwen2 derives head_dim from them"
        )
    if init_std <= 0:
        raise ValueError(f"build_tiny_qwen2: init_std must be positive, got {init_std}")
    eos = vocab_size - 1
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
    )
    save_random_model(Qwen2ForCausalLM, config, out, seed=seed, eos=eos)
    logger.info(
        "saved tiny Qwen2 (vocab %d, hidden %d, layers %d, seed %d) to %s", vocab_size, hidden, layers, seed, out
    )
    return out


def save_random_model(model_class: Any, config: Any, out: Path, *, seed: int, eos: int) -> None:
    """Save ``model_class(config)``, initialised under ``seed`` (the caller's RNG untouched), in float32 with a
    generation config whose EOS, pad and BOS are ``eos`` (the tiny Qwen2 and the tiny VLM alike)."""
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = model_class(config).float().eval()
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=eos, pad_token_id=eos, bos_token_id=eos
    )
    model.save_pretrained(out, safe_serialization=True)
