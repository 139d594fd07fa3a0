"""The parts of a rank's plan (:class:`knittrans.manifest.RankPlan`): its share of one admitted mini-batch."""

from __future__ import annotations

from dataclasses import dataclass

from knittrans.tickets import Ticket

__all__ = ["MediaFetch", "MicroBatchReads", "PlanRow", "RowFetch"]


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
