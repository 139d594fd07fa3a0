"""Admission policies: exact composition, sizes, bounds, feasibility, earliest-first, ordering claims."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.sched.admission import (
    POLICIES,
    VersionAwarePolicy,
    composition_plan,
    expired,
    make_policy,
    mini_batch_sizes,
    quota_deficit,
    remainder_feasible,
)
from knittrans.sched.types import AdmissionDecision, FinishedGroup, SourceBounds, StepState


def _group(n: int, source: str, *, version_start: int = 0) -> FinishedGroup:
    return FinishedGroup(
        group_id=f"g{n:05d}", source=source, trajectory_tokens=(1,), finished_at=float(n), version_start=version_start
    )


@dataclass
class StepRun:
    """What happened when a policy ran a whole train step over one arrival sequence."""

    seen_at: list[int] = field(default_factory=list)
    """Finished groups seen when mini-batch k was admitted."""
    decisions: list[AdmissionDecision] = field(default_factory=list)
    states: list[StepState] = field(default_factory=list)
    admitted: dict[str, int] = field(default_factory=dict)


def run_step(
    policy_name: str,
    quotas: Mapping[str, int],
    k_total: int,
    bounds: Mapping[str, SourceBounds],
    arrivals: list[str],
    *,
    versions: Sequence[tuple[int, int, float]] = (),
    current_version: int = 0,
) -> StepRun:
    """Feed arrivals one by one (supply = the whole arrival list) and call select until it waits.

    ``versions[i]``: (start, end, weighted) of the i-th arrival (default all 0); the trainer is at ``current_version``.
    """
    policy = make_policy(policy_name)
    supply = {s: arrivals.count(s) for s in quotas}
    arrived = dict.fromkeys(quotas, 0)
    finished: list[FinishedGroup] = []
    run = StepRun(admitted=dict.fromkeys(quotas, 0))
    for n, source in enumerate(arrivals, 1):
        arrived[source] += 1
        group = _group(n, source)
        if versions:
            v0, v1, vw = versions[n - 1]
            group = dataclasses.replace(group, version_start=v0, version_end=v1, version_weighted=vw)
        finished.append(group)
        while len(run.decisions) < k_total:
            state = StepState(
                quotas=quotas,
                admitted=dict(run.admitted),
                finished=tuple(finished),
                pending={s: supply[s] - arrived[s] for s in quotas},
                mini_batch_index=len(run.decisions),
                mini_batches_per_step=k_total,
                bounds=bounds,
                current_version=current_version,
            )
            decision = policy.select(state)
            if decision is None:
                break
            taken = {g.group_id for g in decision.groups}
            assert len(taken) == len(decision.groups), "a group admitted twice in one mini-batch"
            assert taken <= {g.group_id for g in finished}, "admitted a group that is not finished"
            finished = [g for g in finished if g.group_id not in taken]
            for s, c in decision.counts.items():
                run.admitted[s] += c
            run.seen_at.append(n)
            run.decisions.append(decision)
            run.states.append(state)
    return run


@st.composite
def workloads(draw: st.DrawFn, with_bounds: bool = True, with_lo: bool = True) -> tuple:  # type: ignore[type-arg]
    """Random quotas, K, feasible uniform bounds, surplus supply and a skewed finish order."""
    n_sources = draw(st.integers(1, 4))
    sources = [f"s{i}" for i in range(n_sources)]
    quotas = {s: draw(st.integers(0, 10)) for s in sources}
    if sum(quotas.values()) == 0:
        quotas[sources[0]] = 1
    k_total = draw(st.integers(1, min(6, sum(quotas.values()))))
    bounds = {}
    if with_bounds:
        for s in sources:
            if draw(st.booleans()):
                lo = draw(st.integers(0, quotas[s] // k_total)) if with_lo else 0
                hi_min = -(-quotas[s] // k_total)
                hi = draw(st.one_of(st.none(), st.integers(max(hi_min, lo), hi_min + 3)))
                bounds[s] = SourceBounds(lo=lo, hi=hi)
    surplus = {s: draw(st.integers(0, 2)) for s in sources}
    speed = {s: draw(st.floats(0, 3)) for s in sources}
    jitter = draw(st.lists(st.floats(0, 1), min_size=sum(quotas.values()) + sum(surplus.values()), max_size=100))
    arrivals = [s for s in sources for _ in range(quotas[s] + surplus[s])]
    order = sorted(range(len(arrivals)), key=lambda i: jitter[i] + speed[arrivals[i]])
    return quotas, k_total, bounds, [arrivals[i] for i in order]


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_every_policy_completes_the_step_with_exact_composition(case: tuple) -> None:  # type: ignore[type-arg]
    """Every policy: train batch exactly q, mini-batch k of size b_k within bounds, earliest-first per source."""
    quotas, k_total, bounds, arrivals = case
    sizes = mini_batch_sizes(sum(quotas.values()), k_total)
    for name in POLICIES:
        run = run_step(name, quotas, k_total, bounds, arrivals)
        assert len(run.decisions) == k_total, f"{name} stalled with all supply finished"
        assert run.admitted == dict(quotas)
        for k, (decision, state) in enumerate(zip(run.decisions, run.states, strict=True)):
            assert sum(decision.counts.values()) == len(decision.groups) == sizes[k]
            assert set(decision.counts) == set(quotas)
            for s, c in decision.counts.items():
                b = bounds.get(s, SourceBounds())
                assert b.lo <= c and (b.hi is None or c <= b.hi)
                assert c == sum(1 for g in decision.groups if g.source == s)
                assert state.admitted[s] + c <= quotas[s]
                # earliest-finished first within each source
                per_source = sorted((g for g in state.finished if g.source == s), key=lambda g: g.finished_at)
                assert [g for g in decision.groups if g.source == s] == per_source[:c]
            assert remainder_feasible(state, decision.counts)


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_admission_time_ordering(case: tuple) -> None:  # type: ignore[type-arg]
    """linear_target never admits mini-batch k later than train_batch (in finished groups seen)."""
    quotas, k_total, bounds, arrivals = case
    lt = run_step("linear_target", quotas, k_total, bounds, arrivals).seen_at
    tb = run_step("train_batch", quotas, k_total, bounds, arrivals).seen_at
    assert all(a <= b for a, b in zip(lt, tb, strict=True))
    assert len(set(tb)) == 1 and tb[0] == max(
        next(i for i in range(len(arrivals) + 1) if sum(1 for x in arrivals[:i] if x == s) >= q)
        for s, q in quotas.items()
    )


@settings(max_examples=120, deadline=None)
@given(workloads(with_bounds=False))
def test_constraint_preserving_never_later_than_linear_target_without_bounds(case: tuple) -> None:  # type: ignore[type-arg]
    """Without per-mini-batch bounds constraint_preserving admits every mini-batch no later than linear_target."""
    quotas, k_total, bounds, arrivals = case
    cp = run_step("constraint_preserving", quotas, k_total, bounds, arrivals).seen_at
    lt = run_step("linear_target", quotas, k_total, bounds, arrivals).seen_at
    assert all(a <= b for a, b in zip(cp, lt, strict=True))


def test_constraint_preserving_can_be_later_than_linear_target_with_an_upper_bound() -> None:
    """Hand case: greedy takes three s0 early; hi[s1]=1 then delays mini-batch 1 past linear_target's."""
    quotas = {"s0": 10, "s1": 3}
    bounds = {"s1": SourceBounds(hi=1)}
    arrivals = ["s0"] * 4 + ["s1"] * 2 + ["s0"] * 2 + ["s1"] + ["s0"] + ["s1"] * 2 + ["s0"] * 3
    cp = run_step("constraint_preserving", quotas, 5, bounds, arrivals).seen_at
    lt = run_step("linear_target", quotas, 5, bounds, arrivals).seen_at
    assert cp[0] == 3 and lt[0] == 5
    assert cp[1] == 7 and lt[1] == 6


