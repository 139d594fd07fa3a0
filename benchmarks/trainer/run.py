"""Trainer ablations (Figure-11 style): sample vs storage-unit fetch, eager vs iter, duplicated vs dedup encoding.

Workload: 512 trajectories per mini-batch, groups of 8 sharing one 256 KiB image (uint8 4x256x256),
4 ranks, micro-batches of 16; tiny Qwen2 (``build_tiny_qwen2``) + ``TinyVisionEncoder``, GRPO loss
through :func:`knittrans.demo.rank.train_mini_batch` (the code ``knittrans train`` runs).
A real control plane and two store processes (LocalCluster) serve real writer units.

Ranks are measured one after another against the same live stores: on 2 cores, 4 rank processes
would fight over the CPUs and every figure would mostly measure contention. Each rank runs all its
mini-batches (so prefetching the next mini-batch overlaps only with that rank's own compute),
without DDP; the normaliser is the rank's share (= 512/4, what the all-reduce gives here).

``iter`` is the client's default: micro-batch i+1 is fetched while i computes, and the next
mini-batch's plan is long-polled (``next?after=``) and its first micro-batches prefetched while
the current one finishes, before the ack. ``iter-within`` turns the second part off
(``prefetch_next=False``): the first micro-batch of every mini-batch is then fetched with
nothing computing. The only transfer ``iter`` cannot hide is the very first micro-batch of a run
(nothing runs before it): every rank first trains ``--warmup`` mini-batches (default 1) that are
left out of the medians for every variant alike, as a steady-state measurement does; the
``*_incl_warmup`` figures keep them (the cold start).

    python benchmarks/trainer/run.py [--repeats 3] [--mini-batches 4] [--warmup 1] [--quick] [--out DIR]

Writes ``trainer.json`` and ``trainer.png`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from knittrans.demo.cluster import ClusterConfig, LocalCluster
from knittrans.demo.rank import Policy, load_policy, train_mini_batch
from knittrans.errors import KnitTransError
from knittrans.flight.client import StoreClient
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import Media, TrajectoryGroup
from knittrans.tickets import Ticket, UnitRead
from knittrans.trainer.client import MicroTiming, MiniBatch, TrainerClient, TrainerConfig, TrainMicroBatch
from knittrans.trainer.convert import to_micro_batch
from knittrans.trainer.fetch import FetchRead
from knittrans.trainer.media import MediaCacheStats, decode_media


@dataclass(frozen=True)
class Variant:
    """One ablation configuration."""

    name: str
    sample_level: bool
    fetch_mode: str
    dedup: bool
    prefetch_next: bool = True
    stream: bool = True


VARIANTS = [
    Variant("sample/eager/dup", True, "eager", False, stream=False),
    Variant("unit/eager-per-micro/dup", False, "eager", False, stream=False),
    Variant("unit/eager/dup", False, "eager", False),
    Variant("unit/iter-within/dup", False, "iter", False, prefetch_next=False),
    Variant("unit/iter/dup", False, "iter", False),
    Variant("unit/iter/dedup", False, "iter", True),
]


class SampleMiniBatch(MiniBatch):
    """Sample-level baseline: one DoGet per trajectory, and each trajectory copies its own media."""

    def _load(self, i: int) -> TrainMicroBatch:
        micro = self.plan.micro_batches[i]
        timing = MicroTiming(global_index=self.global_index, micro_index=i, rows=len(micro.rows))
        t0 = time.perf_counter()
        endpoints = {f.node_id: f.endpoint for f in micro.fetches}
        tables = []
        for row in micro.rows:  # one request per trajectory
            ticket = Ticket(
                job=self.plan.job,
                reads=(UnitRead(unit_id=row.unit_id, row_ranges=((row.row, row.row + 1),)),),
            )
            tables.append(
                self._ctx.fetcher.fetch(
                    [FetchRead(node_id=row.node_id, endpoint=endpoints[row.node_id], ticket=ticket)]
                )
            )
        table = pa.concat_tables(tables)
        t1 = time.perf_counter()
        batch = to_micro_batch(table)
        t2 = time.perf_counter()
        media: dict[str, torch.Tensor] = {}
        moved = 0
        for refs in batch.media_hex():
            for h in refs:  # a private copy per trajectory, no cache
                record = self._fetch_media([h])[h]
                moved += memoryview(record.data).nbytes
                media[h] = decode_media(h, record)
        t3 = time.perf_counter()
        self.moved_bytes = getattr(self, "moved_bytes", 0) + moved
        timing.fetch_s, timing.convert_s, timing.bytes = (t1 - t0) + (t3 - t2), t2 - t1, table.nbytes
        return TrainMicroBatch(index=i, batch=batch, media=media, rows=micro.rows, timing=timing)

    def __iter__(self) -> Iterator[TrainMicroBatch]:
        yield from super().__iter__()
        moved = getattr(self, "moved_bytes", 0)
        self.media_stats = MediaCacheStats(logical_bytes=moved, unique_bytes=moved)


def write_job(
    cluster: LocalCluster,
    job: str,
    *,
    mini_batches: int,
    groups: int,
    group_size: int,
    image: Sequence[int],
    seed: int,
    world: int = 4,
    lookahead: int = 1,
) -> list[Any]:
    """Create the job and write ``mini_batches * groups`` groups (one unit of 8 groups each), round-robin."""
    control = cluster.control()
    control.create_job(
        {
            "name": job,
            "group_size": group_size,
            "quotas": {"mm": groups},
            "mini_batches_per_step": 1,
            "policy": "train_batch",
            "world_size": world,
            "micro_batch_size": 16,
            "total_steps": mini_batches,
            "lookahead": lookahead,
        }
    )
    rng = np.random.default_rng(seed)
    writers = [
        TrajectoryWriter(job=job, node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir) for s in cluster.stores
    ]
    descs = []
    all_groups = []
    for g in range(mini_batches * groups):
        all_groups.append(
            TrajectoryGroup(
                group_id=f"g{g}",
                source="mm",
                prompt_ids=rng.integers(0, 255, 16).astype(np.int32),
                response_ids=[rng.integers(0, 255, 32).astype(np.int32) for _ in range(group_size)],
                response_logprobs=[np.full(32, -np.log(256), np.float32) for _ in range(group_size)],
                rewards=rng.random(group_size).astype(np.float32),
                version_start=0,
                version_end=0,
                media=[Media(kind="image", data=rng.integers(0, 256, tuple(image), dtype=np.uint8))],
                finished_at=1000.0 + g,
            )
        )
    for u, start in enumerate(range(0, len(all_groups), 8)):
        descs.append(writers[u % len(writers)].write_groups(all_groups[start : start + 8]))
    for w in writers:
        w.close()
    control.register_units(job, descs)
    control.close()
    return descs


def delete_job(cluster: LocalCluster, job: str, descs: Sequence[Any]) -> None:
    """Free the job's units on the stores (tmpfs)."""
    clients = {s.node_id: StoreClient(s.endpoint) for s in cluster.stores}
    for d in descs:
        try:
            clients[d.node_id].delete(job, d.unit_id)
        except KnitTransError as exc:
            logging.warning("could not delete %s: %s", d.unit_id, exc)
    for c in clients.values():
        c.close()


