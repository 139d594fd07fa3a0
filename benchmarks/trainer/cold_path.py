"""Cold path: admission -> first micro-batch ready, for a fresh client process and for later mini-batches.

A real control plane and two store processes (LocalCluster) on 127.0.0.1; one rank. Every
mini-batch's units are written beforehand and registered one mini-batch at a time while the
trainer loop already waits, so admission happens at a known moment (the control plane stamps
``admitted_at`` in the manifest). Measured, per mini-batch: ``admitted_at`` -> the rank's share
reached the client (``received_at``) -> the training loop holds micro-batch 0 (wall clock, same host).

- ``cold``: the first mini-batch of a fresh rank process (imports done, its :class:`TrainerClient` made
  0.4 s before the admission, nothing of it used yet): what every job start pays.
- ``warm``: mini-batches 2.. of the same client.

The client runs with its shipped defaults. Each run is a fresh job, a fresh rank process and a fresh
rollout process (which writes each mini-batch's units and registers them on request, as a rollout
worker does). The report gives p50 / mean / p99 over all mini-batches of a kind and the median over
runs of each run's p50. ``--depths`` also measures the steady-state exposed wait per micro-batch for
several ``prefetch_depth`` values (a synthetic compute step per micro-batch), which chose its default.

    python benchmarks/trainer/cold_path.py [--runs 5] [--warm 8] [--depths 1,2,4,8] [--out DIR]

Writes ``cold_path.json`` and ``cold_path.md`` under ``--out`` (default benchmarks/trainer/results).
``pair.py cold`` runs the same runs against another checkout, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import distribution, machine

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup

GROUP_SIZE, GROUPS, MICRO = 8, 4, 8  # 32 trajectories per mini-batch, 4 micro-batches of 8
PROMPT, RESPONSE = 128, 256
SCRIPT = str(Path(__file__).resolve())


def groups(prefix: str, seed: int) -> list[TrajectoryGroup]:
    """Text-only GRPO groups (prompt 128, responses 256 tokens)."""
    rng = np.random.default_rng(seed)
    return [
        TrajectoryGroup(
            group_id=f"{prefix}g{g}",
            source="text",
            prompt_ids=rng.integers(0, 32000, PROMPT).astype(np.int32),
            response_ids=[rng.integers(0, 32000, RESPONSE).astype(np.int32) for _ in range(GROUP_SIZE)],
            response_logprobs=[np.full(RESPONSE, -1.0, np.float32) for _ in range(GROUP_SIZE)],
            rewards=rng.random(GROUP_SIZE).astype(np.float32),
            version_start=0,
            version_end=0,
            finished_at=time.time(),
        )
        for g in range(GROUPS)
    ]


def write_steps(name: str, steps: int, stores: list[dict[str, str]]) -> list[list[Any]]:
    """Each step's units (one per group, spread over the stores), written and sealed, not registered."""
    writers = [
        TrajectoryWriter(job=name, node_id=s["node_id"], endpoint=s["endpoint"], store_dir=s["store_dir"])
        for s in stores
    ]
    try:
        return [
            [writers[g % len(writers)].write_groups([grp]) for g, grp in enumerate(groups(f"{name}s{step}", step))]
            for step in range(steps)
        ]
    finally:
        for w in writers:
            w.close()


class Child:
    """A process of this script (``--rollout-child`` or ``--rank-child``) talking JSON lines over its pipes."""

    def __init__(self, role: str, first: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, role], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.role = role
        self.send(first)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} ended (exit {self.proc.wait(30)})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.role}: {answer['error']}")
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rollout_child() -> None:
    """``--rollout-child``: the first stdin line writes a run's units, each later one registers a step."""
    from knittrans.controlclient import ControlClient

    first = json.loads(sys.stdin.readline())
    descs = write_steps(first["job"], first["steps"], first["stores"])
    with ControlClient(first["control_url"]) as control:
        print(json.dumps({"ok": True}), flush=True)
        for line in sys.stdin:
            control.register_units(first["job"], descs[json.loads(line)["register"]])
            print(json.dumps({"ok": True}), flush=True)


