"""Hand-derived simulator runs: deterministic durations, every policy, every version reading."""

from __future__ import annotations

import pytest

from knittrans.sched.staleness import READINGS, architectural_staleness, staleness, version_of
from knittrans.sim.engine import RunTrace, simulate
from knittrans.sim.metrics import compute_metrics, staleness_split
from knittrans.sim.model import VersionTimeline
from knittrans.sim.rollout import CallGroup, RolloutPool
from knittrans.sim.workload import SourceProfile, Workload

# The hand case. Sources a (every group takes 1 s) and b (3 s), quota 2 each: G = 4, K = 2, b = 2.
# One trajectory of 100 tokens per group, 4 rollout slots, window W = 1: at most W·G = 4 groups
# launched but not in a mini-batch the trainer has started (training, not admission, frees window),
# lookahead L = 1 (mini-batch n is admitted only once n <= trainer position + 1), training takes 1 s
# per mini-batch, weights reach rollout with no delay, in-flight weight updates on. The source furthest
# behind its quota share of launches starts next (ties: workload order), so a, b, a, b, ... Version v
# is usable from the end of mini-batch v-1. At equal times: a finished optimizer step is handled before
# finished groups, finished groups in launch order, and admission runs after each. Versions of a group:
# (start, end, time-weighted mean over its run); the end version is the largest version that produced
# a token, so weights arriving at the very instant a group finishes do not count.


def hand_workload(*, in_flight: bool = True, lookahead: int = 1, handover: str = "step") -> Workload:
    """The 2-source case above."""
    return Workload(
        name="hand",
        sources=(
            SourceProfile(name="a", quota=2, duration_mean_s=1.0, tokens_mean=100),
            SourceProfile(name="b", quota=2, duration_mean_s=3.0, tokens_mean=100),
        ),
        group_size=1,
        mini_batches_per_step=2,
        window=1,
        rollout_slots=4,
        sync_delay_s=0.0,
        in_flight_updates=in_flight,
        trainer_overhead_s=1.0,
        trainer_s_per_token=0.0,
        world_size=1,
        lookahead=lookahead,
        train_batch_handover=handover,
        steps=2,
    )


