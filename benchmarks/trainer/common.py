"""Helpers shared by the trainer benchmarks: the machine a result was measured on, percentiles."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["commit_of", "distribution", "machine"]

REPO = Path(__file__).resolve().parents[2]


def commit_of(tree: Path = REPO) -> str:
    """Short commit of the checkout ``tree`` (``-dirty`` with uncommitted changes to tracked files); "" when
    ``tree`` is no git checkout (a ``git archive``)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    if not (tree / ".git").exists():
        return ""
    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return commit + ("-dirty" if dirty and commit else "")


def machine() -> dict[str, Any]:
    """Platform, CPU model and count, load average, date and this checkout's commit."""
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if "model name" in ln), "")
    return {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "commit": commit_of(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def distribution(values: Sequence[float]) -> dict[str, float]:
    """p50 / mean / p99 / max and the count of ``values`` (NaN figures when empty)."""
    if not values:
        return {"p50": float("nan"), "mean": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    arr = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(arr, 50)),
        "mean": float(arr.mean()),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "n": int(arr.size),
    }
