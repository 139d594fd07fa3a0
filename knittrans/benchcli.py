"""``knittrans bench NAME``: run a benchmark script of the source checkout's ``benchmarks/`` folder."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARKS", "add_arguments", "run"]

BENCHMARKS: dict[str, tuple[str, ...]] = {
    "transfer": ("transfer/run.py",),
    "control_plane": ("control_plane/bench_sched.py", "control_plane/scale.py"),
    "trainer": ("trainer/run.py",),
    "baselines": ("vs_baselines/run.py",),
    "sim_scale": ("sim_scale/run.py",),
}
"""Benchmark name -> scripts under ``benchmarks/``, run in order."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``knittrans bench``."""
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script(s)")


def run(args: Any) -> int:
    """Run the scripts with this interpreter; the first failure's exit code is returned."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    if not root.is_dir():
        print(f"knittrans bench needs a source checkout: {root} does not exist", file=sys.stderr)
        return 2
    for script in BENCHMARKS[args.name]:
        rc = subprocess.call([sys.executable, str(root / script), *args.args])
        if rc != 0:
            return rc
    return 0