def rank_child() -> None:
    """``--rank-child``: a fresh rank process. Makes its client (default settings but ``prefetch_depth``), says
    ready, then trains every mini-batch of the job; one line per ack with the mini-batch's record, then the
    waits of the micro-batches after the first."""
    from knittrans.trainer.client import TrainerClient, TrainerConfig

    first = json.loads(sys.stdin.readline())
    depth = first.get("depth")
    config = TrainerConfig(
        control_url=first["control_url"],
        job=first["job"],
        rank=0,
        world_size=1,
        **({"prefetch_depth": depth} if depth is not None else {}),
    )
    compute_s = float(first.get("compute_s", 0.0))
    waits: list[float] = []
    try:
        with TrainerClient(config) as client:
            print(json.dumps({"ready": True}), flush=True)
            for mb in client.minibatches():
                record: dict[str, Any] = {}
                for i, micro in enumerate(mb):
                    if i == 0:
                        ready = time.time()
                        record = {
                            "admission_to_plan_s": mb.received_at - mb.admitted_at,
                            "admission_to_ready_s": ready - mb.admitted_at,
                            "rows": micro.batch.num_rows,
                            "admitted_at": mb.admitted_at,
                        }
                    else:
                        waits.append(micro.timing.wait_s)
                    if compute_s:
                        time.sleep(compute_s)
                mb.ack()
                client.report_version(mb.policy_version + 1)
                print(json.dumps({"acked": record}), flush=True)
    except BaseException as exc:
        print(json.dumps({"error": repr(exc)}), flush=True)
        raise
    print(json.dumps({"done": True, "waits": waits}), flush=True)


def run_once(
    cluster: LocalCluster,
    name: str,
    *,
    warm: int,
    depth: int | None = None,
    compute_s: float = 0.0,
) -> dict[str, Any]:
    """One fresh job, rank process and rollout process: ``1 + warm`` mini-batches, each registered while the
    loop waits. Only the client API every tree since 7fe2783 has (``pair.py`` runs it with other checkouts)."""
    control = cluster.control()
    steps = 1 + warm
    control.create_job(
        {
            "name": name,
            "group_size": GROUP_SIZE,
            "quotas": {"text": GROUPS},
            "mini_batches_per_step": 1,
            "policy": "train_batch",
            "world_size": 1,
            "micro_batch_size": MICRO,
            "total_steps": steps,
        }
    )
    control.close()
    stores = [{"node_id": s.node_id, "endpoint": s.endpoint, "store_dir": str(s.store_dir)} for s in cluster.stores]
    rollout = Child(
        "--rollout-child", {"job": name, "steps": steps, "stores": stores, "control_url": cluster.control_url}
    )
    rank: Child | None = None
    records: list[dict[str, Any]] = []
    try:
        rollout.receive()
        rank = Child(
            "--rank-child",
            {"control_url": cluster.control_url, "job": name, "depth": depth, "compute_s": compute_s},
        )
        rank.receive()  # ready: its client is made and waiting for mini-batch 0
        for step in range(steps):
            time.sleep(0.4)  # the loop (or its successor) is waiting; connections idle
            rollout.send({"register": step})
            rollout.receive()
            records.append(rank.receive()["acked"])
        waits = rank.receive()["waits"]
    finally:
        if rank is not None:
            rank.close()
        rollout.close()
    for i, r in enumerate(records):
        r["kind"] = "cold" if i == 0 else "warm"
    return {"records": records, "waits": waits}


def summarise(runs: list[dict[str, Any]], kind: str, key: str = "admission_to_ready_s") -> dict[str, float]:
    """p50 / mean / p99 (ms) of ``key`` over every mini-batch of ``kind``, and the median of each run's p50."""
    values = [r[key] * 1e3 for run in runs for r in run["records"] if r["kind"] == kind]
    per_run = [statistics.median([r[key] * 1e3 for r in run["records"] if r["kind"] == kind]) for run in runs]
    d = distribution(values)
    return {
        "p50_ms": d["p50"],
        "mean_ms": d["mean"],
        "p99_ms": d["p99"],
        "max_ms": d["max"],
        "over_10ms": sum(v > 10 for v in values),
        "median_of_run_p50_ms": statistics.median(per_run),
        "n": d["n"],
    }


