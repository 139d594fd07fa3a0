"""One data-parallel trainer rank: GRPO on a tiny multimodal policy, fed by :class:`TrainerClient`."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from knittrans.demo.grpo import grpo_loss
from knittrans.demo.policy import TinyVisionEncoder, packed_response_logprobs
from knittrans.errors import InvalidRequest, KnitTransError
from knittrans.rollout.vlm import VisionTower, VLMLayout, is_vlm, load_image_processor, pixel_values
from knittrans.trainer.client import MiniBatch, TrainerClient, TrainerConfig, TrainMicroBatch
from knittrans.trainer.convert import pad_sequences
from knittrans.trainer.dedup import DedupEncoder, all_reduce_gradients

__all__ = ["Policy", "RankConfig", "load_policy", "micro_batch_loss", "run_rank", "save_weights", "train_mini_batch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """Everything one ``knittrans train`` process needs: its client's settings plus the training ones."""

    client: TrainerConfig
    """Control plane, job, rank, world size, tokens, fetch mode and timeouts of the rank's client."""
    model_dir: Path
    """A saved transformers causal LM (e.g. from ``build_tiny_qwen2``)."""
    dist_url: str | None = None
    """``tcp://HOST:PORT`` for the gloo process group; None only with ``world_size == 1``."""
    weights_dir: Path | None = None
    """Rank 0 writes ``policy-v{n}.safetensors`` here after each optimizer step (None: don't)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    image_channels: int = 3
    """Channels of the images the vision encoder takes."""
    dedup: bool = True
    """Encode each unique media once per mini-batch (False: once per reference)."""
    out: Path | None = None
    """JSON-lines file, one record per mini-batch."""
    min_step_s: float = 0.0
    """Pad every mini-batch to at least this many seconds before its ack (emulates a heavier model, e.g. the
    slow-trainer scenario of the admission-timing proof); 0 trains at the tiny model's own speed."""

    def __post_init__(self) -> None:
        if self.client.world_size > 1 and not self.dist_url:
            raise ValueError("world_size > 1 needs dist_url (tcp://HOST:PORT) for the gloo process group")
        if self.client.world_size > 1 and self.client.group != "auto":
            raise ValueError("world_size > 1 needs the ranks to share the control plane (group 'auto')")
        if self.client.fetch_timeout_s is None:
            raise ValueError("a trainer rank needs a fetch_timeout_s (a dead store host must raise, not block)")
        if self.lr <= 0 or self.image_channels < 1:
            raise ValueError("lr must be > 0 and image_channels >= 1")
        if not self.min_step_s >= 0:
            raise ValueError(f"min_step_s must be >= 0, got {self.min_step_s}")


_DIST_TIMEOUT_S = 300.0
"""Timeout of collectives (a peer rank that died surfaces after this)."""

_ROWS = "knittrans_encoded_rows"
_SECONDS = "knittrans_encoder_seconds"
_STARTED = "knittrans_encoder_started"


def _start_clock(module: nn.Module, _args: tuple[Any, ...]) -> None:
    setattr(module, _STARTED, time.perf_counter())


