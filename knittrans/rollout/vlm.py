"""The tiny vision-language policy: a randomly initialised Idefics3 that rollout and trainer share."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from knittrans.errors import InvalidRequest
from knittrans.rollout.models import save_random_model

__all__ = [
    "TinyVLMSpec",
    "VLMLayout",
    "VisionTower",
    "build_tiny_vlm",
    "image_prompt_ids",
    "image_to_pil",
    "is_vlm",
    "load_image_processor",
    "pixel_values",
    "place_image_features",
]

logger = logging.getLogger(__name__)

EOS_TOKEN = "<end_of_utterance>"
FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TOKEN = "<global-img>"
_SPECIALS = (EOS_TOKEN, FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN)
BYTE_TOKENS = 256
"""Ids ``[0, 256)`` are byte tokens (prompt text is drawn from them); the special tokens follow."""


@dataclass(frozen=True, kw_only=True)
class TinyVLMSpec:
    """Shape of the tiny Idefics3; vLLM's CPU attention needs a text ``head_dim`` of 64."""

    hidden: int = 128
    """Text hidden size (``heads * 64``)."""
    layers: int = 2
    """Text decoder layers."""
    vision_hidden: int = 64
    """Vision transformer hidden size."""
    vision_layers: int = 2
    """Vision transformer layers."""
    vision_heads: int = 2
    """Vision attention heads."""
    image_size: int = 112
    """Every image is resized to ``image_size`` square before the vision tower."""
    patch_size: int = 14
    """Vision patch size; ``image_size`` must be a multiple of ``patch_size * scale_factor``."""
    scale_factor: int = 2
    """Connector pixel-shuffle factor: ``(image_size / patch_size / scale_factor) ** 2`` tokens per image."""
    init_std: float = 0.02
    """Std of the normal weight initialisation."""
    max_positions: int = 2048
    """Text ``max_position_embeddings``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # every field is a size or a std
            if getattr(self, f.name) <= 0:
                raise ValueError(f"TinyVLMSpec.{f.name} must be positive, got {getattr(self, f.name)}")
        if self.hidden % 64:
            raise ValueError(f"TinyVLMSpec.hidden must be a multiple of 64 (head_dim 64), got {self.hidden}")
        if self.image_size % (self.patch_size * self.scale_factor):
            raise ValueError(
                f"TinyVLMSpec.image_size ({self.image_size}) must be a multiple of patch_size*scale_factor "
                f"({self.patch_size}*{self.scale_factor})"
            )
        if self.vision_hidden % self.vision_heads:
            raise ValueError("TinyVLMSpec.vision_hidden must be a multiple of vision_heads")

    @property
    def tokens_per_image(self) -> int:
        """``<image>`` tokens (connector output rows) per image."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    @property
    def vocab_size(self) -> int:
        """Byte tokens plus the four special tokens."""
        return BYTE_TOKENS + len(_SPECIALS)


@dataclass(frozen=True, kw_only=True)
class VLMLayout:
    """Token ids and sizes of a saved tiny VLM (read back from its directory)."""

    eos_token_id: int
    """``<end_of_utterance>``: EOS and pad."""
    fake_token_id: int
    """``<fake_token_around_image>``."""
    image_token_id: int
    """``<image>``: one per connector output row."""
    global_token_id: int
    """``<global-img>``."""
    tokens_per_image: int
    """``<image>`` tokens per image."""
    image_size: int
    """Side of the square the image processor resizes every image to."""

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Image-structure tokens no engine may sample (and the trainer masks the same way)."""
        return (self.fake_token_id, self.image_token_id, self.global_token_id)

    def image_block(self) -> list[int]:
        """The prompt ids standing for one image."""
        return [
            self.fake_token_id,
            self.global_token_id,
            *[self.image_token_id] * self.tokens_per_image,
            self.fake_token_id,
        ]

    def compact_ids(self, prompt_ids: Sequence[int] | np.ndarray) -> list[int]:
        """The prompt as vLLM takes it: each image block collapsed to one ``<image>`` (vLLM expands it back)."""
        ids = [int(t) for t in prompt_ids]
        block = self.image_block()
        out: list[int] = []
        i = 0
        while i < len(ids):
            if ids[i : i + len(block)] == block:
                out.append(self.image_token_id)
                i += len(block)
            elif ids[i] in self.suppressed_token_ids:
                raise InvalidRequest(f"prompt token {i} is an image-structure token outside a whole image block")
            else:
                out.append(ids[i])
                i += 1
        return out

    def count_images(self, prompt_ids: Sequence[int] | np.ndarray) -> int:
        """Image blocks in a prompt (its ``<image>`` tokens divided by ``tokens_per_image``)."""
        return int(np.count_nonzero(np.asarray(prompt_ids) == self.image_token_id)) // self.tokens_per_image

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> VLMLayout:
        """Read the layout from a directory written by :func:`build_tiny_vlm`."""
        raw = json.loads((Path(model_dir) / "knittrans_vlm.json").read_text())
        return cls(**raw)


def is_vlm(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds a tiny VLM of :func:`build_tiny_vlm` (else a text-only model)."""
    return (Path(model_dir) / "knittrans_vlm.json").is_file()


def image_prompt_ids(layout: VLMLayout, text_ids: Sequence[int] | np.ndarray, num_images: int) -> np.ndarray:
    """One image block per image, then the text ids (int32)."""
    if num_images < 0:
        raise InvalidRequest(f"num_images must be >= 0, got {num_images}")
    text = np.asarray(text_ids, dtype=np.int32)
    if text.size and (int(text.min()) < 0 or int(text.max()) >= BYTE_TOKENS):
        raise InvalidRequest(f"prompt text ids must be byte tokens in [0, {BYTE_TOKENS})")
    return np.concatenate([np.asarray(layout.image_block() * num_images, dtype=np.int32), text])


