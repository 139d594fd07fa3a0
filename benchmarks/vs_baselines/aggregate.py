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
    "load_p50_ms": "unhidden fetch p50 (ms)",
    "exposed_mean_ms": "exposed / micro-batch (ms)",
    "minibatch_s": "transfer+train / mini-batch (s)",
    "consumer_cpu_s": "rank processes' CPU / mini-batch (s)",
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
def generate_cached(spec_items: tuple[tuple[str, Any], ...]) -> Any:
    """The generated workload of a spec (for its payload sizes)."""
    return generate(WorkloadSpec(**dict(spec_items)))


@cache
def _reference(spec_items: tuple[tuple[str, Any], ...]) -> tuple[list[bytes], WorkloadSpec]:
    workload = generate_cached(spec_items)
    return workload.digests, workload.spec


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
    # Time to fetch + convert one micro-batch, never overlapped with anything: a prefetching client
    # times it in its loader thread (``load_s``); without prefetch it is the wait itself.
    loads = [1e3 * mb.get("load_s", mb["wait_s"]) for r in run["ranks"] for mb in r["micro"]]
    per_rank = {
        str(r["rank"]): {
            "p50_ms": _pct([1e3 * m["wait_s"] for m in r["micro"]], 0.5),
            "p99_ms": _pct([1e3 * m["wait_s"] for m in r["micro"]], 0.99),
        }
        for r in run["ranks"]
    }
    return {
        "put_s": run["put"]["put_s"],
        "stored_bytes": run["put"].get("stored_bytes", 0.0),
        "fetch_p50_ms": _pct(waits, 0.5),
        "fetch_p99_ms": _pct(waits, 0.99),
        "load_p50_ms": _pct(loads, 0.5),
        "exposed_mean_ms": statistics.fmean(waits),
        "minibatch_s": max(r["train_s"] for r in run["ranks"]),
        # all threads of all rank processes (absent in results of older versions)
        "consumer_cpu_s": (
            sum(r["process_cpu_s"] for r in run["ranks"]) if all("process_cpu_s" in r for r in run["ranks"]) else None
        ),
        "consume_wall_s": run["consume_wall_s"],
        "bytes_received": sum(mb["nbytes"] for r in run["ranks"] for mb in r["micro"]),
        "per_rank": per_rank,
    }


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions, correctness, cross-system digest agreement and pairwise ratios."""
    rows = []
    canon: dict[tuple[str, int, int], set[str]] = {}
    row_sets: dict[tuple[str, int], set[str]] = {}
    for res in results:
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in res["spec"].items()))
        digests, spec = _reference(items)
        family = res["system"].split("_")[0]
        mem = res["memory"]
        window = mem.get("peak_by_role_one_copy", mem["peak_by_role_data_phases"])  # one stored copy at a time
        storage_peak = sum(window.get(role, 0) for role in STORAGE_ROLES.get(family, ()))
        for mode in sorted({r["mode"] for r in res["runs"]}):
            runs = sorted((r for r in res["runs"] if r["mode"] == mode), key=lambda r: int(r.get("rep", 0)))
            metrics = [_run_metrics(r) for r in runs]
            checks = [check_run(r, digests, spec) for r in runs]
            row: dict[str, Any] = {"system": res["system"], "kind": res["kind"], "mode": mode, "reps": len(runs)}
            for key in (
                "put_s",
                "fetch_p50_ms",
                "fetch_p99_ms",
                "load_p50_ms",
                "exposed_mean_ms",
                "minibatch_s",
                "consumer_cpu_s",
                "consume_wall_s",
                "bytes_received",
                "stored_bytes",
            ):
                values = [m[key] for m in metrics if m[key] is not None]
                row[key] = statistics.median(values) if values else None
            row["per_rank"] = {
                rank: {k: statistics.median(m["per_rank"][rank][k] for m in metrics) for k in ("p50_ms", "p99_ms")}
                for rank in metrics[0]["per_rank"]
            }
            row["fetch_p50_ms_by_rep"] = [m["fetch_p50_ms"] for m in metrics]  # rep order (rounds if interleaved)
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
            row["logical_bytes"] = float(generate_cached(items).payload_bytes(image_per_row=True))
            row["storage_bytes_per_logical_byte"] = storage_peak / row["logical_bytes"] if storage_peak else None
            rows.append(row)
            for run in runs:  # every system, whatever its plan: the same row must have the same digest
                for r in run["ranks"]:
                    for mb in r["micro"]:
                        for idx, digest in mb["row_digests"].items():
                            row_sets.setdefault((res["kind"], int(idx)), set()).add(digest)
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
                    ratios.append(
                        {
                            "kind": a["kind"],
                            "mode": a["mode"],
                            "metric": metric,
                            "system": a["system"],
                            "baseline": b["system"],
                            "baseline_over_system": vb / va,
                        }
                    )
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": check_targets(rows),
        "cross_system_digests_agree": all(len(v) == 1 for v in canon.values()),
        "cross_system_microbatches_compared": len(canon),
        "cross_system_rows_agree": all(len(v) == 1 for v in row_sets.values()),
        "cross_system_rows_compared": len(row_sets),
    }


# (target, kind, mode, metric, required baseline/system ratio, baselines); the TransferQueue reference
# is ``tq_kv`` (its faster variant here); "text" compares against every baseline on every speed metric.
TARGETS: tuple[tuple[str, str, str, str, float, tuple[str, ...]], ...] = (
    (
        "multimodal exposed transfer / micro-batch >= 100x lower than TQ",
        "multimodal",
        "compute",
        "exposed_mean_ms",
        100.0,
        ("tq_kv",),
    ),
    (
        "multimodal fetch latency (no compute) >= 20x lower than TQ",
        "multimodal",
        "none",
        "fetch_p50_ms",
        20.0,
        ("tq_kv",),
    ),
    (
        "multimodal fetch latency (no compute) >= 20x lower than TQ, unhidden",
        "multimodal",
        "none",
        "load_p50_ms",
        20.0,
        ("tq_kv",),
    ),
    ("multimodal transfer+train >= 5.8x lower than TQ", "multimodal", "compute", "minibatch_s", 5.8, ("tq_kv",)),
    *(
        (
            f"text no slower than any baseline: {m}",
            "text",
            mode,
            m,
            1.0,
            ("tq_kv", "tq_sampler", "ray_group", "ray_shard"),
        )
        for mode in ("none", "compute")
        for m in ("put_s", "fetch_p50_ms", "fetch_p99_ms", "exposed_mean_ms", "minibatch_s", "startup_s")
    ),
    *(
        (
            f"{kind} storage RSS per stored byte no higher than TQ",
            kind,
            "none",
            "storage_bytes_per_stored_byte",
            1.0,
            ("tq_kv",),
        )
        for kind in ("text", "multimodal")
    ),
    *(
        (
            f"{kind} storage RSS per logical byte no higher than TQ",
            kind,
            "none",
            "storage_bytes_per_logical_byte",
            1.0,
            ("tq_kv",),
        )
        for kind in ("text", "multimodal")
    ),
)


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every issue target for every KnitTrans variant against the baselines present in the same run."""
    out = []
    by = {(r["system"], r["kind"], r["mode"]): r for r in rows}
    systems = sorted({r["system"] for r in rows if r["system"].startswith("knittrans")})
    for name, kind, mode, metric, need, baselines in TARGETS:
        for system in systems:
            mine = by.get((system, kind, mode))
            for base in baselines:
                theirs = by.get((base, kind, mode))
                if mine is None or theirs is None or mine.get(metric) is None or theirs.get(metric) is None:
                    continue
                va, vb = float(mine[metric]), float(theirs[metric])
                ratio = vb / va if va > 0 else float("inf")
                out.append(
                    {
                        "target": name,
                        "kind": kind,
                        "mode": mode,
                        "metric": metric,
                        "system": system,
                        "baseline": base,
                        "system_value": va,
                        "baseline_value": vb,
                        "ratio": ratio,
                        "required": need,
                        "met": ratio >= need,
                    }
                )
    return out
