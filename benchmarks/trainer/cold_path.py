"""Cold path: admission -> first micro-batch ready, for a fresh client and for later mini-batches.

A real control plane and two store processes (LocalCluster) on 127.0.0.1; one rank. Every
mini-batch's units are written beforehand and registered one mini-batch at a time while the
trainer loop already waits, so admission happens at a known moment (the control plane stamps
``admitted_at`` in the plan). Measured, per mini-batch: ``admitted_at`` -> the plan reached the
client (``received_at``) -> the training loop holds micro-batch 0 (wall clock, same host).

- ``cold``: the first mini-batch of a fresh :class:`TrainerClient` (new process-level objects,
  no Flight channel yet): what every job start and every un-prefetched mini-batch pays.
- ``warm``: mini-batches 2.. of the same client (channels open, the successor poll waiting).

Variants: ``default`` (the client's defaults: ``warm_connections`` and ``poll_early``),
``warm_only`` (``poll_early=False``) and ``baseline`` (both off: the client flags before issue 18).
Each variant runs ``--runs`` times (fresh job and client each run); the report gives p50/p99/mean
over all mini-batches of a kind and the median over runs of each run's p50. ``--depths`` also
measures the steady-state exposed wait per micro-batch for several ``prefetch_depth`` values (a
synthetic compute step per micro-batch), which chose the default.

    python benchmarks/trainer/cold_path.py [--runs 3] [--warm 8] [--depths 1,2,4,8] [--out DIR]

The rollout side (writing each mini-batch's units, registering them) runs in a process of its own by
default (``--rollout process``), as it does in a deployment: registered from the rank's own process
(``--rollout in-process``, what this script did before), the registration's request and answer take
the GIL from the rank's threads inside the measured window, and the writer's garbage (its units'
tables and descriptors) starts collections in the rank's process.

Writes ``cold_path.json`` and ``cold_path.md`` under ``--out`` (default benchmarks/trainer/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from knittrans.demo.cluster import ClusterConfig, LocalCluster
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup
from knittrans.trainer.client import TrainerClient, TrainerConfig

GROUP_SIZE, GROUPS, MICRO = 8, 4, 8  # 32 trajectories per mini-batch, 4 micro-batches of 8
PROMPT, RESPONSE = 128, 256


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
            finished_at=time.time(),
        )
        for g in range(GROUPS)
    ]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


VARIANTS = {"baseline": (False, False), "warm_only": (True, False), "default": (True, True)}
"""variant -> (warm_connections, poll_early)."""


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


class Rollout:
    """The rollout side of one run: writes every step's units, then registers one step on request.

    ``process``: in a child process (``--rollout-child``), as in a deployment; ``in-process``: here.
    """

    def __init__(self, mode: str, cluster: LocalCluster, name: str, steps: int) -> None:
        stores = [{"node_id": s.node_id, "endpoint": s.endpoint, "store_dir": str(s.store_dir)} for s in cluster.stores]
        self.child: subprocess.Popen[str] | None = None
        self.control = None
        if mode == "in-process":
            self.control = cluster.control()
            self.descs = write_steps(name, steps, stores)
            return
        self.child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--rollout-child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._ask({"job": name, "steps": steps, "stores": stores, "control_url": cluster.control_url})

    def _ask(self, message: dict[str, Any]) -> None:
        assert self.child is not None and self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(message) + "\n")
        self.child.stdin.flush()
        answer = self.child.stdout.readline()
        if answer.strip() != "ok":
            raise RuntimeError(f"rollout child: {answer!r} (exit {self.child.poll()})")

    def register(self, name: str, step: int) -> None:
        if self.control is not None:
            self.control.register_units(name, self.descs[step])
        else:
            self._ask({"register": step})

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.child is not None:
            assert self.child.stdin is not None
            self.child.stdin.close()
            self.child.wait(30)


def rollout_child() -> None:
    """``--rollout-child``: the first stdin line writes a run's units, each later one registers a step."""
    from knittrans.controlclient import ControlClient

    first = json.loads(sys.stdin.readline())
    descs = write_steps(first["job"], first["steps"], first["stores"])
    with ControlClient(first["control_url"]) as control:
        print("ok", flush=True)
        for line in sys.stdin:
            control.register_units(first["job"], descs[json.loads(line)["register"]])
            print("ok", flush=True)


