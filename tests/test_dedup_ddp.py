"""DedupEncoder over 2 gloo ranks (CPU processes): grads equal the single-process run; ranks tear gloo down cleanly.

Import order matters here: ``torch.distributed.nn.functional`` binds ``group.WORLD`` as default
arguments when it is imported, and DDP imports it lazily (through ``torch._dynamo``) the first
time one is built. Imported after ``init_process_group``, those defaults hold the default
ProcessGroup for good: ``destroy_process_group()`` cannot free it, gloo's worker threads live on
into interpreter finalization, and a worker that drops the last reference to a collective's tensor
then (a tensor Python had released, kept for the worker) waits for the GIL and is ended by CPython
with ``pthread_exit``; the forced unwind through a ``noexcept`` destructor aborts the process:
"terminate called without an active exception", SIGABRT, no Python frame on the stack. Imported
here, before any process group exists, the defaults are ``None``; every rank checks that no gloo
thread is left after ``destroy_process_group()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any process group exists: see the module docstring
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from knittrans.demo.grpo import grpo_loss
from knittrans.demo.policy import packed_response_logprobs
from knittrans.rollout.vlm import VisionTower, VLMLayout, build_tiny_vlm, image_prompt_ids, load_image_processor
from knittrans.rollout.vlm import pixel_values as preprocess
from knittrans.trainer.dedup import DedupEncoder, all_reduce_gradients

DIM = 6
VOCAB = 7
WORLD = 2

Micro = list[tuple[tuple[str, ...], list[int]]]  # (media hashes, tokens) per trajectory

# Per step and rank: micro-batches of trajectories. Media repeat within a micro-batch, across micro-batches
# and across ranks; ranks have different numbers of micro-batches; in step "no_media" rank 1 has none.
STEPS: dict[str, dict[int, list[Micro]]] = {
    "shared": {
        0: [[(("A",), [1, 2, 3]), (("A", "B"), [4, 5])], [(("B",), [6, 1, 2, 3]), ((), [2, 2])]],
        1: [[(("C",), [3, 1]), (("A",), [5, 4, 3])], [(("C", "C"), [1, 6])], [((), [0, 1, 2])]],
    },
    "no_media": {
        0: [[(("A",), [1, 2, 3]), (("A",), [4, 5])], [(("B",), [6, 1])]],
        1: [[((), [3, 1, 2])]],
    },
}
# (step, mode, layout): "separate" = DDP backbone + all_reduce_gradients(encoder);
# "joint" = encoder and backbone in one DDP module, no_sync for every micro-batch, then all-reduce all.
RUNS = [
    ("shared", "keep_graph", "separate"),
    ("shared", "recompute", "separate"),
    ("no_media", "keep_graph", "separate"),
    ("shared", "recompute", "joint"),
]


class Encoder(nn.Module):
    """Linear patch encoder: a 2x4x4 uint8 image -> 2 tokens of DIM."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(16, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.out.weight.dtype).flatten(2) / 255.0  # [n, 2, 16]
        return self.out(torch.tanh(self.patch(x)))


class Backbone(nn.Module):
    """Causal LM over [image tokens; text]; forward takes a whole micro-batch and returns its summed loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, feats: torch.Tensor, micro: Micro) -> torch.Tensor:
        loss = torch.zeros((), dtype=self.head.weight.dtype)
        offset = 0
        for hashes, tokens in micro:
            ids = torch.tensor(tokens)
            image_tokens = feats[offset : offset + len(hashes)].reshape(-1, DIM)
            offset += len(hashes)
            x = torch.cat([image_tokens, self.embed(ids)])
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            h = x + F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            loss = loss + F.cross_entropy(self.head(h[len(image_tokens) : -1]), ids[1:], reduction="sum")
        return loss


class Joint(nn.Module):
    """Encoder and backbone in one module (the 'one DDP module' layout)."""

    def __init__(self, encoder: Encoder, backbone: Backbone) -> None:
        super().__init__()
        self.encoder = encoder
        self.backbone = backbone

    def forward(self, feats: torch.Tensor, micro: Micro) -> torch.Tensor:
        return self.backbone(feats, micro)


def image(media_hash: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(ord(media_hash))
    return torch.randint(0, 256, (2, 4, 4), generator=gen, dtype=torch.uint8)


def fresh_models() -> tuple[Encoder, Backbone]:
    torch.manual_seed(0)
    return Encoder().double(), Backbone().double()


def global_tokens(step: str) -> float:
    return float(sum(len(t) - 1 for mbs in STEPS[step].values() for mb in mbs for _, t in mb))


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}


def rank_step(rank: int, step: str, mode: str, layout: str) -> dict[str, torch.Tensor]:
    """One mini-batch on this rank with dedup; returns the synchronised grads of encoder and backbone."""
    enc, lm = fresh_models()
    micro_batches = STEPS[step][rank]
    norm = global_tokens(step)
    if layout == "separate":
        backbone: nn.Module = DDP(lm)
        sync_ctx = backbone
        dedup = DedupEncoder(enc, mode=mode)  # type: ignore[arg-type]
    else:
        joint = DDP(Joint(enc, lm))
        backbone = sync_ctx = joint
        dedup = DedupEncoder(joint.module.encoder, mode=mode)  # type: ignore[arg-type]
    dedup.begin_mini_batch()
    for i, micro in enumerate(micro_batches):
        hashes = [h for hs, _ in micro for h in hs]
        last = i == len(micro_batches) - 1
        # separate: backbone all-reduces on the last micro-batch; joint: never inside DDP.
        ctx = nullcontext() if (last and layout == "separate") else sync_ctx.no_sync()  # type: ignore[operator]
        with ctx:
            feats = dedup.features(hashes, media={h: image(h) for h in hashes})
            (backbone(feats, micro) / norm).backward()
    dedup.finish()
    all_reduce_gradients(enc.parameters() if layout == "separate" else backbone.parameters())
    return {**{f"enc.{k}": v for k, v in grads(enc).items()}, **{f"lm.{k}": v for k, v in grads(lm).items()}}


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (the transport loop, the process group's workers)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return [n for n in names if "gloo" in n]


def run_rank(rank: int, init_file: str, out_dir: str, step: Callable[[int], dict[str, Any]]) -> None:
    """Init gloo, run ``step``, destroy the group, save the results with the gloo threads still alive."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        results = step(rank)
    finally:
        dist.destroy_process_group()
    results["gloo_threads_after_destroy"] = gloo_threads()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def toy_step(rank: int) -> dict[str, Any]:
    return {f"{s}/{m}/{lay}": rank_step(rank, s, m, lay) for s, m, lay in RUNS}


