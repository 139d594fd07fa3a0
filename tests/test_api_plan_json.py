"""The plan rendered straight to JSON (knittrans.api.planjson) is byte for byte the dataclass renderer's JSON."""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.api import planjson
from knittrans.api.planjson import render_rank_plan_json
from knittrans.api.plans import Signer, render_rank_plan
from knittrans.descriptors import GroupRecord
from knittrans.grants import sign_grant


def _hash(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _groups(rng: random.Random, count: int, nodes: int) -> dict[str, tuple[GroupRecord, str, str]]:
    """``count`` groups of 4 rows in units of two groups each, spread over ``nodes`` nodes, some with media."""
    out = {}
    for i in range(count):
        media = tuple(_hash(rng.randrange(6)) for _ in range(rng.randrange(3)))
        record = GroupRecord(
            group_id=f"g{i}",
            source="math" if i % 2 else "code",
            row_start=4 * (i % 2),
            num_trajectories=4,
            trajectory_tokens=tuple(rng.randrange(1, 4000) for _ in range(4)),
            version_start=0,
            version_end=1,
            version_weighted=0.5,
            finished_at=1767225600.0 + i,
            media_hashes=tuple(dict.fromkeys(media)),
        )
        out[record.group_id] = (record, f"u{i // 2}", f"n{(i // 2) % nodes}")
    return out


def _old(job: str, layout: list[Any], **kw: Any) -> bytes:
    plan = render_rank_plan(job, layout, **kw)
    return json.dumps(plan.to_json(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _both(job: str, layout: list[Any], **kw: Any) -> tuple[Any, Any]:
    """Each renderer's bytes, or the type and message of what it raised."""
    out = []
    for render in (_old, render_rank_plan_json):
        try:
            out.append(render(job, layout, **kw))
        except Exception as exc:  # both must raise the same thing
            out.append((type(exc), str(exc)))
    return out[0], out[1]


def _signer(rank: int, expires: float, columns: list[str] | None) -> Signer:
    def sign(reads: dict[str, list[tuple[int, int]]], media: dict[str, str]) -> str:
        return sign_grant(
            b"k" * 32, job="job1", rank=rank, expires_at=expires, reads=reads, columns=columns, media=media
        )

    return sign


def _args(groups: dict[str, tuple[GroupRecord, str, str]], rank: int, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "rank": rank,
        "n": 7,
        "attempt": 1,
        "step": 3,
        "k": 1,
        "where": groups.__getitem__,
        "endpoint": lambda node: f"grpc://127.0.0.1:{9000 + int(node[1:])}",
        "columns": None,
        "sign": None,
        "mini_batch_trajectories": 64,
        "admitted_at": 1767225600.25,
    }
    kw.update(over)
    return kw


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("columns", [None, ["prompt_ids", "response_ids", "reward_model_score"]])
def test_same_bytes_as_the_dataclass_renderer(
    signed: bool, columns: list[str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ordered layouts (what the scheduler makes): several micro-batches, nodes, units per node, row gaps,
    media shared between groups and nodes, signed tickets, a projection with a user field, null optionals,
    characters JSON escapes; all written by the fast path (never its fallback to the dataclasses)."""

    def no_fallback(*args: Any, **kw: Any) -> Any:
        raise AssertionError("an ordered layout fell back to the dataclass renderer")

    monkeypatch.setattr(planjson, "render_rank_plan", no_fallback)
    rng = random.Random(18)
    groups = _groups(rng, 24, nodes=3)
    seen_media = seen_grants = False
    for rank in range(40):
        # a micro-batch reads its node's units in order; rows of a unit ascending, some skipped
        layout = []
        for _ in range(rng.randrange(1, 4)):
            ids = sorted(rng.sample(sorted(groups), rng.randrange(1, 5)), key=lambda g: (groups[g][2], groups[g][1], g))
            pairs = [[g, groups[g][0].row_start + r] for g in ids for r in range(4) if rng.random() < 0.7 or r == 0]
            layout.append(pairs)
        over: dict[str, Any] = {"columns": columns}
        if signed:
            over["sign"] = _signer(rank, 1767229200.25, columns)
        if rank % 5 == 0:
            over["mini_batch_trajectories"] = None
            over["admitted_at"] = None
        if rank % 7 == 0:  # characters JSON escapes (the plan is not ASCII-escaped, its tickets are)
            over["endpoint"] = lambda node: f'grpc://h\u00f4te-"{node}"\\:1\n'
            over["columns"] = [*(columns or []), 'r\u00e9ward "x"'] if columns else None
        old, new = _both("job1", layout, **_args(groups, rank, **over))
        assert isinstance(old, bytes), old
        assert new == old
        seen_media |= b'"media":[{' in old
        seen_grants |= b"grants" in old
    assert seen_media and seen_grants == signed


def test_empty_share_and_empty_micro_batch() -> None:
    """A rank with no micro-batches, or an empty one, renders the same."""
    groups = _groups(random.Random(1), 4, nodes=2)
    for layout in ([], [[]], [[["g0", 0]], []]):
        old, new = _both("job1", layout, **_args(groups, 0, sign=_signer(0, 1.0, None)))
        assert new == old


def test_unusual_layouts_raise_as_before() -> None:
    """What the scheduler never makes (a row twice, rows of a unit out of order, a node's rows split by
    another node's) raises what the dataclass renderer raises; random layouts, ordered or not, agree."""
    groups = _groups(random.Random(2), 8, nodes=2)
    cases = [
        [[["g0", 0], ["g0", 0]]],  # the same row twice
        [[["g0", 2], ["g0", 1]]],  # out of order inside a unit
        [[["g0", 0], ["g2", 0], ["g0", 1]]],  # g0 and g2 on different nodes: n0's rows not contiguous
        [[["g0", 1], ["g1", 4], ["g0", 2]]],  # one unit twice on one node, disjoint rows (fine)
        [[["g0", 1], ["g1", 4], ["g0", 1]]],  # ... and a row of it twice
    ]
    rng = random.Random(3)
    for _ in range(300):
        cases.append(
            [
                [
                    [g, groups[g][0].row_start + rng.randrange(4)]
                    for g in rng.choices(sorted(groups), k=rng.randrange(6))
                ]
                for _ in range(rng.randrange(1, 3))
            ]
        )
    raised = 0
    for layout in cases:
        old, new = _both("job1", layout, **_args(groups, 3, sign=_signer(3, 2.0, None)))
        assert new == old, layout
        raised += not isinstance(old, bytes)
    assert 0 < raised < len(cases)


@given(
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([0.0, -0.0, 1e300, 5e-324, 1767225600.25]),
    )
)
@settings(max_examples=300, deadline=None)
def test_plan_numbers_are_written_as_the_plan_encoder_writes_them(value: Any) -> None:
    """The plan's numbers (``admitted_at``, ``mini_batch_trajectories``) are written without the encoder's
    per-call setup, to the same text; NaN and infinities are still refused."""
    assert planjson._value(value) == planjson.PLAN_ENCODER.encode(value)


def test_plan_numbers_refuse_nan() -> None:
    """A NaN ``admitted_at`` is refused as the encoder refuses it, not written as invalid JSON."""
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="Out of range float"):
            planjson._value(bad)
