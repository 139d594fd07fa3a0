"""Synthetic trajectory groups for tests (a plain module: ``conftest`` names collide across test folders)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from knittrans.schema import Media, TrajectoryGroup, UnitTables

__all__ = ["make_groups", "store_unit", "unit_bytes"]


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


def unit_bytes(tables: UnitTables) -> int:
    """Bytes of a unit's IPC files as a writer writes them (a unit without media has no media file)."""
    total = 0
    for table in (tables.traj, tables.media) if tables.media.num_rows else (tables.traj,):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        total += sink.getvalue().size
    return total


def store_unit(store: Any, job: str, unit_id: str, tables: UnitTables) -> Any:
    """Write a unit into ``store`` (a :class:`~knittrans.store.UnitStore`) as a same-host writer does: its
    files into a writer temporary, then ``publish_units``; the sealed unit."""
    from knittrans.store import MEDIA_FILE, TRAJ_FILE, SealSpec, writer_temp_name
    from knittrans.store.unit import write_table

    tmp = store.config.root / job / writer_temp_name(unit_id)
    tmp.mkdir(parents=True)
    size = write_table(tmp / TRAJ_FILE, tables.traj)
    if tables.media.num_rows:
        size += write_table(tmp / MEDIA_FILE, tables.media)
    spec = SealSpec(unit_id=unit_id, rows=tables.traj.num_rows, media_rows=tables.media.num_rows, num_bytes=size)
    return store.publish_units(job, [(spec, tmp)])[0]