def worker(rank: int, init_file: str, out_dir: str) -> None:
    run_rank(rank, init_file, out_dir, toy_step)


def duplicated_baseline(step: str) -> dict[str, torch.Tensor]:
    """Single process, every trajectory encodes its own copy of each image, over both ranks' data."""
    enc, lm = fresh_models()
    norm = global_tokens(step)
    for rank in range(WORLD):
        for micro in STEPS[step][rank]:
            parts: Sequence[torch.Tensor] = [enc(image(h)[None]) for hs, _ in micro for h in hs]
            feats = torch.cat(list(parts)) if parts else torch.empty((0, 2, DIM), dtype=torch.float64)
            (lm(feats, micro) / norm).backward()
    return {**{f"enc.{k}": v for k, v in grads(enc).items()}, **{f"lm.{k}": v for k, v in grads(lm).items()}}


def spawn(fn: Callable[..., None], tmp_path: Path, *args: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, init, out, *args)`` in 2 spawned processes (exit 0 required); each rank's results."""
    mp.start_processes(fn, args=(str(tmp_path / "init"), str(tmp_path), *args), nprocs=WORLD, start_method="spawn")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, results in enumerate(per_rank):
        assert results.pop("gloo_threads_after_destroy") == [], f"rank {rank}: gloo outlived destroy_process_group"
    return per_rank


@pytest.mark.timeout(180)
def test_ddp_gloo_two_ranks_match_duplicated_baseline(tmp_path: Path) -> None:
    """Both layouts, both modes and a rank without media: every rank's grads equal the baseline / world size."""
    per_rank = spawn(worker, tmp_path)
    for step, mode, layout in RUNS:
        key = f"{step}/{mode}/{layout}"
        expected = {k: v / WORLD for k, v in duplicated_baseline(step).items()}  # DDP averages over ranks
        for rank in range(WORLD):
            assert_close(per_rank[rank][key], expected, msg=lambda m, k=key, r=rank: f"{k} rank {r}: {m}")


# ---------------------------------------------------------------------------------------------- the VLM
@dataclass(frozen=True)
class Row:
    """One trajectory of the VLM case: prompt (with its image blocks), response, images, advantage, logprob shift."""

    prompt: np.ndarray
    response: np.ndarray
    images: tuple[str, ...]
    advantage: float
    shift: np.ndarray


# Per rank, micro-batches of rows (image names per row): images shared within and across micro-batches on
# rank 0; rank 1 has no image at all, so the vision tower's gradient reaches it only through the all-reduce.
VLM_SPEC: dict[int, list[list[tuple[str, ...]]]] = {
    0: [[("x",), ("x",), ("y",)], [("x", "y"), ("y",)]],
    1: [[(), ()], [()]],
}


