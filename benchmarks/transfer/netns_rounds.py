"""Summarise several rounds of ``netns_throughput.py`` (each its own JSON) into one table.

``python benchmarks/transfer/netns_rounds.py results/netns_throughput_lane_round*.json \
--out results/netns_throughput_lane``

Per case (unit size x streams): the median over rounds of each round's median ratio (lane / TCP,
DoGet / TCP, and the CPU ratios), with the min-max over rounds, plus the median, p50 and p99 of
every individual run's throughput pooled over all rounds. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

METHODS = ("doget", "lane", "tcp")
LABELS = {"doget": "DoGet", "lane": "lane", "tcp": "raw TCP", "nopool": "lane, no receive pool"}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summarise(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-case summary of ``reports`` (each one ``netns_throughput.py`` JSON report)."""
    cases: dict[str, Any] = {}
    for key in reports[0]["results"]:
        rounds = [r["results"][key] for r in reports]
        ratio = {
            "lane/tcp": [x["lane_ratio_median"] for x in rounds],
            "doget/tcp": [x["ratio_median"] for x in rounds],
            "lane/doget": [x["lane_GBps_median"] / x["doget_GBps_median"] for x in rounds],
            "cpu tcp/lane": [x["lane_cpu_ratio"] for x in rounds],
            "cpu tcp/doget": [x["cpu_ratio"] for x in rounds],
        }
        pooled = {m: [g for x in rounds for g in x[f"{m}_GBps"]] for m in METHODS}
        if all("nopool_ratio_median" in x for x in rounds):  # --pool-ab: lane reads without the receive pool
            ratio["no pool/tcp"] = [x["nopool_ratio_median"] for x in rounds]
            ratio["lane/no pool"] = [x["lane_GBps_median"] / x["nopool_GBps_median"] for x in rounds]
            pooled["nopool"] = [g for x in rounds for g in x["nopool_GBps"]]
        cpu = {
            m: {
                k: statistics.median(x["cpu"][m][k] for x in rounds)
                for k in ("client_s_per_GB", "server_s_per_GB", "client_faults_per_GB")
            }
            for m in METHODS
        }
        cases[key] = {
            "bytes": rounds[0]["bytes"],
            "streams": rounds[0]["streams"],
            "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratio.items()},
            "GBps_pooled": {
                m: {
                    "median": statistics.median(v),
                    "mean": statistics.fmean(v),
                    "ms_p50": _pct([rounds[0]["bytes"] / g / 1e6 for g in v], 0.5),
                    "ms_p99": _pct([rounds[0]["bytes"] / g / 1e6 for g in v], 0.99),
                    "n": len(v),
                }
                for m, v in pooled.items()
            },
            "cpu_median_of_rounds": cpu,
        }
    return {
        "rounds": len(reports),
        "commits": sorted({r["commit"] for r in reports}),
        "runs_per_round": reports[0]["runs"],
        "load_avg_1m": [[r["load_avg_1m_before"], r["load_avg_1m"]] for r in reports],
        "cases": cases,
    }


def markdown(summary: dict[str, Any]) -> str:
    """The summary as markdown tables."""
    loads = ", ".join(f"{a:.1f}→{b:.1f}" for a, b in summary["load_avg_1m"])
    out = [
        "# Data lane vs DoGet vs raw TCP (veth between network namespaces), rounds summarised\n",
        f"{summary['rounds']} rounds of `netns_throughput.py --runs {summary['runs_per_round']}` (commit "
        f"{', '.join(summary['commits'])}), 2 CPUs shared with other jobs; load (1 min, before→after each round): "
        f"{loads}.\n",
        "Ratios: median over rounds of each round's median (min–max over rounds in brackets); each round "
        "alternates DoGet, lane and raw TCP run by run.\n",
    ]
    keys = list(next(iter(summary["cases"].values()))["ratios"])
    out += [
        "| unit | streams | "
        + " | ".join(
            k.replace("/", " / ").replace("tcp", "TCP").replace("doget", "DoGet").replace("cpu", "CPU") for k in keys
        )
        + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for c in summary["cases"].values():
        r = c["ratios"]
        cells = [f"{r[k]['median']:.2f} ({r[k]['min']:.2f}–{r[k]['max']:.2f})" for k in r]
        out.append(f"| {c['bytes'] / (1 << 20):.0f} MiB | {c['streams']} | " + " | ".join(cells) + " |")
    out += [
        "\nEvery run pooled over rounds: GB/s median and mean; time of one whole-unit read, p50 / p99 ms:\n",
    ]
    methods = list(next(iter(summary["cases"].values()))["GBps_pooled"])
    out += [
        "| unit | streams | " + " | ".join(LABELS[m] for m in methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for c in summary["cases"].values():
        g = c["GBps_pooled"]
        out.append(
            _row(
                c,
                [
                    f"{g[m]['median']:.2f} / {g[m]['mean']:.2f} GB/s, "
                    f"{g[m]['ms_p50']:.0f} / {g[m]['ms_p99']:.0f} ms (n {g[m]['n']})"
                    for m in methods
                ],
            )
        )
    out += [
        "\nCPU seconds per GB, client + store (or raw sender), and client minor faults per GB; median over rounds:\n",
        "| unit | streams | DoGet | lane | raw TCP |",
        "|---|---|---|---|---|",
    ]
    for c in summary["cases"].values():
        u = c["cpu_median_of_rounds"]
        out.append(
            _row(
                c,
                [
                    f"{u[m]['client_s_per_GB']:.2f} + {u[m]['server_s_per_GB']:.2f} "
                    f"({u[m]['client_faults_per_GB'] / 1e3:.0f}k faults)"
                    for m in METHODS
                ],
            )
        )
    return "\n".join(out) + "\n"


def _row(case: dict[str, Any], cells: list[str]) -> str:
    return f"| {case['bytes'] / (1 << 20):.0f} MiB | {case['streams']} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary = summarise([json.loads(p.read_text()) for p in args.reports])
    summary["reports"] = [p.name for p in args.reports]
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
