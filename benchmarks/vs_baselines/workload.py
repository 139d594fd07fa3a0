"""Deterministic text and multimodal RL workloads, the canonical per-rank plan, and row digests.

Every system in the head-to-head benchmark stores the same :class:`Workload` and hands its consumer
ranks :class:`TrainBatch` objects (packed, ``cu_seqlens``-style torch tensors).  A per-row BLAKE2b
digest of the canonicalised tensors lets the harness check that every system returned identical data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

__all__ = [
    "TrainBatch",
    "Workload",
    "WorkloadSpec",
    "batch_from_rows",
    "cu_seqlens",
    "generate",
    "microbatch_digest",
    "row_digests",
]

WorkloadKind = Literal["text", "multimodal"]


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Shape of one benchmark workload (one mini-batch of trajectories)."""

    kind: WorkloadKind = "text"
    """``text`` (tokens, logprobs, rewards) or ``multimodal`` (the same plus one image per group)."""
    num_trajectories: int = 512
    """Trajectories in the mini-batch."""
    group_size: int = 8
    """Responses per prompt (GRPO group); a group shares its prompt and, if multimodal, its image."""
    ranks: int = 4
    """Consumer (data-parallel trainer) ranks."""
    micro_batches: int = 8
    """Micro-batches per rank per mini-batch."""
    prompt_len: tuple[int, int] = (192, 320)
    """Half-open range of prompt lengths in tokens (one per group)."""
    response_len: tuple[int, int] = (512, 1024)
    """Half-open range of response lengths in tokens (one per trajectory); mean total ~1k tokens."""
    image_shape: tuple[int, int] = (512, 512)
    """Grayscale uint8 image shape; 512x512 = 256 KiB."""
    vocab_size: int = 32000
    """Token ids are drawn from ``[0, vocab_size)``."""
    seed: int = 0
    """Seed of the generator; same spec + seed -> identical bytes."""
    groups_per_put: int = 8
    """Groups a rollout producer finishes and publishes together (one engine call's prompts): one
    ``kv_batch_put`` for TransferQueue, one storage unit for KnitTrans; the Ray variants keep their
    own granularity (an object per group, or per rank shard)."""

    def __post_init__(self) -> None:
        if self.kind not in ("text", "multimodal"):
            raise ValueError(f"kind must be 'text' or 'multimodal', got {self.kind!r}")
        for name in ("num_trajectories", "group_size", "ranks", "micro_batches", "groups_per_put"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_trajectories % self.group_size:
            raise ValueError("num_trajectories must be a multiple of group_size")
        if self.num_trajectories % (self.ranks * self.micro_batches):
            raise ValueError("num_trajectories must be a multiple of ranks * micro_batches")
        if self.micro_batch_size % self.group_size and self.group_size % self.micro_batch_size:
            raise ValueError("micro_batch_size and group_size must divide one another")
        for name in ("prompt_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 0 < lo < hi:
                raise ValueError(f"{name} must be a range 0 < lo < hi, got {(lo, hi)}")

    @property
    def micro_batch_size(self) -> int:
        """Trajectories per micro-batch."""
        return self.num_trajectories // (self.ranks * self.micro_batches)

    @property
    def num_groups(self) -> int:
        """Groups in the mini-batch."""
        return self.num_trajectories // self.group_size

    def put_batches(self) -> list[range]:
        """Group indices of each producer put, in order (the last one may be shorter)."""
        n, k = self.num_groups, self.groups_per_put
        return [range(i, min(i + k, n)) for i in range(0, n, k)]

    def plan(self, rank: int, micro_batch: int) -> range:
        """Canonical trajectory indices of ``(rank, micro_batch)``: contiguous, whole groups per rank."""
        start = (rank * self.micro_batches + micro_batch) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def rank_rows(self, rank: int) -> range:
        """All trajectory indices of one rank's share of the mini-batch."""
        per_rank = self.num_trajectories // self.ranks
        return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True)
class Workload:
    """One generated mini-batch: per-trajectory numpy arrays plus one image per group."""

    spec: WorkloadSpec
    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    response_logprobs: list[np.ndarray]
    reward: np.ndarray
    version_start: np.ndarray
    version_end: np.ndarray
    images: np.ndarray | None
    """uint8 ``[num_groups, H, W]`` for multimodal workloads, else None."""
    digests: list[bytes] = field(repr=False)
    """Reference per-row digest, index = trajectory index."""

    def traj_id(self, index: int) -> str:
        """Stable string id of trajectory ``index``."""
        return f"t{index:05d}"

    def group_of(self, index: int) -> int:
        """Group index of trajectory ``index``."""
        return index // self.spec.group_size

    def payload_bytes(self, *, image_per_row: bool) -> int:
        """Bytes of the row data, counting the image once per row or once per group."""
        n = sum(a.nbytes for a in self.prompt_ids) + sum(a.nbytes for a in self.response_ids)
        n += sum(a.nbytes for a in self.response_logprobs) + self.reward.nbytes
        n += self.version_start.nbytes + self.version_end.nbytes
        if self.images is not None:
            per = self.images[0].nbytes
            n += per * (self.spec.num_trajectories if image_per_row else self.spec.num_groups)
        return n


@dataclass
class TrainBatch:
    """What a consumer rank trains on: packed token tensors plus (possibly deduplicated) images."""

    traj_index: torch.Tensor
    """int64 ``[n]`` trajectory indices (rows of the workload)."""
    prompt_ids: torch.Tensor
    """int32 flat prompt tokens; row ``i`` is ``prompt_ids[prompt_cu[i]:prompt_cu[i+1]]``."""
    prompt_cu: torch.Tensor
    """int64 ``[n+1]`` prompt offsets (``cu_seqlens``)."""
    response_ids: torch.Tensor
    """int32 flat response tokens."""
    response_cu: torch.Tensor
    """int64 ``[n+1]`` response offsets."""
    response_logprobs: torch.Tensor
    """float32 flat, aligned with ``response_ids``."""
    reward: torch.Tensor
    """float32 ``[n]``."""
    version_start: torch.Tensor
    """int32 ``[n]``."""
    version_end: torch.Tensor
    """int32 ``[n]``."""
    images: torch.Tensor | None = None
    """uint8 ``[k, H, W]``: unique images (dedup) or one per row (k == n)."""
    image_index: torch.Tensor | None = None
    """int64 ``[n]``: row ``i`` uses ``images[image_index[i]]``."""

    def nbytes(self) -> int:
        """Bytes held by the batch's tensors (what the consumer received)."""
        tensors = [
            self.traj_index,
            self.prompt_ids,
            self.prompt_cu,
            self.response_ids,
            self.response_cu,
            self.response_logprobs,
            self.reward,
            self.version_start,
            self.version_end,
        ]
        if self.images is not None and self.image_index is not None:
            tensors += [self.images, self.image_index]
        return sum(t.numel() * t.element_size() for t in tensors)


def generate(spec: WorkloadSpec) -> Workload:
    """Generate the workload of ``spec`` deterministically from ``spec.seed``."""
    rng = np.random.default_rng(spec.seed)
    n, g = spec.num_trajectories, spec.group_size
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    for _ in range(spec.num_groups):
        plen = int(rng.integers(*spec.prompt_len))
        prompt = rng.integers(0, spec.vocab_size, plen, dtype=np.int32)
        for _ in range(g):
            rlen = int(rng.integers(*spec.response_len))
            prompts.append(prompt)
            responses.append(rng.integers(0, spec.vocab_size, rlen, dtype=np.int32))
            logprobs.append(-rng.exponential(1.0, rlen).astype(np.float32))
    reward = rng.standard_normal(n).astype(np.float32)
    version_start = rng.integers(0, 4, n, dtype=np.int32)
    version_end = version_start + rng.integers(0, 2, n, dtype=np.int32)
    images = None
    if spec.kind == "multimodal":
        images = rng.integers(0, 256, (spec.num_groups, *spec.image_shape), dtype=np.uint8)
    image_digests = [_image_digest(images[i]) for i in range(spec.num_groups)] if images is not None else None
    digests = [
        _row_digest(
            i,
            prompts[i],
            responses[i],
            logprobs[i],
            reward[i : i + 1],
            version_start[i : i + 1],
            version_end[i : i + 1],
            image_digests[i // g] if image_digests else b"",
        )
        for i in range(n)
    ]
    return Workload(spec, prompts, responses, logprobs, reward, version_start, version_end, images, digests)


def _image_digest(image: np.ndarray) -> bytes:
    return (
        hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=16).digest()
        + repr(tuple(image.shape)).encode()
    )


def _row_digest(index: int, *parts: np.ndarray | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(int(index).to_bytes(8, "little"))
    for part in parts:
        data = part if isinstance(part, bytes) else np.ascontiguousarray(part).tobytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def row_digests(batch: TrainBatch) -> dict[int, bytes]:
    """Digest of every row of ``batch`` keyed by trajectory index (same recipe as :func:`generate`)."""
    n = int(batch.traj_index.numel())
    if int(batch.prompt_cu.numel()) != n + 1 or int(batch.response_cu.numel()) != n + 1:
        raise ValueError("cu_seqlens length does not match the number of rows")
    pcu, rcu = batch.prompt_cu.tolist(), batch.response_cu.tolist()
    prompt, response = batch.prompt_ids.numpy(), batch.response_ids.numpy()
    logp, reward = batch.response_logprobs.numpy(), batch.reward.numpy()
    vs, ve = batch.version_start.numpy(), batch.version_end.numpy()
    image_digest: dict[int, bytes] = {}
    out: dict[int, bytes] = {}
    for i, idx in enumerate(batch.traj_index.tolist()):
        img = b""
        if batch.images is not None and batch.image_index is not None:
            k = int(batch.image_index[i])
            if k not in image_digest:
                image_digest[k] = _image_digest(batch.images[k].numpy())
            img = image_digest[k]
        out[int(idx)] = _row_digest(
            int(idx),
            prompt[pcu[i] : pcu[i + 1]],
            response[rcu[i] : rcu[i + 1]],
            logp[rcu[i] : rcu[i + 1]],
            reward[i : i + 1],
            vs[i : i + 1],
            ve[i : i + 1],
            img,
        )
    return out


def microbatch_digest(digests: dict[int, bytes]) -> str:
    """Order-independent digest of one micro-batch's rows (sorted by trajectory index)."""
    h = hashlib.blake2b(digest_size=16)
    for idx in sorted(digests):
        h.update(digests[idx])
    return h.hexdigest()


def batch_from_rows(workload: Workload, rows: list[int], *, dedup_images: bool) -> TrainBatch:
    """Build the reference :class:`TrainBatch` of ``rows`` straight from the workload (no transfer)."""
    prompts = [workload.prompt_ids[i] for i in rows]
    responses = [workload.response_ids[i] for i in rows]
    images = image_index = None
    if workload.images is not None:
        groups = [workload.group_of(i) for i in rows]
        if dedup_images:
            uniq = sorted(set(groups))
            images = torch.from_numpy(workload.images[uniq])
            image_index = torch.tensor([uniq.index(gr) for gr in groups], dtype=torch.int64)
        else:
            images = torch.from_numpy(workload.images[groups])
            image_index = torch.arange(len(rows), dtype=torch.int64)
    return TrainBatch(
        traj_index=torch.tensor(rows, dtype=torch.int64),
        prompt_ids=torch.from_numpy(np.concatenate(prompts)),
        prompt_cu=cu_seqlens([len(p) for p in prompts]),
        response_ids=torch.from_numpy(np.concatenate(responses)),
        response_cu=cu_seqlens([len(r) for r in responses]),
        response_logprobs=torch.from_numpy(np.concatenate([workload.response_logprobs[i] for i in rows])),
        reward=torch.from_numpy(workload.reward[rows]),
        version_start=torch.from_numpy(workload.version_start[rows]),
        version_end=torch.from_numpy(workload.version_end[rows]),
        images=images,
        image_index=image_index,
    )


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """int64 ``[n+1]`` offsets of rows of the given lengths."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out
