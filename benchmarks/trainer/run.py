"""Trainer ablations: eager vs iter fetch, duplicated vs deduplicated encoding, with the shipped client.

Workload: 512 trajectories per mini-batch, groups of 8 sharing one 256 KiB image (uint8 4x256x256),
4 ranks, micro-batches of 16; tiny Qwen2 (``build_tiny_qwen2``) + ``TinyVisionEncoder``, GRPO loss
through :func:`knittrans.demo.rank.train_mini_batch` (the code ``knittrans train`` runs).
A real control plane and two store processes (LocalCluster) serve real writer units.

Ranks are measured one after another against the same live stores: on 2 cores, 4 rank processes
would fight over the CPUs and every figure would mostly measure contention. Each rank runs all its
mini-batches without DDP; the normaliser is the rank's share (= 512/4, what the all-reduce gives here).

Variants are what a user picks with the shipped API: ``TrainerConfig.fetch_mode`` (``eager``: the
whole share before the first micro-batch; ``iter``, the default: micro-batch i+1 loaded while i
computes, and the next mini-batch's manifest taken and its loading started while the current one
finishes) and ``train_mini_batch(dedup=...)`` (each unique image encoded once per mini-batch; the
default). Every client setting is the default. The only transfer ``iter`` cannot hide is the first
micro-batch of a run (nothing computes before it): every rank first trains ``--warmup`` mini-batches
(default 1) left out of the figures for every variant alike; ``*_incl_warmup`` keeps them.

    python benchmarks/trainer/run.py [--repeats 3] [--mini-batches 4] [--warmup 1] [--quick] [--out DIR]

Writes ``trainer.json`` and ``trainer.png`` under ``--out`` and prints a table. ``pair.py trainer``
measures the default variant against another checkout, interleaved.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from common import distribution, machine

from knittrans.demo.rank import Policy, load_policy, train_mini_batch
from knittrans.errors import KnitTransError
from knittrans.flight.client import StoreClient
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import Media, TrajectoryGroup
from knittrans.trainer.client import MiniBatch, TrainerClient, TrainerConfig

IMAGE = (4, 256, 256)
GROUP_SIZE = 8


@dataclass(frozen=True)
class Variant:
    """One configuration a user picks with the shipped API: the client's fetch mode, the encoder's dedup."""

    name: str
    fetch_mode: Literal["eager", "iter"]
    dedup: bool


VARIANTS = [
    Variant("eager/dup", "eager", False),
    Variant("iter/dup", "iter", False),
    Variant("iter/dedup", "iter", True),
]
DEFAULT = VARIANTS[-1]
"""The shipped defaults: ``TrainerConfig.fetch_mode="iter"``, ``train_mini_batch(dedup=True)``."""


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
    lookahead: int | None = None,
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
        }
        | ({"lookahead": lookahead} if lookahead is not None else {})
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


def train_rank(
    cluster: LocalCluster, job: str, v: Variant, base: Policy, *, mini_batches: int, warmup: int
) -> list[dict[str, Any]]:
    """One rank trains ``warmup + mini_batches`` mini-batches of ``job`` (a world-size-1 job holding one rank's
    share) with a fresh client of default settings but ``fetch_mode``; one record per mini-batch, the first
    ``warmup`` marked ``"warmup": True``.

    The job finishes only when every rank acked, so the loop stops after its mini-batches instead of waiting
    for the end of the job. Uses only the client API every tree since 7fe2783 has (``pair.py`` runs it with
    other checkouts' ``knittrans``).
    """
    policy = copy.deepcopy(base)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    cfg = TrainerConfig(control_url=cluster.control_url, job=job, rank=0, world_size=1, fetch_mode=v.fetch_mode)
    records = []
    total = warmup + mini_batches
    with TrainerClient(cfg) as client:
        for n, mb in enumerate(client.minibatches()):
            record = _train(policy, opt, mb, v.dedup)
            mb.ack()
            records.append({k: x for k, x in record.items() if k != "traj_ids"} | {"warmup": n < warmup})
            if n + 1 == total:
                break
    return records


def run_variant(
    cluster: LocalCluster, jobs: Sequence[str], v: Variant, base: Policy, *, mini_batches: int, warmup: int = 0
) -> list[dict[str, Any]]:
    """Rank ``r`` trains all its mini-batches of ``jobs[r]`` (one rank's share each), ranks in turn; returns
    one record per rank and mini-batch.

    With lookahead ``L`` the control plane admits at most ``L`` mini-batches beyond the slowest rank, so a
    rank measured alone cannot run ahead in a shared multi-rank job: each measured rank has its own
    world-size-1 job holding exactly a rank's share (``groups / ranks`` groups per mini-batch).
    """
    records = []
    for rank, job in enumerate(jobs):
        for record in train_rank(cluster, job, v, base, mini_batches=mini_batches, warmup=warmup):
            records.append(record | {"rank": rank})
    return records


def _train(policy: Policy, opt: torch.optim.Optimizer, mb: MiniBatch, dedup: bool) -> dict[str, Any]:
    record = train_mini_batch(policy, opt, mb, world_size=1, dedup=dedup)
    assert record is not None, f"mini-batch {mb.plan_id} failed"
    return record


def summarise(all_records: list[dict[str, Any]]) -> dict[str, float]:
    """Per-run figures: exposed transfer per micro-batch and per rank and mini-batch, rank time per mini-batch,
    media bytes (moved and as per-trajectory copies), encoder rows.

    Measured mini-batches only (warm-up excluded), except ``*_incl_warmup`` figures.
    """
    records = [r for r in all_records if not r.get("warmup")]
    micro = sum(r["micro_batches"] for r in records)
    micro_all = sum(r["micro_batches"] for r in all_records)
    mbs = len(records)
    per_mb = distribution([1e3 * r["wait_s"] for r in records])
    return {
        "exposed_per_micro_ms": 1e3 * sum(r["wait_s"] for r in records) / micro,
        "exposed_per_micro_incl_warmup_ms": 1e3 * sum(r["wait_s"] for r in all_records) / micro_all,
        "exposed_per_mini_batch_p50_ms": per_mb["p50"],
        "exposed_per_mini_batch_mean_ms": per_mb["mean"],
        "exposed_per_mini_batch_p99_ms": per_mb["p99"],
        "first_micro_exposed_ms": 1e3 * statistics.mean(r["first_wait_s"] for r in records),
        "fetch_per_micro_ms": 1e3 * sum(r["fetch_s"] for r in records) / micro,
        "rank_time_per_mini_batch_s": statistics.mean(r["step_time_s"] for r in records),
        "media_bytes_per_mini_batch": sum(r["media_unique_bytes"] for r in records) / mbs,
        "media_logical_bytes_per_mini_batch": sum(r["media_logical_bytes"] for r in records) / mbs,
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
        shared = client.feed.share(client.feed.start())
        assert shared is not None
        plan, etag = shared
        for dedup in (False, True):
            policy = copy.deepcopy(base)
            params = dict(policy.backbone.named_parameters()) | {
                f"enc.{n}": p for n, p in policy.encoder.named_parameters()
            }
            capture = _Capture(params)
            train_mini_batch(policy, capture, client.minibatch(plan, etag), world_size=1, dedup=dedup)
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
        ("media_bytes_per_mini_batch", "media bytes moved / mini-batch (MiB)"),
        ("encoder_rows_per_mini_batch", "images encoded / mini-batch"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        vals = [v["median"][key] / (2**20 if "bytes" in key else 1) for v in result["variants"]]
        ax.bar(range(len(names)), vals, color=["#59c", "#5a5", "#383"][: len(names)])
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    w = result["workload"]
    fig.suptitle(
        f"trainer ablations: {w['trajectories']} traj/mini-batch, groups of {w['group_size']} sharing one "
        f"{w['image_kib']} KiB image, {w['ranks']} ranks (sequential), micro-batch 16"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = [
    ("exposed_per_micro_ms", "exposed ms/micro", 1.0, ".2f"),
    ("exposed_per_micro_incl_warmup_ms", "incl warm-up", 1.0, ".2f"),
    ("exposed_per_mini_batch_p50_ms", "per mb p50", 1.0, ".2f"),
    ("exposed_per_mini_batch_mean_ms", "mean", 1.0, ".2f"),
    ("exposed_per_mini_batch_p99_ms", "p99", 1.0, ".2f"),
    ("first_micro_exposed_ms", "1st micro ms", 1.0, ".2f"),
    ("fetch_per_micro_ms", "fetch ms/micro", 1.0, ".2f"),
    ("rank_time_per_mini_batch_s", "s/mini-batch", 1.0, ".3f"),
    ("media_bytes_per_mini_batch", "media MiB/mb", 2.0**20, ".1f"),
    ("encoder_rows_per_mini_batch", "enc rows/mb", 1.0, ".0f"),
]


def table(result: dict[str, Any]) -> str:
    """The medians as a markdown table (exposed per mini-batch: each rank's waits summed over a mini-batch)."""
    lines = [
        "| variant | " + " | ".join(label for _, label, _, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for v in result["variants"]:
        m = v["median"]
        lines.append(f"| {v['name']} | " + " | ".join(f"{m[k] / scale:{fmt}}" for k, _, scale, fmt in COLUMNS) + " |")
    return "\n".join(lines)


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
        default=None,
        help="admission lookahead L of the jobs (default: the control plane's, 1)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    groups = 8 if args.quick else 64
    repeats = 1 if args.quick else args.repeats
    mini_batches = 2 if args.quick else args.mini_batches
    warmup = args.warmup
    world = 2 if args.quick else 4
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="knittrans-bench-trainer-", dir=shm))
    result: dict[str, Any] = {
        "machine": machine(),
        "workload": {
            "trajectories": groups * GROUP_SIZE,
            "group_size": GROUP_SIZE,
            "image_kib": int(np.prod(IMAGE)) // 1024,
            "ranks": world,
            "micro_batch": 16,
            "mini_batches": mini_batches,
            "warmup_mini_batches": warmup,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            "ranks_measured": "sequentially, one world-size-1 job per rank share",
            "lookahead": args.lookahead,
        },
    }
    try:
        with LocalCluster(ClusterConfig(work_dir=work, num_stores=2)) as cluster:
            model_dir = build_tiny_qwen2(work / "model", hidden=64, layers=1 if args.quick else 2, heads=1, head_dim=64)
            base = load_policy(model_dir, image_channels=IMAGE[0])
            runs: dict[str, list[dict[str, float]]] = {v.name: [] for v in VARIANTS}
            raw: dict[str, list[list[dict[str, Any]]]] = {v.name: [] for v in VARIANTS}
            for rep in range(repeats):
                for v in VARIANTS:  # interleaved, so load drifts hit every variant alike
                    jobs = [f"r{rep}-{v.name.replace('/', '-')}-rank{r}" for r in range(world)]
                    descs = {
                        j: write_job(
                            cluster,
                            j,
                            mini_batches=warmup + mini_batches,
                            groups=groups // world,
                            group_size=GROUP_SIZE,
                            image=IMAGE,
                            seed=rep * world + r,
                            world=1,
                            lookahead=args.lookahead,
                        )
                        for r, j in enumerate(jobs)
                    }
                    t0 = time.perf_counter()
                    records = run_variant(cluster, jobs, v, base, mini_batches=mini_batches, warmup=warmup)
                    for j, d in descs.items():
                        delete_job(cluster, j, d)
                    summary = summarise(records)
                    raw[v.name].append(records)
                    runs[v.name].append(summary)
                    print(
                        f"  repeat {rep + 1}/{repeats} {v.name:12} exposed {summary['exposed_per_micro_ms']:7.2f} "
                        f"ms/micro, {summary['rank_time_per_mini_batch_s']:6.3f} s/mini-batch "
                        f"({time.perf_counter() - t0:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
            print("  gradient check (float64, dup vs dedup) ...", file=sys.stderr, flush=True)
            result["grad_max_abs_diff"] = grad_check(cluster, model_dir, IMAGE[0])
            result["grads_equal"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    result["variants"] = [
        {
            "name": name,
            "runs": rs,
            "median": {k: statistics.median(r[k] for r in rs) for k in rs[0]},
            "records": raw[name],
        }
        for name, rs in runs.items()
    ]
    med = {v["name"]: v["median"] for v in result["variants"]}
    result["ratios"] = {
        "iter_vs_eager_exposed": med["iter/dup"]["exposed_per_micro_ms"] / med["eager/dup"]["exposed_per_micro_ms"],
        "iter_vs_eager_exposed_incl_warmup": med["iter/dup"]["exposed_per_micro_incl_warmup_ms"]
        / med["eager/dup"]["exposed_per_micro_incl_warmup_ms"],
        "media_copies_vs_moved_bytes": med["iter/dedup"]["media_logical_bytes_per_mini_batch"]
        / med["iter/dedup"]["media_bytes_per_mini_batch"],
        "dup_vs_dedup_encoder_rows": med["iter/dup"]["encoder_rows_per_mini_batch"]
        / med["iter/dedup"]["encoder_rows_per_mini_batch"],
        "dup_vs_dedup_time": med["iter/dup"]["rank_time_per_mini_batch_s"]
        / med["iter/dedup"]["rank_time_per_mini_batch_s"],
    }
    r = result["ratios"]
    result["targets"] = {
        "iter_exposes_le_10pct_of_eager": r["iter_vs_eager_exposed"] <= 0.10,
        "media_bytes_moved_ge_5x_fewer_than_copies": r["media_copies_vs_moved_bytes"] >= 5,
        "dedup_encoder_rows_ge_5x": r["dup_vs_dedup_encoder_rows"] >= 5,
        "grads_equal": result["grads_equal"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "trainer_quick" if args.quick else "trainer"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / f"{name}.png")
    m = result["machine"]
    print(
        f"commit {m['commit']}, {m['date']}, {m['cpus']} CPUs {m['cpu_model']}, "
        f"load {m['loadavg'][0]:.1f} -> {m['loadavg_end'][0]:.1f}; medians of {repeats} repeats"
    )
    print(table(result))
    for k, val in r.items():
        print(f"  {k:36} {val:8.3f}")
    print(f"  gradients dup vs dedup equal (assert_close rtol 1e-5): max abs diff {result['grad_max_abs_diff']:.2e}")
    print("  targets: " + ", ".join(f"{k}={v}" for k, v in result["targets"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
