"""Put path A/B: ``put_path.py`` run alternately on two checkouts' writers, in one session.

Each round runs ``put_path.py`` once with ``PYTHONPATH=<baseline>`` (that tree's ``knittrans`` and
benchmark workload) and once on this checkout, each with its own Ray ``put`` measured in the same
invocation; rounds alternate which tree goes first. The report gives, per tree and path, the median
over rounds of each run's median (and the median of the per-run ratios to that run's Ray), the spread
(min-max over rounds), and this checkout's phase table (medians over rounds).

    git worktree add /tmp/base <commit>   # the baseline checkout
    python benchmarks/transfer/put_path_ab.py --baseline /tmp/base [--rounds 5] [--runs 7] [--tag NAME]

Writes ``put_path_<tag>.json`` and ``put_path_<tag>.md`` under ``--out`` (default
benchmarks/transfer/results); the last run of this checkout also becomes ``put_path.json``/``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks.transfer.put_path import phase_table  # noqa: E402

SCRIPT = Path(__file__).with_name("put_path.py")


def run_once(tree: Path | None, runs: int, ray_python: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    # the tree's own knittrans, in the script and in the cluster's processes (whatever their working
    # directory, and ahead of an editable install of another checkout)
    env["PYTHONPATH"] = str(tree if tree is not None else REPO)
    cmd = [sys.executable, str(SCRIPT), "--runs", str(runs), "--ray-python", str(ray_python), "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
    return dict(json.loads((out / "put_path.json").read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="checkout whose writer is the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ray-python", type=Path, default=REPO / ".venv-bench" / "bin" / "python")
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    trees: dict[str, Path | None] = {"baseline": args.baseline.resolve(), "this": None}
    results: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["baseline", "this"] if r % 2 == 0 else ["this", "baseline"]
            for name in order:
                out = Path(tmp) / f"{name}{r}"
                res = run_once(trees[name], args.runs, args.ray_python, out)
                res["loadavg_during"] = [res["machine"]["loadavg_start"][0], res["machine"]["loadavg_end"][0]]
                results[name].append(res)
                print(
                    f"round {r} {name}: "
                    + ", ".join(f"{v} {1e3 * x['median_s']:.1f} ms" for v, x in res["ours"].items())
                    + f"; ray {1e3 * res['ray'].get('put_s', float('nan')):.1f} ms",
                    flush=True,
                )
                if name == "this" and r == args.rounds - 1:
                    args.out.mkdir(parents=True, exist_ok=True)
                    for ext in ("json", "md"):
                        shutil.copy(out / f"put_path.{ext}", args.out / f"put_path.{ext}")
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        paths: dict[str, Any] = {}
        for v in runs[0]["ours"]:
            ms = [1e3 * x["ours"][v]["median_s"] for x in runs]
            ratios = [x["ratio_vs_ray"][v] for x in runs if "ratio_vs_ray" in x]
            pooled = sorted(1e3 * t for x in runs for t in x["ours"][v]["runs"])
            paths[v] = {
                "median_ms": statistics.median(ms),
                "pooled_p50_ms": statistics.median(pooled),
                "pooled_p99_ms": pooled[min(len(pooled) - 1, round(0.99 * (len(pooled) - 1)))],
                "min_ms": min(ms),
                "max_ms": max(ms),
                "per_round_ms": ms,
                "ratio_vs_ray_median": statistics.median(ratios) if ratios else None,
                "ratio_per_round": ratios,
            }
        rays = [1e3 * x["ray"]["put_s"] for x in runs if "put_s" in x["ray"]]
        phases = {
            p: statistics.median(x["writer_units_phases_ms"].get(p, 0.0) for x in runs)
            for p in runs[0]["writer_units_phases_ms"]
        }
        summary[name] = {
            "commit": runs[0]["machine"]["commit"],
            "tree": runs[0]["machine"].get("tree", str(trees[name])),
            "paths": paths,
            "ray_put_ms_median": statistics.median(rays) if rays else None,
            "ray_put_ms_per_round": rays,
            "writer_units_phases_ms": phases,
            "loadavg_per_run": [x["loadavg_during"] for x in runs],
        }
    result = {
        "rounds": args.rounds,
        "runs_per_invocation": args.runs,
        "summary": summary,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "raw": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"put_path_{args.tag}.json").write_text(json.dumps(result, indent=1))
    b, t = summary["baseline"], summary["this"]
    lines = [
        f"# Put path A/B: {b['commit']} (baseline) vs {t['commit']} (this change)",
        "",
        f"Machine: {result['machine']['platform']}, {os.cpu_count()} CPUs, load average "
        f"{load_start[0]:.1f} at start / {result['machine']['loadavg_end'][0]:.1f} at end. {args.rounds} rounds, "
        f"each one `put_path.py --runs {args.runs}` per tree (alternating which goes first), Ray's `put` "
        "measured in every invocation. Figures: median over rounds of each invocation's median "
        "(min-max over rounds); ratio: median over rounds of (path / that invocation's Ray `put`).",
        "",
        "| tree | path | total ms | min-max ms | p50 / p99 ms (all runs) | per unit ms | x Ray put |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, s in (("baseline " + b["commit"], b), ("this " + t["commit"], t)):
        for v, x in s["paths"].items():
            ratio = f"{x['ratio_vs_ray_median']:.2f}" if x["ratio_vs_ray_median"] is not None else "n/a"
            lines.append(
                f"| {label} | {v} | {x['median_ms']:.1f} | {x['min_ms']:.1f}-{x['max_ms']:.1f} | "
                f"{x['pooled_p50_ms']:.1f} / {x['pooled_p99_ms']:.1f} | {x['median_ms'] / 8:.2f} | {ratio} |"
            )
        if s["ray_put_ms_median"] is not None:
            lines.append(
                f"| {label} | ray.put (4 shards) | {s['ray_put_ms_median']:.1f} | "
                f"{min(s['ray_put_ms_per_round']):.1f}-{max(s['ray_put_ms_per_round']):.1f} | | | 1.00 |"
            )
    for label, s in (("baseline", b), ("this change", t)):
        ph = s["writer_units_phases_ms"]
        names = [p for p in ph if p not in ("total", "control_rtt", "store_rtt")]
        lines += [
            "",
            f"`writer_units` phases, {label} (ms per run of both writers; medians over rounds):",
            "",
            *phase_table(ph, names),
            "",
            f"No-op round trips: control plane {ph['control_rtt']:.2f} ms, store {ph['store_rtt']:.2f} ms.",
        ]
    lines += ["", "Load average (1 min) at start/end of each invocation:", ""]
    for label, s in (("baseline", b), ("this change", t)):
        lines.append(f"* {label}: " + ", ".join(f"{a:.1f}/{e:.1f}" for a, e in s["loadavg_per_run"]))
    (args.out / f"put_path_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
