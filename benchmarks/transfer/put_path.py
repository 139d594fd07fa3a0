"""Put path: the rollout side's cost per unit (build + write + seal + register) vs Ray's ``put``.

Workload: the text mini-batch of ``benchmarks/vs_baselines`` (512 trajectories, groups of 8,
prompts 192-320 and responses 512-1024 tokens), published as 8 units of 8 groups over the two
store nodes of a real LocalCluster (control plane + 2 ``knittrans store`` processes on 127.0.0.1,
their directories on ``/dev/shm`` as deployed; on a disk-backed ``/tmp`` the writer's IPC writes cost
about 1.5x the CPU).
Timed from the groups (Python/numpy objects) until every unit is registered with the control plane
(each run's units are deleted from the stores afterwards, untimed, as Ray's side drops its objects):

- ``writer_units``: :meth:`TrajectoryWriter.write_units` on a writer with a control client, one per
  store (the units of one store written in one call and registered in one request);
- ``sequential``: the former path (``write_groups`` per unit, then one ``register_units`` for all);
- ``doput``: as ``writer_units`` but through ``DoPut`` (a writer on another host, no shared dir);
- ``across``: :func:`~knittrans.rollout.writer.write_units_across` over the same writers as
  ``writer_units``: both stores written at once (a thread each), one registration for all the units
  (absent when the tree measured predates it).

Run with ``PYTHONPATH=<another checkout>`` to measure that tree's writer with this script (the
``commit`` recorded is then that tree's).

Where ``writer_units`` spends its time: after the timed runs, ``--runs`` more of it with each phase
timed (the writer's own functions and calls, wrapped with a clock for that pass only: build,
size estimate, ``reserve_units``, IPC writes, ``seal_units``, ``publish_units``, descriptors,
registration), next to the round trip of a no-op call to each server (control plane
``GET /v1/health``, store ``health`` action) as a gauge of this host's scheduling delay during the
run. Where the writer describes its units while the node stores them (a thread), the IPC writes and
the store's action overlap ``describe``: the phases then add up to more than the total (``other``
negative).

Ray: the same bytes (4 per-rank shards packed as numpy columns, as ``benchmarks/vs_baselines``
does) through ``ray.put`` in a local Ray instance, in a subprocess of the ``.venv-bench``
interpreter (``bash scripts/setup_bench_env.sh``); when Ray is not installed the report says so
and gives our figures alone. Each figure is the median of ``--runs`` repetitions in one run.

    python benchmarks/transfer/put_path.py [--runs 7] [--ray-python .venv-bench/bin/python] [--out DIR]

Writes ``put_path.json`` and ``put_path.md`` under ``--out`` (default benchmarks/transfer/results).
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
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH: a tree given there is the one measured

from benchmarks.vs_baselines.knittrans_runner import SOURCE, build_groups  # noqa: E402
from benchmarks.vs_baselines.workload import WorkloadSpec, generate  # noqa: E402
from knittrans.flight.client import StoreClient  # noqa: E402
from knittrans.local import ClusterConfig, LocalCluster  # noqa: E402
from knittrans.rollout import writer as writer_module  # noqa: E402
from knittrans.rollout.writer import TrajectoryWriter  # noqa: E402

write_units_across = getattr(writer_module, "write_units_across", None)  # absent from older trees

JOB = "put"

RAY_SCRIPT = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import ray
from benchmarks.vs_baselines.ray_runner import pack_rows
from benchmarks.vs_baselines.workload import WorkloadSpec, generate
runs = int(sys.argv[2])
workload = generate(WorkloadSpec(kind="text"))
spec = workload.spec
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
times, nbytes = [], 0
for i in range(runs + 1):
    t0 = time.perf_counter()
    shards = [pack_rows(workload, list(spec.rank_rows(r)), image="none") for r in range(spec.ranks)]
    refs = [ray.put(s) for s in shards]
    t1 = time.perf_counter()
    nbytes = sum(a.nbytes for s in shards for a in s.values())
    if i:
        times.append(t1 - t0)
    del refs
print(json.dumps({"ray_version": ray.__version__, "put_s": statistics.median(times), "runs": times,
                  "objects": spec.ranks, "bytes": nbytes}))
ray.shutdown()
"""


