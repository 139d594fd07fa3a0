"""Mutable records of one job's groups and mini-batches (what :class:`JobState` keeps in memory)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from knittrans.descriptors import GroupRecord
from knittrans.lifecycle import GroupStatus, MiniBatchStatus
from knittrans.sched.types import FinishedGroup

__all__ = ["GroupEntry", "MiniBatch"]


@dataclass
class GroupEntry:
    """A group the job knows of and where it is in its life (:data:`~knittrans.lifecycle.GroupStatus`)."""

    record: GroupRecord
    unit_id: str
    node_id: str
    status: GroupStatus = "finished"
    mini_batch: int | None = None
    view: FinishedGroup = field(init=False, repr=False)
    """The scheduling view of the group (what admission and assignment see)."""

    def __post_init__(self) -> None:
        r = self.record
        self.view = FinishedGroup(
            group_id=r.group_id,
            source=r.source,
            trajectory_tokens=r.trajectory_tokens,
            finished_at=r.finished_at,
            version_start=r.version_start,
            version_end=r.version_end,
            version_weighted=r.version_weighted,
            unit_id=self.unit_id,
            node_id=self.node_id,
            row_start=r.row_start,
        )


_PERSISTED = ("n", "step", "k", "attempt", "group_ids", "counts", "admitted_at", "status", "lost_nodes")


@dataclass
class MiniBatch:
    """One admitted mini-batch ``n`` (global index; trained at policy version ``n``)."""

    n: int
    step: int
    k: int
    attempt: int
    group_ids: list[str]
    counts: dict[str, int]
    admitted_at: float
    layout: list[Any]
    """rank -> micro-batch -> ``[group_id, row]`` pairs; empty once consumed."""
    status: MiniBatchStatus = "planned"
    acks: set[int] = field(default_factory=set)
    """Ranks that acked the mini-batch (all ``W``: consumed)."""
    fetched: set[int] = field(default_factory=set)
    """Ranks that reported their share fully fetched and have not acked yet (a mini-batch every rank
    fetched or acked survives a node loss)."""
    lost_nodes: list[str] = field(default_factory=list)
    """Nodes declared lost while every rank held the mini-batch: if it is withdrawn later, its groups there are
    lost, even when the node has registered again meanwhile (its rows may be gone)."""
    manifest: tuple[str, bytes] | None = None
    """``(ETag, bytes)`` of the mini-batch's manifest once built (not persisted: built identically again
    after a restart; see :mod:`knittrans.api.delivery`)."""

    def to_json(self) -> dict[str, Any]:
        """The persisted record (the layout only while planned)."""
        body = {name: getattr(self, name) for name in _PERSISTED}
        if self.status == "planned":
            body["layout"] = self.layout
        return body
