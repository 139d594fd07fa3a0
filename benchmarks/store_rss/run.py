"""Idle resident memory of a store node: a real ``knittrans store`` process after start-up.

Each run starts ``python -m knittrans.cli store --port 0`` on a fresh directory, waits for its ready
file, lets it settle, reads ``VmRSS`` from ``/proc/PID/status`` and stops it. The median of
``--runs`` runs is reported per source tree, so a baseline tree (``--baseline DIR``, e.g. a
``git worktree`` of an older commit) is measured in the same run, on the same interpreter::

    .venv/bin/python -m benchmarks.store_rss.run --baseline /tmp/knittrans-main --runs 3

Writes ``benchmarks/store_rss/results.json`` and ``results.md`` (machine, load average, commit).
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from knittrans.procs import stop_process, wait_ready  # noqa: E402


def vm_rss_kib(pid: int) -> int:
    """``VmRSS`` of a live process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def one_run(tree: Path, settle_s: float, timeout_s: float = 120.0) -> tuple[float, list[str]]:
    """Idle RSS (MiB) of one store process started from ``tree``, and the model-stack modules it loaded."""
    with tempfile.TemporaryDirectory(prefix="knittrans-rss-") as tmp:
        ready = Path(tmp) / "ready"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.pop("KNITTRANS_STORE_TOKEN", None)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "knittrans.cli",
                "store",
                "--port",
                "0",
                "--dir",
                str(Path(tmp) / "store"),
                "--ready-file",
                str(ready),
            ],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_ready(
                proc,
                ready.exists,
                timeout_s=timeout_s,
                what=f"store from {tree}",
                output=lambda: proc.stderr.read().decode()[-2000:] if proc.stderr else "",
            )
            time.sleep(settle_s)  # the measurement itself: RSS a fixed time after ready, not a synchronisation
            rss = vm_rss_kib(proc.pid) / 1024
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            heavy = sorted({lib for lib in ("libtorch", "transformers", "matplotlib") if lib in maps})
            return rss, heavy
        finally:
            stop_process(proc, grace_s=30)


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def measure(tree: Path, runs: int, settle_s: float, commit: str | None = None) -> dict[str, Any]:
    samples = [one_run(tree, settle_s) for _ in range(runs)]
    rss = [s[0] for s in samples]
    return {
        "tree": str(tree),
        "commit": commit or _commit(tree),
        "rss_mib": rss,
        "median_mib": statistics.median(rss),
        "min_mib": min(rss),
        "max_mib": max(rss),
        "model_stack_mapped": samples[-1][1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="store processes per tree (default 3)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="idle seconds after ready before reading RSS")
    parser.add_argument("--baseline", type=Path, default=None, help="source tree to compare against")
    parser.add_argument("--baseline-commit", default=None, help="commit of --baseline when it is no git checkout")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "benchmark": "store_idle_rss",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m_start": os.getloadavg()[0],
        "runs": args.runs,
        "settle_s": args.settle_s,
    }
    if args.baseline is not None:
        result["baseline"] = measure(args.baseline.resolve(), args.runs, args.settle_s, args.baseline_commit)
    result["current"] = measure(REPO, args.runs, args.settle_s)
    result["load_average_1m_end"] = os.getloadavg()[0]
    if "baseline" in result:
        result["ratio_current_vs_baseline"] = result["current"]["median_mib"] / result["baseline"]["median_mib"]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    rows = [("baseline", result["baseline"])] if "baseline" in result else []
    rows.append(("current", result["current"]))
    md = [
        "# Store node idle RSS",
        "",
        f"python {result['python']}, {result['cpus']} CPUs, load average {result['load_average_1m_start']:.1f} "
        f"-> {result['load_average_1m_end']:.1f}; {args.runs} runs, RSS read {args.settle_s} s after ready.",
        "",
        "| tree | commit | median MiB | min | max | model stack mapped |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {name} | {r['commit']} | {r['median_mib']:.1f} | {r['min_mib']:.1f} | {r['max_mib']:.1f} | "
        f"{', '.join(r['model_stack_mapped']) or 'none'} |"
        for name, r in rows
    ]
    if "ratio_current_vs_baseline" in result:
        md += ["", f"ratio current / baseline: {result['ratio_current_vs_baseline']:.3f}"]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
