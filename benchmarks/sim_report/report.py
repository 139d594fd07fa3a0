"""What the sim_report scripts share: their common options and how they write a result (JSON + Markdown)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parser(doc: str | None, *, seeds: int = 3) -> argparse.ArgumentParser:
    """An argument parser with ``--seeds``, ``--steps`` (40) and ``--out`` (this folder's results/)."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--seeds", type=int, default=seeds)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, default=HERE / "results")
    return p


def write(out: Path, stem: str, md: str, meta: dict[str, Any], **payload: Any) -> None:
    """``<stem>.json`` (``{"meta": ..., **payload}``) and ``<stem>.md`` under ``out``; ``meta`` gets the command,
    machine, Python, load average and commit added. Prints the Markdown."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    meta = {
        **meta,
        "command": f"python benchmarks/sim_report/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:]),
        "machine": platform.node(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "git_commit": commit,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, **payload}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
