"""One data-parallel trainer rank: GRPO on a tiny multimodal policy, fed by :class:`TrainerClient`.

Per mini-batch (one optimizer step)::

    N = sum over ranks of the plan's trajectories     # one all-reduce (the plan has no global count)
    dedup.begin_mini_batch()
    for i, micro in enumerate(mini_batch):            # eager or iter (prefetch) fetch
        with backbone.no_sync() unless i is the last: # DDP: one synchronised backward per mini-batch
            loss = grpo_loss(...) / (N / W); loss.backward()
    dedup.finish(); all_reduce_gradients(encoder)     # one encoder backward, encoder outside DDP
    optimizer.step(); mini_batch.ack()
    rank 0: policy-v{n+1}.safetensors (temp name + rename), report_version(n+1)

Normaliser: the plan JSON carries no global count, so the trajectories of the mini-batch are
summed over ranks with one all-reduce before the first backward (known from the plan, before any
fetch). Every rank divides its summed token loss by ``N / W``; DDP and
:func:`~knittrans.trainer.dedup.all_reduce_gradients` average over ``W`` ranks, so the gradient is
exactly that of ``sum(token losses) / N`` over the whole mini-batch, whatever the split.

A rank whose micro-batch has no rows (or whose share has no micro-batch at all) still runs a
zero-loss forward/backward through the DDP module, so every rank issues the same collectives.
Media: each row's features (sum over its media) are added at the row's first positions
(:func:`knittrans.demo.policy.packed_response_logprobs`); ``dedup=False`` encodes every media
reference separately (the duplicated baseline the benchmark compares against).
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from knittrans.demo.policy import TinyVisionEncoder, packed_response_logprobs
from knittrans.trainer.client import MiniBatch, TrainerClient, TrainerConfig, TrainMicroBatch
from knittrans.trainer.convert import pad_sequences
from knittrans.trainer.dedup import DedupEncoder, all_reduce_gradients
from knittrans.trainer.grpo import grpo_loss

__all__ = ["Policy", "RankConfig", "load_policy", "micro_batch_loss", "run_rank", "save_weights",
           "train_mini_batch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """Everything one ``knittrans train`` process needs."""

    control_url: str
    """Control-plane base URL."""
    job: str
    """Job name."""
    rank: int
    """This rank."""
    world_size: int
    """Data-parallel ranks."""
    model_dir: Path
    """A saved transformers causal LM (e.g. from ``build_tiny_qwen2``)."""
    dist_url: str | None = None
    """``tcp://HOST:PORT`` for the gloo process group; None only with ``world_size == 1``."""
    weights_dir: Path | None = None
    """Rank 0 writes ``policy-v{n}.safetensors`` here after each optimizer step (None: don't)."""
    fetch_mode: Literal["eager", "iter"] = "iter"
    """Micro-batch fetch mode of the client."""
    lookahead: bool = False
    """Prefetch the next mini-batch across the ack (``iter`` only; see TrainerClient)."""
    local_dirs: dict[str, str] = field(default_factory=dict)
    """Store node id -> store dir on this host (memory-mapped reads)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    image_channels: int = 3
    """Channels of the images the vision encoder takes."""
    clip_eps: float = 0.2
    """PPO clip range."""
    dedup: bool = True
    """Encode each unique media once per mini-batch (False: once per reference)."""
    seed: int = 0
    """Seed of the vision encoder's initialisation (identical on every rank)."""
    out: Path | None = None
    """JSON-lines file, one record per mini-batch."""
    token: str | None = None
    """Control-plane worker token."""
    store_token: str | None = None
    """Store nodes' token."""
    poll_timeout_s: float = 30.0
    """Long-poll timeout of one ``next`` request."""
    dist_timeout_s: float = 300.0
    """Timeout of collectives (a peer rank that died surfaces after this)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.world_size > 1 and not self.dist_url:
            raise ValueError("world_size > 1 needs dist_url (tcp://HOST:PORT) for the gloo process group")
        if self.lr <= 0 or self.image_channels < 1 or self.clip_eps <= 0:
            raise ValueError("lr and clip_eps must be > 0 and image_channels >= 1")


_ROWS = "knittrans_encoded_rows"


def _count_rows(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
    setattr(module, _ROWS, getattr(module, _ROWS) + int(args[0].shape[0]))


@dataclass
class Policy:
    """The trainable policy of one rank: LM backbone (maybe DDP-wrapped) + vision encoder."""

    backbone: nn.Module
    """The transformers causal LM itself (unwrapped)."""
    encoder: nn.Module
    """Vision encoder (kept outside DDP)."""
    ddp: nn.Module | None = None
    """The DDP wrapper of ``backbone`` under data parallelism."""

    def __post_init__(self) -> None:
        if not hasattr(self.encoder, _ROWS):
            setattr(self.encoder, _ROWS, 0)  # kept on the module, so deep copies count their own rows
            self.encoder.register_forward_hook(_count_rows)

    @property
    def encoded_rows(self) -> int:
        """Images run through the encoder's forward so far (a forward hook counts them)."""
        return int(getattr(self.encoder, _ROWS))

    @property
    def forward_module(self) -> nn.Module:
        """What micro-batches run through: the DDP wrapper, else the backbone."""
        return self.ddp if self.ddp is not None else self.backbone

    def parameters(self) -> list[nn.Parameter]:
        """Backbone and encoder parameters (for the optimizer)."""
        return [*self.backbone.parameters(), *self.encoder.parameters()]