# group -> (mini-batch number n, index k, version_start, version_end, version_weighted)
# constraint_preserving:
#  t=0 launch a-0 b-0 a-1 b-1 (v0). t=1 a-0, a-1 finish -> mb0 = {a-0, a-1} (n0, k0), trains 1..2 and
#  frees two launches: a-2 (1..2), b-2 (1..4) at v0. t=2 v1 usable; a-2 ends at that instant: (0, 0, 0)
#  -- v1 produced none of its tokens. mb1 needs b: wait. t=3 b-0, b-1: v0 on [0,2), v1 on [2,3] ->
#  (0, 1, 1/3); mb1 = {b-0, b-1} (n1, k1) trains 3..4: launch a-3 (3..4), b-3 (3..6) at v1. t=4 v2;
#  b-2 ends: v0 [1,2), v1 [2,4] -> (0, 1, 2/3) and mb2 = {a-2, b-2} (n2, k0) trains 4..5; a-3 ends
#  (1, 1, 1.0). t=5 v3. t=6 b-3: v1 [3,4), v2 [4,5), v3 [5,6] -> (1, 3, 2.0); mb3 = {a-3, b-3} (n3, k1)
#  trains 6..7. Makespan 7 s; every mini-batch starts training as it is admitted.
CP = {
    "a-0": (0, 0, 0, 0, 0.0),
    "a-1": (0, 0, 0, 0, 0.0),
    "b-0": (1, 1, 0, 1, 1 / 3),
    "b-1": (1, 1, 0, 1, 1 / 3),
    "a-2": (2, 0, 0, 0, 0.0),
    "b-2": (2, 0, 0, 1, 2 / 3),
    "a-3": (3, 1, 1, 1, 1.0),
    "b-3": (3, 1, 1, 3, 2.0),
}
# train_batch (default handover "step": the trainer is handed the whole train batch when it starts the
#  step): waits for all four groups (t=3), admits mb0 = {a-0, b-0} and, with L = 1, mb1 = {a-1, b-1}.
#  mb0 trains 3..4 and the whole step leaves the window: a-2, a-3 (3..4), b-2, b-3 (3..6) launch at v0.
#  t=4 v1 arrives as a-2, a-3 end: (0, 0, 0). mb1 trains 4..5. t=5 v2. t=6 b-2, b-3: v0 [3,4), v1 [4,5),
#  v2 [5,6] -> (0, 2, 1.0); mb2 = {a-2, b-2} (n2, k0) trains 6..7, mb3 = {a-3, b-3} (n3, k1) 7..8.
TB = {
    "a-0": (0, 0, 0, 0, 0.0),
    "b-0": (0, 0, 0, 0, 0.0),
    "a-1": (1, 1, 0, 0, 0.0),
    "b-1": (1, 1, 0, 0, 0.0),
    "a-2": (2, 0, 0, 0, 0.0),
    "b-2": (2, 0, 0, 2, 1.0),
    "a-3": (3, 1, 0, 0, 0.0),
    "b-3": (3, 1, 0, 2, 1.0),
}
# train_batch with handover "mini_batch" (the paced baseline: the project's rule, a group leaves the window
#  when its own mini-batch starts): mb0 trains 3..4 and frees one slot of each source: a-2 (3..4), b-2
#  (3..6) at v0. t=4 v1; a-2 ends at that instant: (0, 0, 0). mb1 trains 4..5 and frees the rest: a-3
#  (4..5), b-3 (4..7) at v1. t=5 v2; a-3 ends: (1, 1, 1.0). t=6 b-2: v0 [3,4), v1 [4,5), v2 [5,6] ->
#  (0, 2, 1.0). t=7 b-3: v1 [4,5), v2 [5,7] -> (1, 2, 5/3); mb2 = {a-2, b-2} and mb3 = {a-3, b-3}
#  admitted, train 7..8, 8..9.
TB_PACED = {
    "a-0": (0, 0, 0, 0, 0.0),
    "b-0": (0, 0, 0, 0, 0.0),
    "a-1": (1, 1, 0, 0, 0.0),
    "b-1": (1, 1, 0, 0, 0.0),
    "a-2": (2, 0, 0, 0, 0.0),
    "b-2": (2, 0, 0, 2, 1.0),
    "a-3": (3, 1, 1, 1, 1.0),
    "b-3": (3, 1, 1, 2, 5 / 3),
}
# linear_target (always mini-batch by mini-batch; the handover setting is train_batch's only): mini-batch
#  k needs the plan's cumulative target {a: k+1, b: k+1}, so b gates it:
#  t=3 b-0 -> mb0 = {a-0, b-0} trains 3..4: launch a-2 (3..4), b-2 (3..6) at v0; b-1 -> mb1 = {a-1, b-1}
#  (admitted ahead, not started: no window freed). t=4 v1; a-2 (0, 0, 0); mb1 trains 4..5: launch a-3
#  (4..5), b-3 (4..7) at v1. t=5 v2; a-3 (1, 1, 1.0). t=6 b-2 (0, 2, 1.0) -> mb2 = {a-2, b-2} trains
#  6..7. t=7 v3 arrives as b-3 ends: v1 [4,5), v2 [5,7] -> (1, 2, 5/3); mb3 trains 7..8. Makespan 8 s.
LT = TB_PACED

HAND = {"constraint_preserving": (CP, 7.0), "train_batch": (TB, 8.0), "linear_target": (LT, 8.0)}


def _by_group(trace: RunTrace) -> dict[str, tuple[int, int, int, int, float]]:
    return {
        c.group_id: (c.v_train, c.mini_batch_index, c.version_start, c.version_end, c.version_weighted)
        for c in trace.consumed
    }


@pytest.mark.parametrize("policy", sorted(HAND))
def test_hand_case_versions_and_makespan(policy: str) -> None:
    """Every consumed group's mini-batch, index and three versions, and the makespan, match the derivation."""
    expected, makespan = HAND[policy]
    trace = simulate(hand_workload(), policy, seed=0)
    got = _by_group(trace)
    assert set(got) == set(expected)
    for gid, (n, k, v0, v1, vw) in expected.items():
        assert got[gid][:4] == (n, k, v0, v1), gid
        assert got[gid][4] == pytest.approx(vw), gid
    assert trace.makespan_s == pytest.approx(makespan)


