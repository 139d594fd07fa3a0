"""Real vLLM rollout for tests/test_adapters_vllm.py: generate → adapter → TrajectoryWriter → store.

Run in the vLLM venv (vLLM spawns processes, hence the ``__main__`` guard)::

    python tests/vllm_rollout_script.py --model A --new-weights B/model.safetensors \
        --endpoint grpc://127.0.0.1:PORT --out result.json

Phase 0 samples with the weights of ``--model``; then ``VLLMEngine.load_weights`` switches to
``--new-weights`` and phase 1 samples the same prompts with the same seed. Each phase's groups
are written as one unit (policy version 0, then 1). The JSON holds every group (ids, logprobs,
finish reasons, media hashes), the unit descriptors and the timings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

N = 4
MAX_NEW_TOKENS = 24
TEMPERATURE = 0.8
SEED = 7
# The last prompt spans several KV blocks, so a prefix cache not reset after a weight reload
# would hand phase 1 stale KV (and logprobs off policy b).
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [(7 * i) % 250 for i in range(300)]]


def main() -> None:
    """Run both phases and dump the JSON result."""
    from knittrans.rollout.engines import VLLMEngine, VLLMEngineConfig
    from knittrans.rollout.generated import PromptRequest, to_trajectory_group
    from knittrans.rollout.writer import TrajectoryWriter
    from knittrans.schema import Media

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-weights", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    image = Media(kind="image", data=np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4))
    prompts: list[Any] = [PromptRequest(prompt_ids=np.array(PROMPTS[0]), media=(image,)), *PROMPTS[1:]]
    result: dict[str, Any] = {
        "n": N,
        "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": TEMPERATURE,
        "image_hash": image.hex,
        "phases": [],
        "timings_s": {},
    }
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model, VLLMEngineConfig(kv_cache_gib=1))
    result["timings_s"]["startup"] = time.perf_counter() - t0
    writer = TrajectoryWriter(job="vllm-test", node_id="node-0", endpoint=args.endpoint)
    try:
        for version in (0, 1):
            if version == 1:
                t0 = time.perf_counter()
                engine.load_weights(args.new_weights)
                result["timings_s"]["load_weights"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            groups = engine.generate(prompts, n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=SEED)
            result["timings_s"][f"generate_{version}"] = time.perf_counter() - t0
            traj = [
                to_trajectory_group(
                    g,
                    group_id=f"v{version}-g{i}",
                    source="text" if i else "mm",
                    rewards=[float(s.num_tokens) for s in g.samples],
                    version_start=version,
                    version_end=version,
                )
                for i, g in enumerate(groups)
            ]
            desc = writer.write_groups(traj, unit_id=f"unit-v{version}")
            result["phases"].append(
                {
                    "version": version,
                    "unit": desc.to_dict(),
                    "groups": [
                        {
                            "prompt_ids": g.prompt_ids.tolist(),
                            "media": [m.hex for m in g.media],
                            "samples": [
                                {
                                    "response_ids": s.response_ids.tolist(),
                                    "response_logprobs": s.response_logprobs.tolist(),
                                    "finish_reason": s.finish_reason,
                                }
                                for s in g.samples
                            ],
                        }
                        for g in groups
                    ],
                }
            )
    finally:
        writer.close()
        engine.close()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