def run_variant(
    cluster: LocalCluster, jobs: Sequence[str], v: Variant, base: Policy, *, mini_batches: int, warmup: int = 0
) -> list[dict[str, Any]]:
    """Rank ``r`` trains all its mini-batches of ``jobs[r]`` (one rank's share each), ranks in turn; returns
    one record per rank and mini-batch.

    With lookahead ``L`` the control plane admits at most ``L`` mini-batches beyond the slowest rank, so a
    rank measured alone cannot run ahead in a shared multi-rank job: each measured rank has its own
    world-size-1 job holding exactly a rank's share (``groups / ranks`` groups per mini-batch). The first
    ``warmup`` of the ``warmup + mini_batches`` mini-batches of every rank are marked ``"warmup": True``
    (excluded from the medians, kept in the JSON).
    """
    total = warmup + mini_batches
    records = []
    for rank, job in enumerate(jobs):
        policy = copy.deepcopy(base)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
        cfg = TrainerConfig(
            control_url=cluster.control_url,
            job=job,
            rank=0,
            world_size=1,
            fetch_mode=v.fetch_mode,
            prefetch_next=v.prefetch_next,  # type: ignore[arg-type]
            stream=v.stream,
        )
        # The job finishes only when every rank acked, so a sequentially measured rank stops after its
        # ``mini_batches`` instead of waiting for the end of the job.
        with TrainerClient(cfg) as client:
            if v.sample_level:
                for n in range(total):
                    plan = client.next_plan()
                    assert plan is not None
                    mb: MiniBatch = SampleMiniBatch(client.context, plan)
                    records.append(_train(policy, opt, mb, v.dedup) | {"warmup": n < warmup, "rank": rank})
                    mb.ack()
            else:
                for n, mb in enumerate(client.minibatches()):
                    records.append(_train(policy, opt, mb, v.dedup) | {"warmup": n < warmup, "rank": rank})
                    mb.ack()
                    if n + 1 == total:
                        break
    return records


