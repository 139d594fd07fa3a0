"""Opening a sealed unit's IPC files: ``ipc.open_file`` vs the file's stream part, in one process.

A store opens every unit it publishes (``SealedUnit.open``: memory map, read, schema check), so the
fixed cost per file is most of a small unit's ``publish_units``. This writes the text mini-batch's 8
units (``build_units_tables``, as a put does) as IPC files on ``/dev/shm`` and opens each file both
ways, alternating the two in every round so that both see the same load:

* ``open_file``: ``pa.memory_map`` + ``ipc.open_file(...).read_all()`` (the store before 2026-12-04);
* ``stream``: ``knittrans.store.unit._open_table``: the mapped bytes between the 8-byte header and the
  footer read with ``ipc.open_stream``, after the magic and footer-length checks, plus the schema check.

Per file, µs: median, p99 and mean over every open; the two tables are checked equal.

    python benchmarks/transfer/open_unit.py [--rounds 30]

Writes ``open_unit.json`` and ``.md`` under ``--out`` (default benchmarks/transfer/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from benchmarks.vs_baselines.knittrans_runner import build_groups
from benchmarks.vs_baselines.workload import WorkloadSpec, generate
from knittrans.schema import build_units_tables
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, _open_table, write_table


def by_open_file(path: Path, kind: str) -> pa.Table:
    return ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    spec = WorkloadSpec(kind="text")
    groups = build_groups(generate(spec), "o")
    units = build_units_tables([groups[b.start : b.stop] for b in spec.put_batches()])
    ways = {"open_file": by_open_file, "stream": _open_table}
    times: dict[str, list[float]] = {w: [] for w in ways}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="knittrans_open_", dir="/dev/shm") as tmp:
        files: list[tuple[Path, str]] = []
        for k, u in enumerate(units):
            d = Path(tmp) / f"u{k}"
            d.mkdir()
            write_table(d / TRAJ_FILE, u.traj)
            files.append((d / TRAJ_FILE, "trajectories"))
            if u.media.num_rows:
                write_table(d / MEDIA_FILE, u.media)
                files.append((d / MEDIA_FILE, "media"))
        for path, kind in files:
            if not _open_table(path, kind).equals(by_open_file(path, kind)):
                raise SystemExit(f"{path}: the two ways read different tables")
        for r in range(args.rounds):
            if r % 10 == 0:
                print(f"round {r + 1}/{args.rounds}", flush=True)
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for way in order:
                for path, kind in files:
                    t0 = time.perf_counter()
                    ways[way](path, kind)
                    times[way].append((time.perf_counter() - t0) * 1e6)
    load_end = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stats = {
        w: {"p50": statistics.median(x), "p99": pct(x, 0.99), "mean": statistics.fmean(x), "n": len(x)}
        for w, x in times.items()
    }
    ratio = stats["stream"]["p50"] / stats["open_file"]["p50"]
    out = {
        "commit": commit,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load": [load_start, load_end],
        "rounds": args.rounds,
        "files_per_round": len(files),
        "per_file_us": stats,
        "stream_over_open_file_p50": ratio,
        "pyarrow": pa.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "open_unit.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"# Opening a unit's IPC files: `open_file` vs the stream part ({commit})",
        "",
        f"Machine: {out['platform']}, {out['cpus']} CPUs, load average {load_start:.1f} at start / {load_end:.1f}"
        f" at end; pyarrow {pa.__version__}. The text mini-batch's 8 units ({len(files)} files on /dev/shm),"
        f" each file opened both ways in each of {args.rounds} rounds, the order alternating.",
        "",
        "| way | p50 µs | p99 µs | mean µs | opens |",
        "|---|---|---|---|---|",
        *(f"| {w} | {s['p50']:.0f} | {s['p99']:.0f} | {s['mean']:.0f} | {s['n']} |" for w, s in stats.items()),
        "",
        f"stream / open_file, p50: {ratio:.2f}.",
    ]
    (args.out / "open_unit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