def _brute_force_earliest(state: StepState) -> tuple[float, ...] | None:
    """Lexicographically earliest finish times over every count vector remainder_feasible accepts."""
    size = mini_batch_sizes(state.train_batch_size, state.mini_batches_per_step)[state.mini_batch_index]
    usable = {s: sorted(g.finished_at for g in state.finished if g.source == s) for s in state.quotas}
    sources = sorted(state.quotas)
    best: tuple[float, ...] | None = None
    for xs in itertools.product(*(range(len(usable[s]) + 1) for s in sources)):
        if sum(xs) != size:
            continue
        counts = dict(zip(sources, xs, strict=True))
        b_ok = all(
            state.bounds.get(s, SourceBounds()).lo <= c
            and (state.bounds.get(s, SourceBounds()).hi is None or c <= (state.bounds[s].hi or 0))
            for s, c in counts.items()
        )
        if not b_ok or not remainder_feasible(state, counts):
            continue
        times = tuple(sorted(t for s, c in counts.items() for t in usable[s][:c]))
        if best is None or times < best:
            best = times
    return best


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_constraint_preserving_matches_brute_force(case: tuple) -> None:  # type: ignore[type-arg]
    """constraint_preserving returns the earliest feasible mini-batch, and waits only when none exists."""
    quotas, k_total, bounds, arrivals = case
    policy = make_policy("constraint_preserving")
    run = run_step("constraint_preserving", quotas, k_total, bounds, arrivals)
    for state in run.states:
        decision = policy.select(state)
        assert decision is not None
        assert tuple(sorted(g.finished_at for g in decision.groups)) == _brute_force_earliest(state)
    # a state one arrival before each admission had no feasible mini-batch
    for k, n in enumerate(run.seen_at):
        if n == 1 or (k > 0 and run.seen_at[k - 1] == n):
            continue
        state = run.states[k]
        earlier = StepState(
            quotas=state.quotas,
            admitted=state.admitted,
            finished=tuple(g for g in state.finished if g.finished_at < n),
            pending={s: p + (1 if arrivals[n - 1] == s else 0) for s, p in state.pending.items()},
            mini_batch_index=k,
            mini_batches_per_step=k_total,
            bounds=bounds,
        )
        assert policy.select(earlier) is None and _brute_force_earliest(earlier) is None


