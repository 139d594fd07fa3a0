"""Losing rows: a store node lost (its groups retired, untouched mini-batches re-planned) or a unit removed."""

from __future__ import annotations

import logging

from knittrans.api.entries import MiniBatch
from knittrans.api.jobbase import JobBase
from knittrans.api.records import Kind, index_key
from knittrans.api.store import Txn
from knittrans.errors import Conflict, NotFound
from knittrans.lifecycle import ADMITTED

__all__ = ["NodeLoss"]

logger = logging.getLogger(__name__)


class NodeLoss(JobBase):
    """Node loss and the admin's unit removal: groups become lost and are offered for regeneration."""

    def _held(self, mb: MiniBatch) -> bool:
        """Whether every rank holds its share of ``mb`` (some rank acked, or all reported it fetched)."""
        return bool(mb.acks) or len(mb.fetched | mb.acks) == self.spec.world_size

    # ------------------------------------------------------------------ admin repair
    def remove_unit(self, unit_id: str, reason: str, txn: Txn) -> list[str]:
        """Take a bad unit out of scheduling: its unadmitted groups become lost and are offered for
        regeneration; refused (:class:`Conflict`) once any of its groups is in a mini-batch."""
        unit = self.units.get(unit_id)
        if unit is None and unit_id in self.retired_units:
            raise Conflict(
                f"unit {unit_id!r}: every group of it was consumed; only units whose groups are not "
                f"admitted can be removed"
            )
        if unit is None:
            raise NotFound(f"unit {unit_id!r} is not registered in job {self.name!r}")
        entries = [
            self.groups[g.group_id]
            for g in unit.groups
            if g.group_id in self.groups and self.groups[g.group_id].unit_id == unit_id
        ]
        busy = [g for g in entries if g.status in ADMITTED]
        retired = [
            g.group_id for g in unit.groups if g.group_id in self.retired_groups and g.group_id not in self.groups
        ]
        if retired:
            raise Conflict(
                f"unit {unit_id!r}: group {retired[0]!r} was consumed; only units whose groups are not "
                f"admitted can be removed"
            )
        if busy:
            raise Conflict(
                f"unit {unit_id!r}: group {busy[0].record.group_id!r} is {busy[0].status} in mini-batch "
                f"{busy[0].mini_batch}; only units whose groups are not admitted can be removed"
            )
        removed = []
        for g in entries:
            if g.status == "finished":
                self._set(g, "lost", txn)
                self._regenerate(txn, g, f"unit {unit_id} removed by an admin: {reason}")
                removed.append(g.record.group_id)
        return removed

    # ------------------------------------------------------------------ node loss
    def node_lost(self, node_id: str, txn: Txn) -> list[int]:
        """Drop the node's unadmitted groups and re-plan untouched mini-batches with rows on it."""
        hit = [g for g in self.groups.values() if g.node_id == node_id and g.status in ("finished", "planned")]
        touched = sorted({g.mini_batch for g in hit if g.status == "planned" and g.mini_batch is not None})
        withdrawn: list[int] = []
        gone: set[str] = set()  # groups of withdrawn mini-batches on nodes lost while the mini-batch was held
        held = [n for n in touched if self._held(self.minibatches[n])]
        untouched = [n for n in touched if n not in held]
        for n in held:
            mb = self.minibatches[n]
            if node_id not in mb.lost_nodes:
                mb.lost_nodes.append(node_id)
                txn.put(Kind.MINI_BATCH, self.name, index_key(n), mb.to_json())
        if held:
            logger.warning(
                "job %s: mini-batches %s have rows on lost node %s but every rank holds its share (fetched or "
                "acked); they are kept",
                self.name,
                held,
                node_id,
            )
        if untouched:
            first = untouched[0]
            withdrawn = [n for n in sorted(self.minibatches) if n >= first]
            for n in withdrawn:
                mb = self.minibatches.pop(n)
                assert not mb.acks, f"mini-batch {n} acked after an untouched earlier one"
                txn.delete(Kind.MINI_BATCH, self.name, index_key(n))
                txn.delete(Kind.FETCHED, self.name, index_key(n))
                for gid in mb.group_ids:
                    self._set(self.groups[gid], "finished", txn)
                gone.update(gid for gid in mb.group_ids if self.groups[gid].node_id in mb.lost_nodes)
            self.next_n = first
            logger.warning(
                "job %s: node %s lost, withdrew mini-batches %s for re-planning", self.name, node_id, withdrawn
            )
        for g in [g for g in self.unadmitted.values() if g.node_id == node_id or g.record.group_id in gone]:
            self._set(g, "lost", txn)
            self._regenerate(txn, g, f"node {g.node_id} lost")
        return withdrawn
