"""Put path, paired: two checkouts' ``across`` and Ray's ``put`` alternated put by put, in one session.

``put_path_ab.py`` alternates whole invocations (a cluster start, 7 puts, a Ray start each); on a
shared host the load moves between invocations by more than a change to the put path saves. Here one
long-lived worker per tree (its own LocalCluster of 2 stores on ``/dev/shm``, ``PYTHONPATH`` = that
tree) and one Ray worker (``ray.put`` of the same rows as 4 shards, bench venv) wait for a word on
stdin; the coordinator asks each in turn for one put (order rotating every round), so the three see
the same load within tens of milliseconds. Per put: wall time and the CPU time of the worker and its
cluster's processes (``/proc``, in 10 ms ticks: the mean over the puts; Ray: the driver only, its
raylet not counted). Reported: medians, p50/p99 over the puts, the
median of the per-round ratios to Ray's put in the same round, load average.

A writer that registers its units in the background (its ``flush()``) returns from the put before
the control plane has them: the put's wall time is what the rollout loop waits for, and
``registered`` (untimed by the put, measured apart) is the time from the put's start until its
units are registered (``flush()`` returned; a tree without ``flush`` registers within the put,
so there it equals the put). Each worker answers only after its registrations are done, so no
background work overlaps another worker's put.

After each timed put its units are deleted from the stores (untimed), as Ray's side drops its objects
(``del refs``) and as a job deletes consumed units: the next put's files take the pages freed. With
``--keep`` every unit stays, as before 2026-12-04: the stores' tmpfs then grows by 3.5 MiB a put, and
on a freshly booted VM every put's writes land on pages the guest never touched, about 6x dearer
(``tmpfs_pages.py``); that measured the machine's uptime more than the put path.

    python benchmarks/transfer/put_path_pair.py --baseline <checkout> [--puts 120] [--keep] [--tag NAME] [--no-ray]

A baseline that is no git checkout (a ``git archive`` of main) is labelled with ``--baseline-commit``
(default: the commit of this repository's ``main`` whose tree the baseline directory holds).
Ray's side runs in ``--ray-python`` (default: ``.venv-bench`` of this checkout, else of the main
worktree of its repository, where ``scripts/setup_bench_env.sh`` puts it); ``--no-ray`` pairs the two
trees alone.

Writes ``put_path_pair_<tag>.json`` and ``.md`` under ``--out`` (default benchmarks/transfer/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]

RAY_WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import ray
from benchmarks.vs_baselines.ray_runner import pack_rows
from benchmarks.vs_baselines.workload import WorkloadSpec, generate
workload = generate(WorkloadSpec(kind="text"))
spec = workload.spec
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
print(json.dumps({"ready": True, "version": ray.__version__}), flush=True)
for line in sys.stdin:
    c0, t0 = time.process_time(), time.perf_counter()
    shards = [pack_rows(workload, list(spec.rank_rows(r)), image="none") for r in range(spec.ranks)]
    refs = [ray.put(s) for s in shards]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del refs, shards
    print(json.dumps({"wall": wall, "cpu": cpu}), flush=True)
ray.shutdown()
"""


def worker(puts: int, keep: bool) -> None:
    """One tree's side: a cluster, then one ``write_units_across`` per line read from stdin; each put's units
    deleted from their stores after it is timed unless ``keep`` (as Ray's side drops its objects)."""
    from benchmarks.vs_baselines.knittrans_runner import SOURCE, build_groups
    from benchmarks.vs_baselines.workload import WorkloadSpec, generate
    from knittrans.local import ClusterConfig, LocalCluster
    from knittrans.rollout.writer import TrajectoryWriter, write_units_across

    spec = WorkloadSpec(kind="text")
    workload = generate(spec)
    batches = spec.put_batches()
    tck = os.sysconf("SC_CLK_TCK")

    def cpu(pids: list[int]) -> float:
        total = 0.0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tck
        return total

    shm = Path("/dev/shm")
    with (
        tempfile.TemporaryDirectory(prefix="knittrans_pair_", dir=shm if shm.is_dir() else None) as tmp,
        LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl,
    ):
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
        writers = [
            TrajectoryWriter(job="put", node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir, control=control)
            for s in cl.stores
        ]
        children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
        pids = [os.getpid(), *map(int, children.split())]  # this process, the control plane and the stores
        groups = [build_groups(workload, f"p{k}") for k in range(puts)]  # fresh ids per put, built up front
        print(json.dumps({"ready": True}), flush=True)
        for k, _ in enumerate(sys.stdin):
            chunks = [groups[k][b.start : b.stop] for b in batches]
            f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, cpu(pids), time.perf_counter()
            descs = write_units_across([(w, chunks[i :: len(writers)]) for i, w in enumerate(writers)])
            wall = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0  # the writer's fresh pages
            for w in writers:  # a writer that registers in the background: until the control plane has them
                flush = getattr(w, "flush", None)
                if flush is not None:
                    flush()
            registered = time.perf_counter() - t0
            used = cpu(pids) - c0
            if not keep:  # untimed, like Ray's `del refs`: the store's pages go back for the next put to reuse
                for w, ds in zip(writers, descs, strict=True):
                    for d in ds:
                        w.client.delete("put", d.unit_id)
            print(json.dumps({"wall": wall, "registered": registered, "cpu": used, "minflt": faults}), flush=True)
        for w in writers:
            w.close()
        control.close()


