"""The tiny Idefics3 VLM end to end on CPU: transformers rollout conditions on images, the trainer agrees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from knittrans.demo.policy import packed_response_logprobs
from knittrans.errors import InvalidRequest
from knittrans.local import LocalCluster
from knittrans.procs import free_port, knittrans_command, wait_until
from knittrans.rollout.engines import HFEngine
from knittrans.rollout.generated import GeneratedGroup, PromptRequest, to_trajectory_group
from knittrans.rollout.vlm import (
    TinyVLMSpec,
    VisionTower,
    VLMLayout,
    build_tiny_vlm,
    image_prompt_ids,
    load_image_processor,
    pixel_values,
)
from knittrans.rollout.worker import SourceProfile
from knittrans.schema import Media
from knittrans.trainer.dedup import DedupEncoder
from tests.trainer_support import job_spec, write_and_register


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny VLM (text hidden 128, 2-layer vision tower, 112 px images, 16 tokens per image)."""
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), seed=0)


@pytest.fixture(scope="module")
def engine(vlm_dir: Path) -> HFEngine:
    """The transformers engine on the VLM."""
    return HFEngine(vlm_dir)


def _image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    return rng.integers(0, 256, (3, h, w), dtype=np.uint8)


def _requests(layout: VLMLayout, seed: int = 0) -> list[PromptRequest]:
    """Two images of different sizes, a text-only prompt, and a one-image prompt (HWC layout)."""
    rng = np.random.default_rng(seed)
    a, b = _image(rng, 96, 128), _image(rng, 150, 100)
    c = np.moveaxis(_image(rng, 80, 64), 0, -1)
    return [
        PromptRequest(
            prompt_ids=image_prompt_ids(layout, [1, 2, 3, 4], 2),
            media=(Media(kind="image", data=a), Media(kind="image", data=b)),
        ),
        PromptRequest(prompt_ids=np.array([5, 6, 7], dtype=np.int32)),
        PromptRequest(prompt_ids=image_prompt_ids(layout, [9, 8], 1), media=(Media(kind="image", data=c),)),
    ]


def _trainer_logprobs(
    model: Any, layout: VLMLayout, processor: Any, group: GeneratedGroup, images: list[Any]
) -> list[np.ndarray]:
    """The trainer's logprobs of each sample (``packed_response_logprobs`` with the policy's vision tower)."""
    out = []
    with torch.no_grad():
        feats = VisionTower(model)(pixel_values(processor, images)) if images else None
        for s in group.samples:
            ids = torch.from_numpy(np.concatenate([group.prompt_ids, s.response_ids])).long()[None]
            lp = packed_response_logprobs(
                model,
                ids,
                torch.ones_like(ids),
                torch.tensor([group.prompt_ids.shape[0]]),
                torch.tensor([s.num_tokens]),
                image_features=feats,
                layout=layout,
            )
            out.append(lp.numpy())
    return out


