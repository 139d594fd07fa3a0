"""Real vLLM rollout of the tiny VLM for tests/test_vllm_vlm.py: image prompts, then a weight reload.

Run in the vLLM venv (vLLM spawns processes, hence the ``__main__`` guard)::

    python tests/vllm_vlm_script.py --model A --new-weights B/model.safetensors --out DIR

Prompts: two images of different sizes, one image, and text only; each group of ``N`` samples
shares its prompt's images. Phase 0 samples with the weights of ``--model``; then
``VLLMEngine.load_weights`` switches vision and language weights to ``--new-weights`` and phase 1
samples the same prompts. ``DIR/result.json`` holds every group; ``DIR/image-<i>.npy`` the images.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

N = 3
MAX_NEW_TOKENS = 12
TEMPERATURE = 0.9
SEED = 7
SHAPES = [(3, 96, 128), (3, 150, 100), (3, 112, 112)]
"""Image shapes (CHW uint8); prompt 0 shows images 0 and 1, prompt 1 image 2, prompt 2 none."""


def main() -> None:
    """Run both phases and dump the JSON result."""
    from knittrans.rollout.engines import VLLMEngine
    from knittrans.rollout.generated import PromptRequest
    from knittrans.rollout.vlm import VLMLayout, image_prompt_ids
    from knittrans.schema import Media

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-weights", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in SHAPES]
    for i, im in enumerate(images):
        np.save(out / f"image-{i}.npy", im)
    layout = VLMLayout.from_dir(args.model)
    media = [Media(kind="image", data=im) for im in images]
    prompts = [
        PromptRequest(prompt_ids=image_prompt_ids(layout, [1, 2, 3, 4], 2), media=(media[0], media[1])),
        PromptRequest(prompt_ids=image_prompt_ids(layout, [9, 8, 7], 1), media=(media[2],)),
        PromptRequest(prompt_ids=np.array([5, 6, 7], dtype=np.int32)),
    ]
    result: dict[str, Any] = {"images": [[0, 1], [2], []], "phases": [], "timings_s": {}}
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model)
    result["timings_s"]["startup"] = time.perf_counter() - t0
    try:
        for phase in range(2):
            if phase == 1:
                engine.load_weights(args.new_weights)
            groups = engine.generate(prompts, N, MAX_NEW_TOKENS, TEMPERATURE, SEED)
            result["phases"].append(
                [
                    {
                        "prompt_ids": g.prompt_ids.tolist(),
                        "media": [m.hex for m in g.media],
                        "samples": [
                            {"response_ids": s.response_ids.tolist(), "response_logprobs": s.response_logprobs.tolist()}
                            for s in g.samples
                        ],
                    }
                    for g in groups
                ]
            )
    finally:
        engine.close()
    result["temperature"] = TEMPERATURE
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