def ask(proc: subprocess.Popen[str]) -> dict[str, Any]:
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    stdin.write("go\n")
    stdin.flush()
    return read_json(stdout)


def read_json(stream: TextIO) -> dict[str, Any]:
    while True:
        line = stream.readline()
        if not line:
            raise RuntimeError("worker ended early")
        if line.startswith("{"):
            return dict(json.loads(line))


def git(*argv: str, cwd: Path) -> str:
    """``git argv`` in ``cwd``: its stripped output, or "" when git fails there (not a checkout)."""
    out = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=cwd)
    return out.stdout.strip() if out.returncode == 0 else ""


def commit(tree: Path, given: str | None) -> str:
    """Short commit of ``tree``. A tree that is no git checkout (a ``git archive``): ``given``, else the
    commit of this repository's ``main`` (its last 500) whose tree is the directory's, else "unknown"."""
    if given:
        return git("rev-parse", "--short", given, cwd=REPO) or given
    if (tree / ".git").exists():
        return git("rev-parse", "--short", "HEAD", cwd=tree) or "unknown"
    found = archived_commit(tree)
    return f"main {found}" if found else "unknown"


def archived_commit(tree: Path) -> str:
    """The commit of ``main`` whose tree ``tree`` holds (as ``git archive`` wrote it), or "": the
    directory is hashed into a temporary index and object directory (this repository's objects are read,
    never written)."""
    with tempfile.TemporaryDirectory(prefix="put_pair_tree_") as tmp:
        objects = git("rev-parse", "--path-format=absolute", "--git-path", "objects", cwd=REPO)
        env = {
            **os.environ,
            "GIT_DIR": git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=REPO),
            "GIT_INDEX_FILE": str(Path(tmp) / "index"),
            "GIT_OBJECT_DIRECTORY": str(Path(tmp) / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects,
        }
        (Path(tmp) / "objects").mkdir()
        base = ["git", f"--work-tree={tree}"]
        if subprocess.run([*base, "add", "-A", "."], cwd=tree, env=env, capture_output=True).returncode:
            return ""
        written = subprocess.run([*base, "write-tree"], cwd=tree, env=env, capture_output=True, text=True)
        want = written.stdout.strip()
    for line in git("log", "-n", "500", "--format=%h %T", "main", cwd=REPO).splitlines():
        short, tree_id = line.split()
        if want and tree_id == want:
            return short
    return ""


