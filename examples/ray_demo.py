"""The demo workload on a local Ray cluster: stores and control plane as actors, rollout and ranks as tasks.

    python examples/ray_demo.py --steps 2 --out /tmp/kt-ray      # needs: pip install 'knittrans[ray]'

Loopback only: Ray is started on 127.0.0.1 (``_node_ip_address``), every KnitTrans process binds
its node's address, i.e. 127.0.0.1 here and the node's own IP on a real cluster. On a real cluster
replace ``ray.init(...)`` with ``ray.init(address="auto")``: one store per node comes for free.
Writes ``<out>/results.json`` (control-plane status and the ranks' records) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUOTAS = {"math": 4, "mm_qa": 4}
SOURCES = ["math:8-16:4-12", "mm_qa:8-16:16-32:image=3x32x32"]


def run_knittrans(argv: list[str], env: dict[str, str], log_path: str) -> int:
    """Ray task body: run one ``knittrans`` CLI process on the task's node; its exit code."""
    with open(log_path, "ab") as log:
        return subprocess.run(
            [sys.executable, "-m", "knittrans.cli", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            check=False,
        ).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="train steps (default 2)")
    parser.add_argument("--mini-batches", type=int, default=4, help="mini-batches per step (default 4)")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from knittrans.controlclient import ControlClient
    from knittrans.integrations.ray import node_affinity, start_cluster
    from knittrans.procs import free_port
    from knittrans.rollout.models import build_tiny_qwen2

    out = args.out or Path(tempfile.mkdtemp(prefix="knittrans-ray-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    weights = out / "weights"
    weights.mkdir(exist_ok=True)
    model_dir = build_tiny_qwen2(out / "model", seed=0)
    tokens = {k: secrets.token_hex(16) for k in ("worker", "admin", "store")}
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    store_root = Path(tempfile.mkdtemp(prefix="knittrans-ray-", dir=shm))

    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=max(4, args.ranks + 2), include_dashboard=False, log_to_driver=False
    )
    started = time.monotonic()
    kt = start_cluster(
        out,
        worker_token=tokens["worker"],
        store_token=tokens["store"],
        admin_token=tokens["admin"],
        store_root=store_root,
        node_timeout_s=30,
        control_port=free_port("127.0.0.1"),
    )
    try:
        with ControlClient(kt.control_url, token=tokens["admin"]) as admin:
            admin.create_job(
                {
                    "name": "demo",
                    "group_size": 4,
                    "quotas": QUOTAS,
                    "mini_batches_per_step": args.mini_batches,
                    "policy": "constraint_preserving",
                    "world_size": args.ranks,
                    "micro_batch_size": 4,
                    "total_steps": args.steps,
                }
            )
        task = ray.remote(run_knittrans)
        env = kt.env()
        rollouts = []
        for i, store in enumerate(kt.stores * 2):  # two workers per node, each can generate every source
            argv = [
                "rollout",
                *kt.rollout_args(store.ray_node_id),
                "--job",
                "demo",
                "--worker-id",
                f"ray-w{i}",
                "--model-dir",
                str(model_dir),
                "--weights-dir",
                str(weights),
                "--state-file",
                str(out / f"rollout-{i}.json"),
                "--group-size",
                "4",
                "--chunk-tokens",
                "8",
                "--seed",
                str(i),
            ]
            for s in SOURCES:
                argv += ["--source", s]
            rollouts.append(
                task.options(num_cpus=1, scheduling_strategy=node_affinity(store.ray_node_id)).remote(
                    argv, env, str(out / "logs" / f"rollout-{i}.log")
                )
            )
        dist_url = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        ranks = []
        for rank in range(args.ranks):
            argv = [
                "train",
                "--control-url",
                kt.control_url,
                "--job",
                "demo",
                "--rank",
                str(rank),
                "--world-size",
                str(args.ranks),
                "--dist-url",
                dist_url,
                "--model-dir",
                str(model_dir),
                "--weights-dir",
                str(weights),
                "--lr",
                "1e-3",
                "--out",
                str(out / f"rank-{rank}.jsonl"),
            ]
            ranks.append(task.options(num_cpus=1).remote(argv, env, str(out / "logs" / f"rank-{rank}.log")))
        codes = ray.get(ranks, timeout=args.timeout_s)
        if any(codes):
            raise RuntimeError(f"trainer ranks exited with {codes}; logs in {out / 'logs'}")
        rollout_codes = ray.get(rollouts, timeout=120)
        with ControlClient(kt.control_url, token=tokens["worker"]) as control:
            status = control.status("demo")
        records = [
            json.loads(line)
            for p in sorted(out.glob("rank-*.jsonl"))
            for line in p.read_text().splitlines()
            if line.strip()
        ]
        results: dict[str, Any] = {
            "wall_s": time.monotonic() - started,
            "ray_nodes": len([n for n in ray.nodes() if n["Alive"]]),
            "control_url": kt.control_url,
            "stores": [s.__dict__ for s in kt.stores],
            "rollout_exit_codes": rollout_codes,
            "status": status,
            "rank_records": records,
        }
        (out / "results.json").write_text(json.dumps(results, indent=2))
        arch = status["staleness"]["overall"]["end"]["architectural"]["mean"]
        print(
            f"ray demo: {status['counts']['consumed_mini_batches']} mini-batches over {args.steps} steps, "
            f"state {status['state']}, {len(kt.stores)} store(s) on {results['ray_nodes']} Ray node(s), "
            f"mean architectural staleness (end) {arch}, wall {results['wall_s']:.1f} s; results in {out}"
        )
        return 0 if status["state"] == "completed" else 1
    finally:
        kt.shutdown()
        ray.shutdown()
        import shutil

        shutil.rmtree(store_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