@pytest.mark.parametrize("policy", sorted(HAND))
def test_hand_case_mean_wait_and_generation(policy: str) -> None:
    """Per mini-batch, the mean time its groups waited between finishing and admission, and took to generate
    (a: 1 s, b: 3 s). constraint_preserving: mb0 {a-0, a-1} and mb1 {b-0, b-1} wait 0 (1 s, 3 s), mb2 {a-2
    (1..2), b-2 (1..4)} admitted at 4 and mb3 {a-3 (3..4), b-3 (3..6)} at 6: a waits 2 s, b none (2 s each).
    The others pair an a with a b that finished 2 s later in every mini-batch."""
    trace = simulate(hand_workload(), policy, seed=0)
    got = [(m.mean_wait_s, m.mean_generation_s) for m in trace.mini_batches]
    if policy == "constraint_preserving":
        assert got == [(0.0, 1.0), (0.0, 3.0), (1.0, 2.0), (1.0, 2.0)]
    else:
        assert got == [(1.0, 2.0)] * 4


def test_hand_case_rollout_busy_time() -> None:
    """constraint_preserving's slot-seconds of generation: the eight consumed groups (4 x 1 s + 4 x 3 s), a-4
    (4..5) and b-4 (4..7) launched when mb2 starts, and a-5, b-5 launched at 6 when mb3 starts, counted up to
    the end of the run at 7 (1 s each): 22 of 4 slots x 7 s."""
    trace = simulate(hand_workload(), "constraint_preserving", seed=0)
    assert trace.rollout_busy_s == pytest.approx(22.0)
    assert compute_metrics(trace).rollout_idle == pytest.approx(1 - 22 / 28)


def test_hand_case_paced_train_batch() -> None:
    """train_batch with handover "mini_batch" frees the window mini-batch by mini-batch (the paced baseline)."""
    trace = simulate(hand_workload(handover="mini_batch"), "train_batch", seed=0)
    got = _by_group(trace)
    assert set(got) == set(TB_PACED)
    for gid, (n, k, v0, v1, vw) in TB_PACED.items():
        assert got[gid][:4] == (n, k, v0, v1), gid
        assert got[gid][4] == pytest.approx(vw), gid
    assert trace.makespan_s == pytest.approx(9.0)


@pytest.mark.parametrize("handover", ["step", "mini_batch"])
def test_handover_changes_only_train_batch(handover: str) -> None:
    """The handover setting is the train_batch baseline's: the other policies run identically under both."""
    for policy in ("constraint_preserving", "linear_target"):
        trace = simulate(hand_workload(handover=handover), policy, seed=0)
        assert _by_group(trace) == _by_group(simulate(hand_workload(), policy, seed=0))


def test_unknown_handover_is_rejected() -> None:
    """A handover that is neither "step" nor "mini_batch" is a clear error naming both."""
    with pytest.raises(ValueError, match="train_batch_handover must be one of mini_batch, step"):
        hand_workload(handover="batch")


@pytest.mark.parametrize("policy", sorted(HAND))
@pytest.mark.parametrize("reading", READINGS)
def test_hand_case_architectural_staleness(policy: str, reading: str) -> None:
    """Architectural staleness per group under each reading equals n - v - k from the hand table."""
    expected, _ = HAND[policy]
    trace = simulate(hand_workload(), policy, seed=0)
    index = {"start": 2, "end": 3, "weighted": 4}[reading]
    for c in trace.consumed:
        n, k = expected[c.group_id][0], expected[c.group_id][1]
        v = expected[c.group_id][index]
        assert staleness(c.v_train, version_of(c, reading)) == pytest.approx(n - v)
        assert architectural_staleness(c.v_train, version_of(c, reading), c.mini_batch_index) == pytest.approx(
            n - v - k
        )


def test_hand_case_step_one_means() -> None:
    """Step 1 mean architectural staleness (end reading): CP (2 + 1 + 1 - 1)/4, TB (2 + 0 + 2 + 0)/4, paced TB
    (2 + 0 + 1 + 0)/4.

    a-2 finished the instant v1 arrived and counts as v0 under every policy (the end-reading tie).
    """
    means = {}
    for label, policy, handover in (
        ("constraint_preserving", "constraint_preserving", "step"),
        ("train_batch", "train_batch", "step"),
        ("paced", "train_batch", "mini_batch"),
    ):
        trace = simulate(hand_workload(handover=handover), policy, seed=0)
        step1 = [c for c in trace.consumed if c.step == 1]
        means[label] = sum(architectural_staleness(c.v_train, c.version_end, c.mini_batch_index) for c in step1) / len(
            step1
        )
    assert means == {
        "constraint_preserving": pytest.approx(0.75),
        "train_batch": pytest.approx(1.0),
        "paced": pytest.approx(0.75),
    }