def bench_python() -> Path:
    """The bench venv's python: this checkout's ``.venv-bench``, else the main worktree's."""
    own = REPO / ".venv-bench" / "bin" / "python"
    common = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=REPO)
    if own.exists() or not common:
        return own
    return Path(common).parent / ".venv-bench" / "bin" / "python"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def compile_trees(trees: Iterable[Path]) -> None:
    """Byte-compile each tree's ``knittrans`` and ``benchmarks`` first (``compileall`` writes caches even
    under ``PYTHONDONTWRITEBYTECODE``): an A/A run of one commit, a checkout against a fresh worktree
    without caches, measured every step 15-25 % slower in the worktree; compiled, 0.93-1.06."""
    for tree in trees:
        dirs = [str(tree / d) for d in ("knittrans", "benchmarks") if (tree / d).is_dir()]
        subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="checkout whose writer is the baseline")
    ap.add_argument("--puts", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--ray-python",
        type=Path,
        default=None,
        help="python of the bench venv (default: .venv-bench here, else in the main worktree)",
    )
    ap.add_argument("--baseline-commit", help="label of a baseline that is no git checkout (default: by its tree)")
    ap.add_argument("--tag", default="pair")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep every put's units in the stores (default: delete them after each timed put, as Ray's side "
        "drops its objects; kept units make every put write to fresh tmpfs pages)",
    )
    ap.add_argument("--no-ray", action="store_true", help="pair the two trees alone (no Ray worker)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.keep)
        return
    if args.baseline is None:
        ap.error("--baseline is required")
    ray_python = None if args.no_ray else args.ray_python or bench_python()
    total = args.puts + args.warmup
    trees = {"baseline": args.baseline.resolve(), "this": REPO}
    compile_trees(trees.values())
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": str(tree)}  # this script, that tree's knittrans and workload
        procs[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(total), *(["--keep"] * args.keep)],
            env=env,
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    if ray_python is not None:
        procs["ray"] = subprocess.Popen(
            [str(ray_python), "-c", RAY_WORKER, str(REPO)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    ready = {name: read_json(p.stdout) for name, p in procs.items() if p.stdout is not None}
    load_start = os.getloadavg()
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in procs}
    names = list(procs)
    loads = []
    for k in range(total):
        order = names[k % len(names) :] + names[: k % len(names)]
        for name in order:
            r = ask(procs[name])
            if k >= args.warmup:
                got[name].append(r)
        loads.append(os.getloadavg()[0])
    for p in procs.values():
        if p.stdin is not None:
            p.stdin.close()
    for p in procs.values():
        p.wait(timeout=120)
    summary: dict[str, Any] = {}
    for name, rs in got.items():
        wall = [1e3 * r["wall"] for r in rs]
        cpu = [1e3 * r["cpu"] for r in rs]
        summary[name] = {
            "median_ms": statistics.median(wall),
            "mean_ms": statistics.fmean(wall),
            "p50_ms": pct(wall, 0.5),
            "p99_ms": pct(wall, 0.99),
            "cpu_mean_ms": statistics.fmean(cpu),  # /proc counts 10 ms ticks: only the mean means anything
        }
        if name != "ray":
            summary[name]["writer_minflt_median"] = statistics.median(r.get("minflt", 0) for r in rs)
            registered = [1e3 * r.get("registered", r["wall"]) for r in rs]
            summary[name]["registered_median_ms"] = statistics.median(registered)
            summary[name]["registered_mean_ms"] = statistics.fmean(registered)
            summary[name]["registered_p99_ms"] = pct(registered, 0.99)
        if name != "ray" and "ray" in got:
            ratios = [a["wall"] / b["wall"] for a, b in zip(rs, got["ray"], strict=True)]
            summary[name]["ratio_vs_ray_median"] = statistics.median(ratios)
            summary[name]["ratio_of_medians"] = statistics.median(wall) / statistics.median(
                [1e3 * r["wall"] for r in got["ray"]]
            )

    result = {
        "puts": args.puts,
        "units_after_put": "kept" if args.keep else "deleted",
        "summary": summary,
        "raw": got,
        "ray_version": ready["ray"].get("version") if "ray" in ready else None,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "load_median": statistics.median(loads),
            "commits": {
                "baseline": commit(trees["baseline"], args.baseline_commit),
                "this": commit(REPO, None),
            },
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"put_path_pair_{args.tag}.json").write_text(json.dumps(result, indent=1))
    m = result["machine"]
    lines = [
        f"# Put path, paired: {m['commits']['baseline']} (baseline) vs {m['commits']['this']} (this)"
        + (" vs Ray `put`" if "ray" in got else ""),
        "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs, load average {load_start[0]:.1f} at start / "
        f"{m['loadavg_end'][0]:.1f} at end (median {m['load_median']:.1f}). {args.puts} puts each (after "
        f"{args.warmup} warm-up), the workers asked in turn, order rotating. `write_units_across` of the "
        "text mini-batch (512 trajectories, 8 units over 2 stores on /dev/shm)"
        + (f" vs Ray {result['ray_version']} `put` of the same rows (4 shards). " if "ray" in got else ". ")
        + (
            "Every put's units kept in the stores (`--keep`: each put writes to fresh tmpfs pages). "
            if args.keep
            else "Each put's units deleted from the stores after it is timed, as Ray's side drops its objects. "
        )
        + "CPU: the worker and its cluster's processes (Ray: the driver process only).",
        "",
        "| who | put median ms | mean | p50 / p99 ms | registered median / mean / p99 ms | CPU ms (mean) "
        "| x Ray (median of per-round ratios) | x Ray (ratio of medians) | writer minor faults per put |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        label = f"{name} {m['commits'].get(name, '')}".strip() if name != "ray" else "ray.put"
        r1 = f"{s['ratio_vs_ray_median']:.2f}" if "ratio_vs_ray_median" in s else "-"
        r2 = f"{s['ratio_of_medians']:.2f}" if "ratio_of_medians" in s else "-"
        faults = f"{s['writer_minflt_median']:.0f}" if "writer_minflt_median" in s else "-"
        reg = (
            f"{s['registered_median_ms']:.1f} / {s['registered_mean_ms']:.1f} / {s['registered_p99_ms']:.1f}"
            if "registered_median_ms" in s
            else "-"
        )
        lines.append(
            f"| {label} | {s['median_ms']:.1f} | {s['mean_ms']:.1f} | {s['p50_ms']:.1f} / {s['p99_ms']:.1f} | {reg} "
            f"| {s['cpu_mean_ms']:.1f} | {r1} | {r2} | {faults} |"
        )
    pairs = list(zip(got["this"], got["baseline"], strict=True))
    paired = statistics.median(a["wall"] / b["wall"] for a, b in pairs)
    paired_reg = statistics.median(a.get("registered", a["wall"]) / b.get("registered", b["wall"]) for a, b in pairs)
    summary["this"]["ratio_vs_baseline_median"] = paired
    summary["this"]["registered_ratio_vs_baseline_median"] = paired_reg
    lines += [
        "",
        f"this / baseline, median of the per-round ratios: put {paired:.3f}, registered {paired_reg:.3f}.",
    ]
    (args.out / f"put_path_pair_{args.tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"put_path_pair_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
