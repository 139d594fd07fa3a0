"""Simulator properties: determinism, colocated reference, exact quotas, throughput, workloads, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knittrans.cli import main
from knittrans.errors import InvalidRequest
from knittrans.sched.admission import POLICIES
from knittrans.sched.staleness import READINGS, architectural_staleness, version_of
from knittrans.sim import engine
from knittrans.sim.engine import SimulationStalled, simulate
from knittrans.sim.metrics import compute_metrics, staleness_split
from knittrans.sim.workload import SourceProfile, Workload, bundled_workloads, load_workload


def small(name: str, **changes: object) -> Workload:
    """A bundled workload shrunk to run in a fraction of a second."""
    w = load_workload(name)
    base: dict[str, object] = {"steps": 8, "group_size": 4}
    base.update(changes)
    return w.with_overrides(**base)


def test_bundled_workloads_load() -> None:
    """The three bundled workloads ship as package data and validate."""
    assert set(bundled_workloads()) >= {"balanced", "code_agent_skew", "multimodal"}
    for name in bundled_workloads():
        w = load_workload(name)
        assert w.train_batch_groups % w.mini_batches_per_step == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_run(policy: str) -> None:
    """A seed fixes the run: two runs give identical consumed groups and times; another seed differs."""
    w = small("code_agent_skew")
    a, b, c = (simulate(w, policy, seed=s) for s in (3, 3, 4))
    assert a.consumed == b.consumed
    assert [m.admitted_at for m in a.mini_batches] == [m.admitted_at for m in b.mini_batches]
    assert a.makespan_s == b.makespan_s
    assert a.makespan_s != c.makespan_s


@pytest.mark.parametrize("name", ["balanced", "code_agent_skew", "multimodal"])
def test_colocated_has_zero_architectural_staleness(name: str) -> None:
    """Colocated reference: staleness of mini-batch k is exactly k under every reading, so architectural is 0."""
    m = compute_metrics(simulate(small(name, sync_delay_s=5.0), "constraint_preserving", seed=1, colocated=True))
    for stats in m.readings.values():
        assert stats.architectural.max == 0.0 and stats.architectural.mean == 0.0
        assert stats.architectural.p50 == 0.0
    assert m.quota_violations == 0


@pytest.mark.parametrize(("name", "per_call"), [("balanced", 3), ("skewed3", 2), ("multimodal", 3)])
def test_colocated_calls_of_several_groups_launch_each_source_its_quota(name: str, per_call: int) -> None:
    """Colocated with calls of several groups: a call takes at most what its source still lacks of the batch, so
    every batch is generated exactly at the quotas (a call of 3 from q = 32 used to take a 33rd group of one
    source, leave another at 31 and stall the run in step 0) and trains with zero architectural staleness."""
    w = small(name, groups_per_call=per_call)
    trace = simulate(w, "constraint_preserving", seed=0, colocated=True)
    assert trace.step_counts == [w.quotas] * w.steps and trace.dropped == 0
    for stats in compute_metrics(trace).readings.values():
        assert stats.architectural.max == 0.0 and stats.architectural.mean == 0.0


@pytest.mark.parametrize("name", ["balanced", "code_agent_skew", "multimodal"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("window", [1, 2])
def test_quotas_exact_every_policy(name: str, policy: str, window: int) -> None:
    """Every train batch has exactly the quota composition and every mini-batch b groups, for every policy."""
    w = small(name, window=window, mini_batches_per_step=16)
    trace = simulate(w, policy, seed=0)
    assert len(trace.step_counts) == w.steps
    assert all(counts == w.quotas for counts in trace.step_counts)
    assert all(sum(m.counts.values()) == w.mini_batch_groups for m in trace.mini_batches)
    assert compute_metrics(trace).quota_violations == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    eta=st.one_of(st.none(), st.integers(0, 8)),
    quotas=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    k=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 3),
    slots=st.integers(1, 24),
    cvs=st.lists(st.floats(0.0, 1.5), min_size=4, max_size=4),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 1000),
    lookahead=st.integers(0, 5),
    handover=st.sampled_from(["step", "mini_batch"]),
)
def test_quotas_exact_random_workloads(
    eta: int | None,
    quotas: list[int],
    k: int,
    window: int,
    slots: int,
    cvs: list[float],
    policy: str,
    seed: int,
    lookahead: int,
    handover: str,
) -> None:
    """Property: on random skewed workloads every policy keeps each train batch exactly at the quotas, never
    admits more than L mini-batches beyond the trainer, never has more than W·G groups launched and untaken
    (under either train_batch handover, with or without a staleness bound η), and never trains a group more than η
    versions after it started: the bound is read against the version its mini-batch trains at, as the control
    plane reads it, not the trainer's version at admission (up to L older)."""
    q = [x * k for x in quotas]  # K must divide G; scaling every quota keeps the mix random
    sources = tuple(
        SourceProfile(
            name=f"s{i}",
            quota=qi,
            duration_mean_s=10.0 * (i + 1),
            duration_cv=cvs[i],
            tail_prob=0.1,
            tail_scale=2.0,
            tail_alpha=1.5,
            tokens_mean=200,
            tokens_cv=0.5,
        )
        for i, qi in enumerate(q)
    )
    w = Workload(
        name="random",
        sources=sources,
        group_size=2,
        mini_batches_per_step=k,
        window=window,
        rollout_slots=slots,
        world_size=2,
        micro_batch_tokens=512,
        steps=4,
        in_flight_updates=True,
        lookahead=lookahead,
        train_batch_handover=handover,
        max_staleness=eta,
    )
    trace = simulate(w, policy, seed=seed)
    assert all(counts == w.quotas for counts in trace.step_counts)
    assert compute_metrics(trace).quota_violations == 0
    assert trace.peak_admitted_ahead <= lookahead
    assert trace.peak_untaken_total <= window * w.train_batch_groups
    if eta is not None:
        assert all(c.v_train - c.version_start <= eta for c in trace.consumed)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("lookahead", [1, 2])