def _train(policy: Policy, opt: torch.optim.Optimizer, mb: MiniBatch, dedup: bool) -> dict[str, Any]:
    record = train_mini_batch(policy, opt, mb, world_size=1, dedup=dedup)
    assert record is not None, f"mini-batch {mb.plan_id} failed"
    return record


def summarise(all_records: list[dict[str, Any]]) -> dict[str, float]:
    """Per-run figures: exposed transfer per micro-batch, rank time per mini-batch, bytes, encoder rows.

    Measured mini-batches only (warm-up excluded), except ``*_incl_warmup`` figures.
    """
    records = [r for r in all_records if not r.get("warmup")]
    micro = sum(r["micro_batches"] for r in records)
    micro_all = sum(r["micro_batches"] for r in all_records)
    mbs = len({r["global_index"] for r in records})
    firsts = [r["first_wait_s"] for r in records]
    return {
        "exposed_per_micro_ms": 1e3 * sum(r["wait_s"] for r in records) / micro,
        "exposed_per_micro_incl_warmup_ms": 1e3 * sum(r["wait_s"] for r in all_records) / micro_all,
        "first_micro_exposed_ms": 1e3 * statistics.mean(firsts),
        "fetch_per_micro_ms": 1e3 * sum(r["fetch_s"] for r in records) / micro,
        "rank_time_per_mini_batch_s": statistics.mean(r["step_time_s"] for r in records),
        "media_bytes_per_mini_batch": sum(r["media_unique_bytes"] for r in records) / mbs,
        "encoder_rows_per_mini_batch": sum(r["encoded_rows"] for r in records) / mbs,
    }