def test_hand_case_staleness_split() -> None:
    """CP's step 1 (the steps after warm-up), weighted reading, split at each group's finish: the trainer's
    version then (optimizer steps ended 2, 4, 5, 7 s; one ending at the finish counts) minus v_gen, and
    step·K minus it; b-3 finished while its step trained, so its wait is negative."""
    trace = simulate(hand_workload(), "constraint_preserving", seed=0)
    split = {g.group_id: (g.generation, g.wait) for g in staleness_split(trace, "weighted")}
    # a-2 ends at 2 s (n 1, v 0); b-2 at 4 s (n 2, v 2/3); a-3 at 4 s (n 2, v 1); b-3 at 6 s (n 3, v 2); step·K = 2
    expected = {"a-2": (1.0, 1.0), "b-2": (4 / 3, 0.0), "a-3": (1.0, 0.0), "b-3": (1.0, -1.0)}
    assert set(split) == set(expected)
    for gid, (generation, wait) in expected.items():
        assert split[gid] == (pytest.approx(generation), pytest.approx(wait)), gid


def test_hand_case_without_in_flight_updates_keeps_start_version() -> None:
    """Without partial rollout a group keeps its start weights: all three readings are the start version."""
    trace = simulate(hand_workload(in_flight=False), "constraint_preserving", seed=0)
    for c in trace.consumed:
        assert c.version_end == c.version_start
        assert c.version_weighted == c.version_start
    assert {c.group_id: c.version_start for c in trace.consumed} == {g: v[2] for g, v in CP.items()}


def test_hand_case_colocated() -> None:
    """Colocated: batch 0 at v0 trains 3..5; batch 1 launched at 5 with v2 ends at 8, trains 8..10."""
    trace = simulate(hand_workload(), "train_batch", seed=0, colocated=True)
    assert trace.makespan_s == pytest.approx(10.0)
    for c in trace.consumed:
        assert c.version_start == c.version_end == 2 * c.step
        assert c.v_train - c.version_end == c.mini_batch_index
    assert [m.admitted_at for m in trace.mini_batches] == [3.0, 3.0, 8.0, 8.0]


def test_end_version_ignores_weights_arriving_at_the_finish() -> None:
    """End reading: a group finishing exactly when new weights arrive keeps the old end version (CP a-2)."""
    trace = simulate(hand_workload(), "constraint_preserving", seed=0)
    a2 = next(c for c in trace.consumed if c.group_id == "a-2")
    assert (a2.version_start, a2.version_end, a2.version_weighted) == (0, 0, 0.0)


@pytest.mark.parametrize("policy", sorted(HAND))
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_hand_case_timing_bounds(policy: str, lookahead: int) -> None:
    """At most L mini-batches wait admitted beyond the trainer; at most W·G = 4 groups launched and untaken.
    constraint_preserving admits every mini-batch as the trainer starts it; train_batch and linear_target admit
    mb1 while mb0 trains once L >= 1 (never more: the next step's groups launch only when the step trains)."""
    trace = simulate(hand_workload(lookahead=lookahead), policy, seed=0)
    assert trace.peak_admitted_ahead == (0 if policy == "constraint_preserving" else min(lookahead, 1))
    assert trace.peak_untaken_total == 4
    if lookahead == 0:  # every mini-batch is admitted only when the trainer is ready to start it
        assert all(m.admitted_at == m.train_start for m in trace.mini_batches)


def sync_workload(launch_weights: str) -> Workload:
    """One source a (1 s per group), quota 2: G = 2, K = 2 (one group per mini-batch), 2 slots, W = 1, 1 s of
    training per mini-batch (the hand case's trainer) and weights that take 0.5 s to reach rollout."""
    return hand_workload().with_overrides(
        name="sync",
        sources=(SourceProfile(name="a", quota=2, duration_mean_s=1.0, tokens_mean=100),),
        rollout_slots=2,
        sync_delay_s=0.5,
        launch_weights=launch_weights,
    )


