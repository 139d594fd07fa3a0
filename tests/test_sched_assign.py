"""Rank assignment: exactly-once rows in read order, token balance bound, budgets, equal micro-batch counts."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.sched.assign import Assignment, assign_mini_batch, lpt_assign
from knittrans.sched.types import FinishedGroup

Row = tuple[str, str, int, int, str]
"""``(node_id, unit_id, row, tokens, group_id)`` of one assigned trajectory."""


@st.composite
def mini_batches(draw: st.DrawFn) -> list[FinishedGroup]:
    """Random groups packed into units (1-3 groups each) spread over a few nodes."""
    n_groups = draw(st.integers(0, 24))
    groups = []
    unit, row = 0, 0
    for i in range(n_groups):
        if i == 0 or draw(st.booleans()):
            unit, row = unit + 1, draw(st.integers(0, 3))
        sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
        groups.append(
            FinishedGroup(
                group_id=f"g{i}",
                source="s",
                trajectory_tokens=tuple(sizes),
                finished_at=float(i),
                unit_id=f"u{unit}",
                node_id=f"n{unit % 3}",
                row_start=row,
            )
        )
        row += len(sizes) + draw(st.integers(0, 2))
    return draw(st.permutations(groups))


def _micro_batches(a: Assignment) -> list[list[list[Row]]]:
    """rank -> micro-batch -> its trajectories, in order."""
    return [
        [[(*a.units[a.unit_of[p]], a.rows[p], a.tokens[p], a.gids[p]) for p in part] for part in parts]
        for parts in a.cuts
    ]


def _check(groups: list[FinishedGroup], a: Assignment, world_size: int) -> list[list[list[Row]]]:
    plans = _micro_batches(a)
    assert len(plans) == world_size
    expected = Counter((g.node_id, g.unit_id, g.row_start + i) for g in groups for i in range(g.num_trajectories))
    got: Counter[tuple[str, str, int]] = Counter()
    tokens = {(g.node_id, g.unit_id, g.row_start + i): t for g in groups for i, t in enumerate(g.trajectory_tokens)}
    for plan in plans:
        for mb in plan:
            keys = [(node, unit, row) for node, unit, row, _, _ in mb]
            assert keys == sorted(keys), "a micro-batch's rows are not in read order"
            assert all(tokens[(node, unit, row)] == t for node, unit, row, t, _ in mb)
            got.update(keys)
        flat = [(node, unit, row) for mb in plan for node, unit, row, _, _ in mb]
        assert flat == sorted(flat), "a rank's micro-batches are not in read order"
    assert got == expected, "every trajectory exactly once"
    if sum(expected.values()) >= world_size:
        assert all(plans), "a rank got nothing"
    return plans


@settings(max_examples=150, deadline=None)
@given(
    mini_batches(),
    st.integers(1, 9),
    st.one_of(st.tuples(st.just("tokens"), st.integers(1, 900)), st.tuples(st.just("rows"), st.integers(1, 5))),
    st.booleans(),
)
def test_assignment_invariants(
    groups: list[FinishedGroup], world_size: int, budget: tuple[str, int], keep_groups: bool
) -> None:
    """Exactly-once rows, reads = trajectories, balance bound, budgets respected, equal micro-batch counts."""
    kind, value = budget
    kwargs = {"micro_batch_tokens": value} if kind == "tokens" else {"micro_batch_size": value}
    assignment = assign_mini_batch(groups, world_size, keep_groups=keep_groups, **kwargs)  # type: ignore[arg-type]
    plans = _check(groups, assignment, world_size)
    # the control plane's compact form is the same assignment, rank by rank, row by row
    assert assignment.layout() == [[[[gid, row] for _, _, row, _, gid in mb] for mb in p] for p in plans]
    total = sum(sum(g.trajectory_tokens) for g in groups)
    biggest = max((t for g in groups for t in g.trajectory_tokens), default=0)
    ideal = total / world_size
    assert assignment.rank_tokens() == [sum(t for mb in p for *_, t, _ in mb) for p in plans]
    assert max(assignment.rank_tokens(), default=0) <= max(ideal * 1.05, ideal + biggest) + 1e-9
    for plan in plans:
        for mb in plan:
            if kind == "tokens":
                assert sum(t for *_, t, _ in mb) <= value or len(mb) == 1
            else:
                assert 1 <= len(mb) <= value
    counts = [len(p) for p in plans]
    top = max(counts, default=0)
    for plan, count in zip(plans, counts, strict=True):
        assert count in (top, sum(len(mb) for mb in plan)), "micro-batch counts not equalised where possible"


def test_whole_groups_kept_when_balanced() -> None:
    """Four equal groups over two ranks: each rank gets two whole groups, one read range per unit."""
    groups = [
        FinishedGroup(
            group_id=f"g{i}",
            source="s",
            trajectory_tokens=(10, 10),
            finished_at=i,
            unit_id="u0",
            node_id="n0",
            row_start=2 * i,
        )
        for i in range(4)
    ]
    assignment = assign_mini_batch(groups, 2, micro_batch_size=8)
    assert assignment.rank_tokens() == [40, 40]
    for plan in _micro_batches(assignment):
        ids = [gid for mb in plan for *_, gid in mb]
        assert len(set(ids)) == 2 and all(ids.count(g) == 2 for g in set(ids))


def test_groups_split_when_fewer_groups_than_ranks() -> None:
    """One group of four over four ranks: every rank gets one row."""
    group = FinishedGroup(
        group_id="g", source="s", trajectory_tokens=(5, 6, 7, 8), finished_at=0, unit_id="u", node_id="n", row_start=3
    )
    plans = _micro_batches(assign_mini_batch([group], 4, micro_batch_tokens=100))
    assert sorted(row for p in plans for mb in p for _, _, row, _, _ in mb) == [3, 4, 5, 6]
    assert all(len(p) == 1 for p in plans)


def test_token_budget_and_oversized_trajectory() -> None:
    """Next-fit by token budget in read order; a trajectory above the budget is its own micro-batch."""
    group = FinishedGroup(
        group_id="g",
        source="s",
        trajectory_tokens=(40, 40, 500, 30, 30, 30),
        finished_at=0,
        unit_id="u",
        node_id="n",
        row_start=0,
    )
    (plan,) = _micro_batches(assign_mini_batch([group], 1, micro_batch_tokens=100))
    assert [[row for _, _, row, _, _ in mb] for mb in plan] == [[0, 1], [2], [3, 4, 5]]


def test_micro_batch_counts_equalised_by_splitting() -> None:
    """Rank with one short group is split to match the rank that needs three micro-batches."""
    long = FinishedGroup(
        group_id="long",
        source="s",
        trajectory_tokens=(90, 90, 90),
        finished_at=0,
        unit_id="u1",
        node_id="n",
    )
    short = FinishedGroup(
        group_id="short",
        source="s",
        trajectory_tokens=(30, 30, 30, 30, 30, 30, 30, 30, 30),
        finished_at=1,
        unit_id="u2",
        node_id="n",
    )
    plans = _micro_batches(assign_mini_batch([long, short], 2, micro_batch_tokens=100))
    assert [len(p) for p in plans] == [3, 3]
    assert all(sum(t for *_, t, _ in mb) <= 100 for p in plans for mb in p)


def test_equalising_splits_the_largest_micro_batch() -> None:
    """A rank one micro-batch short splits its largest one ([50, 50]), not its first ([1, 1])."""
    a = FinishedGroup(group_id="a", source="s", trajectory_tokens=(1, 1, 50, 50), finished_at=0, unit_id="u1")
    b = FinishedGroup(group_id="b", source="s", trajectory_tokens=(17,) * 6, finished_at=1, unit_id="u2")
    plans = _micro_batches(assign_mini_batch([a, b], 2, micro_batch_size=2))
    assert sorted([[t for *_, t, _ in mb] for mb in p] for p in plans) == [
        [[1, 1], [50], [50]],
        [[17, 17], [17, 17], [17, 17]],
    ]
    # the split falls where the running tokens first reach half (40 >= 60 / 2): after the 30
    c = FinishedGroup(group_id="c", source="s", trajectory_tokens=(10, 30, 10, 10), finished_at=0, unit_id="u1")
    d = FinishedGroup(group_id="d", source="s", trajectory_tokens=(10,) * 6, finished_at=1, unit_id="u2")
    plans = _micro_batches(assign_mini_batch([c, d], 2, micro_batch_size=4))
    assert sorted([[t for *_, t, _ in mb] for mb in p] for p in plans) == [
        [[10, 10, 10, 10], [10, 10]],
        [[10, 30], [10, 10]],
    ]


def test_groups_stay_whole_when_splitting_rows_does_not_help() -> None:
    """(7) and (6, 7) over two ranks: no split meets the tolerance and rows balance no better (13), so the
    whole-group split, the first of the best, is used."""
    a = FinishedGroup(group_id="a", source="s", trajectory_tokens=(7,), finished_at=0, unit_id="u")
    b = FinishedGroup(group_id="b", source="s", trajectory_tokens=(6, 7), finished_at=1, unit_id="u", row_start=1)
    assert assign_mini_batch([a, b], 2, micro_batch_size=9).layout() == [[[["b", 1], ["b", 2]]], [[["a", 0]]]]


def test_lpt_hand_case() -> None:
    """LPT on (7, 5, 4, 3, 1) over two bins: 7|5, then 4 onto 5, 3 onto 7, 1 onto 9 -> loads 10 and 10."""
    owner, loads = lpt_assign([7, 5, 4, 3, 1], 2)
    assert owner == [0, 1, 1, 0, 1] and loads == [10, 10]


@given(st.lists(st.integers(0, 60), max_size=40), st.integers(1, 30))
@settings(max_examples=300, deadline=None)
def test_lpt_places_each_item_as_the_rule_says(weights: list[int], bins: int) -> None:
    """Largest first (ties: lower index), each onto the least-loaded bin (ties: fewer items, then lower index),
    checked against that rule written out item by item: the heap, and the empty bins filled before it, agree."""
    owner, loads = lpt_assign(weights, bins)
    load, count, expected = [0] * bins, [0] * bins, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min(range(bins), key=lambda b: (load[b], count[b], b))
        expected[i], load[b], count[b] = b, load[b] + weights[i], count[b] + 1
    assert owner == expected and loads == load


def test_bad_arguments() -> None:
    """Both or neither budget, zero ranks, duplicate groups and overlapping rows are refused by name."""
    g = FinishedGroup(group_id="g", source="s", trajectory_tokens=(1, 2), finished_at=0, unit_id="u", node_id="n")
    with pytest.raises(ValueError, match="exactly one"):
        assign_mini_batch([g], 1)
    with pytest.raises(ValueError, match="exactly one"):
        assign_mini_batch([g], 1, micro_batch_size=1, micro_batch_tokens=1)
    with pytest.raises(ValueError, match="world_size"):
        assign_mini_batch([g], 0, micro_batch_size=1)
    with pytest.raises(ValueError, match="twice"):
        assign_mini_batch([g, g], 1, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        assign_mini_batch([g], 1, micro_batch_tokens=0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        assign_mini_batch([g], 1, micro_batch_size=0)
    with pytest.raises(ValueError, match="negative token count"):
        assign_mini_batch([dataclasses.replace(g, trajectory_tokens=(1, -2))], 1, micro_batch_size=1)
    with pytest.raises(ValueError, match="row_start -1 < 0"):
        assign_mini_batch([dataclasses.replace(g, row_start=-1)], 1, micro_batch_size=1)
    h = FinishedGroup(
        group_id="h", source="s", trajectory_tokens=(1,), finished_at=0, unit_id="u", node_id="n", row_start=1
    )
    with pytest.raises(ValueError, match="overlaps"):
        assign_mini_batch([g, h], 1, micro_batch_size=1)
    assert assign_mini_batch([], 3, micro_batch_size=2).layout() == [[], [], []]
    assert assign_mini_batch([], 2, micro_batch_tokens=10).layout() == [[], []]


def test_groups_without_trajectories() -> None:
    """Groups without trajectories take no rows: alone they give every rank nothing (the balance used to split
    by 0 rows), inside another group's rows they overlap nothing, and they do not hide a real overlap."""

    def group(gid: str, tokens: tuple[int, ...], row: int) -> FinishedGroup:
        return FinishedGroup(
            group_id=gid, source="s", trajectory_tokens=tokens, finished_at=0, unit_id="u", node_id="n", row_start=row
        )

    empty = [group("a", (), 0), group("b", (), 0)]
    for keep_groups in (True, False):
        assert assign_mini_batch(empty, 2, micro_batch_size=1, keep_groups=keep_groups).layout() == [[], []]
    inside = [group("a", (5, 5, 5), 0), group("b", (), 1)]
    assert assign_mini_batch(inside, 1, micro_batch_size=3).layout() == [[[["a", 0], ["a", 1], ["a", 2]]]]
    with pytest.raises(ValueError, match="overlaps"):
        assign_mini_batch([*inside, group("c", (5,), 2)], 1, micro_batch_size=3)
