"""Rebuild a :class:`JobState` from the records the store holds for it (control-plane restart)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from knittrans.api.delivery import ranks_of_runs
from knittrans.api.entries import GroupEntry, MiniBatch
from knittrans.api.jobstate import JobState
from knittrans.api.records import META_KEY, Kind
from knittrans.descriptors import UnitDescriptor
from knittrans.sched.staleness import ConsumedGroup

__all__ = ["restore_job"]


def restore_job(job: JobState, records: Mapping[Kind, Iterable[tuple[str, Any]]]) -> None:
    """Load ``records`` (``kind -> [(key, value)]`` in key order) into a freshly built ``job``.

    Group status is derived: every group of a registered unit starts finished (a later unit holding
    the same group id replaces a lost or expired one), ``group`` records mark lost/expired groups,
    and the mini-batch records mark planned and consumed ones.
    """
    meta = dict(records[Kind.JOB])[META_KEY]
    job.state, job.next_n = meta["state"], meta["next_n"]
    job.attempts = {int(n): a for n, a in meta["attempts"].items()}
    job.quota_changes = [(s, q) for s, q in meta["quota_changes"]]
    for _, batch in records.get(Kind.UNITS, ()):
        job.unit_batches += 1
        for body in batch:
            u = UnitDescriptor.from_dict(body)
            job.units[u.unit_id] = u
            for g in u.groups:
                job.groups[g.group_id] = GroupEntry(record=g, unit_id=u.unit_id, node_id=u.node_id)
    for gid, body in records.get(Kind.GROUP, ()):
        entry = job.groups[gid]
        if entry.unit_id == body["unit_id"]:
            entry.status = body["status"]
    for _, body in records.get(Kind.MINI_BATCH, ()):
        mb = MiniBatch(**{"layout": [], **body})  # a consumed one's record has no layout
        job.minibatches[mb.n] = mb
        for gid in mb.group_ids:
            job.groups[gid].status, job.groups[gid].mini_batch = mb.status, mb.n
        if "lost_nodes" not in body and mb.status == "planned":  # a previous release's record: its nodes lost now
            nodes = {job.groups[gid].node_id for gid in mb.group_ids}
            mb.lost_nodes = sorted(n for n in nodes if job._node_state(n) == "lost")
    job.unadmitted = {gid: g for gid, g in job.groups.items() if g.status == "finished"}
    for entry in job.groups.values():
        job.count_group(entry, 1)
    job.retire([gid for mb in job.minibatches.values() if mb.status == "consumed" for gid in mb.group_ids])
    while (m := job.minibatches.get(job.position)) is not None and m.status == "consumed":
        job.position += 1
    for kind in (Kind.ACK, Kind.FETCHED):
        for key, body in records.get(kind, ()):
            held = job.minibatches.get(int(key))
            if held is not None and held.attempt == body["attempt"]:
                (held.acks if kind is Kind.ACK else held.fetched).update(ranks_of_runs(body["ranks"]))
    for mb in job.minibatches.values():
        mb.fetched -= mb.acks
    job.rank_versions = {int(r): v for r, v in records.get(Kind.VERSION, ())}
    for s, body in records.get(Kind.SUPPLY, ()):
        job.started[s], job.dropped[s], job.finished_count[s] = body["started"], body["dropped"], body["finished"]
    job.started_ids = {gid for gid, _ in records.get(Kind.STARTED, ())}
    job.request_ids = {rid for rid, _ in records.get(Kind.REQUEST, ())}
    for _, rows in records.get(Kind.CONSUMED, ()):
        job.consumed.add(ConsumedGroup(**r) for r in rows)
    job.evict_consumed()
    job.to_regenerate = dict(records.get(Kind.TO_REGENERATE, ()))
