"""Head-to-head benchmark: TransferQueue vs the Ray object store vs KnitTrans on the same workloads.

    python -m benchmarks.vs_baselines.harness                 # full matrix, 3 repetitions
    python -m benchmarks.vs_baselines.harness --smoke         # CI: reduced, < 2 minutes
    python -m benchmarks.vs_baselines.harness --systems tq:kv,ray:group --kinds multimodal

Each (system, workload) runs in its own driver subprocess (``driver.py``) whose whole process tree
is memory-sampled from here.  Results: ``results.json``, ``results.md``, ``results.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.vs_baselines.aggregate import summarise
from benchmarks.vs_baselines.procmem import TreeMemorySampler
from benchmarks.vs_baselines.report import write_markdown, write_png

__all__ = ["DEFAULT_SYSTEMS", "main", "run_one"]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SYSTEMS = (
    "knittrans:flight",
    "knittrans:flight_eager",
    "knittrans:mmap",
    "tq:kv",
    "tq:sampler",
    "ray:group",
    "ray:shard",
    "local:memory",
)
SMOKE_SYSTEMS = ("knittrans:flight", "tq:kv", "ray:group", "local:memory")
SMOKE_SPEC = {"num_trajectories": 128, "micro_batches": 2}


def available(system: str) -> bool:
    """Whether the runner module of ``system`` and its dependencies are importable here."""
    needs = {"tq": ["transfer_queue", "ray"], "ray": ["ray"], "knittrans": ["knittrans"], "local": ["torch"]}[system]
    if system == "knittrans" and not (Path(__file__).parent / "knittrans_runner.py").exists():
        return False
    return all(importlib.util.find_spec(m) is not None for m in needs)


def kill_tree(pid: int) -> None:
    """Kill a timed-out driver and every process it started (Ray services, actors, subprocesses)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def run_one(
    system: str,
    variant: str,
    kind: str,
    *,
    reps: int,
    modes: str,
    spec: dict[str, Any],
    hidden: int,
    timeout_s: float,
    workdir: Path,
    warmup: int = 1,
    put_ahead: bool = True,
) -> dict[str, Any]:
    """Run one driver subprocess, sampling its process tree's memory; return its result plus memory."""
    out = workdir / f"{system}_{variant}_{kind}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.vs_baselines.driver",
        "--system",
        system,
        "--variant",
        variant,
        "--kind",
        kind,
        "--reps",
        str(reps),
        "--modes",
        modes,
        "--spec-json",
        json.dumps(spec),
        "--compute-hidden",
        str(hidden),
        "--out",
        str(out),
        "--warmup",
        str(warmup),
        *([] if put_ahead else ["--no-put-ahead"]),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        TQ_LOGGING_LEVEL=os.environ.get("TQ_LOGGING_LEVEL", "ERROR"),
    )
    logger.info("running %s:%s on %s (%d reps, modes %s)", system, variant, kind, reps, modes)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    sampler = TreeMemorySampler(proc.pid).start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        rc = -9
    finally:
        sampler.stop()
    if rc != 0 or not out.exists():
        raise RuntimeError(f"{system}:{variant} on {kind} failed (exit {rc}) after {time.time() - t0:.0f} s")
    result: dict[str, Any] = json.loads(out.read_text())
    consume = [p for p in result["phases"] if p["name"].startswith(("put:", "consume:"))]
    # Mode "none" holds one stored copy at a time (compute mode puts the next one ahead): the window
    # for memory per stored byte.
    single = [p for p in consume if p["name"].endswith("_none")] or consume
    result["memory"] = {
        "peak_by_role_whole_run": sampler.peak_per_role(),
        "peak_by_role_data_phases": sampler.peak_per_role(consume[0]["start"], consume[-1]["end"]),
        "peak_by_role_one_copy": sampler.peak_per_role(single[0]["start"], single[-1]["end"]),
        "peak_by_process": {
            str(pid): {"role": role, "peak_rss": rss} for pid, (role, rss) in sampler.peak_by_pid.items()
        },
        "processes": len(sampler.peak_by_pid),
    }
    return result


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per (system, workload) from interleaved rounds (one driver, one repetition per round):
    their repetitions side by side, warm-up waits pooled per mode, start-up the median, memory peaks the
    largest per role."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for parts in zip(*rounds, strict=True):
        base = dict(parts[0])
        runs = []
        for rnd, part in enumerate(parts):
            runs += [{**run, "rep": rnd} for run in part["runs"]]
        base["runs"] = runs
        base["phases"] = [p for part in parts for p in part["phases"]]
        base["startup_s"] = statistics.median(part["startup_s"] for part in parts)
        warm: dict[str, dict[str, Any]] = {}
        for part in parts:
            for w in part.get("warmup", []):
                slot = warm.setdefault(w["mode"], {**w, "waits_ms": []})
                slot["waits_ms"] = slot["waits_ms"] + list(w["waits_ms"])
        base["warmup"] = list(warm.values())
        memory = dict(parts[0]["memory"])
        for key in ("peak_by_role_whole_run", "peak_by_role_data_phases", "peak_by_role_one_copy"):
            roles = {role for part in parts for role in part["memory"][key]}
            memory[key] = {role: max(part["memory"][key].get(role, 0) for part in parts) for role in roles}
        memory["processes"] = max(part["memory"]["processes"] for part in parts)
        base["memory"] = memory
        merged.append(base)
    return merged