def _count_rows(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
    setattr(module, _ROWS, getattr(module, _ROWS) + int(args[0].shape[0]))
    setattr(module, _SECONDS, getattr(module, _SECONDS) + time.perf_counter() - getattr(module, _STARTED))


@dataclass
class Policy:
    """The trainable policy of one rank: LM backbone + vision encoder (no DDP wrapper; see module doc)."""

    backbone: nn.Module
    """The transformers causal LM itself."""
    encoder: nn.Module
    """Vision encoder: the VLM's own vision tower (its parameters are the backbone's), else a side encoder."""
    layout: VLMLayout | None = None
    """Token layout of a VLM backbone (then ``encoder`` is its own vision tower); None: text-only backbone."""
    image_processor: Any = None
    """The VLM's image processor (uint8 image → pixels the vision tower takes)."""

    def __post_init__(self) -> None:
        if not hasattr(self.encoder, _ROWS):
            setattr(self.encoder, _ROWS, 0)  # kept on the module, so deep copies count their own rows
            setattr(self.encoder, _SECONDS, 0.0)
            self.encoder.register_forward_pre_hook(_start_clock)
            self.encoder.register_forward_hook(_count_rows)

    @property
    def encoded_rows(self) -> int:
        """Images run through the encoder's forward so far (a forward hook counts them)."""
        return int(getattr(self.encoder, _ROWS))

    @property
    def encoder_seconds(self) -> float:
        """Wall seconds spent in the encoder's forward so far (both hooks time it)."""
        return float(getattr(self.encoder, _SECONDS))

    def parameters(self) -> list[nn.Parameter]:
        """Backbone and encoder parameters, each once (a VLM's vision tower is part of the backbone)."""
        return list({id(p): p for p in [*self.backbone.parameters(), *self.encoder.parameters()]}.values())

    def encoder_inputs(self, media: dict[str, torch.Tensor], hashes: list[str]) -> dict[str, torch.Tensor]:
        """What the encoder takes per media hash: the VLM's preprocessed pixels, else the decoded tensor."""
        if self.layout is None:
            return {h: media[h] for h in hashes}
        unique = list(dict.fromkeys(hashes))
        pixels = pixel_values(self.image_processor, [media[h] for h in unique])
        return dict(zip(unique, pixels, strict=True))


def load_policy(model_dir: Path, *, image_channels: int, dtype: torch.dtype = torch.float32) -> Policy:
    """Load ``model_dir``: a tiny VLM with its own vision tower, or a text LM plus a seeded side encoder."""
    from transformers import AutoModelForCausalLM

    if is_vlm(model_dir):
        from transformers import Idefics3ForConditionalGeneration

        vlm: nn.Module = Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype)
        vlm.train()
        return Policy(
            backbone=vlm,
            encoder=VisionTower(vlm),
            layout=VLMLayout.from_dir(model_dir),
            image_processor=load_image_processor(model_dir),
        )

    backbone: nn.Module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    backbone.train()
    hidden = int(backbone.config.hidden_size)  # type: ignore[union-attr,arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same side encoder on every rank
        encoder = TinyVisionEncoder(channels=image_channels, hidden=hidden).to(dtype)
    return Policy(backbone=backbone, encoder=encoder)


