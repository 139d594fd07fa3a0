"""Baseline (a): TransferQueue 0.1.11 (PyPI), SimpleStorage backend, public API only.

The producer stores each finished group with ``tq.kv_batch_put`` (one row per trajectory; token
columns as jagged nested tensors; the group's image copied into *every* row, because TransferQueue
has no shared/deduplicated column — that is how its users store per-sample images).  Four consumer
ranks run as Ray actors that attach with ``tq.init()`` and fetch each micro-batch either by key
(variant ``kv``: ``tq.kv_batch_get`` of the rank's planned keys) or through the controller's sampler
(variant ``sampler``: ``get_meta`` with ``RankAwareSampler`` then ``get_data``; which rows a rank
gets is decided by the sampler at run time, so the harness checks rows by trajectory index).

TransferQueue hands dense columns back as nested (jagged) tensors in some cases (the image column
comes back as a jagged ``[n, 512, j]`` tensor); the consumer converts to plain tensors before the
digest.  All of that conversion is counted in the fetch time, as it would be for a user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDict

from benchmarks.vs_baselines.common import RunnerOptions, rank_loop, warm_up
from benchmarks.vs_baselines.workload import TrainBatch, Workload, WorkloadSpec, cu_seqlens

__all__ = ["VARIANTS", "TQRunner", "make_runner"]

VARIANTS = ("kv", "sampler", "kt_kv", "kt_sampler", "kt_kv_nodedup", "kt_sampler_nodedup")
"""``kt_*``: the same client calls with TransferQueue's storage backend switched to KnitTrans
(``knittrans.integrations.transferqueue``: node-local Arrow units, one DoGet per node, the group's
image stored once per content hash); ``*_nodedup``: the same without ``media_fields`` (every row's
image stored, as SimpleStorage stores it)."""
SETUP_HOOK = "knittrans.integrations.transferqueue.register"
TASK = "train"
TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_logprobs")
SCALAR_FIELDS = ("traj_index", "reward", "version_start", "version_end")


def group_fields(workload: Workload, groups: int | range) -> tuple[list[str], TensorDict]:
    """Keys and TensorDict of one group or a range of groups, one row per trajectory (image repeated per row)."""
    g = workload.spec.group_size
    groups = range(groups, groups + 1) if isinstance(groups, int) else groups
    rows = list(range(groups.start * g, groups.stop * g))
    cols: dict[str, Any] = {
        "traj_index": torch.tensor(rows, dtype=torch.int64),
        "reward": torch.from_numpy(workload.reward[rows]),
        "version_start": torch.from_numpy(workload.version_start[rows]),
        "version_end": torch.from_numpy(workload.version_end[rows]),
    }
    for name, arrays in (
        ("prompt_ids", workload.prompt_ids),
        ("response_ids", workload.response_ids),
        ("response_logprobs", workload.response_logprobs),
    ):
        cols[name] = torch.nested.nested_tensor([torch.from_numpy(arrays[i]) for i in rows], layout=torch.jagged)
    if workload.images is not None:
        cols["image"] = torch.from_numpy(workload.images[list(groups)]).repeat_interleave(g, dim=0)
    return [workload.traj_id(i) for i in rows], TensorDict(cols, batch_size=len(rows))


def _plain(column: torch.Tensor) -> list[torch.Tensor]:
    """Rows of a column whether TransferQueue returned it dense or nested."""
    return list(column.unbind(0))


def to_train_batch(td: TensorDict) -> TrainBatch:
    """Convert a TransferQueue result (TensorDict, possibly nested columns) into a :class:`TrainBatch`."""
    tokens = {name: _plain(td[name]) for name in TOKEN_FIELDS}
    scalars = {name: torch.stack([t.reshape(()) for t in _plain(td[name])]) for name in SCALAR_FIELDS}
    images = image_index = None
    if "image" in td:
        images = torch.stack(_plain(td["image"]))
        image_index = torch.arange(images.shape[0])
    return TrainBatch(
        traj_index=scalars["traj_index"].to(torch.int64),
        prompt_ids=torch.cat(tokens["prompt_ids"]),
        prompt_cu=cu_seqlens([len(t) for t in tokens["prompt_ids"]]),
        response_ids=torch.cat(tokens["response_ids"]),
        response_cu=cu_seqlens([len(t) for t in tokens["response_ids"]]),
        response_logprobs=torch.cat(tokens["response_logprobs"]),
        reward=scalars["reward"],
        version_start=scalars["version_start"],
        version_end=scalars["version_end"],
        images=images,
        image_index=image_index,
    )


@ray.remote(num_cpus=0)
class TQConsumer:
    """One trainer rank attached to the running TransferQueue."""

    def __init__(self, rank: int, spec: WorkloadSpec, hidden: int) -> None:
        import transfer_queue as tq

        self.rank, self.spec, self.hidden, self.tq = rank, spec, hidden, tq
        warm_up(spec, hidden)
        tq.init()  # attaches to the existing controller, creates this process's client

    def ready(self) -> int:
        return os.getpid()

    def run(self, variant: str, partition: str, fields: list[str], compute: bool) -> dict[str, Any]:
        batches = self._kv(partition) if "kv" in variant.split("_") else self._sampler(partition, fields)
        return rank_loop(self.rank, self.spec, batches, compute=compute, hidden=self.hidden)

    def _kv(self, partition: str) -> Iterator[TrainBatch]:
        for m in range(self.spec.micro_batches):
            keys = [f"t{i:05d}" for i in self.spec.plan(self.rank, m)]
            yield to_train_batch(self.tq.kv_batch_get(keys=keys, partition_id=partition))

    def _sampler(self, partition: str, fields: list[str]) -> Iterator[TrainBatch]:
        client = self.tq.get_client()
        for m in range(self.spec.micro_batches):
            config = {"dp_rank": self.rank, "batch_index": m, "task_name": TASK, "partition_id": partition}
            meta = client.get_meta(
                data_fields=fields,
                batch_size=self.spec.micro_batch_size,
                partition_id=partition,
                task_name=TASK,
                sampling_config=config,
            )
            yield to_train_batch(client.get_data(meta))


class TQRunner:
    """TransferQueue baseline (see module docstring for the variants)."""

    def __init__(self, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown transferqueue variant {variant!r}; choose from {VARIANTS}")
        self.variant = variant
        self.name = f"tq_{variant}"
        self._actors: list[Any] = []
        self._store_root: str | None = None

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self.spec, self.tq = spec, tq
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        knit = self.variant.startswith("kt_")
        ray.init(
            _node_ip_address=options.loopback,
            include_dashboard=False,
            num_cpus=options.logical_cpus,
            logging_level="WARNING",
            log_to_driver=False,
            runtime_env={"worker_process_setup_hook": SETUP_HOOK} if knit else None,
        )
        if knit:
            from knittrans.integrations.transferqueue import register

            register()
            shm = Path("/dev/shm")  # tmpfs, as SimpleStorage keeps its data in memory
            self._store_root = tempfile.mkdtemp(prefix="knittrans_tq_bench_", dir=shm if shm.is_dir() else None)
            backend = {
                "storage_backend": "KnitTrans",
                "KnitTrans": {
                    "media_fields": [] if self.variant.endswith("_nodedup") else ["image"],
                    "store_root": self._store_root,
                    "host": options.loopback,
                },
            }
        else:
            backend = {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2}}
        conf = OmegaConf.create(
            {"controller": {"sampler": tq.RankAwareSampler()}, "backend": backend}, flags={"allow_objects": True}
        )
        tq.init(conf)
        self._actors = [
            TQConsumer.remote(r, spec, options.compute_hidden)  # type: ignore[attr-defined]
            for r in range(spec.ranks)
        ]
        ray.get([a.ready.remote() for a in self._actors])

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        t0 = time.perf_counter()
        for groups in workload.spec.put_batches():  # one kv_batch_put per producer batch of groups
            keys, fields = group_fields(workload, groups)
            self.tq.kv_batch_put(keys=keys, partition_id=tag, fields=fields)
        put_s = time.perf_counter() - t0
        dedup = self.variant.startswith("kt_") and not self.variant.endswith("_nodedup")
        return {"put_s": put_s, "stored_bytes": float(workload.payload_bytes(image_per_row=not dedup))}

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        fields = [*SCALAR_FIELDS, *TOKEN_FIELDS] + (["image"] if self.spec.kind == "multimodal" else [])
        futures = [a.run.remote(self.variant, tag, fields, compute) for a in self._actors]
        return list(ray.get(futures))

    def clear(self, tag: str) -> None:
        self.tq.get_client().clear_partition(tag)

    def teardown(self) -> None:
        for a in self._actors:
            ray.kill(a)
        self._actors = []
        self.tq.close()
        ray.shutdown()
        if self._store_root:
            shutil.rmtree(self._store_root, ignore_errors=True)


def make_runner(variant: str) -> TQRunner:
    """Factory used by the driver."""
    return TQRunner(variant)
