"""Views of a job's state: its status and the admin overview built from it (``/ui``, ``knittrans status``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from knittrans.sched.admission import quota_deficit
from knittrans.sched.staleness import READINGS, StalenessStats, step_report
from knittrans.sched.timing import admitted_ahead

if TYPE_CHECKING:
    from knittrans.api.jobstate import JobState
    from knittrans.api.observe import Observations

__all__ = ["LOST_SHOWN", "POOL_SHOWN", "RANKS_SHOWN", "job_status", "overview"]

POOL_SHOWN = 16
"""Status lists this many of the pool's groups, in the order admission considers them."""
LOST_SHOWN = 50
"""The overview lists at most this many lost groups and groups to regenerate per job (the counts are exact)."""
RANKS_SHOWN = 256
"""Ranks the overview lists per job even before they report (ranks that reported are always listed)."""


def _stats(value: Any) -> Any:
    if isinstance(value, StalenessStats):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _stats(v) for k, v in value.items()}
    return value


def job_status(job: JobState) -> dict[str, Any]:
    """Everything an operator wants to see about a job, as plain JSON."""
    step, k = divmod(job.next_n, job.K)
    quotas = job.quotas_for_step(step)
    admitted = job.admitted_in_step(step)
    by_status: dict[str, int] = {}
    for (_, status), count in job.group_counts.items():
        if count:
            by_status[status] = by_status.get(status, 0) + count
    lost = [
        {"group_id": g.record.group_id, "source": g.record.source, "node_id": g.node_id}
        for g in job.groups.values()
        if g.status == "lost"
    ]
    pool = job.pool()
    finished = Counter(g.record.source for g in pool)
    by_node = Counter(g.node_id for g in pool)
    in_flight = job.in_flight()
    open_step = job.can_admit() or job.state == "paused"  # neither holds for a finished job
    deficits = quota_deficit(job.step_state()) if open_step else {}
    return {
        "job": job.name,
        "state": job.state,
        "step": step,
        "mini_batch_index": k,
        "next_global_index": job.next_n,
        "version": job.version,
        "quotas": dict(quotas),
        "quota_fill": {
            s: {"admitted": admitted.get(s, 0), "quota": q, "fill": (admitted.get(s, 0) / q) if q else 1.0}
            for s, q in sorted(quotas.items())
        },
        "counts": {
            "units": len(job.units) + len(job.retired_units),
            "finished": dict(finished),
            "pending": job.pending(),
            "admitted_in_step": admitted,
            "groups_by_status": by_status,
            "in_flight_mini_batches": len(in_flight),
            "in_flight_groups": sum(len(mb.group_ids) for mb in in_flight),
            "consumed_mini_batches": job.position,  # consumed: exactly those below the position
            "consumed_groups": by_status.get("consumed", 0),
        },
        "deficits": deficits,
        # what waits for admission, and where: what losing a node would send back for regeneration
        "pool": {
            "by_node": dict(sorted(by_node.items())),
            "head": [
                {
                    "group_id": g.record.group_id,
                    "source": g.record.source,
                    "node_id": g.node_id,
                    "finished_at": g.record.finished_at,
                }
                for g in pool[:POOL_SHOWN]
            ],
        },
        "lost_groups": sorted(lost, key=lambda r: r["group_id"]),  # all of them, claimed for regeneration or not
        "to_regenerate": sorted(job.to_regenerate.values(), key=lambda r: (r["at"], r["group_id"])),
        "staleness": {
            "overall": {reading: _stats(job.consumed.report(reading)) for reading in READINGS},
            "by_step": {
                str(s): {r: _stats(step_report(groups, r)) for r in READINGS}
                for s, groups in job.consumed.recent_steps().items()
            },
        },
        "timing": {
            "position": job.position,
            "lookahead": job.spec.lookahead,
            "window": job.spec.window,
            "admitted_ahead": admitted_ahead(job.next_n, job.position),
            "untaken": job.untaken(),
            "peak_admitted_ahead": job.peak_admitted_ahead,
            "peak_untaken": job.peak_untaken,
        },
        "recent_admissions": list(job.admissions),
    }


def _overview_job(job: JobState, observed: Observations) -> dict[str, Any]:
    status = job_status(job)
    counts = status["counts"]
    in_flight = [
        {
            "global_index": mb.n,
            "step": mb.step,
            "k": mb.k,
            "attempt": mb.attempt,
            "groups": len(mb.group_ids),
            "counts": dict(mb.counts),
            "fetched": len(mb.fetched | mb.acks),
            "acked": len(mb.acks),
            "world_size": job.spec.world_size,
            "admitted_at": mb.admitted_at,
        }
        for mb in job.in_flight()
    ]
    pool_by_node: dict[str, Counter[str]] = {}
    for g in job.pool():
        pool_by_node.setdefault(g.node_id, Counter())[g.record.source] += 1
    transfers = observed.job_ranks(job.name)
    # the first RANKS_SHOWN ranks and every rank that reported (acks or versions): O(ranks seen), not O(world_size)
    shown = set(range(min(job.spec.world_size, RANKS_SHOWN))) | set(transfers) | set(job.rank_versions)
    empty = {"mini_batches": 0, "last_ack": {}}
    ranks = [{"rank": r, "version": job.rank_versions.get(r), **transfers.get(r, empty)} for r in sorted(shown)]
    shared = ("job", "state", "step", "mini_batch_index", "next_global_index", "version", "quota_fill", "deficits")
    return {
        **{key: status[key] for key in shared},
        **{key: counts[key] for key in ("pending", "finished", "groups_by_status")},
        "policy": job.spec.policy,
        "world_size": job.spec.world_size,
        "total_steps": job.spec.total_steps,
        "mini_batches_per_step": job.K,
        "pool_by_node": pool_by_node,
        "in_flight_mini_batches": in_flight,
        "consumed_mini_batches": counts["consumed_mini_batches"],
        "consumed_groups": counts["consumed_groups"],
        "lost_groups_total": len(status["lost_groups"]),
        "lost_groups": status["lost_groups"][:LOST_SHOWN],
        "to_regenerate_total": len(status["to_regenerate"]),
        "to_regenerate": status["to_regenerate"][:LOST_SHOWN],
        "admissions": status["recent_admissions"],
        "staleness": job.consumed.series(),
        "ranks": ranks,
    }


def overview(
    jobs: Mapping[str, JobState], list_nodes: Callable[[], list[dict[str, Any]]], observed: Observations, now: float
) -> dict[str, Any]:
    """Jobs (state, quota fill, admissions, staleness, mini-batches, lost groups, ranks) and store nodes
    (``list_nodes``: the service's, called here, on the state thread)."""
    nodes = [{**node, "usage": observed.stores.get(node["node_id"])} for node in list_nodes()]
    return {"at": now, "jobs": [_overview_job(job, observed) for _, job in sorted(jobs.items())], "nodes": nodes}
