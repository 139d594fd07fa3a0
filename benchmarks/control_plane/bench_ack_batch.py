"""State-thread CPU of applying a mini-batch's acks (``ControlPlane.ack_many``, real SQLite file), this tree vs another.

Run: ``python benchmarks/control_plane/bench_ack_batch.py [--ranks 1024] [--batches 8 128 1024]
[--mini-batches 20] [--runs 5] [--baseline-source DIR] [--out PATH]``. One process per run and tree
(``--baseline-source``: a directory holding another checkout's ``knittrans``, e.g. ``git archive main
knittrans | tar -x -C DIR``), interleaved. Each process builds a ``ControlPlane`` on a SQLite file in a
temp dir (WAL, ``synchronous=NORMAL``, as the server), one job of ``--ranks`` ranks with one row per rank
per mini-batch (the stress case of ``scale.py``), registers the groups of ``--mini-batches`` + 2
mini-batches, then for each mini-batch takes every rank's plan id and acks all ranks in calls of
``--batch`` acks (what the gateway's or the ack batcher's batches are). Measured: the CPU time
(``time.process_time``) of the ``ack_many`` calls only (each applies, admits when a mini-batch is
consumed, and commits), per mini-batch; the median over runs. No event loop and no plan board here:
this is the part of the state thread's work per mini-batch that the ack path itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from delivery_stream import result_header

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GROUP = 8


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One tree, one run: ms of ``ack_many`` CPU per mini-batch for each batch size."""
    from knittrans.api.service import ControlPlane
    from knittrans.api.spec import JobSpec
    from knittrans.api.store import RecordStore
    from knittrans.descriptors import UnitDescriptor

    out: dict[str, Any] = {}
    for batch in args.batches:
        with tempfile.TemporaryDirectory(prefix="knittrans-ack-batch-") as tmp:
            store = RecordStore(str(Path(tmp) / "cp.db"))
            cp = ControlPlane(store)
            per_mb = max(1, args.ranks // GROUP)
            quotas = {"math": per_mb, "code": per_mb}  # per step of 2 mini-batches: per_mb groups each
            spec = {
                "name": "acks",
                "group_size": GROUP,
                "quotas": quotas,
                "mini_batches_per_step": 2,
                "policy": "constraint_preserving",
                "world_size": args.ranks,
                "micro_batch_size": 1,
            }
            cp.create_job(JobSpec.from_dict(spec))
            cp.register_node("n0", "grpc://127.0.0.1:10000", "h0")
            sources = [s for s, q in quotas.items() for _ in range(q)]
            units = []
            for i in range(per_mb * (args.mini_batches + 2)):
                group = {
                    "group_id": f"g{i}",
                    "source": sources[i % len(sources)],
                    "row_start": 0,
                    "num_trajectories": GROUP,
                    "trajectory_tokens": [100] * GROUP,
                    "version_start": 0,
                    "version_end": 0,
                    "version_weighted": 0.0,
                    "finished_at": 1000.0 + i,
                    "media_hashes": [],
                }
                units.append(
                    UnitDescriptor.from_dict(
                        {
                            "unit_id": f"g{i}",
                            "job": "acks",
                            "node_id": "n0",
                            "endpoint": "grpc://127.0.0.1:10000",
                            "num_rows": GROUP,
                            "num_bytes": 4096,
                            "schema_version": 1,
                            "groups": [group],
                        }
                    )
                )
            for start in range(0, len(units), 512):
                cp.register_units("acks", units[start : start + 512])
            spent = 0.0
            for _ in range(args.mini_batches):
                plan_ids = []
                for rank in range(args.ranks):
                    raw = cp.rank_answer("acks", rank)[0]
                    assert raw is not None, "a rank has no plan: too few groups registered"
                    plan_ids.append(json.loads(raw)["plan_id"])
                acks = list(enumerate(plan_ids))
                for start in range(0, len(acks), batch):
                    t0 = time.process_time()
                    results = cp.ack_many("acks", acks[start : start + batch])
                    spent += time.process_time() - t0
                    assert all(isinstance(r, dict) for r in results), results
            store.close()
            out[str(batch)] = spent / args.mini_batches * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 128, 1024], help="acks per ack_many call")
    parser.add_argument("--mini-batches", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline-source", type=Path, default=None)
    parser.add_argument("--baseline-label", default="base")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_ack_batch")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    trees: dict[str, Path] = {"this tree": ROOT}
    if args.baseline_source:
        trees[args.baseline_label] = args.baseline_source.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    loads: list[float] = []
    for i in range(args.runs):
        for name, tree in trees.items():
            loads.append(os.getloadavg()[0])
            cmd = [sys.executable, __file__, "--child", "--ranks", str(args.ranks), "--mini-batches"]
            cmd += [str(args.mini_batches), "--batches", *map(str, args.batches)]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
            runs[name].append(got)
            print(f"[bench_ack_batch] run {i} {name}: {got}", file=sys.stderr, flush=True)
    medians = {name: {b: statistics.median(r[b] for r in rs) for b in rs[0]} for name, rs in runs.items()}
    result = {
        **result_header("control_plane_ack_batch", args),
        "load_avg_1m": loads,
        "runs": runs,
        "medians_ms_per_mini_batch": medians,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    base = medians.get(args.baseline_label)
    lines = [
        f"# State-thread CPU of a mini-batch's acks ({args.ranks} ranks, one row per rank)\n",
        f"{result['machine']}, {result['cpus']} CPUs, commit {result['commit']}; {args.runs} runs of "
        f"{args.mini_batches} mini-batches per tree, interleaved; load {min(loads):.1f}–{max(loads):.1f}; "
        "medians over runs.\n",
        "| tree | acks per `ack_many` call | `ack_many` CPU per mini-batch (ms) | per ack (µs) | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name, by_batch in medians.items():
        for b, ms in by_batch.items():
            ratio = f"{ms / base[b]:.2f}" if base and name != args.baseline_label else "–"
            lines.append(f"| {name} | {b} | {ms:.1f} | {ms / args.ranks * 1e3:.0f} | {ratio} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
