"""vLLM (CPU) engine on a real tiny Qwen2: LLM.generate → adapter → TrajectoryWriter → store, weight reload.

Runs only in the vLLM venv (``scripts/setup_vllm_env.sh``; CI: ``pytest -m vllm``). vLLM runs
in a subprocess (``tests/vllm_rollout_script.py``) because it spawns engine/worker processes;
the checks here compare its output with a transformers forward pass on the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from knittrans.flight import StoreServer
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.store.unit import LocalReader

pytestmark = pytest.mark.vllm

VOCAB = 256
EOS = VOCAB - 1
SCRIPT = Path(__file__).with_name("vllm_rollout_script.py")
# vLLM's CPU kernels (paged attention, fused RMSNorm/SiLU, its own rotary code) vs transformers'
# eager float32 forward: measured max |Δlogprob| 1.5e-5 .. 3.4e-5 over ~900 tokens (docs/explanation/rollout.md);
# 5e-4 leaves a 15x margin and is still 200x below what a weight or temperature mix-up
# produces (> 0.1, asserted below).
TOL = 5e-4


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the vLLM rollout script once against a real store server; return its JSON + paths."""
    from knittrans.flight import StoreServerConfig
    from knittrans.store import StoreConfig

    root = tmp_path_factory.mktemp("vllm")
    a = build_tiny_qwen2(root / "a", vocab_size=VOCAB, seed=0, init_std=0.3)
    b = build_tiny_qwen2(root / "b", vocab_size=VOCAB, seed=1, init_std=0.3)
    store_dir = root / "store"
    server = StoreServer(StoreServerConfig(store=StoreConfig(root=store_dir)))
    out = root / "result.json"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--model",
                str(a),
                "--new-weights",
                str(b / "model.safetensors"),
                "--endpoint",
                server.endpoint,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=540,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    finally:
        server.shutdown()
    assert proc.returncode == 0, f"vLLM rollout failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    result.update(model_a=a, model_b=b, store_dir=store_dir)
    return result


def forward_logprobs(model_dir: Path, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    """log_softmax(logits / T) of each response token from one transformers forward pass (float32)."""
    model: Callable[..., Any] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1).numpy()


def max_error(result: dict[str, Any], phase: int, model_dir: Path, temperature: float) -> float:
    """Largest |vLLM logprob - transformers logprob| over every token of a phase."""
    worst = 0.0
    for g in result["phases"][phase]["groups"]:
        for s in g["samples"]:
            ref = forward_logprobs(model_dir, g["prompt_ids"], s["response_ids"], temperature)
            worst = max(worst, float(np.abs(np.asarray(s["response_logprobs"]) - ref).max()))
    return worst


def test_groups_have_n_samples_within_limits(rollout: dict[str, Any]) -> None:
    """n samples per prompt, 1..max_tokens tokens, finite logprobs <= 0 aligned with tokens, EOS only last."""
    for phase in rollout["phases"]:
        assert len(phase["groups"]) == 4
        for g in phase["groups"]:
            assert len(g["samples"]) == rollout["n"]
            for s in g["samples"]:
                ids, lp = s["response_ids"], np.asarray(s["response_logprobs"])
                assert 1 <= len(ids) <= rollout["max_new_tokens"] and lp.shape == (len(ids),)
                assert np.isfinite(lp).all() and (lp <= 0).all()
                assert all(0 <= t < VOCAB for t in ids)
                if s["finish_reason"] == "stop":
                    assert ids[-1] == EOS and EOS not in ids[:-1]
                else:
                    assert s["finish_reason"] == "length" and len(ids) == rollout["max_new_tokens"]
                    assert EOS not in ids


def test_logprobs_match_transformers_at_the_sampling_temperature(rollout: dict[str, Any]) -> None:
    """vLLM processed logprobs == log_softmax(logits/T) of the same weights within TOL, != at T=1."""
    t = rollout["temperature"]
    assert max_error(rollout, 0, rollout["model_a"], t) < TOL
    assert max_error(rollout, 0, rollout["model_a"], 1.0) > 0.1


def test_load_weights_switches_the_policy_in_place(rollout: dict[str, Any]) -> None:
    """After load_weights(b) the samples follow policy b (within TOL) and clearly not policy a."""
    t = rollout["temperature"]
    assert max_error(rollout, 1, rollout["model_b"], t) < TOL
    assert max_error(rollout, 1, rollout["model_a"], t) > 0.1
    before = [s["response_ids"] for g in rollout["phases"][0]["groups"] for s in g["samples"]]
    after = [s["response_ids"] for g in rollout["phases"][1]["groups"] for s in g["samples"]]
    assert before != after