def test_layout_blocks_compact_and_bad_prompts(vlm_dir: Path) -> None:
    """One block per image before the text; vLLM's compact form collapses each block; stray tokens are refused."""
    layout = VLMLayout.from_dir(vlm_dir)
    assert layout.tokens_per_image == TinyVLMSpec().tokens_per_image == 16
    ids = image_prompt_ids(layout, [7, 8], 2)
    assert ids.shape[0] == 2 * (layout.tokens_per_image + 3) + 2
    assert layout.count_images(ids) == 2
    assert layout.compact_ids(ids) == [layout.image_token_id, layout.image_token_id, 7, 8]
    with pytest.raises(InvalidRequest, match="image-structure token"):
        layout.compact_ids([layout.image_token_id, 1])
    with pytest.raises(InvalidRequest, match="byte tokens"):
        image_prompt_ids(layout, [layout.eos_token_id], 1)
    tok = json.loads((vlm_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert added["<image>"] == layout.image_token_id and added["<end_of_utterance>"] == layout.eos_token_id


def test_hf_rollout_conditions_on_images_and_trainer_logprobs_agree(engine: HFEngine, vlm_dir: Path) -> None:
    """Shared images, 2 per prompt, mixed sizes: trainer logprobs equal the rollout's; a wrong image breaks them."""
    layout = VLMLayout.from_dir(vlm_dir)
    processor = load_image_processor(vlm_dir)
    requests = _requests(layout)
    groups = engine.generate(requests, 3, 8, 1.0, seed=5)
    worst = 0.0
    suppressed = set(layout.suppressed_token_ids)
    for g, r in zip(groups, requests, strict=True):
        assert g.media == r.media and g.n == 3
        images = [m.data for m in r.media]
        for s, lp in zip(g.samples, _trainer_logprobs(engine.model, layout, processor, g, images), strict=True):
            assert not suppressed & set(s.response_ids.tolist())
            worst = max(worst, float(np.abs(lp - s.response_logprobs).max()))
    assert worst < 2e-4
    rng = np.random.default_rng(99)
    wrong = [_image(rng, 112, 112), _image(rng, 112, 112)]
    gap = max(
        float(np.abs(lp - s.response_logprobs).max())
        for lp, s in zip(
            _trainer_logprobs(engine.model, layout, processor, groups[0], wrong), groups[0].samples, strict=True
        )
    )
    assert gap > 50 * max(worst, 1e-6), (gap, worst)
    with pytest.raises(InvalidRequest, match="image blocks"):
        engine.generate([PromptRequest(prompt_ids=requests[0].prompt_ids)], 1, 2, 1.0, seed=0)


def test_images_change_the_samples(engine: HFEngine, vlm_dir: Path) -> None:
    """Same ids and seed, other image: other samples (the engine really conditions on the pixels)."""
    layout = VLMLayout.from_dir(vlm_dir)
    rng = np.random.default_rng(3)
    ids = image_prompt_ids(layout, [1, 2, 3], 1)
    first, second = (
        engine.generate([PromptRequest(prompt_ids=ids, media=(Media(kind="image", data=im),))], 4, 8, 1.0, seed=1)[0]
        for im in (_image(rng, 112, 112), _image(rng, 112, 112))
    )
    assert any(
        not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(first.samples, second.samples, strict=True)
    )


def test_load_weights_reloads_vision_and_language(vlm_dir: Path, tmp_path: Path) -> None:
    """A weights file of another seed replaces the vision tower and the text model of the engine."""
    other = build_tiny_vlm(tmp_path / "other", seed=1)
    engine = HFEngine(vlm_dir)
    engine.load_weights(other / "model.safetensors")
    state = load_file(str(other / "model.safetensors"))
    own = engine.model.state_dict()
    for name in (
        "model.vision_model.encoder.layers.0.self_attn.q_proj.weight",
        "model.connector.modality_projection.proj.weight",
        "model.text_model.layers.0.mlp.up_proj.weight",
    ):
        assert torch.equal(own[name], state[name]), name


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_dedup_gradients_equal_per_row_encoding_in_float64(vlm_dir: Path, mode: str) -> None:
    """The real vision tower in float64: one encode per unique image gives the per-row gradients to 1e-10."""
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(vlm_dir), dtype=torch.float64)
    tower = VisionTower(model)
    processor = load_image_processor(vlm_dir)
    rng = np.random.default_rng(0)
    images = {f"h{i}": pixel_values(processor, [_image(rng, 90 + 10 * i, 120)])[0].double() for i in range(3)}
    # 3 micro-batches; group-shared images are used many times, one micro-batch has two uses of h0
    micro = [["h0", "h1", "h0"], ["h1", "h2"], ["h0"]]
    proj = torch.from_numpy(rng.standard_normal((128,))).double()

    def loss_of(feats: torch.Tensor, k: int) -> torch.Tensor:
        return (torch.tanh(feats @ proj) * (k + 1)).sum()

    params = [p for p in tower.parameters()]
    dedup = DedupEncoder(tower, mode=mode)  # type: ignore[arg-type]
    dedup.begin_mini_batch(images)
    for k, hashes in enumerate(micro):
        loss_of(dedup.features(hashes), k).backward()
    stats = dedup.finish()
    assert stats.unique_media == 3 and stats.uses == 6 and stats.encoder_calls == 1
    got = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    for k, hashes in enumerate(micro):
        loss_of(tower(torch.stack([images[h] for h in hashes])), k).backward()
    worst = max(float((g - p.grad).abs().max()) for g, p in zip(got, params, strict=True))  # type: ignore[operator]
    assert worst <= 1e-10
    assert max(float(g.abs().max()) for g in got) > 1e-6  # the gradients are not trivially zero


def test_packed_logprobs_equal_the_models_own_forward_in_float64(vlm_dir: Path) -> None:
    """float64 VLM: padded, batched logprobs with VisionTower features equal Idefics3's own per-row forward to 1e-12."""
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(vlm_dir), dtype=torch.float64).eval()
    layout = VLMLayout.from_dir(vlm_dir)
    processor = load_image_processor(vlm_dir)
    rng = np.random.default_rng(4)
    allowed = np.array([t for t in range(256) if t not in set(layout.suppressed_token_ids)])
    rows = []  # (prompt ids, response ids, images): two images, text only, one image
    for count, text, resp in ((2, 4, 7), (0, 6, 3), (1, 2, 5)):
        images = [_image(rng, 96 + 8 * i, 112) for i in range(count)]
        prompt = image_prompt_ids(layout, rng.integers(0, 255, text), count) if count else rng.integers(0, 255, text)
        rows.append((np.asarray(prompt, dtype=np.int64), rng.choice(allowed, resp), images))
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r, _) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.from_numpy(np.concatenate([p, r]))
        mask[i, : len(p) + len(r)] = 1
    pixels = [pixel_values(processor, images).double() for _, _, images in rows if images]
    with torch.no_grad():
        feats = VisionTower(model)(torch.cat(pixels))
        got = packed_response_logprobs(
            model,
            ids,
            mask,
            torch.tensor([len(p) for p, _, _ in rows]),
            torch.tensor([len(r) for _, r, _ in rows]),
            image_features=feats,
            layout=layout,
        )
        expected = []
        for p, r, images in rows:
            row = torch.from_numpy(np.concatenate([p, r]))[None]
            extra = {"pixel_values": pixel_values(processor, images).double()[None]} if images else {}
            logits = model(input_ids=row, attention_mask=torch.ones_like(row), **extra).logits[0]
            logits[:, list(layout.suppressed_token_ids)] = float("-inf")
            logp = torch.log_softmax(logits, dim=-1)
            expected.append(logp[torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.from_numpy(r)])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.cat(expected), rtol=0, atol=1e-12)