def put_job(spec: WorkloadSpec, *, total_steps: int) -> dict[str, Any]:
    """The job the put benchmarks register into: one source, a train batch of the workload's groups, one rank
    (nothing consumes: admission stops at the staleness window, as no trainer acks)."""
    return {
        "name": JOB,
        "group_size": spec.group_size,
        "quotas": {SOURCE: spec.num_groups},
        "mini_batches_per_step": 1,
        "policy": "train_batch",
        "world_size": 1,
        "micro_batch_size": spec.micro_batch_size,
        "total_steps": total_steps,
    }


def phase_table(ph: dict[str, float], names: Sequence[str]) -> list[str]:
    """Markdown lines of a phase breakdown (ms): the ``names`` phases, what the total leaves ("other"), the total."""
    return [
        "| " + " | ".join((*names, "other", "total")) + " |",
        "|" + "---|" * (len(names) + 2),
        "| "
        + " | ".join(f"{ph[p]:.1f}" for p in names)
        + f" | {ph['total'] - sum(ph[p] for p in names):.1f} | {ph['total']:.1f} |",
    ]


def ray_put(python: Path, runs: int) -> dict[str, Any]:
    """Ray's put of the same mini-batch, measured in ``python`` (the bench venv); an ``error`` when absent."""
    if not python.exists():
        return {
            "error": f"{python} not found: Ray is installed only in the bench venv (bash scripts/setup_bench_env.sh)"
        }
    proc = subprocess.run(
        [str(python), "-c", RAY_SCRIPT, str(REPO), str(runs)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"ray run failed ({proc.returncode}): {' | '.join(tail)}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


PHASES = ("build", "estimate", "reserve_units", "write_files", "seal_units", "publish_units", "describe", "register")


@contextmanager
def phase_clocks(writers: list[TrajectoryWriter], control: Any) -> Iterator[dict[str, float]]:
    """Seconds spent in each of :data:`PHASES` while the block runs (the functions and calls wrapped)."""
    spent: dict[str, float] = defaultdict(float)

    def clocked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return run

    module_fns = {
        "build_units_tables": "build",
        "write_table": "write_files",
        "describe_unit": "describe",
    }
    saved = {attr: getattr(writer_module, attr) for attr in module_fns}
    for attr, name in module_fns.items():
        setattr(writer_module, attr, clocked(name, saved[attr]))
    actions = [a for a in ("seal_units", "publish_units") if hasattr(StoreClient, a)]
    for w in writers:
        for a in actions:
            setattr(w.client, a, clocked(a, getattr(w.client, a)))
    control.register_units = clocked("register", control.register_units)
    try:
        yield spent
    finally:
        for attr, fn in saved.items():
            setattr(writer_module, attr, fn)
        for w in writers:
            for a in actions:
                delattr(w.client, a)
        del control.register_units


TREE = Path(writer_module.__file__).resolve().parents[2]
"""The checkout whose ``knittrans`` is measured (this one, or the one first on ``PYTHONPATH``)."""


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=TREE, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ray-python", type=Path, default=REPO / ".venv-bench" / "bin" / "python")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    load_start = os.getloadavg()
    spec = WorkloadSpec(kind="text")
    workload = generate(spec)
    batches = spec.put_batches()
    units = len(batches)
    times: dict[str, list[float]] = {"writer_units": [], "sequential": [], "doput": []}
    if write_units_across is not None:
        times["across"] = []
    shm = Path("/dev/shm")  # the stores' directories on tmpfs, as deployed (DEFAULT_ROOT) and like Ray's plasma
    with (
        tempfile.TemporaryDirectory(prefix="knittrans_put_", dir=shm if shm.is_dir() else None) as tmp,
        LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl,
    ):
        control = cl.control()
        control.create_job(put_job(spec, total_steps=10_000))
        local = [
            TrajectoryWriter(job=JOB, node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir, control=control)
            for s in cl.stores
        ]
        remote = [TrajectoryWriter(job=JOB, node_id=s.node_id, endpoint=s.endpoint, control=control) for s in cl.stores]
        plain = [
            TrajectoryWriter(job=JOB, node_id=s.node_id, endpoint=s.endpoint, store_dir=s.store_dir) for s in cl.stores
        ]
        by_node = {w.node_id: w.client for w in local}

        def drop(descs: Sequence[Any]) -> None:
            """Delete a timed run's units (untimed), as Ray's side drops its objects and a job its consumed
            units: kept, they would make every later run write to fresh tmpfs pages (``tmpfs_pages.py``)."""
            for d in descs:
                by_node[d.node_id].delete(JOB, d.unit_id)

        for run in range(args.runs + 1):  # run 0 warms every path up and is left out
            for variant in times:
                groups = build_groups(workload, f"{variant}{run}")  # fresh group ids (outside the timing)
                chunks = [groups[b.start : b.stop] for b in batches]
                t0 = time.perf_counter()
                if variant == "sequential":
                    descs = [plain[k % 2].write_groups(c) for k, c in enumerate(chunks)]
                    control.register_units(JOB, descs)
                elif variant == "across":
                    assert write_units_across is not None
                    descs = [
                        d
                        for ds in write_units_across([(w, chunks[k :: len(local)]) for k, w in enumerate(local)])
                        for d in ds
                    ]
                else:
                    writers = local if variant == "writer_units" else remote
                    descs = [d for k, w in enumerate(writers) for d in w.write_units(chunks[k :: len(writers)])]
                elapsed = time.perf_counter() - t0
                if run:
                    times[variant].append(elapsed)
                drop(descs)
        phases: dict[str, list[float]] = {p: [] for p in (*PHASES, "total", "control_rtt", "store_rtt")}
        for run in range(args.runs):  # the phase breakdown of writer_units (not in the figures above)
            groups = build_groups(workload, f"phases{run}")
            chunks = [groups[b.start : b.stop] for b in batches]
            with phase_clocks(local, control) as spent:
                t0 = time.perf_counter()
                descs = [d for k, w in enumerate(local) for d in w.write_units(chunks[k :: len(local)])]
                total = time.perf_counter() - t0
            drop(descs)
            for p in PHASES:
                phases[p].append(spent[p])
            phases["total"].append(total)
            t0 = time.perf_counter()
            control.health()
            phases["control_rtt"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            local[0].client.health()
            phases["store_rtt"].append(time.perf_counter() - t0)
        for w in [*local, *remote, *plain]:
            w.close()
        control.close()
    ray = ray_put(args.ray_python, args.runs)
    result: dict[str, Any] = {
        "workload": {
            "kind": "text",
            "trajectories": spec.num_trajectories,
            "groups": spec.num_groups,
            "units": units,
            "payload_bytes": workload.payload_bytes(image_per_row=False),
        },
        "ours": {
            v: {"median_s": statistics.median(t), "per_unit_ms": 1e3 * statistics.median(t) / units, "runs": t}
            for v, t in times.items()
        },
        "writer_units_phases_ms": {p: 1e3 * statistics.median(v) for p, v in phases.items()},
        "ray": ray,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "commit": commit(),
            "tree": str(TREE),
        },
    }
    if "put_s" in ray:
        result["ratio_vs_ray"] = {v: r["median_s"] / ray["put_s"] for v, r in result["ours"].items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "put_path.json").write_text(json.dumps(result, indent=1))
    m = result["machine"]
    lines = [
        f"# Put path: build + write + seal + register (commit {m['commit']})",
        "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs, load average {load_start[0]:.1f} at start / "
        f"{m['loadavg_end'][0]:.1f} at end. Text mini-batch, {spec.num_trajectories} trajectories, "
        f"{result['workload']['payload_bytes'] / 2**20:.1f} MiB of row data, {units} units over 2 stores; "
        f"median of {args.runs} runs.",
        "",
        "| path | total ms | per unit ms | x Ray put |",
        "|---|---|---|---|",
    ]
    for v, r in result["ours"].items():
        ratio = f"{result['ratio_vs_ray'][v]:.2f}" if "ratio_vs_ray" in result else "n/a"
        lines.append(f"| {v} | {1e3 * r['median_s']:.1f} | {r['per_unit_ms']:.2f} | {ratio} |")
    if "put_s" in ray:
        lines.append(
            f"| ray.put ({ray['objects']} shards, Ray {ray['ray_version']}) | {1e3 * ray['put_s']:.1f} | "
            f"{1e3 * ray['put_s'] / ray['objects']:.2f} per object | 1.00 |"
        )
    else:
        lines += ["", f"Ray: not measured: {ray['error']}"]
    ph = result["writer_units_phases_ms"]
    lines += [
        "",
        f"Where `writer_units` spends its time ({args.runs} more runs, each phase clocked; medians, ms per run of "
        "both writers):",
        "",
        *phase_table(ph, PHASES),
        "",
        f"No-op round trips in the same pass (the host's scheduling delay): control plane `GET /v1/health` "
        f"{ph['control_rtt']:.2f} ms, store `health` action {ph['store_rtt']:.2f} ms.",
    ]
    (args.out / "put_path.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
