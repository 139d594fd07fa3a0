"""Turn raw driver results into medians per (system, workload, mode), correctness verdicts and ratios."""

from __future__ import annotations

import statistics
from functools import cache
from typing import Any

from benchmarks.vs_baselines.workload import WorkloadSpec, generate

__all__ = ["METRICS", "STORAGE_ROLES", "summarise"]

# metric -> (label, lower is better)
METRICS: dict[str, str] = {
    "startup_s": "start-up (s)",
    "put_s": "put (s)",
    "fetch_p50_ms": "fetch p50 (ms)",
    "fetch_p99_ms": "fetch p99 (ms)",
    "exposed_mean_ms": "exposed / micro-batch (ms)",
    "minibatch_s": "transfer+train / mini-batch (s)",
    "peak_total_mib": "peak RSS all processes (MiB)",
    "storage_bytes_per_stored_byte": "storage RSS / stored byte",
}
# Processes that hold the stored data, per system family.  Ray keeps objects in plasma shared memory
# (/dev/shm), whose pages show up in whichever process touches them (the putting driver, the getting
# consumers), not in the raylet: per-process RSS cannot attribute them, so Ray gets no such figure.
STORAGE_ROLES = {"tq": ("storage",), "knittrans": ("storage",)}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@cache
def _reference(spec_items: tuple[tuple[str, Any], ...]) -> tuple[list[bytes], WorkloadSpec]:
    spec = WorkloadSpec(**dict(spec_items))
    return generate(spec).digests, spec


def check_run(run: dict[str, Any], digests: list[bytes], spec: WorkloadSpec) -> dict[str, Any]:
    """Row digests equal the reference, every row exactly once, and whether the plan is canonical."""
    seen: list[int] = []
    wrong = 0
    canonical = True
    for rank in run["ranks"]:
        for mb in rank["micro"]:
            seen += mb["rows"]
            wrong += sum(digests[int(k)].hex() != v for k, v in mb["row_digests"].items())
            canonical &= mb["rows"] == list(spec.plan(rank["rank"], mb["micro_batch"]))
    exactly_once = sorted(seen) == list(range(spec.num_trajectories))
    return {"wrong_rows": wrong, "exactly_once": exactly_once, "canonical_plan": canonical}


def _run_metrics(run: dict[str, Any]) -> dict[str, Any]:
    waits = [1e3 * mb["wait_s"] for r in run["ranks"] for mb in r["micro"]]
    per_rank = {
        str(r["rank"]): {"p50_ms": _pct([1e3 * m["wait_s"] for m in r["micro"]], 0.5),
                         "p99_ms": _pct([1e3 * m["wait_s"] for m in r["micro"]], 0.99)}
        for r in run["ranks"]
    }
    return {
        "put_s": run["put"]["put_s"],
        "stored_bytes": run["put"].get("stored_bytes", 0.0),
        "fetch_p50_ms": _pct(waits, 0.5),
        "fetch_p99_ms": _pct(waits, 0.99),
        "exposed_mean_ms": statistics.fmean(waits),
        "minibatch_s": max(r["train_s"] for r in run["ranks"]),
        "consume_wall_s": run["consume_wall_s"],
        "bytes_received": sum(mb["nbytes"] for r in run["ranks"] for mb in r["micro"]),
        "per_rank": per_rank,
    }


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions, correctness, cross-system digest agreement and pairwise ratios."""
    rows = []
    canon: dict[tuple[str, int, int], set[str]] = {}
    for res in results:
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in res["spec"].items()))
        digests, spec = _reference(items)
        family = res["system"].split("_")[0]
        mem = res["memory"]
        storage_peak = sum(mem["peak_by_role_data_phases"].get(role, 0) for role in STORAGE_ROLES.get(family, ()))
        for mode in sorted({r["mode"] for r in res["runs"]}):
            runs = [r for r in res["runs"] if r["mode"] == mode]
            metrics = [_run_metrics(r) for r in runs]
            checks = [check_run(r, digests, spec) for r in runs]
            row: dict[str, Any] = {"system": res["system"], "kind": res["kind"], "mode": mode, "reps": len(runs)}
            for key in ("put_s", "fetch_p50_ms", "fetch_p99_ms", "exposed_mean_ms", "minibatch_s",
                        "consume_wall_s", "bytes_received", "stored_bytes"):
                row[key] = statistics.median(m[key] for m in metrics)
            row["per_rank"] = {rank: {k: statistics.median(m["per_rank"][rank][k] for m in metrics)
                                      for k in ("p50_ms", "p99_ms")} for rank in metrics[0]["per_rank"]}
            row["startup_s"] = res["startup_s"]
            row["peak_total_mib"] = mem["peak_by_role_whole_run"].get("total", 0) / 2**20
            row["peak_by_role_mib"] = {k: v / 2**20 for k, v in mem["peak_by_role_whole_run"].items()}
            row["storage_peak_mib"] = storage_peak / 2**20
            row["storage_bytes_per_stored_byte"] = (
                storage_peak / row["stored_bytes"] if storage_peak and row["stored_bytes"] else None
            )
            row["checks"] = checks
            row["correct"] = all(c["wrong_rows"] == 0 and c["exactly_once"] for c in checks)
            row["canonical_plan"] = all(c["canonical_plan"] for c in checks)
            rows.append(row)
            if row["canonical_plan"]:
                for run in runs:
                    for r in run["ranks"]:
                        for mb in r["micro"]:
                            canon.setdefault((res["kind"], r["rank"], mb["micro_batch"]), set()).add(mb["digest"])
    ratios = []
    for a in rows:
        for b in rows:
            if a is b or (a["kind"], a["mode"]) != (b["kind"], b["mode"]):
                continue
            for metric in METRICS:
                va, vb = a.get(metric), b.get(metric)
                if va and vb:
                    ratios.append({"kind": a["kind"], "mode": a["mode"], "metric": metric, "system": a["system"],
                                   "baseline": b["system"], "baseline_over_system": vb / va})
    return {"rows": rows, "ratios": ratios,
            "cross_system_digests_agree": all(len(v) == 1 for v in canon.values()),
            "cross_system_microbatches_compared": len(canon)}