def cold_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fetch waits of each driver's unrecorded warm-up mini-batches (the first ones after start-up: cold)."""
    out = []
    for res in results:
        for w in res.get("warmup", []):
            waits = sorted(w["waits_ms"])
            if waits:
                out.append(
                    {
                        "system": res["system"],
                        "kind": res["kind"],
                        "mode": w["mode"],
                        "tag": w["tag"],
                        "p50_ms": waits[len(waits) // 2],
                        "p99_ms": waits[min(len(waits) - 1, int(0.99 * len(waits)))],
                    }
                )
    return out


def machine_info() -> dict[str, Any]:
    """Host, CPU model and the git commit of the checkout (``-dirty`` with uncommitted changes)."""
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu,
        "commit": commit + ("-dirty" if dirty else ""),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=None, help=f"comma list of system:variant (default {DEFAULT_SYSTEMS})")
    p.add_argument("--kinds", default="text,multimodal")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="none,compute")
    p.add_argument("--compute-hidden", type=int, default=64)
    p.add_argument(
        "--spec-json",
        default=None,
        help='WorkloadSpec overrides as JSON, e.g. \'{"ranks": 1, "num_trajectories": 128}\'',
    )
    p.add_argument("--warmup", type=int, default=1, help="unrecorded mini-batches per system and mode first")
    p.add_argument(
        "--no-put-ahead",
        dest="put_ahead",
        action="store_false",
        help="compute mode: put each mini-batch only after the previous one was consumed "
        "(default: the next one is put before the current one is consumed)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run the repetitions as rounds (every system once per round, one driver each) instead of "
        "all repetitions of one system in a row, so systems share the host's load window",
    )
    p.add_argument("--smoke", action="store_true", help="reduced CI mode (< 2 min): fewer systems, rows, reps")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per driver subprocess")
    p.add_argument("--from-json", default=None, help="re-summarise the raw results of an earlier results.json")
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default benchmarks/vs_baselines/results, or results/smoke with --smoke)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s harness %(message)s")
    spec: dict[str, Any] = dict(SMOKE_SPEC) if args.smoke else {}
    if args.spec_json:
        spec.update(json.loads(args.spec_json))
    reps = 1 if args.smoke else args.reps
    kinds = ["multimodal"] if args.smoke and args.kinds == "text,multimodal" else args.kinds.split(",")
    wanted = args.systems.split(",") if args.systems else list(SMOKE_SYSTEMS if args.smoke else DEFAULT_SYSTEMS)
    chosen = []
    for item in wanted:
        system, _, variant = item.partition(":")
        if available(system):
            chosen.append((system, variant or "default"))
        elif args.systems:
            raise SystemExit(f"system {system!r} is not available here (install the 'bench' extra?)")
        else:
            logger.warning("skipping %s: runner or its packages not available", item)
    default_out = REPO / "benchmarks" / "vs_baselines" / "results"
    out_dir = Path(args.out) if args.out else (default_out / "smoke" if args.smoke else default_out)
    if not chosen and not args.from_json:
        raise SystemExit(
            "no system to run: the baselines need the 'bench' extra "
            "(scripts/setup_bench_env.sh, or pip install -e '.[bench]')"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    machine, load_start = machine_info(), list(os.getloadavg())
    earlier: dict[str, Any] = {}
    if args.from_json:
        loaded = json.loads(Path(args.from_json).read_text())
        results, earlier, chosen = loaded["raw"], loaded.get("meta", {}), []
    rounds = reps if args.interleave else 1
    round_loads: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="vs_baselines_") as tmp:
        per_round: list[list[dict[str, Any]]] = []
        for _ in range(rounds):
            round_loads.append(list(os.getloadavg()))
            done: list[dict[str, Any]] = []
            for kind in kinds:
                for system, variant in chosen:
                    done.append(
                        run_one(
                            system,
                            variant,
                            kind,
                            reps=1 if args.interleave else reps,
                            modes=args.modes,
                            spec=spec,
                            hidden=args.compute_hidden,
                            timeout_s=args.timeout,
                            workdir=Path(tmp),
                            warmup=args.warmup,
                            put_ahead=args.put_ahead,
                        )
                    )
                    (out_dir / "raw_partial.json").write_text(json.dumps({"rounds": [*per_round, done]}))
            per_round.append(done)
        results += merge_rounds(per_round)
    (out_dir / "raw_partial.json").unlink(missing_ok=True)
    summary = summarise(results)
    summary["cold"] = cold_rows(results)
    meta = {
        "argv": sys.argv[1:],
        "smoke": args.smoke,
        "reps": reps,
        "spec_overrides": spec,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        **machine,
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
        "interleaved": args.interleave,
        "loadavg_rounds": round_loads if args.interleave else None,
    }
    if earlier:  # re-summarised: the run's own machine, load, time and rounds, not this invocation's
        meta = {**earlier, "resummarised": meta["time"]}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": results}))
    table = write_markdown(summary, meta, out_dir / "results.md")
    write_png(summary, out_dir / "results.png")
    print(table)
    missed = [t for t in summary["targets"] if not t["met"]]
    if missed:
        logger.warning(
            "%d of %d target checks missed (see results.md; targets are reported, not enforced)",
            len(missed),
            len(summary["targets"]),
        )
    bad = [f"{s['system']}/{s['kind']}/{s['mode']}" for s in summary["rows"] if not s["correct"]]
    if bad or not summary["cross_system_digests_agree"] or not summary["cross_system_rows_agree"]:
        logger.error("CORRECTNESS FAILURE: %s", bad or "cross-system digests disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