def run_once(
    cluster: LocalCluster,
    name: str,
    *,
    variant: str,
    warm: int,
    depth: int = 2,
    compute_s: float = 0.0,
    rollout: str = "process",
) -> dict[str, Any]:
    """One fresh job and client: ``1 + warm`` mini-batches, each registered while the loop waits."""
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
    side = Rollout(rollout, cluster, name, steps)
    records: list[dict[str, Any]] = []
    waits: list[float] = []
    done = threading.Event()
    acked = threading.Semaphore(0)
    errors: list[BaseException] = []
    config = TrainerConfig(
        control_url=cluster.control_url,
        job=name,
        rank=0,
        world_size=1,
        poll_timeout_s=5,
        prefetch_depth=depth,
        warm_connections=VARIANTS[variant][0],
        poll_early=VARIANTS[variant][1],
    )
    client = TrainerClient(config)

    def loop() -> None:
        try:
            for mb in client.minibatches():
                for i, micro in enumerate(mb):
                    if i == 0:
                        ready = time.time()
                        assert mb.admitted_at is not None
                        records.append(
                            {
                                "admission_to_plan_s": mb.received_at - mb.admitted_at,
                                "admission_to_ready_s": ready - mb.admitted_at,
                                "rows": micro.batch.num_rows,
                                "admitted_at": mb.admitted_at,
                            }
                        )
                    else:
                        waits.append(micro.timing.wait_s)
                    if compute_s:
                        time.sleep(compute_s)
                mb.ack()
                client.report_version(mb.policy_version + 1)
                acked.release()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        for step in range(steps):
            time.sleep(0.4)  # the loop (or its successor poll) is waiting; connections idle
            side.register(name, step)
            while not acked.acquire(timeout=0.1):
                if done.is_set():
                    raise RuntimeError(f"trainer loop ended early: {errors}")
        done.wait(30)
    finally:
        client.close()
        side.close()
    if errors:
        raise errors[0]
    for i, r in enumerate(records):
        r["kind"] = "cold" if i == 0 else "warm"
    return {"records": records, "waits": waits}


def summarise(runs: list[dict[str, Any]], kind: str, key: str = "admission_to_ready_s") -> dict[str, float]:
    values = [r[key] * 1e3 for run in runs for r in run["records"] if r["kind"] == kind]
    per_run = [statistics.median([r[key] * 1e3 for r in run["records"] if r["kind"] == kind]) for run in runs]
    return {
        "p50_ms": pct(values, 50),
        "p99_ms": pct(values, 99),
        "mean_ms": float(np.mean(values)),
        "median_of_run_p50_ms": statistics.median(per_run),
        "n": len(values),
    }


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "commit": commit,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warm", type=int, default=8, help="mini-batches after the first, per run")
    ap.add_argument("--depths", default="1,2,4,8", help="prefetch_depth values for the steady-state sweep ('' = skip)")
    ap.add_argument("--compute-ms", type=float, default=20.0, help="synthetic compute per micro-batch in the sweep")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument(
        "--rollout",
        choices=("process", "in-process"),
        default="process",
        help="where the units are written and registered: a process of their own (default) or the rank's",
    )
    ap.add_argument("--rollout-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rollout_child:
        rollout_child()
        return
    start_load = os.getloadavg()
    result: dict[str, Any] = {
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
            "rollout": args.rollout,
        },
        "variants": {},
        "depth_sweep": {},
    }
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for r in range(args.runs):  # variants interleaved, so load drifts hit all alike
            for variant in VARIANTS:
                runs[variant].append(
                    run_once(cl, f"cp-{variant}-{r}", variant=variant, warm=args.warm, rollout=args.rollout)
                )
        for variant, rs in runs.items():
            result["variants"][variant] = {
                kind: {
                    "admission_to_ready": summarise(rs, kind),
                    "admission_to_plan": summarise(rs, kind, "admission_to_plan_s"),
                }
                for kind in ("cold", "warm")
            }
            result["variants"][variant]["raw"] = [run["records"] for run in rs]
        for d in [int(x) for x in args.depths.split(",") if x]:
            per_run = []
            for r in range(args.runs):
                out = run_once(
                    cl,
                    f"cp-d{d}-{r}",
                    variant="default",
                    warm=3,
                    depth=d,
                    compute_s=args.compute_ms / 1e3,
                    rollout=args.rollout,
                )
                per_run.append(1e3 * float(np.mean(out["waits"])) if out["waits"] else 0.0)
            result["depth_sweep"][str(d)] = {
                "mean_wait_ms_per_micro_batch": statistics.median(per_run),
                "runs": per_run,
            }
    result["machine"] = {**machine(), "loadavg_start": start_load}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_path.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Cold path: admission -> first micro-batch ready (commit {result['machine']['commit']})",
        "",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs, load average "
        f"{start_load[0]:.1f} at start / {result['machine']['loadavg'][0]:.1f} at end; "
        f"OMP_NUM_THREADS={result['machine']['omp_num_threads']}. {args.runs} runs per variant, "
        f"1 cold + {args.warm} warm mini-batches each (32 text trajectories, 4 micro-batches, 2 stores); "
        f"rollout (writes, registrations): {args.rollout}.",
        "",
        "| variant | kind | ready p50 ms | p99 ms | mean ms | median of run p50s | plan delivered p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, v in result["variants"].items():
        for kind in ("cold", "warm"):
            s, p = v[kind]["admission_to_ready"], v[kind]["admission_to_plan"]
            lines.append(
                f"| {variant} | {kind} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['mean_ms']:.1f} | "
                f"{s['median_of_run_p50_ms']:.1f} | {p['p50_ms']:.1f} |"
            )
    if result["depth_sweep"]:
        lines += [
            "",
            f"Steady state, {args.compute_ms:.0f} ms compute per micro-batch: mean exposed wait per "
            "micro-batch (after the first), median over runs",
            "",
            "| prefetch_depth | wait ms |",
            "|---|---|",
        ]
        lines += [f"| {d} | {v['mean_wait_ms_per_micro_batch']:.2f} |" for d, v in result["depth_sweep"].items()]
    (args.out / "cold_path.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
