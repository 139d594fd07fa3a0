"""tmpfs pages: what writing a unit's bytes to ``/dev/shm`` costs on pages the machine never used vs pages freed.

Why this exists: ``put_path_pair.py`` measured a put at 24-26 ms when every put's units stayed in the
stores and at 12-16 ms when each put's units were deleted after it (as Ray's side drops its objects),
on the same host in the same hour. The difference is the IPC writes: a file write to tmpfs takes a
page for every 4 KiB, and on a freshly booted virtual machine a page the guest has never touched
costs far more than one the kernel freed a moment ago (the host backs guest memory on first touch).

Here, in one process: ``--mib`` MiB written with ``os.write`` in 512 KiB chunks (the size of one text
unit's trajectory file) to files on ``/dev/shm``, in three cases, alternating, ``--rounds`` rounds:

* ``kept``: new files, never deleted (the tmpfs grows by ``--mib`` each round, as a store that keeps
  every unit): once the tmpfs passes the most memory this machine has used since it booted, these
  writes land on pages the guest never touched;
* ``recycled``: new files, the previous round's deleted first (a store whose consumed units are
  deleted: the kernel hands the freed pages out again);
* ``overwrite``: the ``kept`` files of the round written again in place (pages already in the files).

Reported: per round and case the microseconds per 4 KiB page (with the tmpfs size before the round),
and per case the median, p99 and MiB/s.

    python benchmarks/transfer/tmpfs_pages.py [--mib 64] [--rounds 8] [--out DIR]

Writes ``tmpfs_pages.json`` and ``tmpfs_pages.md`` under ``--out`` (default benchmarks/transfer/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

CHUNK = 512 * 1024
PAGE = 4096


def write_files(paths: list[Path], chunk: bytes, *, truncate: bool = True) -> float:
    """Write ``chunk`` once to each path (created or truncated unless ``truncate`` is False); seconds."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, flags, 0o600)
        try:
            os.write(fd, chunk)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB written per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    files = max(1, args.mib * 1024 * 1024 // CHUNK)
    chunk = os.urandom(CHUNK)
    pages = files * CHUNK // PAGE
    load_start = os.getloadavg()
    per_page: dict[str, list[float]] = {"kept": [], "recycled": [], "overwrite": []}
    tmpfs_mib: list[float] = []
    with tempfile.TemporaryDirectory(prefix="knittrans_pages_", dir="/dev/shm") as tmp:
        root = Path(tmp)
        for r in range(args.rounds):  # the cases alternate round by round, so that all see the same load
            print(f"round {r + 1}/{args.rounds}", flush=True)
            disk = shutil.disk_usage("/dev/shm")
            tmpfs_mib.append(disk.used / 2**20)
            kept = [root / f"kept-{r}-{i}" for i in range(files)]
            per_page["kept"].append(1e6 * write_files(kept, chunk) / pages)
            recycled = [root / f"recycled-{r}-{i}" for i in range(files)]
            for old in root.glob(f"recycled-{r - 1}-*"):
                old.unlink()
            per_page["recycled"].append(1e6 * write_files(recycled, chunk) / pages)
            per_page["overwrite"].append(1e6 * write_files(kept, chunk, truncate=False) / pages)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {
        case: {
            "us_per_page_median": statistics.median(xs),
            "us_per_page_p99": pct(xs, 0.99),
            "mib_per_s": PAGE / statistics.median(xs) / 1.048576,
        }
        for case, xs in per_page.items()
    }
    result = {
        "benchmark": "tmpfs_pages",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "uptime_s": float(Path("/proc/uptime").read_text().split()[0]),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "commit": commit or "unknown",
        },
        "args": {"mib": args.mib, "rounds": args.rounds, "chunk_bytes": CHUNK},
        "summary": summary,
        "raw_us_per_page": per_page,
        "tmpfs_used_mib_before_round": tmpfs_mib,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tmpfs_pages.json").write_text(json.dumps(result, indent=1))
    m = result["machine"]
    lines = [
        "# tmpfs pages: kept vs recycled vs overwritten",
        "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs, up {m['uptime_s'] / 60:.0f} min, load average "
        f"{load_start[0]:.1f} at start / {m['loadavg_end'][0]:.1f} at end, commit {m['commit']}. {args.mib} MiB "
        f"per round in {CHUNK // 1024} KiB files on /dev/shm, {args.rounds} rounds, the cases alternating.",
        "",
        "| case | us per 4 KiB page, median | p99 | MiB/s |",
        "|---|---|---|---|",
    ]
    for case, s in summary.items():
        lines.append(f"| {case} | {s['us_per_page_median']:.2f} | {s['us_per_page_p99']:.2f} | {s['mib_per_s']:.0f} |")
    lines += ["", "| round | tmpfs used before, MiB | kept | recycled | overwrite |", "|---|---|---|---|---|"]
    for r, used in enumerate(tmpfs_mib):
        cells = " | ".join(f"{per_page[c][r]:.2f}" for c in per_page)
        lines.append(f"| {r + 1} | {used:.0f} | {cells} |")
    (args.out / "tmpfs_pages.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
