"""Rollout engines: ``RolloutEngine`` over transformers and vLLM, on CPU or GPU (docs/explanation/rollout.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from knittrans.errors import InvalidRequest
from knittrans.rollout.adapters.hf import groups_from_generate_output
from knittrans.rollout.adapters.vllm import group_from_request_output, vllm_prompt
from knittrans.rollout.generated import GeneratedGroup, Prompt, PromptRequest, as_prompt_request
from knittrans.rollout.vlm import VLMLayout, is_vlm, load_image_processor, pixel_values

__all__ = [
    "HFEngine",
    "HFEngineConfig",
    "RolloutEngine",
    "VLLMEngine",
    "VLLMEngineConfig",
    "WeightFileLoader",
    "check_sampling_args",
    "open_engine",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker needs from an inference engine."""

    def generate(
        self, prompts: Sequence[Prompt], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[GeneratedGroup]:
        """Sample ``n`` responses for every prompt; one group per prompt, in prompt order."""
        ...

    def load_weights(self, path: str | Path) -> None:
        """Replace the policy weights with those of a safetensors file (HF checkpoint names)."""
        ...

    def close(self) -> None:
        """Release the engine (processes, memory); idempotent."""
        ...


def check_sampling_args(n: int, max_new_tokens: int, temperature: float) -> None:
    """Raise :class:`InvalidRequest` naming the bad sampling argument."""
    if n <= 0:
        raise InvalidRequest(f"n must be positive, got {n}")
    if max_new_tokens <= 0:
        raise InvalidRequest(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be finite and >= 0, got {temperature}")


def _check_weights_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InvalidRequest(f"weights file {str(p)!r} does not exist")
    if p.suffix != ".safetensors":
        raise InvalidRequest(f"weights file {str(p)!r} is not a .safetensors file")
    return p


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """Settings of :class:`HFEngine` (the model runs in float32)."""

    logprobs_mode: Literal["processed", "raw"] = "processed"
    """``processed``: logprobs of the sampling distribution (after temperature); ``raw``: at T=1."""
    max_batch_rows: int = 64
    """Most rows (prompts x n) per ``generate()`` call; prompts are chunked to fit."""
    device: str = "cpu"
    """torch device of the model."""

    def __post_init__(self) -> None:
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"HFEngineConfig.logprobs_mode must be processed or raw, got {self.logprobs_mode!r}")
        if self.max_batch_rows <= 0:
            raise ValueError(f"HFEngineConfig.max_batch_rows must be positive, got {self.max_batch_rows}")


class HFEngine:
    """transformers ``generate()`` with sampled-token logprobs; left-pads prompts into batches."""

    def __init__(self, model_dir: str | Path, config: HFEngineConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.config = config or HFEngineConfig()
        self.model_dir = Path(model_dir)
        self.layout: VLMLayout | None = None
        self._image_processor: Any = None
        if is_vlm(self.model_dir):
            from transformers import Idefics3ForConditionalGeneration

            self.layout = VLMLayout.from_dir(self.model_dir)
            self._image_processor = load_image_processor(self.model_dir)
            model: Any = Idefics3ForConditionalGeneration.from_pretrained(self.model_dir, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model: Any = model.to(self.config.device).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        if eos is None:
            raise InvalidRequest(f"model in {str(self.model_dir)!r} defines no eos_token_id")
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (int(eos),)
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        # A clean generation config: nothing (top_k=50 default, repetition penalty, ...) but
        # what generate() below sets may shape the sampling distribution.
        self.model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id
        )

    def generate(
        self, prompts: Sequence[Prompt], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[GeneratedGroup]:
        """Sample ``n`` responses per prompt (logprob semantics: docs/explanation/rollout.md)."""
        check_sampling_args(n, max_new_tokens, temperature)
        requests = [as_prompt_request(p) for p in prompts]
        per_call = max(1, self.config.max_batch_rows // n)
        groups: list[GeneratedGroup] = []
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed)
            for start in range(0, len(requests), per_call):
                groups += self._generate_chunk(requests[start : start + per_call], n, max_new_tokens, temperature)
        return groups

    def _generate_chunk(
        self, requests: list[PromptRequest], n: int, max_new_tokens: int, temperature: float
    ) -> list[GeneratedGroup]:
        width = max(r.prompt_ids.shape[0] for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            k = r.prompt_ids.shape[0]
            ids[i, width - k :] = torch.from_numpy(r.prompt_ids.astype(np.int64))
            mask[i, width - k :] = 1
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        raw = self.config.logprobs_mode == "raw"
        if self.layout is not None:
            sampling.update(self._image_inputs(requests, n))
        # Rows are expanded here (prompt-major, like num_return_sequences) so greedy n > 1 works too.
        out = self.model.generate(
            input_ids=ids.repeat_interleave(n, dim=0).to(self.config.device),
            attention_mask=mask.repeat_interleave(n, dim=0).to(self.config.device),
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_scores=not raw,
            output_logits=raw,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            **sampling,
        )
        return groups_from_generate_output(
            requests,
            out.sequences.cpu(),
            out.logits if raw else out.scores,
            n=n,
            prompt_width=width,
            eos_token_ids=self.eos_token_ids,
        )

    def _image_inputs(self, requests: list[PromptRequest], n: int) -> dict[str, Any]:
        """``generate`` kwargs of a VLM: the suppressed tokens and ``pixel_values`` ``[rows, max_images, 3, S, S]``.

        Prompts with fewer images are padded with all-zero images, which Idefics3 skips.
        """
        assert self.layout is not None
        layout = self.layout
        per_prompt = [[m.data for m in r.media if m.kind == "image"] for r in requests]
        for r, images in zip(requests, per_prompt, strict=True):
            if layout.count_images(r.prompt_ids) != len(images):
                raise InvalidRequest(
                    f"prompt has {layout.count_images(r.prompt_ids)} image blocks but {len(images)} images"
                )
        extra: dict[str, Any] = {"suppress_tokens": list(layout.suppressed_token_ids)}
        most = max(len(images) for images in per_prompt)
        if most == 0:
            return extra
        side = layout.image_size
        pixels = torch.zeros((len(requests), most, 3, side, side), dtype=self.model.dtype)
        for i, images in enumerate(per_prompt):
            if images:
                pixels[i, : len(images)] = pixel_values(self._image_processor, images).to(self.model.dtype)
        extra["pixel_values"] = pixels.repeat_interleave(n, dim=0).to(self.config.device)
        return extra

    def load_weights(self, path: str | Path) -> None:
        """``load_state_dict(strict=True)`` from a safetensors file; names what does not match."""
        from safetensors.torch import load_file

        state = load_file(str(_check_weights_file(path)), device=self.config.device)
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise InvalidRequest(
                f"weights file {str(path)!r} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, tensor in state.items():
            if tensor.shape != own[name].shape:
                raise InvalidRequest(
                    f"weights file {str(path)!r}: {name} has shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(own[name].shape)}"
                )
        self.model.load_state_dict(state, strict=True)
        logger.info("HFEngine loaded %d tensors from %s", len(state), path)

    def close(self) -> None:
        """Nothing to release beyond the model (kept for the protocol)."""


@dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    """Settings of :class:`VLLMEngine` (float32, eager, processed logprobs: fits a tiny model on vLLM's CPU backend)."""

    kv_cache_gib: float = 1.0
    """KV cache size (``kv_cache_memory_bytes``; same as ``VLLM_CPU_KVCACHE_SPACE`` on CPU)."""

    def __post_init__(self) -> None:
        if self.kv_cache_gib <= 0:
            raise ValueError(f"VLLMEngineConfig.kv_cache_gib must be positive, got {self.kv_cache_gib}")


class VLLMEngine:
    """vLLM ``LLM`` with token-id prompts and in-place weight reloads from a safetensors file.

    Create it under ``if __name__ == "__main__":`` (vLLM spawns its engine and worker processes).
    """

    def __init__(self, model_dir: str | Path, config: VLLMEngineConfig | None = None) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "VLLMEngine needs vLLM: run scripts/setup_vllm_env.sh (CPU) or pip install 'knittrans[vllm]'"
            ) from exc
        self.config = config or VLLMEngineConfig()
        self.model_dir = Path(model_dir)
        self.layout = VLMLayout.from_dir(self.model_dir) if is_vlm(self.model_dir) else None
        # vLLM refuses images without a tokenizer (skip_tokenizer_init); the tiny VLM brings its own.
        multimodal: dict[str, Any] = (
            {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 4}}  # images per prompt, at most
            if self.layout is not None
            else {"skip_tokenizer_init": True}
        )
        self._allowed: list[int] | None = None
        if self.layout is not None:
            vocab = int(json.loads((self.model_dir / "config.json").read_text())["text_config"]["vocab_size"])
            self._allowed = [t for t in range(vocab) if t not in self.layout.suppressed_token_ids]
        self._llm: Any = LLM(
            model=str(self.model_dir),
            **multimodal,
            dtype="float32",
            enforce_eager=True,  # no CUDA graphs / compilation: start-up time dominates for tiny models
            kv_cache_memory_bytes=int(self.config.kv_cache_gib * 2**30),
            logprobs_mode="processed_logprobs",  # after temperature: the distribution sampled from
            seed=0,  # per-request seeds come from generate(seed=...)
            worker_extension_cls="knittrans.rollout.engines.WeightFileLoader",
        )

    def generate(
        self, prompts: Sequence[Prompt], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[GeneratedGroup]:
        """One vLLM request per prompt, each with its own seed derived from ``seed``."""
        from vllm import SamplingParams

        check_sampling_args(n, max_new_tokens, temperature)
        requests = [as_prompt_request(p) for p in prompts]
        seeds = np.random.SeedSequence(seed).generate_state(len(requests), dtype=np.uint32)
        params = [
            SamplingParams(
                n=n,
                max_tokens=max_new_tokens,
                temperature=float(temperature),
                top_k=0,
                top_p=1.0,
                logprobs=0,
                seed=int(s) & 0x7FFFFFFF,
                detokenize=False,
                allowed_token_ids=self._allowed,
            )
            for s in seeds
        ]
        # media go to vLLM only for the tiny VLM (other models' media are carried into the groups only)
        prompts_in = [vllm_prompt(r, self.layout) for r in requests]
        outputs = self._llm.generate(prompts_in, params, use_tqdm=False)
        return [group_from_request_output(o, r) for o, r in zip(outputs, requests, strict=True)]

    def load_weights(self, path: str | Path) -> None:
        """Reload the weights in every worker from ``path``; drop the (now stale) prefix and encoder caches."""
        p = _check_weights_file(path).resolve()
        counts = self._llm.collective_rpc("knittrans_load_weights_file", args=(str(p),))
        # Cached KV blocks were computed with the old weights; reusing them would mix policies.
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")
        if self.layout is not None:
            # Cached vision embeddings came from the old vision tower; vLLM's scheduler would
            # also still count them as cached while the worker's copies are gone.
            self._llm.llm_engine.reset_encoder_cache()
        logger.info("VLLMEngine loaded %s tensors from %s", counts, p)

    def close(self) -> None:
        """Shut the engine-core and worker processes down."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


class WeightFileLoader:
    """vLLM worker extension behind :meth:`VLLMEngine.load_weights`: vLLM mixes it into its ``Worker`` (``self`` at
    run time), so ``collective_rpc("knittrans_load_weights_file", args=(path,))`` runs in every worker process.
    Only the path crosses the RPC; each worker reads the tensors itself, in checkpoint (Hugging Face) naming,
    into the worker's own ``reload_weights`` (vLLM 0.32: ``Worker.reload_weights(weights_iterator=...)`` →
    ``model.load_weights``)."""

    def knittrans_load_weights_file(self, path: str) -> int:
        """Load every tensor of ``path`` (memory-mapped, one at a time) into the worker's model in place; return
        how many.

        Raises:
            KeyError: a tensor name the model does not have (raised by vLLM's loader).
        """
        from safetensors import safe_open

        worker: Any = self
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            worker.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        logger.info("loaded %d tensors from %s", len(names), path)
        return len(names)


def open_engine(kind: Literal["hf", "vllm"], model_dir: str | Path) -> RolloutEngine:
    """Engine by name: ``hf`` (transformers) or ``vllm``."""
    if kind == "hf":
        return HFEngine(model_dir)
    if kind == "vllm":
        return VLLMEngine(model_dir)
    raise InvalidRequest(f"unknown engine {kind!r}; expected 'hf' or 'vllm'")