def report(result: dict[str, Any]) -> str:
    """The result as markdown: machine, then the cold / warm table and the depth sweep."""
    m = result["machine"]
    w = result["workload"]
    lines = [
        f"# Cold path: admission -> first micro-batch ready (commit {m['commit']})",
        "",
        f"{m['date']}; {m['platform']}, {m['cpus']} CPUs {m['cpu_model']}, load average {m['loadavg'][0]:.1f} "
        f"at start / {m['loadavg_end'][0]:.1f} at end; OMP_NUM_THREADS={m['omp_num_threads']}. {w['runs']} runs, "
        f"each a fresh rank process: 1 cold + {w['warm_per_run']} warm mini-batches (32 text trajectories, "
        "4 micro-batches, 2 stores); the client's default settings.",
        "",
        "| kind | ready p50 ms | mean ms | p99 ms | over 10 ms | median of run p50s | share arrived p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in ("cold", "warm"):
        s, p = result[kind]["admission_to_ready"], result[kind]["admission_to_plan"]
        lines.append(
            f"| {kind} | {s['p50_ms']:.1f} | {s['mean_ms']:.1f} | {s['p99_ms']:.1f} | {s['over_10ms']} of {s['n']} | "
            f"{s['median_of_run_p50_ms']:.1f} | {p['p50_ms']:.1f} |"
        )
    if result["depth_sweep"]:
        lines += [
            "",
            f"Steady state, {w['compute_ms']:.0f} ms compute per micro-batch: mean exposed wait per "
            "micro-batch (after the first), median over runs",
            "",
            "| prefetch_depth | wait ms |",
            "|---|---|",
        ]
        lines += [f"| {d} | {v['mean_wait_ms_per_micro_batch']:.2f} |" for d, v in result["depth_sweep"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm", type=int, default=8, help="mini-batches after the first, per run")
    ap.add_argument("--depths", default="", help="prefetch_depth values for a steady-state sweep, e.g. 1,2,4,8")
    ap.add_argument("--compute-ms", type=float, default=20.0, help="synthetic compute per micro-batch in the sweep")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    for role in ("--rollout-child", "--rank-child"):
        ap.add_argument(role, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rollout_child:
        rollout_child()
        return
    if args.rank_child:
        rank_child()
        return
    result: dict[str, Any] = {
        "machine": machine(),
        "workload": {
            "group_size": GROUP_SIZE,
            "groups": GROUPS,
            "micro_batch_size": MICRO,
            "prompt_tokens": PROMPT,
            "response_tokens": RESPONSE,
            "stores": 2,
            "ranks": 1,
            "runs": args.runs,
            "warm_per_run": args.warm,
            "compute_ms": args.compute_ms,
        },
        "depth_sweep": {},
    }
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl:
        runs = [run_once(cl, f"cp-{r}", warm=args.warm) for r in range(args.runs)]
        for kind in ("cold", "warm"):
            result[kind] = {
                "admission_to_ready": summarise(runs, kind),
                "admission_to_plan": summarise(runs, kind, "admission_to_plan_s"),
            }
        result["raw"] = [run["records"] for run in runs]
        for d in [int(x) for x in args.depths.split(",") if x]:
            per_run = []
            for r in range(args.runs):
                out = run_once(cl, f"cp-d{d}-{r}", warm=3, depth=d, compute_s=args.compute_ms / 1e3)
                per_run.append(1e3 * float(np.mean(out["waits"])) if out["waits"] else 0.0)
            result["depth_sweep"][str(d)] = {
                "mean_wait_ms_per_micro_batch": statistics.median(per_run),
                "runs": per_run,
            }
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_path.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (args.out / "cold_path.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
