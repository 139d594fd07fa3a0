"""A rank's plan: its share of one admitted mini-batch, as :meth:`knittrans.manifest.Manifest.share` derives it.

The plan is not sent anywhere: every rank receives the same manifest and takes its slice locally. A
plan holds the rank's micro-batches, each with its rows in read order, one rows ``DoGet`` per store
node and one media ``DoGet`` per unique hash (tickets as :class:`~knittrans.tickets.Ticket` objects,
each carrying its node's grant).
"""

from __future__ import annotations

from dataclasses import dataclass

from knittrans.tickets import Ticket

__all__ = ["MediaFetch", "MicroBatchReads", "PlanRow", "RankPlan", "RowFetch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRow:
    """One trajectory row of a micro-batch, in the order the micro-batch's reads return rows."""

    group_id: str
    """Group the row belongs to."""
    unit_id: str
    """Storage unit that holds the row."""
    node_id: str
    """Store node that owns the unit."""
    row: int
    """Row inside the unit."""
    num_tokens: int
    """Prompt + response tokens of the trajectory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFetch:
    """One ``DoGet``: every row of the micro-batch on one node, returned in ``rows`` order."""

    node_id: str
    """Store node to ask."""
    endpoint: str
    """Its Flight location when the manifest was built."""
    ticket: Ticket
    """A ``rows`` ticket naming the unit row ranges."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaFetch:
    """One unique media hash of the micro-batch and the ``DoGet`` that serves it."""

    hash: str
    """Lower-case hex content hash of the media item."""
    node_id: str
    """Store node to ask."""
    endpoint: str
    """Its Flight location when the manifest was built."""
    ticket: Ticket
    """A ``media`` ticket naming the hash and the unit that holds it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchReads:
    """One micro-batch of a rank's plan: its rows and the reads that fetch them."""

    index: int
    """Position in the rank's share (0, 1, ...)."""
    rows: tuple[PlanRow, ...]
    """Its rows, in the order the fetches return them."""
    fetches: tuple[RowFetch, ...]
    """One rows ``DoGet`` per store node, in row order."""
    media: tuple[MediaFetch, ...]
    """One entry per unique media hash its rows use, in first-use order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """``rank``'s share of mini-batch ``global_index`` (attempt ``attempt``, trained at ``policy_version``)."""

    job: str
    """Job the mini-batch belongs to."""
    rank: int
    """Rank the share is for."""
    global_index: int
    """Global index ``n`` of the mini-batch."""
    attempt: int
    """Re-plan attempt of the mini-batch (0 first)."""
    step: int
    """Optimizer step the mini-batch belongs to."""
    mini_batch_index: int
    """Index ``k`` of the mini-batch within its step."""
    policy_version: int
    """Policy version the mini-batch is trained at."""
    admitted_at: float
    """Wall-clock admission time of the mini-batch."""
    mini_batch_trajectories: int
    """Trajectories of the whole mini-batch over all ranks."""
    micro_batches: tuple[MicroBatchReads, ...]
    """The share cut into micro-batches; every rank of the mini-batch gets the same count when it can."""

    @property
    def plan_id(self) -> str:
        """``n{global_index}.a{attempt}.r{rank}``: names this share in logs and training records."""
        return f"n{self.global_index}.a{self.attempt}.r{self.rank}"