def vlm_data(layout: VLMLayout, processor: Any) -> tuple[dict[int, list[list[Row]]], dict[str, torch.Tensor]]:
    """The rows of both ranks and the preprocessed float64 pixels of each image (the same in every process)."""
    rng = np.random.default_rng(21)
    pixels = {name: preprocess(processor, [rng.integers(0, 256, (3, 90, 120), dtype=np.uint8)]) for name in "xy"}
    suppressed = set(layout.suppressed_token_ids)
    allowed = np.array([t for t in range(256) if t not in suppressed])
    rows: dict[int, list[list[Row]]] = {}
    for rank, micro_batches in VLM_SPEC.items():
        rows[rank] = []
        for micro in micro_batches:
            out = []
            for images in micro:
                text = rng.integers(0, 255, 3)
                n = int(rng.integers(3, 7))
                out.append(
                    Row(
                        prompt=image_prompt_ids(layout, text, len(images)).astype(np.int64) if images else text,
                        response=rng.choice(allowed, n),
                        images=images,
                        advantage=float(rng.standard_normal()),
                        shift=rng.normal(0.0, 0.05, n),
                    )
                )
            rows[rank].append(out)
    return rows, {k: v[0].double() for k, v in pixels.items()}


def vlm_micro_loss(
    model: nn.Module, layout: VLMLayout, rows: list[Row], feats: torch.Tensor | None, normaliser: float
) -> torch.Tensor:
    """The demo trainer's GRPO loss of one micro-batch (old logprobs = current + a fixed shift)."""
    width = max(len(r.prompt) + len(r.response) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r.prompt) + len(r.response)] = torch.from_numpy(np.concatenate([r.prompt, r.response]))
        mask[i, : len(r.prompt) + len(r.response)] = 1
    response_lens = torch.tensor([len(r.response) for r in rows])
    logprobs = packed_response_logprobs(
        model,
        ids,
        mask,
        torch.tensor([len(r.prompt) for r in rows]),
        response_lens,
        image_features=feats,
        layout=layout,
    )
    old = logprobs.detach() + torch.from_numpy(np.concatenate([r.shift for r in rows]))
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float64).repeat_interleave(response_lens)
    return grpo_loss(logprobs, old, advantages, torch.ones_like(old), normaliser=normaliser)


def load_vlm(model_dir: str) -> tuple[nn.Module, VLMLayout, Any]:
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64).train()
    return model, VLMLayout.from_dir(model_dir), load_image_processor(model_dir)


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def vlm_worker(rank: int, init_file: str, out_dir: str, model_dir: str) -> None:
    run_rank(rank, init_file, out_dir, lambda r: vlm_rank_step(r, model_dir))


def vlm_rank_step(rank: int, model_dir: str) -> dict[str, Any]:
    """What ``knittrans train`` does per mini-batch: vision tower through DedupEncoder, then one all-reduce."""
    from knittrans.demo.rank import Policy

    model, layout, processor = load_vlm(model_dir)
    policy = Policy(backbone=model, encoder=VisionTower(model), layout=layout, image_processor=processor)
    rows, pixels = vlm_data(layout, processor)
    normaliser = sum(len(mb) for mbs in rows.values() for mb in mbs) / WORLD  # N / W, as train_mini_batch
    dedup = DedupEncoder(policy.encoder)
    dedup.begin_mini_batch()
    for micro in rows[rank]:
        hashes = [h for r in micro for h in r.images]
        feats = dedup.features(hashes, media={h: pixels[h] for h in hashes if h not in dedup}) if hashes else None
        vlm_micro_loss(model, layout, micro, feats, normaliser).backward()  # type: ignore[no-untyped-call]
    stats = dedup.finish()
    all_reduce_gradients(policy.parameters())
    return {"grads": param_grads(model), "unique_media": stats.unique_media, "encoded_rows": policy.encoded_rows}


@pytest.mark.timeout(300)
def test_vlm_two_ranks_one_without_images_match_single_process_float64(tmp_path: Path) -> None:
    """VLM vision tower via DedupEncoder + all_reduce_gradients, rank 1 imageless: grads = one process, float64."""
    model_dir = build_tiny_vlm(tmp_path / "vlm", seed=0)
    per_rank = spawn(vlm_worker, tmp_path, str(model_dir))
    model, layout, processor = load_vlm(str(model_dir))
    tower = VisionTower(model)
    rows, pixels = vlm_data(layout, processor)
    total = sum(len(mb) for mbs in rows.values() for mb in mbs)
    for rank in range(WORLD):  # every image encoded once per use
        for micro in rows[rank]:
            hashes = [h for r in micro for h in r.images]
            feats = tower(torch.stack([pixels[h] for h in hashes])) if hashes else None
            vlm_micro_loss(model, layout, micro, feats, float(total)).backward()  # type: ignore[no-untyped-call]
    expected = param_grads(model)
    vision = "model.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert float(expected[vision].abs().max()) > 1e-6  # the vision tower does get a gradient
    assert per_rank[0]["unique_media"] == 2 and per_rank[0]["encoded_rows"] == 2  # x and y, once each
    assert per_rank[1]["unique_media"] == 0 and per_rank[1]["encoded_rows"] == 0
    for rank in range(WORLD):
        assert_close(per_rank[rank]["grads"], expected, rtol=1e-9, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")
