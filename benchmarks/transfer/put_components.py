"""Put path, piece by piece: the CPU of each step of ``write_units_across`` in two checkouts, alternated.

On a loaded 2-core host a whole put moves by more than a change to one step saves, so this clocks
the steps alone (``time.thread_time`` of the calling thread, medians over ``--reps``), in a fresh
process per tree and round, alternating the trees:

* ``build``: ``build_units_tables`` of the text mini-batch as 8 units (512 trajectories);
* ``describe``: ``describe_unit`` of those 8 units (``trusted=True`` in a tree whose writer describes so);
* ``write``: the 4 IPC files of one node's units into fresh writer temporaries on ``/dev/shm``;
* ``publish``: in-process ``UnitStore.publish_units`` of those 4 units (budget, validation, rename);
* ``register``: ``ControlClient.register_units`` of 8 units against a real control plane (the
  client's CPU; ``register_cp``: the control-plane process's, from ``/proc``, mean).

    python benchmarks/transfer/put_components.py --baseline <checkout> [--rounds 3] [--tag NAME]

Writes ``put_components_<tag>.json`` and ``.md`` under ``--out`` (default benchmarks/transfer/results).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = ("build", "describe", "write", "publish", "register", "register_cp")


def measure(reps: int) -> dict[str, float]:
    """One tree's medians (ms); runs in a child process with that tree on ``PYTHONPATH``."""
    from benchmarks.vs_baselines.knittrans_runner import SOURCE, build_groups
    from benchmarks.vs_baselines.workload import WorkloadSpec, generate
    from knittrans.local import ClusterConfig, LocalCluster
    from knittrans.rollout.writer import describe_unit
    from knittrans.schema import build_units_tables
    from knittrans.store.store import SealSpec, StoreConfig, UnitStore, writer_temp_name
    from knittrans.store.unit import TRAJ_FILE, write_table

    spec = WorkloadSpec(kind="text")
    workload = generate(spec)
    batches = spec.put_batches()
    out: dict[str, list[float]] = {k: [] for k in STEPS[:-1]}
    # as the tree's writer describes its own units (``trusted`` where the tree has it)
    as_writer = {"trusted": True} if "trusted" in inspect.signature(describe_unit).parameters else {}

    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="knittrans_parts_", dir=shm if shm.is_dir() else None) as tmp:
        root = Path(tmp) / "store"
        store = UnitStore(StoreConfig(root=root))
        (root / "j").mkdir(parents=True)
        with LocalCluster(ClusterConfig(work_dir=Path(tmp) / "cluster", num_stores=1)) as cl:
            control = cl.control()
            control.create_job(
                {
                    "name": "put",
                    "group_size": spec.group_size,
                    "quotas": {SOURCE: spec.num_groups},
                    "mini_batches_per_step": 1,
                    "policy": "train_batch",
                    "world_size": 1,
                    "micro_batch_size": spec.micro_batch_size,
                    "total_steps": 1_000_000,
                }
            )
            node = cl.stores[0]
            cp_pid = _first_child()
            tck = os.sysconf("SC_CLK_TCK")

            def cp_cpu() -> float:
                fields = Path(f"/proc/{cp_pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / tck

            cp_total = 0.0
            for k in range(reps):
                groups = build_groups(workload, f"p{k}")
                units = [groups[b.start : b.stop] for b in batches]
                t0 = time.thread_time()
                tables = build_units_tables(units)
                t1 = time.thread_time()
                descs = [
                    describe_unit(
                        t,
                        u,
                        unit_id=f"{node.node_id}-u{k}x{i}",
                        job="put",
                        node_id=node.node_id,
                        endpoint=node.endpoint,
                        num_bytes=1,
                        **as_writer,
                    )
                    for i, (u, t) in enumerate(zip(units, tables, strict=True))
                ]
                t2 = time.thread_time()
                made = []
                for i, t in enumerate(tables[:4]):  # one node's share
                    uid = f"u{k}x{i}"
                    d = root / "j" / writer_temp_name(uid)
                    d.mkdir()
                    n = write_table(d / TRAJ_FILE, t.traj)
                    made.append((SealSpec(unit_id=uid, rows=t.traj.num_rows, media_rows=0, num_bytes=n), str(d)))
                t3 = time.thread_time()
                store.publish_units("j", made)
                t4 = time.thread_time()
                c0 = cp_cpu()
                control.register_units("put", descs)
                t5 = time.thread_time()
                cp_total += cp_cpu() - c0
                for step, ms in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=False):
                    out[step].append(1e3 * ms)
                del tables, descs, made  # as in a writer's put: gone before the next build
            control.close()
    medians = {k: statistics.median(v) for k, v in out.items()}
    medians["register_cp"] = 1e3 * cp_total / reps  # /proc ticks are 10 ms: only the mean means anything
    return medians


def _first_child() -> int:
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    return int(children[0])  # LocalCluster starts the control plane first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="checkout whose steps are the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--tag", default="components")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.reps)))
        return
    if args.baseline is None:
        ap.error("--baseline is required")
    trees = {"baseline": args.baseline.resolve(), "this": REPO}
    from benchmarks.transfer.put_path_pair import compile_trees  # here: a child runs with the baseline tree

    compile_trees(trees.values())
    got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            run = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", "--reps", str(args.reps)],
                env={**os.environ, "PYTHONPATH": str(trees[name])},
                cwd=trees[name],
                capture_output=True,
                text=True,
                check=True,
            )
            got[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in STEPS} for name, rs in got.items()}

    def commit(tree: Path) -> str:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree)
        return out.stdout.strip() or "unknown"

    commits = {name: commit(tree) for name, tree in trees.items()}
    result = {
        "rounds": args.rounds,
        "reps": args.reps,
        "summary": summary,
        "raw": got,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "commits": commits,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"put_components_{args.tag}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Put path, step by step: {commits['baseline']} (baseline) vs {commits['this']} (this), CPU ms",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, load average {load_start[0]:.1f} at start / "
        f"{os.getloadavg()[0]:.1f} at end. {args.rounds} rounds alternating the trees, each a fresh process "
        f"with {args.reps} repetitions; medians of the rounds' medians (register_cp: of the rounds' means).",
        "",
        "| step | baseline | this | this / baseline |",
        "|---|---|---|---|",
    ]
    for k in STEPS:
        b, t = summary["baseline"][k], summary["this"][k]
        lines.append(f"| {k} | {b:.2f} | {t:.2f} | {t / b:.2f} |")
    (args.out / f"put_components_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