def test_staleness_bound_is_read_at_the_training_version(policy: str, lookahead: int) -> None:
    """A mini-batch admitted ahead of the trainer trains at its own version, so the bound η holds there; the
    simulator used to read it against the trainer's version and trained groups up to η + L versions old."""
    w = small("skewed3", max_staleness=1, lookahead=lookahead)
    trace = simulate(w, policy, seed=1)
    assert trace.consumed and max(c.v_train - c.version_start for c in trace.consumed) <= 1


@pytest.mark.parametrize("policy", POLICIES)
def test_staleness_bound_drops_expired_groups_at_once(policy: str) -> None:
    """With ``max_staleness`` a group that finishes already past the bound is dropped at the next admission attempt
    (as the control plane expires it), so it leaves the window: quotas stay exact and at most W·G groups are
    launched and untaken. (Expired groups used to stay in the window until the trainer's next version, and the
    deadlock guard launched their stand-ins past W·G.)"""
    w = small("code_agent_skew", max_staleness=1)
    trace = simulate(w, policy, seed=1)
    assert trace.dropped > 0
    assert all(counts == w.quotas for counts in trace.step_counts)
    assert trace.peak_untaken_total <= w.window * w.train_batch_groups


@pytest.mark.parametrize("name", ["balanced", "code_agent_skew", "multimodal"])
@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("k", [4, 16])
def test_constraint_preserving_throughput_not_below_train_batch(name: str, window: int, k: int) -> None:
    """At equal windows (and equal rollouts: common random numbers) CP trains at least as many steps per hour."""
    w = small(name, window=window, mini_batches_per_step=k, steps=12)
    for seed in (0, 1):
        cp = compute_metrics(simulate(w, "constraint_preserving", seed=seed))
        tb = compute_metrics(simulate(w, "train_batch", seed=seed))
        assert cp.steps_per_hour >= tb.steps_per_hour


def test_in_flight_updates_separate_the_readings() -> None:
    """With partial rollout, start <= weighted <= end for every group and end is fresher on average."""
    trace = simulate(small("code_agent_skew"), "constraint_preserving", seed=0)
    assert all(c.version_start <= c.version_weighted <= c.version_end for c in trace.consumed)
    m = compute_metrics(trace)
    assert m.readings["end"].staleness.mean < m.readings["start"].staleness.mean