# constraint_preserving, 0.5 s sync. t=0 a-0, a-1 launch at v0 and finish at t=1: mb0 = {a-0} trains 1..2,
#  frees a slot of the window: a-2 launches (v0 is the newest version, already there), runs 1..2; mb1 = {a-1}
#  is admitted ahead (L = 1). t=2 mb0 ends: v1 is published and reaches rollout at 2.5; mb1 trains 2..3 and
#  frees the window: a-3 launches. a-2 ends: (0, 0, 0) -> mb2 (n2, k0) trains 3..4.
#  "arrived": a-3 generates from 2 with v0, switches to v1 at 2.5, ends at 3: (0, 1, 0.5); mb3 (n3, k1).
#  "published": a-3 waits for v1 and generates 2.5..3.5 (v2, published at 3, arrives exactly at 3.5 and
#  makes none of its tokens): (1, 1, 1.0); mb3 (n3, k1) trains 4..5 either way.
SYNC = {
    "arrived": {"a-0": (0, 0, 0, 0, 0.0), "a-1": (1, 1, 0, 0, 0.0), "a-2": (2, 0, 0, 0, 0.0), "a-3": (3, 1, 0, 1, 0.5)},
    "published": {
        "a-0": (0, 0, 0, 0, 0.0),
        "a-1": (1, 1, 0, 0, 0.0),
        "a-2": (2, 0, 0, 0, 0.0),
        "a-3": (3, 1, 1, 1, 1.0),
    },
}


@pytest.mark.parametrize("launch_weights", sorted(SYNC))
def test_launch_weights(launch_weights: str) -> None:
    """``published`` starts a launch with the newest published weights (waiting for them); ``arrived`` does not wait."""
    trace = simulate(sync_workload(launch_weights), "constraint_preserving", seed=0)
    got = _by_group(trace)
    assert set(got) == set(SYNC[launch_weights])
    for gid, (n, k, v0, v1, vw) in SYNC[launch_weights].items():
        assert got[gid][:4] == (n, k, v0, v1), gid
        assert got[gid][4] == pytest.approx(vw), gid
    assert trace.makespan_s == pytest.approx(5.0)


def test_unknown_launch_weights_is_rejected() -> None:
    """launch_weights other than "arrived" / "published" is a clear error naming both."""
    with pytest.raises(ValueError, match="launch_weights must be one of arrived, published"):
        sync_workload("latest")


def live_workload(**changes: object) -> Workload:
    """One source a (1 s per group), quota 2: G = 2, K = 2, 2 slots, W = 1, L = 1, 1 s of training per mini-batch,
    no sync delay; ``changes`` set the live loop's publish delay, load time or groups per call."""
    return hand_workload().with_overrides(
        name="live",
        sources=(SourceProfile(name="a", quota=2, duration_mean_s=1.0, tokens_mean=100),),
        rollout_slots=2,
        **changes,
    )


