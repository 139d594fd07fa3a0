"""Assignment of an admitted mini-batch over ``W`` data-parallel ranks and into micro-batches."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from knittrans.sched.types import FinishedGroup

__all__ = ["BALANCE_TOLERANCE", "Assignment", "assign_mini_batch", "lpt_assign"]

logger = logging.getLogger(__name__)

BALANCE_TOLERANCE = 0.05
"""How far above the ideal ``total / W`` the most-loaded rank may be when whole groups stay on one rank."""


def lpt_assign(weights: Sequence[int], bins: int) -> tuple[list[int], list[int]]:
    """Greedy LPT: owner bin of every item and the load of every bin.

    Items are placed largest first onto the least-loaded bin (ties: fewer items, then lower bin index).
    """
    owner = [0] * len(weights)
    loads = [0] * bins
    order = sorted(range(len(weights)), key=weights.__getitem__, reverse=True)  # stable: ties by index
    # while empty bins remain, the least-loaded bin is the next empty one: item j of the order goes to bin j
    first = min(len(order), bins)
    for b, i in enumerate(order[:first]):
        owner[i], loads[b] = b, weights[i]
    heap = [(loads[b], 1 if b < first else 0, b) for b in range(bins)]
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for i in order[first:]:
        load, count, b = heap[0]
        owner[i] = b
        load += weights[i]
        loads[b] = load
        replace(heap, (load, count + 1, b))
    return owner, loads


def _check(
    groups: Sequence[FinishedGroup],
    world_size: int,
    micro_batch_tokens: int | None,
    micro_batch_size: int | None,
) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (micro_batch_tokens is None) == (micro_batch_size is None):
        raise ValueError("give exactly one of micro_batch_tokens and micro_batch_size")
    budget = micro_batch_tokens if micro_batch_tokens is not None else micro_batch_size
    if budget is not None and budget < 1:
        name = "micro_batch_tokens" if micro_batch_tokens is not None else "micro_batch_size"
        raise ValueError(f"{name} must be >= 1, got {budget}")
    seen: set[str] = set()
    for group in groups:
        if group.group_id in seen:
            raise ValueError(f"group {group.group_id!r} appears twice in the mini-batch")
        seen.add(group.group_id)
        if group.trajectory_tokens and min(group.trajectory_tokens) < 0:
            raise ValueError(f"group {group.group_id!r} has a negative token count")
        if group.row_start < 0:
            raise ValueError(f"group {group.group_id!r} has row_start {group.row_start} < 0")


def _cut(
    positions: list[int], tokens: list[int], budget_tokens: int | None, budget_rows: int | None
) -> list[list[int]]:
    """Cut a rank's read-ordered trajectory positions into micro-batches."""
    if budget_rows is not None:
        if len(positions) <= budget_rows:
            return [positions] if positions else []
        return [positions[i : i + budget_rows] for i in range(0, len(positions), budget_rows)]
    assert budget_tokens is not None
    out: list[list[int]] = []
    current: list[int] = []
    load = 0
    for p in positions:
        t = tokens[p]
        if current and load + t > budget_tokens:
            out.append(current)
            current, load = [], 0
        current.append(p)
        load += t
    if current:
        out.append(current)
    return out


def _split_to(parts: list[list[int]], target: int, tokens: list[int]) -> list[list[int]]:
    """Split the largest multi-trajectory micro-batches (token midpoint) until there are ``target``."""
    heap = [(-sum(tokens[p] for p in part), part[0], part) for part in parts if len(part) > 1]
    done = [part for part in parts if len(part) == 1]
    heapq.heapify(heap)
    count = len(parts)
    while count < target and heap:
        neg, _, part = heapq.heappop(heap)
        half, acc, cut = -neg / 2, 0, 1
        for i, p in enumerate(part[:-1]):
            acc += tokens[p]
            cut = i + 1
            if acc >= half:
                break
        for piece in (part[:cut], part[cut:]):
            if len(piece) > 1:
                heapq.heappush(heap, (-sum(tokens[p] for p in piece), piece[0], piece))
            else:
                done.append(piece)
        count += 1
    done.extend(part for _, _, part in heap)
    done.sort(key=lambda part: part[0])
    return done