def test_metrics_shape_and_idle_fractions() -> None:
    """Per-step metrics cover every step with K admission times; idle fractions lie in [0, 1]."""
    w = small("multimodal")
    m = compute_metrics(simulate(w, "linear_target", seed=0))
    assert len(m.per_step) == w.steps
    assert all(len(s.admitted_at) == w.mini_batches_per_step for s in m.per_step)
    assert all(s.admitted_at == sorted(s.admitted_at) for s in m.per_step)
    per_step = w.train_batch_groups * w.group_size  # each step's readings count its own trajectories
    assert all(s.readings[r].staleness.count == per_step for s in m.per_step for r in READINGS)
    assert 0.0 <= m.trainer_idle <= 1.0 and 0.0 <= m.rollout_idle <= 1.0
    assert m.steps_per_hour == pytest.approx(w.steps / (m.makespan_s / 3600))
    json.dumps(m.to_json())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"window": 0}, "window"),
        ({"mini_batches_per_step": 7}, "mini_batches_per_step"),
        ({"rollout_slots": 0}, "rollout_slots"),
        ({"name": ""}, "workload name must not be empty"),
        ({"sources": ()}, "at least one source"),
        ({"load_s": -1.0}, "times must be >= 0"),
        ({"trainer_overhead_s": 0.0, "trainer_s_per_token": 0.0}, "training must take some time"),
        ({"lookahead": -1}, "lookahead"),
        ({"lookahead": True}, "lookahead"),
        ({"launch_lead": 3.0}, "launch_lead"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_bad_workload_is_rejected(change: dict[str, object], field: str) -> None:
    """A workload that cannot run raises ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        load_workload("balanced").with_overrides(**change)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": ""}, "source name must not be empty"),
        ({"duration_mean_s": 0.0}, "duration_mean_s"),
        ({"duration_cv": -1.0}, "duration_cv"),
        ({"tail_prob": 2.0}, "tail_prob"),
        ({"tail_scale": 0.5}, "tail_scale"),
        ({"tail_alpha": 1.0}, "tail_alpha"),
        ({"tokens_mean": 0.0}, "tokens_mean"),
    ],
)
def test_bad_source_is_rejected(change: dict[str, object], field: str) -> None:
    """A source profile that cannot be drawn from raises ValueError naming the field; duplicate names too."""
    base = {"name": "a", "quota": 1, "duration_mean_s": 1.0}
    with pytest.raises(ValueError, match=field):
        SourceProfile(**{**base, **change})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate source names"):
        Workload(name="w", sources=(SourceProfile(**base), SourceProfile(**base)), mini_batches_per_step=1)  # type: ignore[arg-type]


def test_bad_yaml_names_the_problem(tmp_path: Path) -> None:
    """Unknown fields and bad source values in a YAML workload raise InvalidRequest with the location; a workload
    without a name is named after its file."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsources:\n  - {name: a, quota: 2, duration_mean_s: 1, colour: red}\n")
    with pytest.raises(InvalidRequest, match=r"bad.yaml: sources\[0\] has unknown fields \['colour'\]"):
        load_workload(str(bad))
    bad.write_text("sources:\n  - {name: a, quota: 8, duration_mean_s: 1}\n")
    assert load_workload(str(bad)).name == str(bad)  # no name: the file's path names it
    bad.write_text("name: x\nsources:\n  - {name: a, quota: 0, duration_mean_s: 1}\n")
    with pytest.raises(InvalidRequest, match="quota"):
        load_workload(str(bad))
    with pytest.raises(InvalidRequest, match="unknown workload"):
        load_workload("no_such_workload")
    for text, message in (
        ("- a\n", "a workload must be a mapping, got list"),
        ("name: x\ncolour: red\nsources: []\n", r"unknown workload fields \['colour'\]"),
        ("name: x\nsources: []\n", "'sources' must be a non-empty list"),
        ("name: x\nsources: [a]\n", r"sources\[0\] must be a mapping"),
        ("name: x\nwindow: 0\nsources:\n  - {name: a, quota: 2, duration_mean_s: 1}\n", "window must be >= 1"),
        ("name: [x\n", "not valid YAML"),
    ):
        bad.write_text(text)
        with pytest.raises(InvalidRequest, match=message):
            load_workload(str(bad))
    with pytest.raises(InvalidRequest, match="does not exist"):
        load_workload(str(tmp_path / "missing.yaml"))