def _train_tokenizer(out: Path) -> None:
    """Byte-level BPE with the 256 byte tokens and no merges, plus the special tokens (ids 256..259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_TOKENS,
        special_tokens=[],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["knittrans tiny vision-language policy"], trainer=trainer)
    if tok.get_vocab_size() != BYTE_TOKENS:
        raise RuntimeError(f"byte-level tokenizer has {tok.get_vocab_size()} tokens, expected {BYTE_TOKENS}")
    tok.add_special_tokens(list(_SPECIALS))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    fast.save_pretrained(str(out))


def build_tiny_vlm(directory: str | Path, spec: TinyVLMSpec | None = None, *, seed: int = 0) -> Path:
    """Save a randomly initialised float32 ``Idefics3ForConditionalGeneration`` with tokenizer and processor.

    The same ``spec`` and ``seed`` give the same weights.

    Returns:
        The directory: ``config.json``, ``model.safetensors``, tokenizer and processor files and
        ``knittrans_vlm.json`` (the :class:`VLMLayout`).
    """
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    spec = spec or TinyVLMSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out)
    eos, fake, image, glob = (BYTE_TOKENS + i for i in range(len(_SPECIALS)))
    config = Idefics3Config(  # type: ignore[call-arg]  # pad_token_id: taken by **kwargs, not in the stub
        image_token_id=image,
        scale_factor=spec.scale_factor,
        tie_word_embeddings=False,
        pad_token_id=eos,
        vision_config={
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "image_size": spec.image_size,
            "patch_size": spec.patch_size,
            "initializer_range": spec.init_std,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden,
            "intermediate_size": 2 * spec.hidden,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.hidden // 64,
            "num_key_value_heads": spec.hidden // 64,
            "head_dim": 64,
            "max_position_embeddings": spec.max_positions,
            "initializer_range": spec.init_std,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "pad_token_id": eos,
            "tie_word_embeddings": False,
        },
        dtype="float32",
    )
    save_random_model(Idefics3ForConditionalGeneration, config, out, seed=seed, eos=eos)
    processor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": spec.image_size},
        "resample": 1,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "do_image_splitting": False,
        "max_image_size": {"longest_edge": spec.image_size},
        "processor_class": "Idefics3Processor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": spec.tokens_per_image}, indent=2)
    )
    layout = VLMLayout(
        eos_token_id=eos,
        fake_token_id=fake,
        image_token_id=image,
        global_token_id=glob,
        tokens_per_image=spec.tokens_per_image,
        image_size=spec.image_size,
    )
    (out / "knittrans_vlm.json").write_text(json.dumps(layout.__dict__, indent=2))
    logger.info("saved tiny Idefics3 %s (seed %d) to %s", spec, seed, out)
    return out


def load_image_processor(model_dir: str | Path) -> Any:
    """The PIL Idefics3 image processor configured by ``model_dir`` (no torchvision needed)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class")}
    return Idefics3ImageProcessorPil(**kwargs)


def image_to_pil(image: Any) -> Any:
    """A uint8 image array (``HxWxC`` or ``CxHxW``, C in 1/3/4, or ``HxW``) or tensor as an RGB PIL image."""
    from PIL import Image

    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.dtype != np.uint8:
        raise InvalidRequest(f"images must be uint8 arrays, got dtype {arr.dtype}")
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
        raise InvalidRequest(f"image of shape {arr.shape} is not HxW, HxWxC or CxHxW with C in 1/3/4")
    return Image.fromarray(np.ascontiguousarray(arr)).convert("RGB")


def pixel_values(processor: Any, images: Sequence[Any]) -> torch.Tensor:
    """Preprocess images (any sizes) to float32 ``[n, 3, S, S]``, exactly as the engines' processor does."""
    if not images:
        raise InvalidRequest("pixel_values() needs at least one image")
    out = processor([[image_to_pil(im)] for im in images], return_tensors="pt")
    pv: torch.Tensor = out["pixel_values"]
    return pv.reshape(len(images), *pv.shape[-3:]).float()


class VisionTower(nn.Module):
    """The policy's own vision transformer + connector: pixels ``[n, 3, S, S]`` → ``[n, tokens, hidden]``.

    Holds the modules of the model (no copies), so its parameters are the policy's parameters.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        inner: Any = model.model  # Idefics3ForConditionalGeneration.model: Idefics3Model
        self.vision_model: nn.Module = inner.vision_model
        self.connector: nn.Module = inner.connector

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Vision transformer (every patch real: images are never padded) then pixel shuffle + projection."""
        dtype = next(self.connector.parameters()).dtype
        hidden = self.vision_model(pixel_values=pixels.to(dtype)).last_hidden_state
        out: torch.Tensor = self.connector(hidden)
        return out


def place_image_features(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    image_token_id: int,
    prompt_lens: torch.Tensor,
) -> torch.Tensor:
    """Put ``features`` (``[images, tokens, hidden]``, in prompt order row by row) at the ``<image>`` tokens of the
    prompts (the first ``prompt_lens`` positions of each row).

    Raises :class:`InvalidRequest` when the number of ``<image>`` tokens and feature rows differ.
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    mask = (input_ids == image_token_id) & (positions[None, :] < prompt_lens.to(input_ids.device)[:, None])
    flat = features.reshape(-1, features.shape[-1]).to(embeds.dtype)
    if int(mask.sum()) != flat.shape[0]:
        raise InvalidRequest(f"{int(mask.sum())} <image> tokens in the prompts but {flat.shape[0]} feature rows")
    out = embeds.clone()
    out[mask] = flat
    return out
