"""CPU to render one admission's 1,024 rank plans: the dataclass path against the direct JSON writer, same process.

Run: ``python benchmarks/control_plane/bench_render.py [--ranks 1024] [--repeats 7]``. The layout is
shaped like ``scale.py``'s delivery phase: groups of 8 rows, one unit per group, units spread over
128 nodes, every rank ``rows`` consecutive rows (1: the stress case, 8: 8,192 trajectories a
mini-batch); each configuration unsigned and with signed tickets (a ticket key), with and without
media. Timed with the thread's CPU clock (``time.thread_time``), so other processes on a shared
machine slow it less than wall time; the two renderers alternate, and the output bytes are checked
equal. Results: ``results/bench_render.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from knittrans.api.planjson import render_rank_plan_json
from knittrans.api.plans import Signer, render_rank_plan
from knittrans.descriptors import GroupRecord
from knittrans.grants import sign_grant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GROUP = 8


def dataclass_path(job: str, layout: Any, **kw: Any) -> bytes:
    """What the control plane did before: the RankPlan dataclasses, ``to_json``, ``json.dumps``."""
    plan = render_rank_plan(job, layout, **kw)
    return json.dumps(plan.to_json(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def setup(ranks: int, rows: int, media: bool) -> tuple[dict[str, tuple[GroupRecord, str, str]], list[Any]]:
    groups = {}
    for i in range(ranks * rows // GROUP):
        record = GroupRecord(
            group_id=f"u{i}",
            source="math",
            row_start=0,
            num_trajectories=GROUP,
            trajectory_tokens=tuple(100 + j for j in range(GROUP)),
            version_start=0,
            version_end=0,
            version_weighted=0.0,
            finished_at=1767225600.0,
            media_hashes=(hashlib.sha256(str(i).encode()).hexdigest(),) if media else (),
        )
        groups[record.group_id] = (record, f"u{i}", f"n{i % 128}")
    # one micro-batch per row (micro_batch_size 1, as in scale.py), rank r reads rows r*rows ... of the groups
    layout = [[[[f"u{(r * rows + j) // GROUP}", (r * rows + j) % GROUP]] for j in range(rows)] for r in range(ranks)]
    return groups, layout


def signer(rank: int) -> Signer:
    def sign(reads: dict[str, list[tuple[int, int]]], media: dict[str, str]) -> str:
        return sign_grant(
            b"k" * 32, job="delivery", rank=rank, expires_at=1767229200.0, reads=reads, columns=None, media=media
        )

    return sign


def run(ranks: int, rows: int, signed: bool, media: bool, repeats: int) -> dict[str, Any]:
    groups, layout = setup(ranks, rows, media)
    kws = [
        {
            "rank": r,
            "n": 7,
            "attempt": 0,
            "step": 3,
            "k": 1,
            "where": groups.__getitem__,
            "endpoint": lambda node: f"grpc://127.0.0.1:{10000 + int(node[1:])}",
            "columns": None,
            "sign": signer(r) if signed else None,
            "mini_batch_trajectories": ranks * rows,
            "admitted_at": 1767225600.125,
        }
        for r in range(ranks)
    ]
    times: dict[str, list[float]] = {"dataclasses": [], "direct": []}
    out: dict[str, list[bytes]] = {}
    for _ in range(repeats):
        for name, render in (("dataclasses", dataclass_path), ("direct", render_rank_plan_json)):
            t0 = time.thread_time()
            got = [render("delivery", layout[r], **kws[r]) for r in range(ranks)]
            times[name].append((time.thread_time() - t0) / ranks * 1e6)
            out[name] = got
    assert out["dataclasses"] == out["direct"], "the renderers disagree"
    old, new = statistics.median(times["dataclasses"]), statistics.median(times["direct"])
    return {
        "rows_per_rank": rows,
        "signed": signed,
        "media": media,
        "plan_bytes": len(out["direct"][0]),
        "dataclasses_us_per_rank": old,
        "direct_us_per_rank": new,
        "ratio": new / old,
        "dataclasses_ms_per_admission": old * ranks / 1e3,
        "direct_ms_per_admission": new * ranks / 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_render")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    rows = [
        run(args.ranks, r, signed, media, args.repeats)
        for r in (1, 8)
        for signed in (False, True)
        for media in (False, True)
    ]
    result = {
        "benchmark": "control_plane_render",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m_start": load0,
        "load_avg_1m_end": os.getloadavg()[0],
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "ranks": args.ranks,
        "repeats": args.repeats,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Rendering one admission's {args.ranks} rank plans\n",
        f"{result['machine']}, {result['cpus']} CPUs, Python {result['python']}, commit {result['commit']}, load "
        f"{load0:.1f}–{result['load_avg_1m_end']:.1f}; thread CPU time, median of {args.repeats} alternating repeats\n",
        "| rows / rank | signed tickets | media | plan bytes | dataclasses (µs / rank) | direct (µs / rank) | "
        "ratio | per admission: dataclasses → direct (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows_per_rank']} | {'yes' if r['signed'] else 'no'} | {'yes' if r['media'] else 'no'} | "
            f"{r['plan_bytes']:,} | {r['dataclasses_us_per_rank']:.1f} | {r['direct_us_per_rank']:.1f} | "
            f"{r['ratio']:.2f} | {r['dataclasses_ms_per_admission']:.0f} → {r['direct_ms_per_admission']:.0f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
