"""Baseline (b): the Ray object store — ``ray.put`` by the producer, ``ray.get`` in 4 consumer actors.

Variants:

* ``group`` — one object per GRPO group (8 trajectories, packed columns, the group's image once), as a
  group-aware producer would publish finished groups; a micro-batch is ``ray.get`` of its 2 groups.
* ``shard`` — one object per rank shard (128 trajectories, per-row columns with one image copy per row,
  like a driver dispatching a ``DataProto`` chunk); a rank ``ray.get``\\ s its shard before its first
  micro-batch and slices micro-batches from it.

Public Ray API only: ``ray.init`` (local cluster on loopback), ``ray.put``, ``ray.get``, actors.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import torch

from benchmarks.vs_baselines.common import RunnerOptions, rank_loop, warm_up
from benchmarks.vs_baselines.workload import TrainBatch, Workload, WorkloadSpec

__all__ = ["VARIANTS", "RayRunner", "make_runner"]

VARIANTS = ("group", "shard")


def pack_rows(workload: Workload, rows: list[int], *, image: str) -> dict[str, np.ndarray]:
    """Pack rows into flat numpy columns; ``image`` is ``"group"`` (one copy), ``"row"`` or ``"none"``."""
    prompts = [workload.prompt_ids[i] for i in rows]
    responses = [workload.response_ids[i] for i in rows]
    out = {
        "traj_index": np.asarray(rows, dtype=np.int64),
        "prompt_ids": np.concatenate(prompts),
        "prompt_cu": np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int64),
        "response_ids": np.concatenate(responses),
        "response_cu": np.concatenate([[0], np.cumsum([len(r) for r in responses])]).astype(np.int64),
        "response_logprobs": np.concatenate([workload.response_logprobs[i] for i in rows]),
        "reward": workload.reward[rows],
        "version_start": workload.version_start[rows],
        "version_end": workload.version_end[rows],
    }
    if workload.images is not None and image != "none":
        groups = [workload.group_of(i) for i in rows]
        out["images"] = workload.images[groups[:1]] if image == "group" else workload.images[groups]
    return out


def _cat(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts))


def batch_from_packs(packs: list[dict[str, np.ndarray]]) -> TrainBatch:
    """Concatenate packed groups into one :class:`TrainBatch` (copies, as a user would)."""

    def cu(key: str) -> torch.Tensor:
        offs, base = [np.zeros(1, np.int64)], 0
        for p in packs:
            offs.append(p[key][1:] + base)
            base += int(p[key][-1])
        return _cat(offs)

    images = image_index = None
    if "images" in packs[0]:
        images = _cat([p["images"] for p in packs])
        counts = [len(p["traj_index"]) for p in packs]
        if images.shape[0] == len(packs):
            image_index = torch.repeat_interleave(torch.arange(len(packs)), torch.tensor(counts))
        else:
            image_index = torch.arange(images.shape[0])
    return TrainBatch(
        traj_index=_cat([p["traj_index"] for p in packs]),
        prompt_ids=_cat([p["prompt_ids"] for p in packs]),
        prompt_cu=cu("prompt_cu"),
        response_ids=_cat([p["response_ids"] for p in packs]),
        response_cu=cu("response_cu"),
        response_logprobs=_cat([p["response_logprobs"] for p in packs]),
        reward=_cat([p["reward"] for p in packs]),
        version_start=_cat([p["version_start"] for p in packs]),
        version_end=_cat([p["version_end"] for p in packs]),
        images=images,
        image_index=image_index,
    )


def slice_pack(pack: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows ``[lo, hi)`` of a per-row pack (views, rebased offsets)."""
    out = {k: pack[k][lo:hi] for k in ("traj_index", "reward", "version_start", "version_end")}
    for col, key in (("prompt_ids", "prompt_cu"), ("response_ids", "response_cu")):
        a, b = int(pack[key][lo]), int(pack[key][hi])
        out[col] = pack[col][a:b]
        out[key] = pack[key][lo : hi + 1] - a
    r0, r1 = int(pack["response_cu"][lo]), int(pack["response_cu"][hi])
    out["response_logprobs"] = pack["response_logprobs"][r0:r1]
    if "images" in pack:
        out["images"] = pack["images"][lo:hi]
    return out


@ray.remote(num_cpus=0)
class RayConsumer:
    """One trainer rank: ``ray.get`` its objects and run the shared rank loop."""

    def __init__(self, rank: int, spec: WorkloadSpec, hidden: int) -> None:
        self.rank, self.spec, self.hidden = rank, spec, hidden
        warm_up(spec, hidden)

    def ready(self) -> int:
        return os.getpid()

    def run(self, variant: str, refs: list[list[Any]], compute: bool) -> dict[str, Any]:
        return rank_loop(self.rank, self.spec, self._batches(variant, refs), compute=compute, hidden=self.hidden)

    def _batches(self, variant: str, refs: list[list[Any]]) -> Iterator[TrainBatch]:
        if variant == "group":
            for mb_refs in refs:
                yield batch_from_packs(ray.get(mb_refs))
            return
        shard = ray.get(refs[0][0])
        b = self.spec.micro_batch_size
        for m in range(self.spec.micro_batches):
            yield batch_from_packs([slice_pack(shard, m * b, (m + 1) * b)])


class RayRunner:
    """Ray object store baseline (see module docstring for the variants)."""

    def __init__(self, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown ray variant {variant!r}; choose from {VARIANTS}")
        self.variant = variant
        self.name = f"ray_{variant}"
        self._refs: dict[str, list[list[list[Any]]]] = {}
        self._actors: list[Any] = []

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        self.spec = spec
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(
            _node_ip_address=options.loopback,
            include_dashboard=False,
            num_cpus=options.logical_cpus,
            logging_level="WARNING",
            log_to_driver=False,
        )
        self._actors = [
            RayConsumer.remote(r, spec, options.compute_hidden)  # type: ignore[attr-defined]
            for r in range(spec.ranks)
        ]
        ray.get([a.ready.remote() for a in self._actors])

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        spec = workload.spec
        t0 = time.perf_counter()
        per_rank: list[list[list[Any]]] = []
        if self.variant == "group":
            g = spec.group_size
            group_refs = [
                ray.put(pack_rows(workload, list(range(k * g, (k + 1) * g)), image="group"))
                for k in range(spec.num_groups)
            ]
            for r in range(spec.ranks):
                mbs = []
                for m in range(spec.micro_batches):
                    rows = spec.plan(r, m)
                    mbs.append([group_refs[k] for k in range(rows.start // g, (rows.stop + g - 1) // g)])
                per_rank.append(mbs)
        else:
            for r in range(spec.ranks):
                per_rank.append([[ray.put(pack_rows(workload, list(spec.rank_rows(r)), image="row"))]])
        t1 = time.perf_counter()
        self._refs[tag] = per_rank
        stored = workload.payload_bytes(image_per_row=self.variant == "shard")
        return {"put_s": t1 - t0, "stored_bytes": float(stored)}

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        refs = self._refs[tag]
        futures = [a.run.remote(self.variant, refs[r], compute) for r, a in enumerate(self._actors)]
        return list(ray.get(futures))

    def clear(self, tag: str) -> None:
        self._refs.pop(tag, None)
        gc.collect()

    def teardown(self) -> None:
        for a in self._actors:
            ray.kill(a)
        self._actors = []
        ray.shutdown()


def make_runner(variant: str) -> RayRunner:
    """Factory used by the driver."""
    return RayRunner(variant)
