"""Admission timing: trainer position, lookahead L, window W — the pure rule and the control plane's use of it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knittrans.api.jobstate import JobState
from knittrans.api.spec import JobSpec
from knittrans.api.store import Txn
from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.manifest import Manifest
from knittrans.sched.staleness import ConsumedGroup
from knittrans.sched.timing import (
    AdmissionTiming,
    admitted_ahead,
    launch_lead,
    launch_order,
    launchable,
    staleness_bound,
)
from knittrans.schema import SCHEMA_VERSION


@pytest.mark.parametrize(("lookahead", "allowed"), [(0, [4]), (1, [4, 5]), (2, [4, 5, 6])])
def test_lookahead_allows_exactly_l_beyond_the_position(lookahead: int, allowed: list[int]) -> None:
    """With the trainer on 4, mini-batches 4..4+L may be admitted and nothing further; L = 0 means on demand."""
    timing = AdmissionTiming(lookahead=lookahead)
    assert [n for n in range(10) if n >= 4 and timing.may_admit(n, 4)] == allowed
    assert admitted_ahead(4 + lookahead + 1, 4) == lookahead
    assert admitted_ahead(4, 4) == 0


def test_window_room_and_launch_order() -> None:
    """Room is W·G minus untaken groups; the source furthest behind its quota share of launches goes first."""
    quotas = {"fast": 4, "slow": 2}
    assert AdmissionTiming(window=1).room(quotas, {"fast": 3, "slow": 2}) == 1
    assert AdmissionTiming(window=2).room(quotas, {"fast": 3, "slow": 2}) == 7
    assert AdmissionTiming(window=1).room(quotas, {"fast": 6, "slow": 2}) == -2
    assert launch_order(quotas, {"fast": 4, "slow": 1}) == ["slow", "fast"]
    assert launch_order(quotas, {"fast": 2, "slow": 1}) == ["fast", "slow"]  # tie: quota order
    assert launchable(quotas, {"fast": 2, "slow": 1}) == ["fast", "slow"]  # tied: both may launch
    assert launchable(quotas, {"fast": 3, "slow": 1}) == ["slow"]
    assert launchable({"fast": 0}, {}) == []  # no source with a quota


def test_timing_rule_validates() -> None:
    """A negative lookahead or a window below one is refused with the field named."""
    with pytest.raises(ValueError, match="lookahead"):
        AdmissionTiming(lookahead=-1)
    with pytest.raises(ValueError, match="window"):
        AdmissionTiming(window=0)
    assert staleness_bound(mini_batches_per_step=16, window=1, train_batch_groups=64, quota=13, sync_lag=1) == 81
    with pytest.raises(ValueError, match="quota must be >= 1, got 0"):
        staleness_bound(mini_batches_per_step=16, window=1, train_batch_groups=64, quota=0)
    with pytest.raises(ValueError, match="sync_lag must be >= 0, got -1"):
        staleness_bound(mini_batches_per_step=16, window=1, train_batch_groups=64, quota=13, sync_lag=-1)


# ---------------------------------------------------------------- property test on the control plane's state
_SOURCES = ("a", "b")


class _Driver:
    """Plays rollout and trainer against a real :class:`JobState`: launches only within the room."""

    def __init__(self, *, quotas: dict[str, int], k: int, lookahead: int, window: int, world: int) -> None:
        self.spec = JobSpec(
            name="j",
            group_size=1,
            quotas=quotas,
            mini_batches_per_step=k,
            policy="constraint_preserving",
            world_size=world,
            micro_batch_size=1,
            lookahead=lookahead,
            window=window,
        )
        self.alive: dict[str, bool] = {"n0": True, "n1": True}
        self.job = JobState(
            self.spec,
            endpoint=lambda n: "grpc://127.0.0.1:1",
            node_state=lambda n: "alive" if self.alive.get(n, False) else "lost",
        )
        self.running: list[tuple[str, str]] = []  # (group id, source) launched, not finished
        self.seq = 0
        self.time = 0.0
        self.losses = 0
        self.consumed: list[ConsumedGroup] = []
        self.G = sum(quotas.values())
        self.b = self.G // k

    def check(self) -> None:
        job = self.job
        assert admitted_ahead(job.next_n, job.position) <= self.spec.lookahead
        assert job.peak_admitted_ahead <= self.spec.lookahead
        slack = 0 if not self.losses else (self.spec.lookahead + 1) * self.b  # withdrawn mini-batches return
        assert sum(job.untaken().values()) <= self.spec.window * self.G + slack

    def launch(self, count: int) -> None:
        view = self.job.headroom()
        count = min(count, view["room"])
        for _ in range(max(0, count)):
            source = launch_order(self.spec.quotas, {s: self.job.started.get(s, 0) for s in _SOURCES})[0]
            gid = f"g{self.seq}"
            self.seq += 1
            claims = [r["group_id"] for r in self.job.to_regenerate.values() if r["source"] == source][:1]
            self.job.add_supply(
                Txn(), started={}, group_ids={source: [gid]}, dropped={}, request_id=None, regenerates=claims
            )
            self.running.append((gid, source))
            self.job.admit_all(Txn())
            self.check()

    def finish(self, index: int, node: str) -> None:
        if not self.running:
            return
        if not self.alive[node]:
            node = next(n for n, up in self.alive.items() if up)
        gid, source = self.running.pop(index % len(self.running))
        self.time += 1.0
        record = GroupRecord(
            group_id=gid,
            source=source,
            row_start=0,
            num_trajectories=1,
            trajectory_tokens=(8,),
            version_start=0,
            version_end=0,
            version_weighted=0.0,
            finished_at=self.time,
        )
        unit = UnitDescriptor(
            unit_id=f"u-{gid}",
            job="j",
            node_id=node,
            endpoint="grpc://127.0.0.1:1",
            num_rows=1,
            num_bytes=1,
            schema_version=SCHEMA_VERSION,
            groups=(record,),
        )
        self.job.add_units([unit], Txn())
        self.job.admit_all(Txn())
        self.check()

    def ack(self, rank: int) -> None:
        rank %= self.spec.world_size
        found = self.job.published().manifests.get(self.job.rank_cursor(rank))
        if found is None:
            return
        m = Manifest.decode(found[1])  # the bytes every rank is answered
        assert m.share(rank).rank == rank
        self.job.fetched(m.global_index, m.attempt, [rank], Txn())
        txn = Txn()
        self.job.ack(m.global_index, m.attempt, [rank], None, txn)
        self.consumed += [
            ConsumedGroup(**r) for (kind, _, _), rows in txn.puts.items() if kind == "consumed" for r in rows
        ]  # the records the service would persist
        self.job.admit_all(Txn())
        self.check()

    def lose(self, node: str) -> None:
        if not self.alive[node] or not any(self.alive[n] for n in self.alive if n != node):
            return
        self.alive[node] = False
        self.losses += 1
        self.job.node_lost(node, Txn())
        self.job.admit_all(Txn())
        self.check()


_launch = st.tuples(st.just("launch"), st.integers(1, 12))
_finish = st.tuples(st.just("finish"), st.integers(0, 50), st.sampled_from(["n0", "n1"]))
_ack = st.tuples(st.just("ack"), st.integers(0, 3))
_lose = st.tuples(st.just("lose"), st.sampled_from(["n0", "n1"]))
_op = st.one_of(_launch, _finish, _finish, _finish, _ack, _ack, _lose)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    qa=st.integers(1, 4),
    qb=st.integers(1, 4),
    k=st.sampled_from([1, 2]),
    lookahead=st.integers(0, 3),
    window=st.integers(1, 2),
    world=st.integers(1, 2),
    ops=st.lists(_op, min_size=10, max_size=150),
)
def test_any_interleaving_keeps_lookahead_window_and_quotas(
    qa: int, qb: int, k: int, lookahead: int, window: int, world: int, ops: list[tuple[object, ...]]
) -> None:
    """Property: any interleaving of launches, registrations, acks and node losses keeps admitted-ahead <= L,
    untaken <= W·G (plus the mini-batches a node loss hands back), and every consumed step exactly at quota."""
    quotas = {"a": qa * k, "b": qb * k}
    d = _Driver(quotas=quotas, k=k, lookahead=lookahead, window=window, world=world)
    for op in ops:
        name = op[0]
        if name == "launch":
            d.launch(int(op[1]))  # type: ignore[call-overload]
        elif name == "finish":
            for i in range(3):
                d.finish(int(op[1]) + i, str(op[2]))  # type: ignore[call-overload]
        elif name == "ack":
            d.ack(int(op[1]))  # type: ignore[call-overload]
        else:
            d.lose(str(op[1]))
    per_step: dict[int, Counter[str]] = {}
    assert len(d.consumed) == sum(c for (_, status), c in d.job.group_counts.items() if status == "consumed")
    for c in d.consumed:
        per_step.setdefault(c.step, Counter())[c.source] += 1
    seen = [c.group_id for c in d.consumed]
    assert len(seen) == len(set(seen))  # exactly once
    for step, counts in per_step.items():
        if sum(counts.values()) == d.G:
            assert dict(counts) == quotas, f"step {step}"


def test_trainer_progress_not_admission_frees_the_window() -> None:
    """With L = 0 and W = 1: a full window stays full after admission and opens by one mini-batch per ack."""
    d = _Driver(quotas={"a": 2, "b": 2}, k=2, lookahead=0, window=1, world=1)
    d.launch(10)
    assert d.job.headroom()["room"] == 0 and len(d.running) == 4
    for i in range(4):
        d.finish(0, "n0" if i % 2 else "n1")
    assert d.job.next_n == 1  # only the trainer's current mini-batch is admitted (L = 0)
    assert d.job.headroom()["room"] == 2  # mini-batch 0 is the one the trainer is on: its groups are taken
    d.ack(0)
    assert d.job.next_n == 2 and d.job.position == 1
    assert d.job.headroom()["room"] == 4


def test_launch_headroom_gives_a_deficit_room_only_while_the_trainer_is_idle() -> None:
    """Room goes to the allowed sources; a source in deficit gets its deficit with a full window only when the
    trainer has nothing admitted left to start."""
    from knittrans.sched.timing import launch_headroom

    quotas = {"math": 2, "code": 2}
    assert launch_headroom(quotas, 3, ["math"], deficit={}, trainer_idle=False) == {"math": 3, "code": 0}
    assert launch_headroom(quotas, -1, ["math"], deficit={"code": 2}, trainer_idle=False) == {"math": 0, "code": 0}
    assert launch_headroom(quotas, -1, ["math"], deficit={"code": 2}, trainer_idle=True) == {"math": 0, "code": 2}
    assert launch_headroom(quotas, 3, ["code"], deficit={"code": 1}, trainer_idle=True) == {"math": 0, "code": 3}


def test_launch_lead_shifts_launches_from_fast_to_slow_sources() -> None:
    """λ·q[s]/G·(D[s] - D̄): a (10 s) runs 0.5 launches behind, b (30 s) 0.5 ahead at 0.1 groups/s; the leads sum
    to 0, a source without an estimate gets none, and the lead moves a slow source up the launch order."""
    quotas = {"a": 2, "b": 2}
    lead = launch_lead(quotas, {"a": 10.0, "b": 30.0}, 0.1)
    assert lead == pytest.approx({"a": -0.5, "b": 0.5})
    assert launch_lead({"a": 2, "b": 2, "c": 4}, {"a": 10.0}, 0.1) == {"a": 0.0, "b": 0.0, "c": 0.0}
    # no estimate yet (the first launches), or only for sources without a quota: no lead for anyone
    assert launch_lead(quotas, {}, 0.0) == {"a": 0.0, "b": 0.0}
    assert launch_lead({"a": 2, "b": 0}, {"b": 10.0, "x": 5.0}, 0.1) == {"a": 0.0, "b": 0.0}
    launched = {"a": 3, "b": 3}
    assert launch_order(quotas, launched) == ["a", "b"]
    assert launch_order(quotas, {s: n - lead[s] for s, n in launched.items()}) == ["b", "a"]
    with pytest.raises(ValueError, match=">= 0"):
        launch_lead(quotas, {"a": -1.0}, 0.1)