@pytest.mark.slow  # ~25 s: the simulator CLI over every policy
def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`knittrans sim` runs a sweep, prints the table, writes JSON and the four PNG plots per configuration."""
    wl = tmp_path / "tiny.yaml"
    data = dataclasses.asdict(small("code_agent_skew", steps=4))
    import yaml

    wl.write_text(yaml.safe_dump(data))
    out = tmp_path / "res.json"
    plots = tmp_path / "plots"
    rc = main(
        [
            "sim",
            "--workload",
            str(wl),
            "--policy",
            "all",
            "--seeds",
            "2",
            "--mini-batches",
            "4,8",
            "--window",
            "1",
            "--colocated",
            "--json",
            str(out),
            "--plots",
            str(plots),
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "constraint_preserving" in captured.out and "colocated" in captured.out
    assert "%" in captured.err  # the progress bar
    payload = json.loads(out.read_text())
    assert len(payload["configs"]) == 2
    assert len(payload["runs"]) == 2 * (len(POLICIES) + 2) * 2  # + colocated and the paced baseline
    assert all(r["quota_violations"] == 0 for r in payload["runs"])
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert len(pngs) == 8 and all(p.startswith("code_agent_skew_K") for p in pngs)


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown policy or workload exits 2 with a message naming it."""
    assert main(["sim", "--policy", "fastest", "--no-progress"]) == 2
    assert "fastest" in capsys.readouterr().err
    assert main(["sim", "--workload", "nope", "--no-progress"]) == 2
    assert "nope" in capsys.readouterr().err
    for flag in ("--seeds", "--steps"):
        assert main(["sim", flag, "0", "--no-progress"]) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
    for flag, value, message in (
        ("--mini-batches", "4,x", "expected comma-separated integers"),
        ("--window", "0", "expected positive integers"),
        ("--lookahead", "1,-1", "expected integers >= 0 or K"),
        ("--lookahead", "J", "expected integers >= 0 or K"),
    ):
        with pytest.raises(SystemExit):
            main(["sim", flag, value, "--no-progress"])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        simulate(small("balanced"), "train_batch", steps=0)


def test_cli_lookahead_sweep_without_the_train_batch_policy(tmp_path: Path) -> None:
    """`--lookahead 0,K` runs L = 0 and L = K; with one policy there is no `train_batch` row, so the reductions
    against it are NaN while those against the paced baseline (always run) are numbers."""
    out = tmp_path / "res.json"
    argv = ["sim", "--workload", "skewed3", "--policy", "constraint_preserving", "--seeds", "1", "--steps", "2"]
    assert main([*argv, "--lookahead", "0,K", "--json", str(out), "--no-progress"]) == 0
    configs = json.loads(out.read_text())["configs"]
    assert [c["lookahead"] for c in configs] == [0, load_workload("skewed3").mini_batches_per_step]
    row = configs[0]["policies"]["constraint_preserving"]
    assert math.isnan(row["start_arch_reduction"]) and not math.isnan(row["start_arch_reduction_vs_paced"])
    assert "steps_per_hour_vs_train_batch" not in row and "steps_per_hour_vs_paced" in row


@pytest.mark.parametrize("name", ["skewed3", "balanced", "code_agent_skew"])
def test_train_batch_handed_whole_batches_is_exactly_one_batch_off_policy(name: str) -> None:
    """The conventional baseline (handover "step") launches a whole train batch when the trainer starts a step
    with the newest weights: every later group's start-reading architectural staleness is exactly W·K. The paced
    baseline (handover "mini_batch") launches as mini-batches start, so it is fresher on average."""
    w = load_workload(name).with_overrides(steps=8)
    k = w.mini_batches_per_step
    handed = simulate(w, "train_batch", seed=0)
    values = {
        architectural_staleness(c.v_train, c.version_start, c.mini_batch_index) for c in handed.consumed if c.step >= 1
    }
    assert values == {float(w.window * k)}
    paced = compute_metrics(simulate(w.with_overrides(train_batch_handover="mini_batch"), "train_batch", seed=0))
    assert paced.readings["start"].architectural.mean < w.window * k - 1


