"""System (c): KnitTrans — control plane + 2 store nodes (real processes) + 4 ``TrainerClient`` ranks.

Variants (all: producer on the stores' host writes units through the shared directory, as a rollout
worker next to its store node does, one unit per producer batch of ``spec.groups_per_put`` groups,
batches alternating between the two nodes; one job for the whole run, one train step per ``put``;
ranks read their share through share streams, one rows and one media ``DoGet`` per node, with
``prefetch_depth`` = the share's micro-batches):

* ``flight`` — ranks fetch rows and media from the store nodes over loopback (the data lane, else
  Flight ``DoGet``), what a trainer on another host does; ``fetch_mode="iter"``, the default
  (micro-batch ``i+1`` loaded while ``i`` trains, and the next mini-batch's manifest taken and its
  loading started while the current one finishes, before the ack).
* ``flight_eager`` — the same with ``fetch_mode="eager"`` (the whole share fetched before the first).
* ``mmap`` — same-host short-circuit: ``local_dirs`` makes ranks memory-map the units (no Flight);
  ``iter`` mode.  Only valid when trainer and store share a host; labelled separately for that reason.

Job spec = the workload: ``group_size=8``, one source with quota ``num_groups`` (one train batch =
the 512-trajectory mini-batch), ``K=1``, ``world_size=4``, ``micro_batch_size=16``, projection to the
columns the workload uses.  The scheduler balances ranks by tokens over whole groups; with the
workload's seed every rank gets 16 groups = 8 micro-batches of 16 (checked at run time), but *which*
groups differs from the baselines' fixed plan, so KnitTrans is compared row by row (see aggregate.py).

Consumer ranks are 4 persistent subprocesses (``python -m ...knittrans_runner knittrans_consumer``),
like the baselines' 4 Ray actor processes: one process per rank, started and warmed up in ``setup``.
They take commands as JSON lines on stdin and answer one JSON line on stdout.  Each consume is one
mini-batch: waiting for its manifest is inside the first micro-batch's wait, the ack after the
optimizer step is added to the rank's transfer+train time. Every client setting is the default but
``fetch_mode``, ``local_dirs`` and ``prefetch_depth``.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from benchmarks.vs_baselines.common import RunnerOptions, rank_loop, warm_up
from benchmarks.vs_baselines.rankprocs import RankProcesses, rank_main, read_config, serve_commands
from benchmarks.vs_baselines.workload import TrainBatch, Workload, WorkloadSpec

__all__ = ["COLUMNS", "VARIANTS", "KnitTransRunner", "make_runner", "to_train_batch"]

logger = logging.getLogger(__name__)

VARIANTS = ("flight", "flight_eager", "mmap")
ALIASES = {"default": "flight"}
JOB = "bench"
SOURCE = "bench"
COLUMNS = (
    "traj_id",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "reward",
    "version_start",
    "version_end",
    "media",
)
"""Columns the ranks fetch (the job spec's projection): what the workload has, nothing more."""


def to_train_batch(micro: Any) -> TrainBatch:
    """A :class:`TrainMicroBatch` (tensors are zero-copy views of Arrow buffers) as the workload's batch."""
    b = micro.batch
    ids = [int(s[1:]) for s in b.table.column("traj_id").to_pylist()]  # "t00012" -> 12
    images = image_index = None
    if micro.media:
        refs = [row[0] for row in b.media_hex()]
        uniq = list(dict.fromkeys(refs))
        slot = {h: i for i, h in enumerate(uniq)}
        # numpy's stack: torch.stack/cat of uint8 images runs intra-op threads (slow on a busy 2-core host)
        images = torch.from_numpy(np.stack([micro.media[h].numpy() for h in uniq]))
        image_index = torch.tensor([slot[h] for h in refs], dtype=torch.int64)
    return TrainBatch(
        traj_index=torch.tensor(ids, dtype=torch.int64),
        prompt_ids=b.prompt_ids,
        prompt_cu=b.prompt_cu_seqlens.long(),
        response_ids=b.response_ids,
        response_cu=b.response_cu_seqlens.long(),
        response_logprobs=b.response_logprobs,
        reward=b.rewards,
        version_start=b.version_start,
        version_end=b.version_end,
        images=images,
        image_index=image_index,
    )


def build_groups(workload: Workload, tag: str) -> list[Any]:
    """The workload's groups as :class:`TrajectoryGroup`\\ s (trajectory ids ``t00012`` as the harness uses)."""
    from knittrans.schema import Media, TrajectoryGroup

    spec, g = workload.spec, workload.spec.group_size
    out = []
    for k in range(spec.num_groups):
        rows = list(range(k * g, (k + 1) * g))
        media = [Media(kind="image", data=workload.images[k])] if workload.images is not None else []
        out.append(
            TrajectoryGroup(
                group_id=f"{tag}-g{k:04d}",
                source=SOURCE,
                prompt_ids=workload.prompt_ids[rows[0]],
                response_ids=[workload.response_ids[i] for i in rows],
                response_logprobs=[workload.response_logprobs[i] for i in rows],
                rewards=workload.reward[rows],
                version_start=workload.version_start[rows],
                version_end=workload.version_end[rows],
                media=media,
                traj_ids=[workload.traj_id(i) for i in rows],
            )
        )
    return out


class KnitTransRunner:
    """KnitTrans under the harness (see the module docstring for the variants)."""

    def __init__(self, variant: str) -> None:
        variant = ALIASES.get(variant, variant)
        if variant not in VARIANTS:
            raise ValueError(f"unknown knittrans variant {variant!r}; choose from {VARIANTS}")
        self.variant = variant
        self.name = f"knittrans_{variant}"
        self._ranks: RankProcesses | None = None
        self._descs: dict[str, list[Any]] = {}
        self._work: Path | None = None
        self._cluster: Any = None

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        from knittrans.local import ClusterConfig, LocalCluster
        from knittrans.rollout.writer import TrajectoryWriter

        self.spec = spec
        shm = Path("/dev/shm")  # tmpfs, like Ray's plasma store and TransferQueue's in-memory storage
        self._work = Path(tempfile.mkdtemp(prefix="knittrans_bench_", dir=shm if shm.is_dir() else None))
        self._cluster = LocalCluster(ClusterConfig(work_dir=self._work, num_stores=2, host=options.loopback))
        self._cluster.start()
        self.control = self._cluster.control()
        self.control.create_job(
            {
                "name": JOB,
                "group_size": spec.group_size,
                "quotas": {SOURCE: spec.num_groups},
                "mini_batches_per_step": 1,
                "policy": "train_batch",
                "world_size": spec.ranks,
                "micro_batch_size": spec.micro_batch_size,
                "columns": list(COLUMNS),
            }
        )
        self.writers = [
            TrajectoryWriter(job=JOB, node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir)
            for s in self._cluster.stores
        ]
        config = {
            "control_url": self._cluster.control_url,
            "job": JOB,
            "world_size": spec.ranks,
            "fetch_mode": "eager" if self.variant == "flight_eager" else "iter",
            "local_dirs": {s.node_id: str(s.store_dir) for s in self._cluster.stores} if self.variant == "mmap" else {},
            "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
            "hidden": options.compute_hidden,
        }
        self._ranks = RankProcesses(
            "benchmarks.vs_baselines.knittrans_runner", "knittrans_consumer", spec.ranks, config
        )

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        t0 = time.perf_counter()
        groups = build_groups(workload, tag)
        # one unit per producer batch of groups, batches alternating between the two store nodes
        descs = [
            self.writers[k % len(self.writers)].write_groups(groups[b.start : b.stop])
            for k, b in enumerate(self.spec.put_batches())
        ]
        t1 = time.perf_counter()
        self.control.register_units(JOB, descs)
        t2 = time.perf_counter()
        self._descs[tag] = descs
        return {
            "put_s": t2 - t0,
            "write_s": t1 - t0,
            "register_s": t2 - t1,
            "stored_bytes": float(workload.payload_bytes(image_per_row=False)),
            "unit_bytes": float(sum(d.num_bytes for d in descs)),
        }

    def _server_cpu(self) -> dict[str, float]:
        """CPU seconds so far of the store nodes and the control plane (all their threads)."""
        import psutil

        out: dict[str, float] = {}
        for name, proc in self._cluster.procs.children.items():
            role = "control_plane" if name.startswith("control") else "stores"
            try:
                t = psutil.Process(proc.pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        before = self._server_cpu()
        assert self._ranks is not None
        self._ranks.send({"cmd": "run", "compute": compute, "tag": tag})
        ranks = self._ranks.receive()
        after = self._server_cpu()
        # servers' CPU during the consume (plans, acks, DoGets), reported with rank 0
        ranks[0]["server_cpu_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
        return ranks

    def clear(self, tag: str) -> None:
        by_node = {w.node_id: w for w in self.writers}
        for d in self._descs.pop(tag, []):
            by_node[d.node_id].client.delete(JOB, d.unit_id)

    def teardown(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
        for w in getattr(self, "writers", []):
            w.close()
        if getattr(self, "control", None) is not None:
            self.control.close()
        if self._cluster is not None:  # nothing to keep: short grace before SIGKILL
            self._cluster.procs.stop_all(grace_s=2.0)
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)


def make_runner(variant: str) -> KnitTransRunner:
    """Factory used by the driver."""
    return KnitTransRunner(variant)


# ---------------------------------------------------------------------- consumer rank (subprocess)
def _rank_batches(mbs: Iterator[Any], state: dict[str, Any]) -> Iterator[TrainBatch]:
    mb = next(mbs)  # waiting for the manifest: part of the first micro-batch's wait
    state["mb"] = mb
    for micro in mb:
        yield micro.prepared  # to_train_batch, run by the client where it loaded the micro-batch


def _serve(rank: int, inp: IO[str], out: IO[str]) -> None:
    from knittrans.trainer.client import TrainerClient, TrainerConfig

    config, spec, hidden = read_config(inp)
    warm_up(spec, hidden)
    cfg = TrainerConfig(
        control_url=config["control_url"],
        job=config["job"],
        rank=rank,
        world_size=int(config["world_size"]),
        fetch_mode=config["fetch_mode"],
        local_dirs=config["local_dirs"],
        prefetch_depth=spec.micro_batches,
    )
    # The conversion to the workload's TrainBatch is the client's transform (its collate function):
    # it runs in the prefetch thread, off the training loop, as a DataLoader's collate_fn would.
    # The client connects to the control plane and every store node when it starts, as the baselines'
    # consumers attach at start-up (the harness's warm-up mini-batch follows before any measured one).
    with TrainerClient(cfg, transform=to_train_batch) as client:
        mbs = client.minibatches()

        def run(cmd: dict[str, Any]) -> dict[str, Any]:
            state: dict[str, Any] = {}
            batches = _rank_batches(mbs, state)
            result = rank_loop(rank, spec, batches, compute=bool(cmd["compute"]), hidden=hidden)
            extra = list(batches)
            mb = state["mb"]
            if extra or mb.num_micro_batches != spec.micro_batches:
                raise RuntimeError(
                    f"plan of rank {rank} has {mb.num_micro_batches} micro-batches, "
                    f"the workload expects {spec.micro_batches}"
                )
            t0 = time.perf_counter()
            mb.ack()  # after the optimizer step, as a trainer does; counted in transfer+train
            ack_s = time.perf_counter() - t0
            result["train_s"] += ack_s
            result["ack_s"] = ack_s
            for rec, timing in zip(result["micro"], mb.timings, strict=True):
                rec["load_s"] = timing.fetch_s + timing.convert_s + timing.transform_s  # unoverlapped
                rec["client_wait_s"] = timing.wait_s
            result["media"] = {
                k: getattr(mb.media_stats, k) for k in ("requests", "hits", "fetched", "logical_bytes", "unique_bytes")
            }
            return result

        serve_commands(inp, out, run)


def main(argv: list[str] | None = None) -> int:
    return rank_main("knittrans_consumer", "KnitTrans consumer rank of the vs_baselines benchmark", _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