# Publish delay 0.5 s (the rank saves the weights, then acks with the new version). t=0 a-0, a-1 (v0) end at 1:
#  mb0 = {a-0} computes 1..2, publishes 2..2.5 and frees a window slot when it starts: a-2 (v0) runs 1..2;
#  mb1 = {a-1} is admitted ahead. t=2.5 the ack: v1 is usable at once (shared filesystem), mb1 starts (its
#  ack at 4) and frees the window: a-3 starts with v1, 2.5..3.5: (1, 1, 1.0). mb2 = {a-2} is admitted at the ack
#  (L = 1) and trains 4..5.5; mb3 = {a-3} 5.5..7.
PUBLISH = {"a-0": (0, 0, 0, 0, 0.0), "a-1": (1, 1, 0, 0, 0.0), "a-2": (2, 0, 0, 0, 0.0), "a-3": (3, 1, 1, 1, 1.0)}
# Load time 0.5 s, in-flight updates. a-0..a-2 as without loads (a-2 runs 1..2 on v0, which its slot holds).
#  t=2 v1 (mb0's ack; a-2 ends at that instant and is not stopped); mb1 starts and frees the window: a-3 takes
#  the slot holding v0, loads v1 2..2.5 and generates from 2.5; t=3 v2 arrives (mb1's ack): a-3 stops after
#  0.5 s on v1, loads v2 3..3.5, generates its last 0.5 s on v2 and ends at 4: (1, 2, 1.5). mb3 trains 4..5.
LOAD = {"a-0": (0, 0, 0, 0, 0.0), "a-1": (1, 1, 0, 0, 0.0), "a-2": (2, 0, 0, 0, 0.0), "a-3": (3, 1, 1, 2, 1.5)}
# The same without in-flight updates: a-3 loads v1 2..2.5 and keeps it to its end at 3.5: (1, 1, 1.0).
LOAD_NO_IN_FLIGHT = {**LOAD, "a-3": (3, 1, 1, 1, 1.0)}
# Two groups per call: the window's two groups go to one slot as one call, a-0 0..1 then a-1 1..2, both
#  published at 2 (the other slot idles: no room). mb0 = {a-0} trains 2..3 and frees one slot: a-2 (v0) 2..3;
#  mb1 = {a-1} ahead. t=3 v1, mb1 trains 3..4: a-3 (v1) 3..4 ends as v2 arrives: (1, 1, 1.0). mb2 4..5, mb3 5..6.
CALLS = {"a-0": (0, 0, 0, 0, 0.0), "a-1": (1, 1, 0, 0, 0.0), "a-2": (2, 0, 0, 0, 0.0), "a-3": (3, 1, 1, 1, 1.0)}
LIVE = {
    "publish": (dict(publish_delay_s=0.5), PUBLISH, 7.0),
    "load": (dict(load_s=0.5), LOAD, 5.0),
    "load_no_in_flight": (dict(load_s=0.5, in_flight_updates=False), LOAD_NO_IN_FLIGHT, 5.0),
    "calls": (dict(groups_per_call=2), CALLS, 6.0),
}


@pytest.mark.parametrize("case", sorted(LIVE))
def test_live_loop_timings(case: str) -> None:
    """Publish delay before the ack, blocking weight loads (with and without in-flight updates) and calls of two
    groups give the hand-derived versions and makespan."""
    changes, expected, makespan = LIVE[case]
    trace = simulate(live_workload(**changes), "constraint_preserving", seed=0)
    got = _by_group(trace)
    assert set(got) == set(expected)
    for gid, (n, k, v0, v1, vw) in expected.items():
        assert got[gid][:4] == (n, k, v0, v1), gid
        assert got[gid][4] == pytest.approx(vw), gid
    assert trace.makespan_s == pytest.approx(makespan)


def test_publish_delay_keeps_the_trainer_busy_and_loads_are_counted() -> None:
    """The publish delay is trainer time (busy = 4 x 1.5 s); every timed load is counted with its duration."""
    trace = simulate(live_workload(publish_delay_s=0.5), "constraint_preserving", seed=0)
    assert trace.trainer_busy_s == pytest.approx(4 * 1.5)
    assert trace.weight_loads == 0
    loaded = simulate(live_workload(load_s=0.5), "constraint_preserving", seed=0)
    assert loaded.weight_loads >= 2 and loaded.load_s == pytest.approx(0.5 * loaded.weight_loads)


def test_a_version_arriving_during_a_load_is_loaded_right_after_it() -> None:
    """In-flight updates, 1 s loads, one slot. A 4 s group starts on v0; v1 arrives at 1 (stop, load 1..2); v2
    arrives at 1.5, during that load, so the slot loads v2 right after (2..3) and generates its last 3 s on it,
    ending at 6: versions (0, 2, 1.5), two loads."""
    timeline = VersionTimeline()
    events: list[tuple[float, tuple[int, int]]] = []
    pool = RolloutPool(hand_workload().with_overrides(load_s=1.0), timeline, lambda t, p: events.append((t, p)))
    group = CallGroup(group_id="a-0", source="a", duration=4.0, tokens=(100,))
    pool.launch([group], 0.0)
    pool.on_arrive(timeline.publish(1.0), 1.0)
    pool.on_arrive(timeline.publish(1.5), 1.5)
    done = None
    while done is None:
        events.sort()
        t, payload = events.pop(0)
        done = pool.on_slot(payload, t)
    assert (t, done) == (6.0, [group])
    assert (group.version_start, group.version_end, group.version_weighted) == (0, 2, 1.5)
    assert (pool.loads, pool.load_s_total) == (2, 2.0)