def test_source_profile_images_per_prompt_and_size_ranges() -> None:
    """``image=3x64-160x80:images=2``: two images per prompt, heights drawn from a range."""
    p = SourceProfile.parse("mm:4-8:8-16:image=3x64-160x80:images=2")
    assert p.images == 2 and p.image_shape == (3, 160, 80) and p.image_min_shape == (3, 64, 80)
    with pytest.raises(InvalidRequest):
        SourceProfile.parse("mm:4-8:8-16:image=3x64:images=0")


def test_images_of_every_accepted_layout_become_rgb() -> None:
    """``image_to_pil``: ``HxW``, ``1xHxW`` (a grey image, e.g. a source's ``image=1x8x8``), ``CxHxW`` and
    ``HxWxC`` are RGB images of the same size; other dtypes and channel counts are refused by name."""
    from knittrans.rollout.vlm import image_to_pil

    for shape in ((8, 6), (1, 8, 6), (3, 8, 6), (8, 6, 4), (8, 6, 1)):
        im = image_to_pil(np.full(shape, 200, np.uint8))
        assert (im.mode, im.size, im.getpixel((0, 0))) == ("RGB", (6, 8), (200, 200, 200)), shape
    with pytest.raises(InvalidRequest, match="uint8"):
        image_to_pil(np.zeros((8, 6), np.float32))
    with pytest.raises(InvalidRequest, match="not HxW"):
        image_to_pil(np.zeros((8, 6, 5), np.uint8))


