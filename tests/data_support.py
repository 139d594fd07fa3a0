"""Synthetic trajectory groups for tests (a plain module: ``conftest`` names collide across test folders)."""

from __future__ import annotations

import numpy as np

from knittrans.schema import Media, TrajectoryGroup

__all__ = ["make_groups"]


def make_groups(
    n_groups: int = 3, n_responses: int = 4, *, seed: int = 0, prefix: str = "g", media: bool = True, max_len: int = 40
) -> list[TrajectoryGroup]:
    """Random GRPO groups with shared images per group and one per-response extra item."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(n_groups):
        lens = rng.integers(0, max_len, n_responses)
        image = Media(kind="image", data=rng.integers(0, 255, (3, 4, 4), dtype=np.uint8))
        groups.append(
            TrajectoryGroup(
                group_id=f"{prefix}{i}",
                source=["math", "code", "mm_qa"][i % 3],
                prompt_ids=rng.integers(0, 50_000, int(rng.integers(1, max_len)), dtype=np.int32),
                response_ids=[rng.integers(0, 50_000, n, dtype=np.int32) for n in lens],
                response_logprobs=[-rng.random(n, dtype=np.float32) for n in lens],
                loss_masks=[rng.integers(0, 2, n, dtype=np.uint8) for n in lens],
                rewards=rng.random(n_responses).astype(np.float32),
                version_start=int(i),
                version_end=[int(i) + int(k % 2) for k in range(n_responses)],
                media=[image] if media else (),
                response_media=[[Media(kind="audio", data=f"clip{k % 2}".encode())] for k in range(n_responses)]
                if media
                else None,
                finished_at=1_700_000_000.0 + i,
            )
        )
    return groups
