"""Regeneration of lost groups: which ``to_regenerate`` entries a worker claims when it starts new groups.

When a store node is lost, the control plane lists the unadmitted groups that were on it (and
groups retired past the staleness bound) in job status ``to_regenerate``. Any worker that
generates the same source may replace them: it starts fresh group ids as usual (so supply
accounting stays exact) and names the lost ids in the same supply report
(``report_supply(group_ids=..., regenerates=...)``), which removes them from the list. Two
workers may race for the same ids; the control plane refuses the whole report then (nothing
applied), and the loser reports its groups again without claims.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from knittrans.controlclient import ControlClient
from knittrans.errors import InvalidRequest

__all__ = ["claimable", "report_started"]

logger = logging.getLogger(__name__)


def claimable(status: Mapping[str, Any], source: str, count: int) -> list[str]:
    """Up to ``count`` group ids of ``source`` waiting to be regenerated, oldest first."""
    waiting = [r for r in status.get("to_regenerate", ()) if r.get("source") == source]
    waiting.sort(key=lambda r: (r.get("at", 0.0), r["group_id"]))
    return [r["group_id"] for r in waiting[: max(0, count)]]


def report_started(
    control: ControlClient, job: str, source: str, group_ids: Sequence[str], regenerates: Sequence[str]
) -> None:
    """Announce ``group_ids`` as started, claiming ``regenerates`` (without them if another worker was first)."""
    if regenerates:
        try:
            control.report_supply(job, group_ids={source: list(group_ids)}, regenerates=list(regenerates))
            logger.info("job %s: new groups %s replace lost groups %s", job, list(group_ids), list(regenerates))
            return
        except InvalidRequest as exc:  # another worker claimed them first; nothing was applied
            logger.info("job %s: regeneration claim refused (%s); announcing without claims", job, exc)
    control.report_supply(job, group_ids={source: list(group_ids)})