class _Capture(torch.optim.Optimizer):
    """An "optimizer" whose step records the gradients (and changes nothing)."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        super().__init__(list(params.values()), {})
        self.named = params
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.grads = {n: p.grad.clone() for n, p in self.named.items() if p.grad is not None}


def grad_check(cluster: LocalCluster, model_dir: Path, image_channels: int) -> float:
    """Rank 0's first mini-batch with dup and dedup encoding from the same float64 weights: grads equal."""
    job = "gradcheck"
    descs = write_job(cluster, job, mini_batches=1, groups=8, group_size=8, image=(image_channels, 64, 64), seed=9)
    grads: dict[bool, dict[str, torch.Tensor]] = {}
    base = load_policy(model_dir, image_channels=image_channels, dtype=torch.float64)
    cfg = TrainerConfig(control_url=cluster.control_url, job=job, rank=0, world_size=4, fetch_mode="eager")
    with TrainerClient(cfg) as client:
        plan = client.next_plan()
        assert plan is not None
        for dedup in (False, True):
            policy = copy.deepcopy(base)
            params = dict(policy.backbone.named_parameters()) | {
                f"enc.{n}": p for n, p in policy.encoder.named_parameters()
            }
            capture = _Capture(params)
            train_mini_batch(policy, capture, client.minibatch(plan), world_size=1, dedup=dedup)
            grads[dedup] = capture.grads
    delete_job(cluster, job, descs)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-9)
    return max(float((grads[True][k] - grads[False][k]).abs().max()) for k in grads[True])


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v["name"] for v in result["variants"]]
    panels = [
        ("exposed_per_micro_ms", "exposed transfer / micro-batch (ms)"),
        ("rank_time_per_mini_batch_s", "transfer+train / mini-batch (s)"),
        ("media_bytes_per_mini_batch", "media bytes / mini-batch (MiB)"),
        ("encoder_rows_per_mini_batch", "images encoded / mini-batch"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        vals = [v["median"][key] / (2**20 if "bytes" in key else 1) for v in result["variants"]]
        ax.bar(range(len(names)), vals, color=["#b55", "#d95", "#59c", "#5a5", "#383"])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    w = result["workload"]
    fig.suptitle(
        f"trainer ablations: {w['trajectories']} traj/mini-batch, groups of {w['group_size']} sharing one "
        f"{w['image_kib']} KiB image, {w['ranks']} ranks (sequential), micro-batch 16"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mini-batches", type=int, default=4, help="measured mini-batches per rank and run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured mini-batches per rank and run before them (0: measure the cold start)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="CI smoke (~1 min): 64 trajectories, 2 ranks, 2 mini-batches, 1 repeat"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--lookahead",
        type=int,
        default=1,
        help="admission lookahead L of the jobs (default 1, the control plane's default)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    groups = 8 if args.quick else 64
    repeats = 1 if args.quick else args.repeats
    mini_batches = 2 if args.quick else args.mini_batches
    warmup = args.warmup
    image = (4, 256, 256)
    world = 2 if args.quick else 4
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="knittrans-bench-trainer-", dir=shm))
    result: dict[str, Any] = {
        "workload": {
            "trajectories": groups * 8,
            "group_size": 8,
            "image_kib": 256,
            "ranks": world,
            "micro_batch": 16,
            "mini_batches": mini_batches,
            "warmup_mini_batches": warmup,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            "ranks_measured": "sequentially, one world-size-1 job per rank share",
            "lookahead": args.lookahead,
        }
    }
    try:
        with LocalCluster(ClusterConfig(work_dir=work, num_stores=2)) as cluster:
            model_dir = build_tiny_qwen2(work / "model", hidden=64, layers=1 if args.quick else 2, heads=1, head_dim=64)
            base = load_policy(model_dir, image_channels=image[0])
            runs: dict[str, list[dict[str, float]]] = {v.name: [] for v in VARIANTS}
            raw: dict[str, list[list[dict[str, Any]]]] = {}
            for rep in range(repeats):
                for v in VARIANTS:
                    job = f"r{rep}-{v.name.replace('/', '-').replace('+', '-')}"
                    jobs = [f"{job}-rank{r}" for r in range(world)]
                    descs = {
                        j: write_job(
                            cluster,
                            j,
                            mini_batches=warmup + mini_batches,
                            groups=groups // world,
                            group_size=8,
                            image=image,
                            seed=rep * world + r,
                            world=1,
                            lookahead=args.lookahead,
                        )
                        for r, j in enumerate(jobs)
                    }
                    t0 = time.perf_counter()
                    records = run_variant(cluster, jobs, v, base, mini_batches=mini_batches, warmup=warmup)
                    raw.setdefault(v.name, []).append(records)
                    summary = summarise(records)
                    for j, d in descs.items():
                        delete_job(cluster, j, d)
                    runs[v.name].append(summary)
                    print(
                        f"  repeat {rep + 1}/{repeats} {v.name:28} exposed {summary['exposed_per_micro_ms']:7.2f} "
                        f"ms/micro, {summary['rank_time_per_mini_batch_s']:6.2f} s/mini-batch "
                        f"({time.perf_counter() - t0:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
            print("  gradient check (float64, dup vs dedup) ...", file=sys.stderr, flush=True)
            result["grad_max_abs_diff"] = grad_check(cluster, model_dir, image[0])
            result["grads_equal"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["variants"] = [
        {
            "name": name,
            "runs": rs,
            "median": {k: statistics.median(r[k] for r in rs) for k in rs[0]},
            "records": [[{k: v for k, v in rec.items() if k != "traj_ids"} for rec in recs] for recs in raw[name]],
        }
        for name, rs in runs.items()
    ]
    med = {v["name"]: v["median"] for v in result["variants"]}
    exposed = {name: m["exposed_per_micro_ms"] for name, m in med.items()}
    result["ratios"] = {
        "unit_vs_sample_exposed": exposed["unit/eager/dup"] / exposed["sample/eager/dup"],
        "iter_vs_eager_exposed": exposed["unit/iter/dup"] / exposed["unit/eager/dup"],
        "stream_vs_per_micro_fetch": med["unit/eager/dup"]["fetch_per_micro_ms"]
        / med["unit/eager-per-micro/dup"]["fetch_per_micro_ms"],
        "iter_within_vs_eager_exposed": exposed["unit/iter-within/dup"] / exposed["unit/eager/dup"],
        "iter_vs_eager_exposed_incl_warmup": med["unit/iter/dup"]["exposed_per_micro_incl_warmup_ms"]
        / med["unit/eager/dup"]["exposed_per_micro_incl_warmup_ms"],
        "dup_vs_dedup_media_bytes": med["sample/eager/dup"]["media_bytes_per_mini_batch"]
        / med["unit/iter/dedup"]["media_bytes_per_mini_batch"],
        "dup_vs_dedup_encoder_rows": med["unit/iter/dup"]["encoder_rows_per_mini_batch"]
        / med["unit/iter/dedup"]["encoder_rows_per_mini_batch"],
        "dup_vs_dedup_time": med["unit/iter/dup"]["rank_time_per_mini_batch_s"]
        / med["unit/iter/dedup"]["rank_time_per_mini_batch_s"],
    }
    r = result["ratios"]
    result["targets"] = {
        "iter_exposes_le_10pct_of_eager": r["iter_vs_eager_exposed"] <= 0.10,
        "dedup_media_bytes_ge_5x": r["dup_vs_dedup_media_bytes"] >= 5,
        "dedup_encoder_rows_ge_5x": r["dup_vs_dedup_encoder_rows"] >= 5,
        "grads_equal": result["grads_equal"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "trainer_quick" if args.quick else "trainer"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / f"{name}.png")
    print(
        f"{'variant':28}{'exposed ms/micro':>18}{'incl warm-up':>14}{'1st micro ms':>14}{'fetch ms/micro':>16}"
        f"{'s/mini-batch':>14}{'media MiB/mb':>14}{'enc rows/mb':>13}"
    )
    for v in result["variants"]:
        m = v["median"]
        print(
            f"{v['name']:28}{m['exposed_per_micro_ms']:>18.2f}{m['exposed_per_micro_incl_warmup_ms']:>14.2f}"
            f"{m['first_micro_exposed_ms']:>14.2f}"
            f"{m['fetch_per_micro_ms']:>16.2f}"
            f"{m['rank_time_per_mini_batch_s']:>14.2f}{m['media_bytes_per_mini_batch'] / 2**20:>14.1f}"
            f"{m['encoder_rows_per_mini_batch']:>13.0f}"
        )
    for k, val in r.items():
        print(f"  {k:32} {val:8.3f}")
    print(f"  gradients dup vs dedup equal (assert_close rtol 1e-5): max abs diff {result['grad_max_abs_diff']:.2e}")
    print("  targets: " + ", ".join(f"{k}={v}" for k, v in result["targets"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