def test_units_in_the_store_hold_exactly_the_generated_groups(rollout: dict[str, Any]) -> None:
    """The sealed units carry the adapter's ids, logprobs, versions and the prompt's image once."""
    reader = LocalReader([rollout["store_dir"]])
    for phase in rollout["phases"]:
        unit = reader.unit("vllm-test", phase["unit"]["unit_id"])
        samples = [s for g in phase["groups"] for s in g["samples"]]
        assert unit.traj.column("response_ids").to_pylist() == [s["response_ids"] for s in samples]
        got = np.concatenate([np.asarray(x, np.float32) for x in unit.traj.column("response_logprobs").to_pylist()])
        want = np.concatenate([np.asarray(s["response_logprobs"], np.float32) for s in samples])
        np.testing.assert_array_equal(got, want)
        assert set(unit.traj.column("version_start").to_pylist()) == {phase["version"]}
        assert unit.media.column("media_hash").to_pylist() == [bytes.fromhex(rollout["image_hash"])]
        assert phase["groups"][0]["media"] == [rollout["image_hash"]]
        assert [g["media"] for g in phase["groups"][1:]] == [[], [], []]
        assert [g["num_trajectories"] for g in phase["unit"]["groups"]] == [rollout["n"]] * 4


def _completion(token_ids: list[int], logprobs: Any, finish_reason: str | None = "length") -> Any:
    """A real ``vllm.CompletionOutput`` as the engine builds it."""
    from vllm.outputs import CompletionOutput

    return CompletionOutput(
        index=0, text="", token_ids=token_ids, cumulative_logprob=None, logprobs=logprobs, finish_reason=finish_reason
    )


def _request(prompt: list[int], outputs: list[Any], finished: bool = True) -> Any:
    """A real ``vllm.RequestOutput``."""
    from vllm.outputs import RequestOutput

    return RequestOutput(
        request_id="r0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None, outputs=outputs, finished=finished
    )


def test_adapter_reads_list_and_flat_logprobs_alike() -> None:
    """The sampled token's logprob is found in list-of-dict and FlatLogprobs layouts (incl. top-k extras)."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from knittrans.rollout.adapters.vllm import group_from_request_output
    from knittrans.rollout.generated import PromptRequest

    positions = [{7: Logprob(-0.5, rank=2), 3: Logprob(-0.25, rank=1)}, {EOS: Logprob(-1.5, rank=1)}]
    flat = FlatLogprobs()
    flat.extend(positions)
    prompt = PromptRequest(prompt_ids=np.array([1, 2]))
    for lp in (positions, flat):
        g = group_from_request_output(_request([1, 2], [_completion([7, EOS], lp, "stop")]), prompt)
        assert g.samples[0].response_ids.tolist() == [7, EOS]
        assert g.samples[0].response_logprobs.tolist() == [-0.5, -1.5]
        assert [s.finish_reason for s in g.samples] == ["stop"]


def test_adapter_rejects_unusable_outputs() -> None:
    """Aborted or unfinished requests, missing logprobs and a different prompt are clear errors."""
    from vllm.logprobs import Logprob

    from knittrans.errors import InvalidRequest
    from knittrans.rollout.adapters.vllm import group_from_request_output
    from knittrans.rollout.generated import PromptRequest

    prompt = PromptRequest(prompt_ids=np.array([1, 2]))
    ok = [{4: Logprob(-0.1)}]
    with pytest.raises(InvalidRequest, match="finish_reason 'abort'"):
        group_from_request_output(_request([1, 2], [_completion([4], ok, "abort")]), prompt)
    with pytest.raises(InvalidRequest, match="not finished"):
        group_from_request_output(_request([1, 2], [_completion([4], ok, None)], finished=False), prompt)
    with pytest.raises(InvalidRequest, match="logprobs=0"):
        group_from_request_output(_request([1, 2], [_completion([4], None)]), prompt)
    with pytest.raises(InvalidRequest, match="no logprob for sampled token 5"):
        group_from_request_output(_request([1, 2], [_completion([5], ok)]), prompt)
    with pytest.raises(InvalidRequest, match="prompt token ids differ"):
        group_from_request_output(_request([9], [_completion([4], ok)]), prompt)


def test_media_go_to_multi_modal_data_only_for_the_vlm() -> None:
    """vllm_prompt keeps media out of a text-only model; the VLM gets compact ids and its images as PIL images."""
    from PIL import Image

    from knittrans.rollout.adapters.vllm import vllm_prompt
    from knittrans.rollout.generated import PromptRequest
    from knittrans.rollout.vlm import VLMLayout, image_prompt_ids
    from knittrans.schema import Media

    img = Media(kind="image", data=np.zeros((4, 4, 3), np.uint8))
    req = PromptRequest(prompt_ids=np.array([1, 2]), media=(img,))
    assert vllm_prompt(req) == {"prompt_token_ids": [1, 2]}
    layout = VLMLayout(
        eos_token_id=256, fake_token_id=257, image_token_id=258, global_token_id=259, tokens_per_image=2, image_size=4
    )
    two = PromptRequest(
        prompt_ids=image_prompt_ids(layout, [1, 2], 2), media=(img, img, Media(kind="audio", data=b"x"))
    )
    mm = vllm_prompt(two, layout)
    assert mm["prompt_token_ids"] == [258, 258, 1, 2]
    assert [im.size for im in mm["multi_modal_data"]["image"]] == [(4, 4), (4, 4)] and list(mm["multi_modal_data"]) == [
        "image"
    ]
    one = vllm_prompt(PromptRequest(prompt_ids=image_prompt_ids(layout, [1], 1), media=(img,)), layout)
    assert isinstance(one["multi_modal_data"]["image"], Image.Image)
