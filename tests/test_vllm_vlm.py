"""vLLM (CPU) on the tiny Idefics3 VLM: image prompts, logprobs equal the trainer's, vision weights reload.

Runs only in the vLLM venv (CI: ``pytest -m vllm``); vLLM runs in ``tests/vllm_vlm_script.py``.
The reference is the trainer's own computation (:func:`knittrans.demo.policy.packed_response_logprobs`
with the policy's vision tower) in that venv's transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from knittrans.demo.policy import packed_response_logprobs
from knittrans.rollout.vlm import VisionTower, VLMLayout, build_tiny_vlm, load_image_processor, pixel_values

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("vllm_vlm_script.py")
TOL = 2e-4
"""vLLM's CPU kernels vs the trainer's eager float32 forward (measured ~5e-7 on this model)."""


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the vLLM VLM script once; return its JSON, images and model paths."""
    root = tmp_path_factory.mktemp("vllm_vlm")
    a = build_tiny_vlm(root / "a", seed=0)
    b = build_tiny_vlm(root / "b", seed=1)
    out = root / "out"
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            str(a),
            "--new-weights",
            str(b / "model.safetensors"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, f"vLLM VLM rollout failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["image_arrays"] = [np.load(out / f"image-{i}.npy") for i in range(3)]
    result.update(model_a=a, model_b=b)
    return result


def _gap(result: dict[str, Any], phase: int, model_dir: Path, images: list[list[np.ndarray]] | None = None) -> float:
    """Largest |vLLM logprob - trainer logprob| over a phase (``images`` overrides each prompt's images)."""
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    layout = VLMLayout.from_dir(model_dir)
    processor = load_image_processor(model_dir)
    worst = 0.0
    for g, which in zip(result["phases"][phase], result["images"], strict=True):
        shown = images.pop(0) if images else [result["image_arrays"][i] for i in which]
        with torch.no_grad():
            feats = VisionTower(model)(pixel_values(processor, shown)) if shown else None
            for s in g["samples"]:
                ids = torch.tensor([g["prompt_ids"] + s["response_ids"]])
                lp = packed_response_logprobs(
                    model,
                    ids,
                    torch.ones_like(ids),
                    torch.tensor([len(g["prompt_ids"])]),
                    torch.tensor([len(s["response_ids"])]),
                    image_features=feats,
                    layout=layout,
                    temperature=result["temperature"],
                )
                worst = max(worst, float(np.abs(lp.numpy() - np.asarray(s["response_logprobs"])).max()))
    return worst


def test_vllm_image_rows_match_the_trainer(rollout: dict[str, Any]) -> None:
    """Two images of different sizes, one image, none: every token within TOL of the trainer's logprob."""
    assert _gap(rollout, 0, rollout["model_a"]) < TOL
    suppressed = set(VLMLayout.from_dir(rollout["model_a"]).suppressed_token_ids)
    for g in rollout["phases"][0]:
        assert all(not suppressed & set(s["response_ids"]) for s in g["samples"])
        assert len(g["samples"]) == 3


def test_a_wrong_image_breaks_the_agreement(rollout: dict[str, Any]) -> None:
    """The same tokens scored with other images of the same sizes are far off: vLLM really saw the pixels."""
    rng = np.random.default_rng(5)
    wrong = [
        [rng.integers(0, 256, im.shape, dtype=np.uint8) for im in (rollout["image_arrays"][i] for i in which)]
        for which in rollout["images"]
    ]
    assert _gap(rollout, 0, rollout["model_a"], wrong) > 1e-2


def test_load_weights_reloads_vision_and_language(rollout: dict[str, Any]) -> None:
    """After load_weights, image rows match model b (vision tower and text model both replaced)."""
    assert _gap(rollout, 1, rollout["model_b"]) < TOL
    assert _gap(rollout, 1, rollout["model_a"]) > 1e-2
