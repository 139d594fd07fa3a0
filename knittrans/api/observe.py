"""What the control plane observes but keeps in memory only: store usage, rank transfers, rollout weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from knittrans.api.models import TransferIn

__all__ = ["TRANSFER_FIELDS", "Observations", "RankTransfers"]


TRANSFER_FIELDS = tuple(TransferIn.model_fields)
"""The per-rank figures an ack carries (:class:`~knittrans.api.models.TransferIn`'s columns), summed per rank."""


class RankTransfers:
    """One job's transfer sums by rank, kept as columns indexed by rank: an ack's figures arrive as columns
    (one entry per rank it reports for), so an ack of 1,024 ranks is a few array additions."""

    def __init__(self) -> None:
        self.columns = {name: np.zeros(0, dtype) for name, dtype in _COLUMNS.items()}
        """``mini_batches`` (acks with figures), the sums of :data:`TRANSFER_FIELDS` and the last such ack's
        ``last_n`` (-1: none yet), ``last_attempt``, ``last_at`` and ``last_consumed``, by rank."""

    def add(self, ranks: Sequence[int], columns: Mapping[str, Sequence[float]], last: Mapping[str, Any]) -> None:
        """The ack ``last`` (``global_index``, ``attempt``, ``consumed``, ``at``, ``duplicate``) of ``ranks``,
        with ``columns[name][i]`` the figure of ``ranks[i]`` (a repeated ack adds nothing to the sums)."""
        if not len(ranks):
            return
        at = np.asarray(ranks, np.int64)
        size, c = int(at.max()) + 1, self.columns
        if size > len(c["last_n"]):
            more = size - len(c["last_n"])
            c = self.columns = {
                k: np.concatenate([v, np.full(more, -1 if k == "last_n" else 0, v.dtype)]) for k, v in c.items()
            }
        c["last_n"][at], c["last_attempt"][at] = last["global_index"], last["attempt"]
        c["last_at"][at], c["last_consumed"][at] = last["at"], bool(last["consumed"])
        if not last["duplicate"]:
            np.add.at(c["mini_batches"], at, 1)
            for name, values in columns.items():
                np.add.at(c[name], at, np.asarray(values, c[name].dtype))

    def copy(self) -> RankTransfers:
        out = RankTransfers()
        out.columns = {k: v.copy() for k, v in self.columns.items()}
        return out

    def entries(self) -> dict[int, dict[str, Any]]:
        """``{rank: {"mini_batches", <TRANSFER_FIELDS>, "last_ack"}}`` of the ranks that acked with figures
        (``last_ack``: ``manifest_id``, ``global_index``, ``consumed`` and ``at``)."""
        c = {k: v.tolist() for k, v in self.columns.items()}
        n, attempt = c["last_n"], c["last_attempt"]
        return {
            r: {
                "mini_batches": c["mini_batches"][r],
                **{name: c[name][r] for name in TRANSFER_FIELDS},
                "last_ack": {
                    "manifest_id": f"n{n[r]}.a{attempt[r]}",
                    "global_index": n[r],
                    "consumed": c["last_consumed"][r],
                    "at": c["last_at"][r],
                },
            }
            for r in range(len(n))
            if n[r] >= 0
        }


_COLUMNS: dict[str, Any] = {
    "mini_batches": np.int64,
    **{name: np.float64 if name.endswith("_s") else np.int64 for name in TRANSFER_FIELDS},  # bytes: exact integers
    "last_n": np.int64,
    "last_attempt": np.int64,
    "last_at": np.float64,
    "last_consumed": np.bool_,
}


@dataclass
class Observations:
    """Per-rank transfer counters, per-node store usage and per-worker weights of one control-plane instance."""

    transfers: dict[str, RankTransfers] = field(default_factory=dict)
    """Per job: the sums of :data:`TRANSFER_FIELDS` by rank and each rank's last ack with figures."""
    stores: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node: its latest heartbeat's figures (``NodeUsageIn``'s fields) and ``at``, the unix time."""
    rollout: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """Per (job, worker): its latest weights report (``RolloutWeightsIn``'s fields) and ``at``."""

    def record_ack(
        self,
        job: str,
        ack: Mapping[str, Any],
        ranks: Sequence[int],
        columns: Mapping[str, Sequence[float]],
        now: float,
    ) -> None:
        """Remember ``ack`` (the answer of ``ack``: ``global_index``, ``attempt``, ``consumed``, ``duplicate``)
        for each of ``ranks`` and add its figures (``columns[name][i]``: rank ``ranks[i]``'s), unless the ack
        was a repeat."""
        table = self.transfers.get(job)
        if table is None:
            table = self.transfers[job] = RankTransfers()
        table.add(ranks, columns, {**ack, "at": now})

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
        transfers = {job: table.copy() for job, table in list(self.transfers.items())}
        return Observations(transfers, dict(list(self.stores.items())), dict(list(self.rollout.items())))

    def job_ranks(self, job: str) -> dict[int, dict[str, Any]]:
        """The ranks of ``job`` that acked with figures, by rank (:meth:`RankTransfers.entries`)."""
        table = self.transfers.get(job)
        return {} if table is None else table.entries()
