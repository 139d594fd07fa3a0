"""What rollout reports to a job: units registered (groups finished) and groups started or dropped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from knittrans.api.entries import GroupEntry
from knittrans.api.jobbase import JobBase
from knittrans.api.records import Kind, index_key
from knittrans.api.store import Txn
from knittrans.descriptors import UnitDescriptor
from knittrans.errors import Conflict, InvalidRequest, NotFound
from knittrans.lifecycle import REPLACEABLE

__all__ = ["Supply"]


class Supply(JobBase):
    """Registration of units and supply reports (the pool admission draws from)."""

    # ------------------------------------------------------------------ units and supply
    def _check_units(self, units: Sequence[UnitDescriptor]) -> None:
        """Raise for any unit of the batch that cannot be registered; changes nothing."""
        quotas = set().union(*(q for _, q in self.quota_changes))
        seen_groups: dict[str, str] = {}
        seen_units: set[str] = set()
        for u in units:
            if u.job != self.name:
                raise InvalidRequest(f"unit {u.unit_id!r} says job {u.job!r} but was sent to job {self.name!r}")
            if u.unit_id in seen_units:
                raise InvalidRequest(f"unit {u.unit_id!r} appears twice in the batch")
            seen_units.add(u.unit_id)
            state = self._node_state(u.node_id)
            if state is None:
                raise NotFound(f"unit {u.unit_id!r}: node {u.node_id!r} is not registered; POST /v1/nodes first")
            if state == "lost":
                raise Conflict(f"unit {u.unit_id!r}: node {u.node_id!r} was declared lost; register it again first")
            old = self.units.get(u.unit_id)
            if old is not None:
                if old != u:
                    raise Conflict(f"unit {u.unit_id!r} is already registered with a different descriptor")
                continue
            if u.unit_id in self.retired_units:  # consumed: only its id is kept, a retry is a duplicate
                continue
            for g in u.groups:
                if g.source not in quotas:
                    raise InvalidRequest(
                        f"unit {u.unit_id!r}: group {g.group_id!r} has source {g.source!r} "
                        f"without a quota; known sources: {sorted(quotas)}"
                    )
                if g.num_trajectories != self.spec.group_size:
                    raise InvalidRequest(
                        f"unit {u.unit_id!r}: group {g.group_id!r} has {g.num_trajectories} "
                        f"trajectories, the job's group_size is {self.spec.group_size}"
                    )
                prior = self.groups.get(g.group_id)
                if (
                    g.group_id in seen_groups
                    or (prior is not None and prior.status not in REPLACEABLE)
                    or g.group_id in self.retired_groups
                ):
                    where = seen_groups.get(g.group_id) or (prior.unit_id if prior else "(consumed)")
                    raise Conflict(f"unit {u.unit_id!r}: group {g.group_id!r} is already registered in unit {where!r}")
                seen_groups[g.group_id] = u.unit_id

    def add_units(self, units: Sequence[UnitDescriptor], txn: Txn) -> int:
        """Register a batch of units, all or none (identical repeats are no-ops); returns how many were new."""
        self._check_units(units)
        fresh = [u for u in units if u.unit_id not in self.units and u.unit_id not in self.retired_units]
        groups, unadmitted, finished = self.groups, self.unadmitted, self.finished_count
        for u in fresh:
            self.units[u.unit_id] = u
            for g in u.groups:
                gid = g.group_id
                old = groups.get(gid)
                if old is not None:  # replaces a lost or expired incarnation
                    txn.delete(Kind.GROUP, self.name, gid)
                    self.count_group(old, -1)
                if self.to_regenerate.pop(gid, None) is not None:
                    txn.delete(Kind.TO_REGENERATE, self.name, gid)
                entry = GroupEntry(record=g, unit_id=u.unit_id, node_id=u.node_id)  # status "finished"
                groups[gid] = unadmitted[gid] = entry  # what _set(entry, "finished") does, without its no-op recount
                self.count_group(entry, 1)
                finished[g.source] += 1
        if fresh:
            txn.put(Kind.UNITS, self.name, index_key(self.unit_batches), [u.to_dict() for u in fresh])
            self.unit_batches += 1
        for s in {g.source for u in fresh for g in u.groups}:  # a repeated unit changes no count
            self._save_supply(txn, s)
        return len(fresh)

    def add_supply(
        self,
        txn: Txn,
        *,
        started: Mapping[str, int],
        group_ids: Mapping[str, Sequence[str]],
        dropped: Mapping[str, int],
        request_id: str | None,
        regenerates: Sequence[str] = (),
    ) -> bool:
        """Count groups started (and dropped) per source (counts >= 0, as ``SupplyIn`` checks); returns False
        for a repeated ``request_id``.

        ``regenerates`` names lost or expired groups whose replacements this report starts: they leave
        the list of groups to regenerate.
        """
        quotas = set().union(*(q for _, q in self.quota_changes))
        for what, per_source in (("started", started), ("dropped", dropped), ("group_ids", group_ids)):
            for s in per_source:
                if s not in quotas:
                    raise InvalidRequest(f"{what}.{s}: source has no quota; known sources: {sorted(quotas)}")
        if request_id is not None and request_id in self.request_ids:
            return False  # a retry: its claims below were taken by the report it repeats
        unknown = [g for g in regenerates if g not in self.to_regenerate]
        if unknown:
            raise Conflict(f"regenerates: {unknown[:5]} are not groups waiting to be regenerated")
        for gid in dict.fromkeys(regenerates):  # a group named twice is claimed once
            del self.to_regenerate[gid]
            txn.delete(Kind.TO_REGENERATE, self.name, gid)
        touched = set(started) | set(dropped)
        self.started.update(started)
        self.dropped.update(dropped)
        for s, ids in group_ids.items():
            fresh = [i for i in dict.fromkeys(ids) if i not in self.started_ids]
            self.started_ids.update(fresh)
            for i in fresh:
                txn.put(Kind.STARTED, self.name, i, s)
            self.started[s] += len(fresh)
            touched.add(s)
        for s in touched:
            self._save_supply(txn, s)
        self.peak_untaken = max(self.peak_untaken, sum(self.untaken().values()))
        if request_id is not None:
            self.request_ids.add(request_id)
            txn.put(Kind.REQUEST, self.name, request_id, 1)
        return True