def test_tiny_model_shapes_that_cannot_be_built_are_refused_by_name(tmp_path: Path) -> None:
    """``TinyVLMSpec`` and ``build_tiny_qwen2`` name the bad size before anything is written."""
    from knittrans.rollout.models import build_tiny_qwen2

    def qwen2(**bad: Any) -> None:
        build_tiny_qwen2(tmp_path / "m", **bad)

    for build, bad, words in (
        (TinyVLMSpec, {"layers": 0}, "layers must be positive"),
        (TinyVLMSpec, {"hidden": 96}, "multiple of 64"),
        (TinyVLMSpec, {"image_size": 100}, "patch_size"),
        (TinyVLMSpec, {"vision_heads": 3}, "vision_heads"),
        (qwen2, {"heads": 0}, "heads must be positive"),
        (qwen2, {"vocab_size": 1}, "at least 2"),
        (qwen2, {"hidden": 100}, "heads\\*head_dim"),
        (qwen2, {"init_std": 0.0}, "init_std"),
    ):
        with pytest.raises(ValueError, match=words):
            build(**bad)
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------------------------------- two ranks
def test_two_ranks_grpo_on_the_vlm_match_rollout_logprobs(
    cluster: LocalCluster, engine: HFEngine, vlm_dir: Path, tmp_path: Path
) -> None:
    """Rollout-generated image groups, 2 gloo ranks: first step on-policy (gap < 2e-4), one encode per image."""
    layout = VLMLayout.from_dir(vlm_dir)
    rng = np.random.default_rng(7)
    requests = []
    for g in range(4):
        count = 1 + g % 2  # 1 or 2 images per prompt, shared by the group's 4 samples
        media = tuple(Media(kind="image", data=_image(rng, 80 + 16 * g, 112)) for _ in range(count))
        requests.append(PromptRequest(prompt_ids=image_prompt_ids(layout, rng.integers(0, 255, 5), count), media=media))
    generated = engine.generate(requests, 4, 6, 1.0, seed=11)
    groups = [
        to_trajectory_group(
            gen, group_id=f"v{i}", source="mm", rewards=[0.1, 0.9, 0.4, 0.6], version_start=0, version_end=0
        )
        for i, gen in enumerate(generated)
    ]
    job = "vlmjob"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=4, k=1, world_size=2, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, groups)
    port = free_port()
    outs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    for r in range(2):
        argv = cluster.train_args(
            job,
            rank=r,
            world_size=2,
            model_dir=vlm_dir,
            out=outs[r],
            weights_dir=tmp_path / "weights",
            dist_url=f"tcp://127.0.0.1:{port}",
        )
        argv += ["--lr", "1e-3", "--threads", "1"]
        cluster.procs.start(f"vrank-{r}", knittrans_command(*argv))
    procs = [cluster.procs.children[f"vrank-{r}"] for r in range(2)]
    wait_until(
        lambda: all(p.poll() is not None for p in procs), timeout_s=180, what="both ranks to exit", interval_s=0.2
    )
    for r, p in enumerate(procs):
        assert p.returncode == 0, cluster.procs.log_tail(f"vrank-{r}", 60)
    records = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    assert len(records) == 2
    for rec in records:
        assert rec["policy_version"] == 0
        assert rec["max_logprob_gap"] < 2e-4, rec
        assert rec["image_rows"] == rec["rows"] == 8
        assert rec["encoded_rows"] == rec["unique_media"] <= rec["media_uses"]
    assert sum(r["unique_media"] for r in records) == 6  # 1+2+1+2 images, each encoded once on its rank
    assert sum(r["media_uses"] for r in records) == 24  # every row uses its group's images
    new = load_file(str(tmp_path / "weights" / "policy-v1.safetensors"))
    old = load_file(str(vlm_dir / "model.safetensors"))
    name = "model.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(new[name], old[name])  # the vision tower was trained
