"""Helpers of the trainer tests: multimodal GRPO groups written by a real TrajectoryWriter to live stores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from knittrans.controlclient import ControlClient
from knittrans.local import StoreNode
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import Media, TrajectoryGroup


def mm_groups(
    prefix: str,
    count: int,
    *,
    group_size: int,
    image_shape: Sequence[int] = (3, 32, 32),
    prompt_len: int = 6,
    response_len: int = 5,
    vocab: int = 256,
    seed: int = 0,
    with_media: bool = True,
) -> list[TrajectoryGroup]:
    """``count`` groups; every response of a group shares the group's one uint8 image."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        image = rng.integers(0, 256, tuple(image_shape), dtype=np.uint8)
        media = [Media(kind="image", data=image)] if with_media else []
        groups.append(
            TrajectoryGroup(
                group_id=f"{prefix}{g}",
                source="mm",
                prompt_ids=rng.integers(0, vocab - 1, prompt_len).astype(np.int32),
                response_ids=[rng.integers(0, vocab - 1, response_len).astype(np.int32) for _ in range(group_size)],
                response_logprobs=[np.full(response_len, -np.log(vocab), np.float32) for _ in range(group_size)],
                rewards=rng.random(group_size).astype(np.float32),
                version_start=0,
                version_end=0,
                media=media,
                finished_at=1000.0 + g,
            )
        )
    return groups


def write_and_register(
    control: ControlClient,
    job: str,
    stores: Sequence[StoreNode],
    groups: Sequence[TrajectoryGroup],
    *,
    groups_per_unit: int = 1,
    token: str | None = None,
) -> list[Any]:
    """Write ``groups`` round-robin over ``stores`` (same-host writers), ``groups_per_unit`` per unit; register."""
    descriptors = []
    writers = [
        TrajectoryWriter(job=job, node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir, token=token)
        for s in stores
    ]
    try:
        chunks = [groups[i : i + groups_per_unit] for i in range(0, len(groups), groups_per_unit)]
        for i, chunk in enumerate(chunks):
            descriptors.append(writers[i % len(writers)].write_groups(chunk))
    finally:
        for w in writers:
            w.close()
    control.register_units(job, descriptors)
    return descriptors


def job_spec(
    name: str,
    *,
    groups: int,
    group_size: int,
    k: int,
    world_size: int,
    micro_batch_size: int,
    total_steps: int = 1,
    policy: str = "train_batch",
) -> dict[str, Any]:
    """A one-source job whose train batch is ``groups`` groups cut into ``k`` mini-batches."""
    return {
        "name": name,
        "group_size": group_size,
        "quotas": {"mm": groups},
        "mini_batches_per_step": k,
        "policy": policy,
        "world_size": world_size,
        "micro_batch_size": micro_batch_size,
        "total_steps": total_steps,
    }