def _zero_loss(policy: Policy) -> torch.Tensor:
    """A zero loss through every backbone parameter (one dummy token): an empty micro-batch backpropagates too."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    logits: torch.Tensor = policy.backbone(input_ids=ids).logits
    return logits.sum() * 0.0


def _media_features(
    policy: Policy, dedup: DedupEncoder | None, micro: TrainMicroBatch, flat: list[str]
) -> torch.Tensor:
    """Encoder output per media reference ``flat`` (dedup: each unique media once per mini-batch)."""
    if dedup is not None:
        fresh = [h for h in flat if h not in dedup]
        return dedup.features(flat, media=policy.encoder_inputs(micro.media, fresh) if fresh else None)
    inputs = policy.encoder_inputs(micro.media, flat)  # duplicated baseline: one encoder row per reference
    out: torch.Tensor = policy.encoder(torch.stack([inputs[h] for h in flat]))
    return out


def micro_batch_loss(
    policy: Policy,
    dedup: DedupEncoder | None,
    micro: TrainMicroBatch,
    *,
    normaliser: float,
    pad_id: int,
    gaps: list[float] | None = None,
) -> torch.Tensor:
    """GRPO loss of one micro-batch's response tokens, divided by ``normaliser``.

    ``gaps`` (optional) gets the largest ``|trainer logprob - rollout logprob|`` over the
    micro-batch's response tokens: on-policy rows (same weights as the rollout) show the engines'
    numerical agreement, a row whose rollout saw other inputs shows up as a large gap.
    """
    b = micro.batch
    if b.num_rows == 0:
        return _zero_loss(policy)
    assert b.prompt_cu_seqlens is not None and b.response_cu_seqlens is not None
    assert b.response_logprobs is not None and b.advantages is not None and b.loss_mask is not None
    packed = b.pack()
    ids, mask = pad_sequences(packed.input_ids, packed.cu_seqlens, pad_value=pad_id)
    prompt_lens = b.prompt_cu_seqlens.long().diff()
    response_lens = b.response_cu_seqlens.long().diff()
    per_row = b.media_hex()
    flat = [h for hs in per_row for h in hs]
    media: dict[str, Any] = {"features": None, "has_media": None}
    if policy.layout is not None:  # VLM: every image of the micro-batch, row by row (the ``<image>`` blocks' order)
        for i, hashes in enumerate(per_row):
            blocks = policy.layout.count_images(ids[i, : int(prompt_lens[i])].numpy())
            if blocks != len(hashes):
                raise InvalidRequest(f"row {i} of the micro-batch has {blocks} image blocks but {len(hashes)} images")
        media = {
            "image_features": _media_features(policy, dedup, micro, flat) if flat else None,
            "layout": policy.layout,
        }
    elif flat:  # text LM: per-row sum of the side encoder's features over the row's media, and the has-media flags
        feats = _media_features(policy, dedup, micro, flat)
        index = torch.tensor([i for i, hs in enumerate(per_row) for _ in hs], dtype=torch.long)
        media["features"] = torch.zeros((len(per_row), *feats.shape[1:]), dtype=feats.dtype).index_add(0, index, feats)
        media["has_media"] = torch.tensor([len(hs) > 0 for hs in per_row])
    logprobs = packed_response_logprobs(policy.backbone, ids.long(), mask.long(), prompt_lens, response_lens, **media)
    if gaps is not None and logprobs.numel():
        gaps.append(float((logprobs.detach() - b.response_logprobs.float()).abs().max()))
    advantages = b.advantages.float().repeat_interleave(response_lens)
    return grpo_loss(logprobs, b.response_logprobs.float(), advantages, b.loss_mask.float(), normaliser=normaliser)


def train_mini_batch(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    mb: MiniBatch,
    *,
    world_size: int,
    dedup: bool = True,
) -> dict[str, Any] | None:
    """Forward/backward every micro-batch of ``mb``; if every rank holds its share, reduce and step.

    Returns the mini-batch's record, or None when the mini-batch failed on some rank (a fetch
    error, or the control plane withdrew the plan): then no rank stepped, gradients are zeroed,
    and the caller abandons ``mb`` (:meth:`MiniBatch.abandon`) to get the re-plan. Does not ack:
    the caller acks after this returns a record. Under ``world_size > 1`` every rank must call it
    for the same global index, with clients that share the control plane (``TrainerConfig.group="auto"``:
    ``report_fetched`` is then one collective answer for all ranks), failed or not.
    """
    t0 = time.perf_counter()
    total = mb.mini_batch_trajectories
    normaliser = max(total, 1) / world_size
    pad_id = int(getattr(policy.backbone.config, "pad_token_id", None) or 0)
    encoder = DedupEncoder(policy.encoder) if dedup else None
    if encoder is not None:
        encoder.begin_mini_batch()
    rows_before = policy.encoded_rows
    seconds_before = policy.encoder_seconds
    image_rows = 0
    loss_sum = 0.0
    gaps: list[float] = []
    traj_ids: list[str] = []
    fetched = True
    stats = None
    try:
        for micro in mb:
            loss = micro_batch_loss(policy, encoder, micro, normaliser=normaliser, pad_id=pad_id, gaps=gaps)
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
            image_rows += sum(1 for hashes in micro.batch.media_hex() if hashes)
            table = micro.batch.table
            if table is not None and "traj_id" in table.column_names:
                traj_ids += [str(t) for t in table.column("traj_id").to_pylist()]
        stats = encoder.finish() if encoder is not None else None
    except KnitTransError as exc:  # a fetch failed: no step on this mini-batch, on any rank
        fetched = False
        logger.warning("plan %s failed on this rank: %s", mb.plan_id, exc)
    # every rank reports; the ranks share the control plane, so this is one request and one answer for all
    if not mb.report_fetched(ok=fetched):  # this call's DedupEncoder, unfinished, goes with its return
        optimizer.zero_grad(set_to_none=True)
        logger.warning("plan %s: some rank could not train it; gradients dropped, no step", mb.plan_id)
        return None
    if world_size > 1:
        all_reduce_gradients(policy.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    timings = mb.timings
    media = mb.media_stats
    return {
        "step": mb.step,
        "k": mb.index,
        "global_index": mb.global_index,
        "policy_version": mb.policy_version,
        "plan_id": mb.plan_id,
        "attempt": mb.attempt,
        "traj_ids": traj_ids,
        "micro_batches": len(timings),
        "rows": sum(t.rows for t in timings),
        "global_trajectories": total,
        "wait_s": sum(t.wait_s for t in timings),
        "fetch_s": sum(t.fetch_s for t in timings),
        "convert_s": sum(t.convert_s for t in timings),
        "row_bytes": sum(t.bytes for t in timings),
        "first_wait_s": timings[0].wait_s if timings else 0.0,
        "media_logical_bytes": media.logical_bytes,
        "media_unique_bytes": media.unique_bytes,
        "media_requests": media.requests,
        "media_fetched": media.fetched,
        "encoder_calls": stats.encoder_calls if stats is not None else None,
        "unique_media": stats.unique_media if stats is not None else None,
        "media_uses": stats.uses if stats is not None else None,
        "encoded_rows": policy.encoded_rows - rows_before,
        "image_rows": image_rows,
        "encoder_forward_s": policy.encoder_seconds - seconds_before,
        "max_logprob_gap": max(gaps) if gaps else None,
        "loss": loss_sum,
        "step_time_s": time.perf_counter() - t0,
        "admission_latency_s": mb.received_at - mb.admitted_at,
    }


def save_weights(backbone: nn.Module, weights_dir: Path, version: int) -> Path:
    """Write ``policy-v{version}.safetensors`` (HF state-dict names) atomically: temp name, then rename."""
    from safetensors.torch import save_file

    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_dir / f"policy-v{version}.safetensors"
    tmp = weights_dir / f".policy-v{version}.safetensors.tmp-{os.getpid()}"
    state = {k: v.detach().contiguous().clone() for k, v in backbone.state_dict().items()}
    save_file(state, str(tmp), metadata={"format": "pt", "policy_version": str(version)})
    os.replace(tmp, final)
    return final


def _setup_dist(cfg: RankConfig, policy: Policy) -> None:
    from datetime import timedelta

    # Imported after init_process_group, this module's default arguments would hold the default group, so
    # destroy_process_group() could not free it and gloo's threads would outlive it into interpreter shutdown,
    # where one of them can abort the process (see tests/test_dedup_ddp.py). Imported first, they hold None.
    import torch.distributed.nn.functional

    dist.init_process_group(
        "gloo",
        init_method=cfg.dist_url,
        rank=cfg.client.rank,
        world_size=cfg.client.world_size,
        timeout=timedelta(seconds=_DIST_TIMEOUT_S),
    )
    with torch.no_grad():  # same start on every rank: rank 0's weights and buffers
        buffers = {id(b): b for b in [*policy.backbone.buffers(), *policy.encoder.buffers()]}
        for t in [*policy.parameters(), *buffers.values()]:
            dist.broadcast(t.data, 0)


def run_rank(cfg: RankConfig) -> int:
    """Train until the job is finished; returns the number of mini-batches trained."""
    policy = load_policy(cfg.model_dir, image_channels=cfg.image_channels)
    distributed = cfg.client.world_size > 1
    if distributed:
        _setup_dist(cfg, policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    out = open(cfg.out, "a", encoding="utf-8") if cfg.out is not None else None  # noqa: SIM115 - closed below
    trained = 0
    try:
        with TrainerClient(cfg.client) as client:
            for mb in client.minibatches():
                record = train_mini_batch(policy, optimizer, mb, world_size=cfg.client.world_size, dedup=cfg.dedup)
                if record is None:  # no rank stepped: ask for this global index again (re-planned)
                    mb.abandon()
                    continue
                if record["step_time_s"] < cfg.min_step_s:
                    time.sleep(cfg.min_step_s - record["step_time_s"])
                    record["step_time_s"] = cfg.min_step_s
                version = mb.policy_version + 1
                record.update(rank=cfg.client.rank, fetch_mode=cfg.client.fetch_mode, published_version=version)
                if out is not None:  # before the ack: a rank killed between the two trains the plan again and
                    out.write(json.dumps(record) + "\n")  # writes it again (same index), never not at all
                    out.flush()
                if cfg.client.rank == 0 and cfg.weights_dir is not None:
                    save_weights(policy.backbone, cfg.weights_dir, version)  # published before the ack frees window
                mb.ack(version=version)  # the version in the same change as the ack: launches it allows see it
                trained += 1
                logger.info(
                    "rank %d: mini-batch %d done (loss %.4f, wait %.3f s, step %.3f s)",
                    cfg.client.rank,
                    mb.global_index,
                    record["loss"],
                    record["wait_s"],
                    record["step_time_s"],
                )
    finally:
        if out is not None:
            out.close()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    return trained
