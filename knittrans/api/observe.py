"""What the control plane observes but keeps in memory only: store usage, rank transfers, rollout weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from knittrans.api.models import TransferIn

__all__ = ["TRANSFER_FIELDS", "Observations"]


TRANSFER_FIELDS = tuple(TransferIn.model_fields)
"""The per-rank figures an ack carries (:class:`~knittrans.api.models.TransferIn`'s columns), summed per rank."""


@dataclass
class Observations:
    """Per-rank transfer counters, per-node store usage and per-worker weights of one control-plane instance."""

    ranks: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    """Per (job, rank): ``mini_batches`` acked with figures, the sums of :data:`TRANSFER_FIELDS` and
    ``last_ack`` (``manifest_id``, ``global_index``, ``consumed`` and ``at`` of the last ack with figures)."""
    stores: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node: its latest heartbeat's figures (``NodeUsageIn``'s fields) and ``at``, the unix time."""
    rollout: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """Per (job, worker): its latest weights report (``RolloutWeightsIn``'s fields) and ``at``."""

    def record_ack(
        self,
        job: str,
        n: int,
        attempt: int,
        ack: Mapping[str, Any],
        transfer: Mapping[int, Mapping[str, Any]],
        now: float,
    ) -> None:
        """Remember the ack of mini-batch ``n`` for each rank in ``transfer`` and add its figures, unless the
        ack was a repeat."""
        last = {"manifest_id": f"n{n}.a{attempt}", "global_index": n, "consumed": ack.get("consumed"), "at": now}
        for rank, figures in transfer.items():
            entry = self.ranks.get((job, rank))
            if entry is None:
                entry = self.ranks[(job, rank)] = {"mini_batches": 0, **dict.fromkeys(TRANSFER_FIELDS, 0)}
            entry["last_ack"] = last
            if ack.get("duplicate"):
                continue
            entry["mini_batches"] += 1
            for name in TRANSFER_FIELDS:
                entry[name] += figures.get(name, 0)

    def record_store(self, node_id: str, usage: Mapping[str, Any], now: float) -> None:
        """Replace ``node_id``'s usage with the figures of its latest heartbeat."""
        self.stores[node_id] = {**usage, "at": now}

    def record_rollout(self, job: str, worker: str, report: Mapping[str, Any], now: float) -> dict[str, Any]:
        """Replace ``worker``'s weights figures with those of its latest report."""
        entry = self.rollout[(job, worker)] = {**report, "at": now}
        return entry

    def job_rollout(self, job: str) -> dict[str, dict[str, Any]]:
        """The rollout workers of ``job`` that reported their weights, by worker id."""
        return {worker: e for (name, worker), e in sorted(list(self.rollout.items())) if name == job}

    def snapshot(self) -> Observations:
        """A copy whose maps the event loop no longer changes (for readers on the state thread).

        ``list(d.items())`` copies in one C call, so the event loop cannot add an entry halfway.
        """
        ranks = {key: dict(entry) for key, entry in list(self.ranks.items())}
        return Observations(ranks, dict(list(self.stores.items())), dict(list(self.rollout.items())))

    def job_ranks(self, job: str) -> dict[int, dict[str, Any]]:
        """The ranks of ``job`` seen so far, by rank."""
        return {rank: entry for (name, rank), entry in sorted(self.ranks.items()) if name == job}