class Assignment:
    """An admitted mini-batch split over ``world_size`` ranks and into micro-batches (``assign_mini_batch``).

    The trajectories are numbered in read order (``node_id``, ``unit_id``, row): position ``p`` is row
    ``rows[p]`` of group ``gids[p]`` in unit ``units[unit_of[p]]`` (``(node_id, unit_id)``) with
    ``tokens[p]`` tokens, and ``cuts[rank][i]`` lists the positions of micro-batch ``i`` of ``rank`` in read
    order. Every trajectory is at exactly one position of exactly one rank. The control plane keeps
    :meth:`layout` and publishes it in the mini-batch's manifest (:mod:`knittrans.manifest`), where
    each rank reads its rows from.

    Args:
        groups: the admitted groups (any order); their rows must not overlap.
        world_size: ``W`` data-parallel ranks.
        micro_batch_tokens: token budget per micro-batch (dynamic batch size); exclusive with
            ``micro_batch_size``.
        micro_batch_size: trajectories per micro-batch.
        keep_groups: try to keep every group on one rank (docs/explanation/on-demand-access.md).

    Raises:
        ValueError: bad ``world_size``/budgets, duplicate group ids, negative tokens, overlapping rows.
    """

    __slots__ = ("cuts", "gids", "rows", "tokens", "unit_of", "units")

    def __init__(
        self,
        groups: Sequence[FinishedGroup],
        world_size: int,
        micro_batch_tokens: int | None = None,
        micro_batch_size: int | None = None,
        keep_groups: bool = True,
    ) -> None:
        _check(groups, world_size, micro_batch_tokens, micro_batch_size)
        ordered = sorted(groups, key=lambda g: (g.node_id, g.unit_id, g.row_start, g.group_id))
        self.gids: list[str] = []
        self.tokens: list[int] = []
        self.unit_of: list[int] = []
        self.rows: list[int] = []
        self.units: list[tuple[str, str]] = []
        spans: list[tuple[int, int]] = []
        last_row = -1
        for g in ordered:
            if not g.trajectory_tokens:
                continue  # no rows: nothing to place, nothing to overlap
            key = (g.node_id, g.unit_id)
            if not self.units or self.units[-1] != key:
                self.units.append(key)
            elif last_row >= g.row_start:
                raise ValueError(f"group {g.group_id!r} overlaps rows of another group in unit {g.unit_id!r}")
            first = len(self.gids)
            n = len(g.trajectory_tokens)
            self.gids.extend([g.group_id] * n)
            self.tokens.extend(g.trajectory_tokens)
            self.unit_of.extend([len(self.units) - 1] * n)
            self.rows.extend(range(g.row_start, g.row_start + n))
            last_row = g.row_start + n - 1
            spans.append((first, first + n))
        per_rank = _balance(spans, self.tokens, world_size, keep_groups, BALANCE_TOLERANCE)
        cuts = [_cut(ps, self.tokens, micro_batch_tokens, micro_batch_size) for ps in per_rank]
        target = max((len(c) for c in cuts), default=0)
        self.cuts = [c if len(c) >= target else _split_to(c, target, self.tokens) for c in cuts]

    def layout(self) -> list[list[list[list[Any]]]]:
        """rank -> micro-batch -> ``[group_id, row]`` pairs in read order (what the control plane keeps)."""
        gids, rows = self.gids, self.rows
        return [[[[gids[p], rows[p]] for p in part] for part in parts] for parts in self.cuts]

    def rank_tokens(self) -> list[int]:
        """Tokens assigned to each rank."""
        tokens = self.tokens
        return [sum(tokens[p] for part in parts for p in part) for parts in self.cuts]


assign_mini_batch = Assignment
"""The scheduling core's name for splitting a mini-batch: ``assign_mini_batch(groups, W, micro_batch_tokens=...)``."""


def _balance(
    spans: list[tuple[int, int]], tokens: list[int], world_size: int, keep_groups: bool, tolerance: float
) -> list[list[int]]:
    """Read-ordered trajectory positions of every rank: LPT over whole groups, then halves, ..., rows."""
    prefix = [0, *itertools.accumulate(tokens)]
    ideal = prefix[-1] / world_size
    longest = max((b - a for a, b in spans), default=1)
    chunk = longest if keep_groups else 1
    best: tuple[int, list[tuple[int, int]], list[int]] | None = None
    while True:
        # items are only listed for the chunk sizes LPT runs on (at least one item per rank, or single rows)
        if chunk == 1 or sum((b - a + chunk - 1) // chunk for a, b in spans) >= world_size:
            items = [(s, min(s + chunk, b)) for a, b in spans for s in range(a, b, chunk)]
            owner, loads = lpt_assign([prefix[b] - prefix[a] for a, b in items], world_size)
            peak = max(loads)
            if best is None or peak < best[0]:
                best = (peak, items, owner)
            if peak <= ideal * (1 + tolerance):
                break
            logger.debug("chunks of %d rows: max rank load %d > ideal %.1f x %.2f", chunk, peak, ideal, 1 + tolerance)
        if chunk == 1:
            break
        chunk = (chunk + 1) // 2
    assert best is not None
    _, items, owner = best
    # items are in read order, so each rank's positions come out in read order too
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for (a, b), rank in zip(items, owner, strict=True):
        if b == a + 1:
            per_rank[rank].append(a)
        else:
            per_rank[rank].extend(range(a, b))
    return per_rank