@st.composite
def versioned(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    """A random workload whose groups carry random versions (start <= weighted <= end), a trainer version and
    an age cap."""
    quotas, k_total, bounds, arrivals = draw(workloads())
    versions = []
    for _ in arrivals:
        v0 = draw(st.integers(0, 12))
        v1 = draw(st.integers(v0, v0 + 4))
        versions.append((v0, v1, draw(st.floats(v0, v1))))
    return quotas, k_total, bounds, arrivals, versions, draw(st.integers(0, 20)), draw(st.integers(0, 10))


@settings(max_examples=150, deadline=None)
@given(versioned())
def test_version_aware_keeps_quotas_and_takes_due_then_newest(case: tuple) -> None:  # type: ignore[type-arg]
    """version_aware: train batch exactly q, mini-batch sizes and bounds, constraint_preserving's counts for the
    same state; within a source, groups at the age cap before any other, then the newest (weighted version)."""
    quotas, k_total, bounds, arrivals, versions, now, cap = case
    sizes = mini_batch_sizes(sum(quotas.values()), k_total)
    cp = make_policy("constraint_preserving")
    policy = VersionAwarePolicy(age_cap=cap)
    run = run_step("version_aware", quotas, k_total, bounds, arrivals, versions=versions, current_version=now)
    assert len(run.decisions) == k_total, "version_aware stalled with all supply finished"
    assert run.admitted == dict(quotas)
    for k, state in enumerate(run.states):
        decision = policy.select(state)  # the run's own decisions used the default cap; redo with ``cap``
        assert decision is not None
        assert decision.counts == run.decisions[k].counts == cp.select(state).counts  # type: ignore[union-attr]
        assert sum(decision.counts.values()) == len(decision.groups) == sizes[k]
        assert remainder_feasible(state, decision.counts)
        for s, c in decision.counts.items():
            b = bounds.get(s, SourceBounds())
            assert b.lo <= c and (b.hi is None or c <= b.hi)
            mine = [g for g in decision.groups if g.source == s]
            left = [g for g in state.finished if g.source == s and g not in mine]
            due = lambda g: now - g.version_start >= cap  # noqa: E731
            if any(due(g) for g in left):
                assert all(due(g) for g in mine), "a newer group went before a due one"
                assert all(a.finished_at <= b.finished_at for a in mine for b in left if due(b)), "due: finish order"
            else:
                fresh_left = [g.version_weighted for g in left if not due(g)]
                taken = [g.version_weighted for g in mine if not due(g)]
                assert not fresh_left or not taken or min(taken) >= max(fresh_left), "an older group went first"


def test_version_aware_age_cap_defaults() -> None:
    """The age cap: η - K with a staleness bound η, 2·K without; a negative cap is refused."""
    state = StepState(
        quotas={"a": 2}, admitted={}, finished=(), pending={"a": 2}, mini_batch_index=0, mini_batches_per_step=2
    )
    assert VersionAwarePolicy().cap(state) == 4
    assert VersionAwarePolicy().cap(dataclasses.replace(state, max_staleness=7)) == 5
    assert VersionAwarePolicy(age_cap=3).cap(state) == 3
    with pytest.raises(ValueError, match="age_cap must be >= 0"):
        VersionAwarePolicy(age_cap=-1)


def test_mini_batch_sizes_hand_cases() -> None:
    """Sizes sum to G, differ by at most one, larger first; K outside 1..G is refused."""
    assert mini_batch_sizes(10, 3) == [4, 3, 3]
    assert mini_batch_sizes(8, 4) == [2, 2, 2, 2]
    assert mini_batch_sizes(5, 5) == [1] * 5
    for bad in (0, 6):
        with pytest.raises(ValueError, match="mini_batches_per_step"):
            mini_batch_sizes(5, bad)


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 30), min_size=1), st.integers(1, 12))
def test_composition_plan_is_balanced(quotas: dict[str, int], k_total: int) -> None:
    """Plan rows sum to b_k, columns to q, and each cell is floor or ceil of q/K."""
    if sum(quotas.values()) < k_total:
        return
    plan = composition_plan(quotas, k_total)
    assert [sum(row.values()) for row in plan] == mini_batch_sizes(sum(quotas.values()), k_total)
    for s, q in quotas.items():
        assert sum(row[s] for row in plan) == q
        assert all(row[s] in (q // k_total, -(-q // k_total)) for row in plan)


def test_composition_plan_hand_case() -> None:
    """q = (a 4, b 2), K = 2 gives two identical halves; K | q gives exactly q/K everywhere."""
    assert composition_plan({"a": 4, "b": 2}, 2) == [{"a": 2, "b": 1}, {"a": 2, "b": 1}]
    assert composition_plan({"a": 3, "b": 1}, 2) == [{"a": 2, "b": 0}, {"a": 1, "b": 1}]


def _state(finished: list[FinishedGroup], **kw: object) -> StepState:
    base: dict[str, object] = {
        "quotas": {"a": 4, "b": 2},
        "admitted": {"a": 0, "b": 0},
        "pending": {"a": 0, "b": 0},
        "mini_batch_index": 0,
        "mini_batches_per_step": 2,
    }
    base.update(kw)
    return StepState(finished=tuple(finished), **base)  # type: ignore[arg-type]


def test_hand_case_policies() -> None:
    """Arrivals a a a b: constraint_preserving admits a a b at once; linear_target likewise; train_batch waits."""
    groups = [_group(1, "a"), _group(2, "a"), _group(3, "a"), _group(4, "b")]
    state = _state(groups, pending={"a": 1, "b": 1})
    cp = make_policy("constraint_preserving").select(state)
    assert cp is not None and [g.group_id for g in cp.groups] == ["g00001", "g00002", "g00003"]
    assert cp.counts == {"a": 3, "b": 0}
    lt = make_policy("linear_target").select(state)
    assert lt is not None and [g.group_id for g in lt.groups] == ["g00001", "g00002", "g00004"]
    assert make_policy("train_batch").select(state) is None
    bounded = _state(groups, pending={"a": 1, "b": 1}, bounds={"b": SourceBounds(lo=1, hi=1)})
    cp_b = make_policy("constraint_preserving").select(bounded)
    assert cp_b is not None and cp_b.counts == {"a": 2, "b": 1}


def test_remainder_feasible_hand_cases() -> None:
    """The remainder check refuses quota overflow, bound breaks, missing supply and wrong sizes."""
    groups = [_group(1, "a"), _group(2, "a"), _group(3, "b")]
    state = _state(groups, pending={"a": 2, "b": 1})
    assert remainder_feasible(state, {"a": 2, "b": 1})
    assert remainder_feasible(state, {"a": 2, "b": 1}) and remainder_feasible(state, {"a": 5, "b": -2}) is False
    assert remainder_feasible(state, {"a": 1, "b": 1}) is False  # later sizes no longer add up
    assert (
        remainder_feasible(_state(groups, pending={"a": 2, "b": 1}, bounds={"b": SourceBounds(hi=0)}), {"a": 2, "b": 1})
        is False
    )
    assert remainder_feasible(_state(groups, pending={"a": 0, "b": 1}), {"a": 2, "b": 1}) is False  # a short by 2
    with pytest.raises(ValueError, match="without a quota"):
        remainder_feasible(state, {"zzz": 1})


def test_deficit_is_reported_and_not_hidden() -> None:
    """Source b cannot meet its quota: quota_deficit says so and constraint_preserving waits instead of re-mixing."""
    groups = [_group(i, "a") for i in range(1, 5)]
    state = _state(groups, pending={"a": 0, "b": 1})
    assert quota_deficit(state) == {"b": 1}
    assert make_policy("constraint_preserving").select(state) is None
    assert quota_deficit(_state(groups, pending={"a": 0, "b": 2})) == {}


def test_staleness_bound_skips_expired_groups() -> None:
    """Groups older than eta are neither admitted nor counted as supply."""
    old = _group(1, "a", version_start=0)
    fresh = [_group(i, "a", version_start=5) for i in range(2, 5)] + [_group(5, "b", version_start=5)]
    state = _state([old, *fresh], current_version=6, max_staleness=2, pending={"a": 1, "b": 1})
    assert expired(state, old) and not expired(state, fresh[0])
    decision = make_policy("constraint_preserving").select(state)
    assert decision is not None and old not in decision.groups
    assert quota_deficit(_state([old, *fresh], current_version=6, max_staleness=2, pending={"a": 0, "b": 1})) == {
        "a": 1
    }


def test_bad_inputs_raise_clear_errors() -> None:
    """Unknown policy, unknown source, over-admitted or impossible-bound states are ValueErrors naming the problem."""
    with pytest.raises(ValueError, match="train_batch, linear_target, constraint_preserving"):
        make_policy("fifo")
    policy = make_policy("constraint_preserving")
    with pytest.raises(ValueError, match="'zzz'"):
        policy.select(_state([_group(1, "zzz")]))
    with pytest.raises(ValueError, match="step is complete"):
        policy.select(_state([], mini_batch_index=2, admitted={"a": 4, "b": 2}))
    with pytest.raises(ValueError, match="cannot meet bounds"):
        policy.select(_state([], bounds={"b": SourceBounds(lo=2)}))
    with pytest.raises(ValueError, match="not formed by this policy"):
        make_policy("linear_target").select(_state([], mini_batch_index=1, admitted={"a": 3, "b": 0}))
    for bad, message in (
        ({"quotas": {"a": 7, "b": -1}}, "quota of source 'b' is negative"),
        ({"quotas": {"a": 0, "b": 0}}, "at least one group"),
        ({"admitted": {"a": 0, "b": 0, "c": 1}}, r"without a quota: \['c'\]"),
        ({"mini_batch_index": 1, "admitted": {"a": 1, "b": 0}}, "admitted 1 groups before mini-batch 1, expected 3"),
        ({"mini_batch_index": 1, "admitted": {"a": 0, "b": 3}}, "admitted 3 groups of source 'b', quota is 2"),
    ):
        for name in POLICIES:
            with pytest.raises(ValueError, match=message):
                make_policy(name).select(_state([], **bad))
    for lo, hi in ((-1, None), (-1, 2), (3, 2)):
        with pytest.raises(ValueError, match=f"bounds need 0 <= lo <= hi, got lo={lo}, hi={hi}"):
            SourceBounds(lo=lo, hi=hi)
    assert SourceBounds(lo=2, hi=2).hi == 2  # lo == hi is allowed: it pins the count


def test_composition_plan_gives_the_extra_to_the_source_furthest_behind() -> None:
    """q = (a 1, b 2), K = 3: after b's extra in mini-batch 0, a is further behind its share 2/3 than b (4/3 - 1)."""
    assert composition_plan({"a": 1, "b": 2}, 3) == [{"a": 0, "b": 1}, {"a": 1, "b": 0}, {"a": 0, "b": 1}]


def test_policies_take_the_earliest_finished_whatever_the_order_of_finished() -> None:
    """``finished`` listed newest first: every policy still takes each source's earliest-finished groups."""
    groups = [_group(n, s) for n, s in ((6, "a"), (5, "b"), (4, "a"), (3, "a"), (2, "b"), (1, "a"))]
    state = _state(groups)
    for name in POLICIES:
        decision = make_policy(name).select(state)
        assert decision is not None
        assert [g.group_id for g in decision.groups] == ["g00001", "g00002", "g00003"], name


def test_version_aware_takes_the_newest_and_lists_them_in_finish_order() -> None:
    """The two newest groups are taken (g3, g2 over g1), and the decision lists them earliest finished first."""
    groups = [
        dataclasses.replace(_group(n, "a"), version_start=n, version_end=n, version_weighted=float(n))
        for n in (1, 2, 3)
    ]
    state = StepState(
        quotas={"a": 2}, admitted={}, finished=groups, pending={}, mini_batch_index=0, mini_batches_per_step=1
    )
    decision = VersionAwarePolicy(age_cap=10).select(state)
    assert decision is not None and [g.group_id for g in decision.groups] == ["g00002", "g00003"]