class _Forward:
    """What ``packed_response_logprobs`` needs of a model, routing the call through DDP."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    def get_input_embeddings(self) -> nn.Module:
        return self._policy.backbone.get_input_embeddings()  # type: ignore[operator,no-any-return]

    def __call__(self, **kwargs: Any) -> Any:
        return self._policy.forward_module(**kwargs)


def load_policy(model_dir: Path, *, image_channels: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Policy:
    """Load the causal LM from ``model_dir`` and build a seeded vision encoder of its hidden size."""
    from transformers import AutoModelForCausalLM

    backbone: nn.Module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    backbone.train()
    hidden = int(backbone.config.hidden_size)  # type: ignore[union-attr,arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = TinyVisionEncoder(channels=image_channels, hidden=hidden).to(dtype)
    return Policy(backbone=backbone, encoder=encoder)


def _zero_loss(policy: Policy) -> torch.Tensor:
    """A zero loss through every backbone parameter (one dummy token), so DDP's reducer fires."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    logits: torch.Tensor = policy.forward_module(input_ids=ids).logits
    return logits.sum() * 0.0


def _row_features(policy: Policy, dedup: DedupEncoder | None, micro: TrainMicroBatch
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-row media features ``[rows, tokens, hidden]`` (sum over a row's media) and the has-media flags."""
    per_row = micro.batch.media_hex()
    flat = [h for hs in per_row for h in hs]
    if not flat:
        return None, None
    if dedup is not None:
        feats = dedup.features(flat, media=micro.media)
    else:  # duplicated baseline: one encoder row per media reference
        feats = policy.encoder(torch.stack([micro.media[h] for h in flat]))
    index = torch.tensor([i for i, hs in enumerate(per_row) for _ in hs], dtype=torch.long)
    rows = torch.zeros((len(per_row), *feats.shape[1:]), dtype=feats.dtype).index_add(0, index, feats)
    has_media = torch.tensor([len(hs) > 0 for hs in per_row])
    return rows, has_media


def micro_batch_loss(policy: Policy, dedup: DedupEncoder | None, micro: TrainMicroBatch, *,
                     normaliser: float, clip_eps: float, pad_id: int) -> torch.Tensor:
    """GRPO loss of one micro-batch's response tokens, divided by ``normaliser``."""
    b = micro.batch
    if b.num_rows == 0:
        return _zero_loss(policy)
    assert b.prompt_cu_seqlens is not None and b.response_cu_seqlens is not None
    assert b.response_logprobs is not None and b.advantages is not None and b.loss_mask is not None
    packed = b.pack()
    ids, mask = pad_sequences(packed.input_ids, packed.cu_seqlens, pad_value=pad_id)
    prompt_lens = b.prompt_cu_seqlens.long().diff()
    response_lens = b.response_cu_seqlens.long().diff()
    features, has_media = _row_features(policy, dedup, micro)
    logprobs = packed_response_logprobs(
        _Forward(policy), ids.long(), mask.long(), prompt_lens, response_lens,  # type: ignore[arg-type]
        features=features, has_media=has_media,
    )
    advantages = b.advantages.float().repeat_interleave(response_lens)
    return grpo_loss(logprobs, b.response_logprobs.float(), advantages, b.loss_mask.float(),
                     normaliser=normaliser, clip_eps=clip_eps)


def _global_trajectories(mb: MiniBatch, world_size: int) -> int:
    given = mb.mini_batch_trajectories
    if given is not None:
        return given
    if world_size == 1:
        return mb.local_trajectories
    count = torch.tensor([mb.local_trajectories], dtype=torch.int64)
    dist.all_reduce(count)
    return int(count.item())


def train_mini_batch(policy: Policy, optimizer: torch.optim.Optimizer, mb: MiniBatch, *, world_size: int,
                     dedup: bool = True, clip_eps: float = 0.2, pad_id: int = 0) -> dict[str, Any]:
    """Forward/backward every micro-batch of ``mb``, reduce, step; returns the mini-batch's record.

    Does not ack: the caller acks after this returns (the optimizer step is done).
    """
    t0 = time.perf_counter()
    total = _global_trajectories(mb, world_size)
    normaliser = max(total, 1) / world_size
    encoder = DedupEncoder(policy.encoder) if dedup else None
    if encoder is not None:
        encoder.begin_mini_batch()
    rows_before = policy.encoded_rows
    loss_sum = 0.0
    count = 0
    last = mb.num_micro_batches - 1
    try:
        for i, micro in enumerate(mb):
            sync: AbstractContextManager[Any] = nullcontext()
            if policy.ddp is not None and i != last:
                sync = policy.ddp.no_sync()  # type: ignore[operator]
            with sync:
                loss = micro_batch_loss(policy, encoder, micro, normaliser=normaliser, clip_eps=clip_eps,
                                        pad_id=pad_id)
                loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
            count += 1
        if count == 0 and policy.ddp is not None:  # no micro-batch at all: keep DDP in step
            _zero_loss(policy).backward()  # type: ignore[no-untyped-call]
        stats = encoder.finish() if encoder is not None else None
    except BaseException:
        if encoder is not None:
            encoder.drop()
        raise
    if policy.ddp is not None:
        all_reduce_gradients(policy.encoder.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    timings = mb.timings
    media = mb.media_stats
    return {
        "step": mb.step, "k": mb.index, "global_index": mb.global_index, "policy_version": mb.policy_version,
        "micro_batches": len(timings), "rows": sum(t.rows for t in timings), "global_trajectories": total,
        "wait_s": sum(t.wait_s for t in timings), "fetch_s": sum(t.fetch_s for t in timings),
        "convert_s": sum(t.convert_s for t in timings), "row_bytes": sum(t.bytes for t in timings),
        "media_logical_bytes": media.logical_bytes, "media_unique_bytes": media.unique_bytes,
        "media_requests": media.requests, "media_fetched": media.fetched,
        "encoder_calls": stats.encoder_calls if stats is not None else None,
        "unique_media": stats.unique_media if stats is not None else None,
        "media_uses": stats.uses if stats is not None else None,
        "encoded_rows": policy.encoded_rows - rows_before,
        "loss": loss_sum, "step_time_s": time.perf_counter() - t0,
        "admission_latency_s": (mb.received_at - mb.admitted_at) if mb.admitted_at is not None else None,
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

    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=cfg.dist_url, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=cfg.dist_timeout_s))
    for p in policy.encoder.parameters():  # same start on every rank (seeded anyway)
        dist.broadcast(p.data, 0)
    policy.ddp = DistributedDataParallel(policy.backbone)  # broadcasts rank 0's backbone


def run_rank(cfg: RankConfig) -> int:
    """Train until the job is finished; returns the number of mini-batches trained."""
    policy = load_policy(cfg.model_dir, image_channels=cfg.image_channels, seed=cfg.seed)
    pad_id = int(getattr(policy.backbone.config, "pad_token_id", None) or 0)
    distributed = cfg.world_size > 1
    if distributed:
        _setup_dist(cfg, policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    client_cfg = TrainerConfig(
        control_url=cfg.control_url, job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, token=cfg.token,
        store_token=cfg.store_token, fetch_mode=cfg.fetch_mode, lookahead=cfg.lookahead,
        local_dirs=dict(cfg.local_dirs), poll_timeout_s=cfg.poll_timeout_s,
    )
    out = open(cfg.out, "a", encoding="utf-8") if cfg.out is not None else None  # noqa: SIM115 - closed below
    trained = 0
    try:
        with TrainerClient(client_cfg) as client:
            for mb in client.minibatches():
                record = train_mini_batch(policy, optimizer, mb, world_size=cfg.world_size, dedup=cfg.dedup,
                                          clip_eps=cfg.clip_eps, pad_id=pad_id)
                mb.ack()
                version = mb.policy_version + 1
                if cfg.rank == 0:
                    if cfg.weights_dir is not None:
                        save_weights(policy.backbone, cfg.weights_dir, version)
                    client.report_version(version)
                record.update(rank=cfg.rank, fetch_mode=cfg.fetch_mode, published_version=version)
                trained += 1
                logger.info("rank %d: mini-batch %d done (loss %.4f, wait %.3f s, step %.3f s)", cfg.rank,
                            mb.global_index, record["loss"], record["wait_s"], record["step_time_s"])
                if out is not None:
                    out.write(json.dumps(record) + "\n")
                    out.flush()
    finally:
        if out is not None:
            out.close()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    return trained
