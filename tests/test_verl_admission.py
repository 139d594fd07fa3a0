"""The verl sampler's framework-free core: exact per-source quotas per train batch, early admission, staleness."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.errors import InvalidJobSpec, InvalidRequest
from knittrans.integrations.verl import QuotaAdmission, _admission_from_kwargs
from knittrans.sched.types import FinishedGroup


def _g(uid: str, source: str, t: float, v: int = 0) -> FinishedGroup:
    return FinishedGroup(group_id=uid, source=source, trajectory_tokens=(1,), version_start=v, finished_at=t)


def test_mini_batch_is_admitted_before_the_oldest_b_groups_would_allow() -> None:
    """With quotas math:2 code:2 in K=2 mini-batches, a mini-batch of 2 math groups is refused only when it
    would break the remainder; a mixed, feasible mini-batch is admitted from what has finished."""
    adm = QuotaAdmission(quotas={"math": 2, "code": 2}, mini_batches_per_step=2)
    finished = [_g("m0", "math", 0), _g("m1", "math", 1), _g("m2", "math", 2)]
    first = adm.select(finished, {"math": 2, "code": 2}, 0, 2)
    assert first == ["m0", "m1"]  # both math: the code quota can still be met by the second mini-batch
    assert adm.select([_g("m2", "math", 2), _g("c0", "code", 3)], {"code": 2}, 0, 2) is None  # needs 2 code
    assert adm.select([_g("m2", "math", 2), _g("c0", "code", 3), _g("c1", "code", 4)], {}, 0, 2) == ["c0", "c1"]
    assert adm.admitted == {"math": 0, "code": 0} and adm.mini_batch_index == 0  # next train batch


def test_stale_groups_are_never_admitted() -> None:
    """A group with version - version_start > max_staleness is reported stale and skipped."""
    adm = QuotaAdmission(quotas={"a": 2}, mini_batches_per_step=1, max_staleness=1)
    groups = [_g("old", "a", 0, v=0), _g("x", "a", 1, v=2), _g("y", "a", 2, v=3)]
    assert adm.stale(groups, 3) == ["old"]
    assert adm.select(groups, {}, 3, 2) == ["x", "y"]


def test_bad_configuration_is_named() -> None:
    """A batch size that does not match the quotas, and impossible quotas, are refused with the field named."""
    adm = QuotaAdmission(quotas={"a": 3, "b": 1}, mini_batches_per_step=2)
    with pytest.raises(InvalidRequest, match="verl asked for 4 groups but mini-batch 0"):
        adm.select([], {}, 0, 4)
    with pytest.raises(InvalidJobSpec, match="quotas"):
        QuotaAdmission(quotas={}, mini_batches_per_step=1)
    with pytest.raises(InvalidJobSpec, match="max_staleness must be >= 0 or null, not -1"):
        QuotaAdmission(quotas={"a": 1}, mini_batches_per_step=1, max_staleness=-1)


def test_sampler_kwargs_and_verl_settings_give_the_admission() -> None:
    """sampler_kwargs' quotas and bounds; K from verl's parameter_sync_step unless given; the staleness bound from
    verl's max_off_policy_threshold (its span, steps - start + 1, is at most the threshold) unless given."""
    kwargs = {"quotas": {"a": 2, "b": 2}, "bounds": {"a": {"hi": 1}}}
    adm = _admission_from_kwargs(kwargs, {"parameter_sync_step": 2}, 3)
    assert (adm.mini_batches_per_step, adm.max_staleness, adm.bounds["a"].hi) == (2, 2, 1)
    adm = _admission_from_kwargs({"quotas": {"a": 2}, "mini_batches_per_step": 1, "max_staleness": 0}, None, 3)
    assert (adm.mini_batches_per_step, adm.max_staleness) == (1, 0)
    assert _admission_from_kwargs({"quotas": {"a": 2}}, None, None).mini_batches_per_step == 1
    with pytest.raises(InvalidJobSpec, match=r"sampler_kwargs\.quotas"):
        _admission_from_kwargs({}, None, None)


@settings(max_examples=60, deadline=None)
@given(
    q=st.dictionaries(st.sampled_from("abcd"), st.integers(1, 5), min_size=1, max_size=4),
    k=st.integers(1, 4),
    order=st.randoms(use_true_random=False),
)
def test_every_train_batch_has_exactly_the_quotas(q: dict[str, int], k: int, order: object) -> None:
    """Whatever order groups finish in, every K consecutive mini-batches hold exactly q[s] groups of s."""
    k = min(k, sum(q.values()))
    adm = QuotaAdmission(quotas=q, mini_batches_per_step=k)
    stream = [(s, i) for s, n in q.items() for i in range(3 * n)]
    order.shuffle(stream)  # type: ignore[attr-defined]
    counter = itertools.count()
    finished: list[FinishedGroup] = []
    per_step: dict[str, int] = {s: 0 for s in q}
    steps = 0
    for s, i in stream:
        finished.append(_g(f"{s}{i}", s, next(counter)))
        while True:
            size = adm.sizes[adm.mini_batch_index]
            uids = adm.select(finished, dict(q), 0, size)
            if uids is None:
                break
            assert len(uids) == size
            for uid in uids:
                per_step[uid[0]] += 1
            finished = [g for g in finished if g.group_id not in set(uids)]
            if adm.mini_batch_index == 0:
                assert per_step == q
                per_step = {s: 0 for s in q}
                steps += 1
    assert steps == 3