def test_cli_paced_baseline_and_handover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every run has the train_batch_paced row and reductions against both baselines; `--tb-handover mini_batch`
    makes train_batch itself the paced baseline (both rows then agree); a bad handover exits 2."""
    out = tmp_path / "res.json"
    rc = main(
        [
            "sim",
            "--workload",
            "skewed3",
            "--seeds",
            "1",
            "--steps",
            "3",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "train_batch_paced" in table and "vs paced s / e+ / w" in table
    rows = json.loads(out.read_text())["configs"][0]["policies"]
    assert set(rows) == {*POLICIES, "train_batch_paced"}
    assert rows["train_batch"]["start_arch_mean"] == 16.0
    assert rows["train_batch_paced"]["start_arch_reduction_vs_paced"] == 0.0
    assert (
        rows["constraint_preserving"]["start_arch_reduction_vs_paced"]
        < rows["constraint_preserving"]["start_arch_reduction"]
    )
    rc = main(
        [
            "sim",
            "--workload",
            "skewed3",
            "--seeds",
            "1",
            "--steps",
            "3",
            "--tb-handover",
            "mini_batch",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["configs"][0]["policies"]
    assert rows["train_batch"]["start_arch_mean"] == rows["train_batch_paced"]["start_arch_mean"]
    with pytest.raises(SystemExit):
        main(["sim", "--tb-handover", "batch", "--no-progress"])


def test_launch_lead_prototype_keeps_quotas_and_freshens_the_token_weighted_reading() -> None:
    """skewed3 with duration-aware launches (``launch_lead: 1``): every train batch exactly at quota, and a lower
    mean token-weighted architectural staleness than quota-share launches on the same draws (more steps/h too)."""
    w = load_workload("skewed3").with_overrides(steps=12)
    plain = compute_metrics(simulate(w, "constraint_preserving", seed=0))
    led = compute_metrics(simulate(w.with_overrides(launch_lead=1.0), "constraint_preserving", seed=0))
    assert led.quota_violations == 0
    assert led.readings["weighted"].architectural.mean < 0.9 * plain.readings["weighted"].architectural.mean
    assert led.steps_per_hour > plain.steps_per_hour


@pytest.mark.parametrize("policy", ["constraint_preserving", "version_aware"])
def test_staleness_split_adds_up_to_the_reported_metric(policy: str) -> None:
    """Generation + wait is each group's architectural staleness and, trajectory-weighted, the reported mean under
    every reading; generation >= 0 and wait >= -k (a group is admitted only after it finished)."""
    w = small("skewed3", mini_batches_per_step=8, steps=10)
    trace = simulate(w, policy, seed=2)
    m = compute_metrics(trace)
    consumed = {c.group_id: c for c in trace.consumed if c.step >= m.warmup_steps}
    for reading in READINGS:
        split = staleness_split(trace, reading)
        assert {g.group_id for g in split} == set(consumed)
        for g in split:
            c = consumed[g.group_id]
            arch = architectural_staleness(c.v_train, version_of(c, reading), c.mini_batch_index)
            assert g.generation + g.wait == pytest.approx(arch, abs=1e-9)
            assert g.generation >= 0 and g.wait >= -g.mini_batch_index
        n = sum(g.num_trajectories for g in split)
        mean = sum((g.generation + g.wait) * g.num_trajectories for g in split) / n
        assert mean == pytest.approx(m.readings[reading].architectural.mean, abs=1e-9)
    assert any(g.wait < 0 for g in split) and any(g.wait > 0 for g in split)


def test_policies_plan_with_the_groups_still_in_flight_as_pending() -> None:
    """The pending supply ``P[s]`` the policies plan with is the groups launched and not yet finished (a call's
    groups leave it when they finish; checked at the end of every step); ``select_calls`` counts every policy
    call, the ones that wait for groups included, ``events`` at least a group's finish and a mini-batch's end
    of training for each, and the metrics report both."""
    checked: list[int] = []

    def check(step: int) -> None:
        consumed = Counter(c.source for c in sim.trace.consumed)
        finished = Counter(g.source for g in sim.finished)
        in_flight = {s: sim.launched[s] - consumed[s] - finished[s] for s in sim.names}
        assert sim.pending == in_flight and sum(in_flight.values()) > 0
        checked.append(step)

    w = small("code_agent_skew", max_staleness=None)
    sim = engine._Simulation(w, "constraint_preserving", seed=0, steps=w.steps, colocated=False, on_step=check)
    trace = sim.run()
    assert checked == list(range(1, w.steps + 1)) and trace.dropped == 0
    assert trace.select_calls > len(trace.mini_batches) == w.steps * w.mini_batches_per_step
    assert trace.events >= len(trace.consumed) + len(trace.mini_batches)
    m = compute_metrics(trace)
    assert (m.select_calls, m.events) == (trace.select_calls, trace.events)


@pytest.mark.parametrize("name", ["balanced", "code_agent_skew"])
def test_a_step_handover_frees_the_steps_groups_only(name: str) -> None:
    """``train_batch`` handed whole train batches with a window of two: when a step's first mini-batch starts,
    ``q[s]`` groups of each source leave the window (the step's own), not the next step's finished groups; at
    the end of every step none is left released ahead of its mini-batch, and the window counts exactly the
    groups launched and not in a started mini-batch."""
    checked: list[int] = []

    def check(step: int) -> None:
        started = Counter(
            c.source for c in sim.trace.consumed if not math.isnan(sim.trace.mini_batches[c.v_train].train_start)
        )
        assert not sim.released
        assert sim.untaken == {s: sim.launched[s] - started[s] for s in sim.names}
        checked.append(step)

    w = small(name, window=2, train_batch_handover="step", max_staleness=None)
    sim = engine._Simulation(w, "train_batch", seed=0, steps=w.steps, colocated=False, on_step=check)
    assert sim.run().dropped == 0 and checked == list(range(1, w.steps + 1))


@pytest.mark.parametrize("policy", ["constraint_preserving", "train_batch"])
def test_no_group_makes_tokens_with_weights_before_they_reach_rollout(policy: str) -> None:
    """With a sync delay, timed loads and in-flight updates, version ``v`` (published when mini-batch ``v - 1``
    ends training) reaches rollout ``sync_delay_s`` later: no consumed group finished before the arrival of the
    newest version it made tokens with."""
    w = small("balanced", sync_delay_s=2.0, load_s=0.5, in_flight_updates=True)
    trace = simulate(w, policy, seed=0)
    arrival = [0.0] + [m.train_end + w.sync_delay_s for m in trace.mini_batches]
    assert any(c.version_end > 0 for c in trace.consumed)
    assert all(arrival[c.version_end] <= trace.finished_at[c.group_id] for c in trace.consumed)


def test_a_run_that_can_never_finish_raises_simulation_stalled() -> None:
    """Colocated, a whole batch is generated at once and nothing more until its step is trained: with a staleness
    bound of 0 the step's groups expire after its first mini-batch and the run stalls, saying where and why."""
    with pytest.raises(
        SimulationStalled,
        match=r"balanced/constraint_preserving: stalled at t=.* in step 0, "
        r"mini-batch 1: .* finished 0, .*\(the policy waits for groups that can never come\)",
    ):
        simulate(small("balanced", max_staleness=0), "constraint_preserving", colocated=True)


def test_cli_reports_a_run_that_can_never_finish(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``knittrans sim`` on a configuration that stalls (colocated, staleness bound 0) exits 1 with the stall's
    message on stderr, not a traceback."""
    import yaml

    wl = tmp_path / "tight.yaml"
    wl.write_text(yaml.safe_dump(dataclasses.asdict(small("balanced", max_staleness=0))))
    argv = ["sim", "--workload", str(wl), "--policy", "constraint_preserving", "--seeds", "1", "--colocated"]
    assert main([*argv, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"knittrans sim: balanced/\w+: stalled at t=.*groups that can never come\)\n", err), err


def test_simulate_refuses_fewer_than_one_step() -> None:
    """``steps`` (or the workload's) below 1 is a ValueError naming it, not an empty run."""
    for steps in (0, -1):
        with pytest.raises(ValueError, match=f"steps must be >= 1, got {steps}"):
            simulate(small("balanced"), "constraint_preserving", steps=steps)


def test_metrics_json_leaves_out_per_step_on_request_and_writes_nan_as_null() -> None:
    """``RunMetrics.to_json``: the per-step detail is optional, everything else is the same, and NaN anywhere
    (a field, a per-step entry in the list) becomes None, so the JSON is strict."""
    w = small("balanced", steps=3)
    m = compute_metrics(simulate(w, "constraint_preserving", seed=0))
    full = m.to_json()
    assert [s["step"] for s in full["per_step"]] == [0, 1, 2]
    assert full["makespan_s"] == m.makespan_s > 0 and full["per_step"][2]["train_end"] == m.makespan_s
    assert m.to_json(per_step=False) == {k: v for k, v in full.items() if k != "per_step"}
    json.dumps(full, allow_nan=False)
    step0 = dataclasses.replace(m.per_step[0], train_end=math.nan)
    odd = dataclasses.replace(m, makespan_s=math.nan, per_step=[step0, *m.per_step[1:]]).to_json()
    assert odd["makespan_s"] is None and odd["per_step"][0]["train_end"] is None
    assert odd["per_step"][0]["counts"] == full["per_step"][0]["counts"] == w.quotas
    json.dumps(odd, allow_nan=False)
