"""Rebuild a :class:`JobState` from the records the store holds for it (control-plane restart)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from knittrans.api.entries import GroupEntry, MiniBatch
from knittrans.api.jobstate import JobState
from knittrans.descriptors import UnitDescriptor
from knittrans.sched.staleness import ConsumedGroup

__all__ = ["JOB_KINDS", "restore_job"]

JOB_KINDS = (
    "job",
    "units",
    "group",
    "mb",
    "ack",
    "fetched",
    "version",
    "supply",
    "started",
    "request",
    "consumed",
    "lost",
)
"""Record kinds that belong to one job."""


def restore_job(job: JobState, records: Mapping[str, Iterable[tuple[str, Any]]]) -> None:
    """Load ``records`` (``kind -> [(key, value)]`` in key order) into a freshly built ``job``.

    Group status is derived: every group of a registered unit starts finished (a later unit holding
    the same group id replaces a lost or expired one), ``group`` records mark lost/expired groups,
    and the mini-batch records mark planned and consumed ones.
    """
    meta = dict(records["job"])["meta"]
    job.state, job.next_n = meta["state"], meta["next_n"]
    job.attempts = {int(n): a for n, a in meta["attempts"].items()}
    job.quota_changes = [(s, q) for s, q in meta["quota_changes"]]
    for _, batch in records.get("units", ()):
        job.unit_batches += 1
        for body in batch:
            u = UnitDescriptor.from_dict(body)
            job.units[u.unit_id] = u
            for g in u.groups:
                job.groups[g.group_id] = GroupEntry(record=g, unit_id=u.unit_id, node_id=u.node_id)
    for gid, body in records.get("group", ()):
        entry = job.groups[gid]
        if entry.unit_id == body["unit_id"]:
            entry.status = body["status"]
    for _, body in records.get("mb", ()):
        mb = MiniBatch(
            n=body["n"],
            step=body["step"],
            k=body["k"],
            attempt=body["attempt"],
            group_ids=body["group_ids"],
            counts=body["counts"],
            admitted_at=body["admitted_at"],
            layout=body.get("layout", []),
            status=body["status"],
        )
        job.minibatches[mb.n] = mb
        for gid in mb.group_ids:
            job.groups[gid].status, job.groups[gid].mini_batch = mb.status, mb.n
    job.unadmitted = {gid: g for gid, g in job.groups.items() if g.status == "finished"}
    job.recount_groups()
    job.retire([gid for mb in job.minibatches.values() if mb.status == "consumed" for gid in mb.group_ids])
    while (m := job.minibatches.get(job.first_unconsumed)) is not None and m.status == "consumed":
        job.first_unconsumed += 1
    for key, _ in records.get("ack", ()):
        n, rank = key.split(".")
        job.minibatches[int(n)].acks.add(int(rank))
    for key, body in records.get("fetched", ()):
        n, rank = key.split(".")
        held = job.minibatches.get(int(n))
        if held is not None and held.attempt == body["attempt"]:
            held.fetched.add(int(rank))
    job.rank_versions = {int(r): v for r, v in records.get("version", ())}
    for s, body in records.get("supply", ()):
        job.started[s], job.dropped[s], job.finished_count[s] = body["started"], body["dropped"], body["finished"]
    job.started_ids = {gid for gid, _ in records.get("started", ())}
    job.request_ids = {rid for rid, _ in records.get("request", ())}
    for _, rows in records.get("consumed", ()):
        job.consumed.add(ConsumedGroup(**r) for r in rows)
    job.consumed_mini_batches = sum(1 for mb in job.minibatches.values() if mb.status == "consumed")
    job.to_regenerate = dict(records.get("lost", ()))
