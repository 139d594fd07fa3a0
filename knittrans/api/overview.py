"""The admin overview: every job, node and rank in one JSON document (for ``/ui`` and ``knittrans status``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from knittrans.api.status import job_status

if TYPE_CHECKING:
    from knittrans.api.jobstate import JobState
    from knittrans.api.observe import Observations
    from knittrans.api.service import ControlPlane

__all__ = ["LOST_SHOWN", "RANKS_SHOWN", "overview"]

LOST_SHOWN = 50
"""At most this many lost groups and groups to regenerate are listed per job (the counts are exact)."""
RANKS_SHOWN = 256
"""Ranks listed per job even before they report (ranks that reported are always listed)."""


def _job(job: JobState, observed: Observations) -> dict[str, Any]:
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
    pool_by_node: dict[str, dict[str, int]] = {}
    for g in job.pool():
        per_source = pool_by_node.setdefault(g.node_id, {})
        per_source[g.record.source] = per_source.get(g.record.source, 0) + 1
    ranks = []
    transfers = observed.job_ranks(job.name)
    # the first RANKS_SHOWN ranks and every rank that reported (acks or versions): O(ranks seen), not O(world_size)
    shown = set(range(min(job.spec.world_size, RANKS_SHOWN))) | set(transfers) | set(job.rank_versions)
    for rank in sorted(shown):
        entry = transfers.get(rank)
        ranks.append(
            {
                "rank": rank,
                "version": job.rank_versions.get(rank),
                **(entry.to_dict() if entry is not None else {"mini_batches": 0, "last_ack": {}}),
            }
        )
    return {
        "job": job.name,
        "state": status["state"],
        "policy": job.spec.policy,
        "world_size": job.spec.world_size,
        "total_steps": job.spec.total_steps,
        "step": status["step"],
        "mini_batch_index": status["mini_batch_index"],
        "mini_batches_per_step": job.K,
        "next_global_index": status["next_global_index"],
        "version": status["version"],
        "quota_fill": status["quota_fill"],
        "deficits": status["deficits"],
        "pending": counts["pending"],
        "finished": counts["finished"],
        "pool_by_node": pool_by_node,
        "groups_by_status": counts["groups_by_status"],
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


def overview(service: ControlPlane, observed: Observations, now: float) -> dict[str, Any]:
    """Jobs (state, quota fill, admissions, staleness, mini-batches, lost groups, ranks) and store nodes."""
    nodes = []
    for node in service.list_nodes():
        usage = observed.stores.get(node["node_id"])
        nodes.append({**node, "usage": usage.to_dict() if usage is not None else None})
    jobs = [_job(job, observed) for _, job in sorted(service.jobs.items())]
    return {"at": now, "jobs": jobs, "nodes": nodes}
