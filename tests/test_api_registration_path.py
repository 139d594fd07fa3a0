"""The unit-registration hot path agrees with the plain path it replaces.

Registration parses its body with a strict twin of ``UnitsIn`` (no Python validators) and falls back to
``UnitsIn`` itself for anything the twin refuses; it builds descriptors from the validated fields without
their per-field checks, stores the batch's units record encoded by pydantic-core, and builds each group's
scheduling view without ``FinishedGroup.__init__``. Each of these is checked here against the slow,
obvious version: same accepted bodies, same values, same errors (naming the field), same record on disk,
same state after a restart. Real app (TestClient), real SQLite.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, job_spec, one_group_unit_body, single_group_units
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BeforeValidator, ValidationError

from knittrans.api import models
from knittrans.api.models import GroupIn, UnitIn, UnitsIn, parse_units, unit_dict
from knittrans.api.plans import unit_json
from knittrans.api.records import Kind
from knittrans.api.routes.units import descriptor_of, to_descriptor
from knittrans.api.store import Encoded, RecordStore, Txn
from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.sched.types import FinishedGroup

JOB = "job1"


def _plain(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed units with their sequences as tuples and the default of ``media_hashes`` filled in."""
    return [
        {
            **u,
            "groups": [
                {
                    **g,
                    "trajectory_tokens": tuple(g["trajectory_tokens"]),
                    "media_hashes": tuple(g.get("media_hashes", ())),
                }
                for g in u["groups"]
            ],
        }
        for u in units
    ]


def _same_outcome(raw: bytes) -> None:
    """``parse_units`` accepts ``raw`` exactly when ``UnitsIn`` does, with the same values, or raises the
    same errors."""
    try:
        want = _plain([unit_dict(u) for u in UnitsIn.model_validate_json(raw).units])
    except ValidationError as exc:
        with pytest.raises(ValidationError) as got:
            parse_units(raw)
        assert got.value.json() == exc.json() and str(got.value) == str(exc)
        return
    got_units = _plain(parse_units(raw))
    assert got_units == want
    for a, b in zip(got_units, want, strict=True):  # same types too (1 == 1.0 == True)
        assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in b.items()}
        for ga, gb in zip(a["groups"], b["groups"], strict=True):
            assert {k: type(v) for k, v in ga.items()} == {k: type(v) for k, v in gb.items()}


def test_strict_twin_has_the_models_fields_and_constraints() -> None:
    """The twin has each model's fields, in order, with the same constraints, minus the Python validators
    (so a constraint added to ``GroupIn`` later reaches the hot path too); a field with a default may be
    left out."""
    for model, twin in (
        (GroupIn, models._StrictGroupIn),
        (UnitIn, models._StrictUnitIn),
        (UnitsIn, models._StrictUnitsIn),
    ):
        hints = typing.get_type_hints(twin, include_extras=True)
        assert list(hints) == list(model.model_fields)
        assert twin.__pydantic_config__ == {"extra": "forbid", "allow_inf_nan": False, "strict": True}
        assert twin.__required_keys__ == {n for n, f in model.model_fields.items() if f.is_required()}
        for name, info in model.model_fields.items():
            mine = list(getattr(hints[name], "__metadata__", ()))
            assert mine == [m for m in info.metadata if not isinstance(m, BeforeValidator)], name
    group_hints = typing.get_type_hints(models._StrictGroupIn, include_extras=True)
    for name in ("trajectory_tokens", "media_hashes"):
        items = typing.get_args(typing.get_args(group_hints[name])[0])
        assert items[1] is Ellipsis and not any(isinstance(m, BeforeValidator) for m in typing.get_args(items[0])), name
    assert not any(isinstance(m, BeforeValidator) for m in getattr(group_hints["version_weighted"], "__metadata__", ()))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"num_trajectories": True},  # a boolean is not an integer
        {"trajectory_tokens": [3, False]},
        {"version_weighted": True},
        {"finished_at": False},
        {"num_trajectories": "2"},  # lax UnitsIn takes these: so must the hot path
        {"num_trajectories": 2.0},
        {"trajectory_tokens": ["3", 4.0]},
        {"version_weighted": "1.5"},
        {"finished_at": "10"},
        {"row_start": -1},
        {"trajectory_tokens": []},
        {"group_id": "bad..id"},
        {"source": ""},
        {"media_hashes": ["ab"]},
        {"media_hashes": ["a" * 64]},
        {"surprise": 1},
        {"version_start": 2**40},
        {"finished_at": 1e12},
        {"num_trajectories": None},
    ],
)
def test_hot_parser_accepts_and_refuses_like_units_in(changes: dict[str, Any]) -> None:
    _same_outcome(json.dumps({"units": [one_group_unit_body(**changes)]}).encode())


@pytest.mark.parametrize(
    "raw",
    [
        b'{"units": ['
        + json.dumps(one_group_unit_body()).encode().replace(b'"finished_at": 10.0', b'"finished_at": NaN')
        + b"]}",
        b'{"units": ['
        + json.dumps(one_group_unit_body()).encode().replace(b'"num_bytes": 10', b'"num_bytes": true')
        + b"]}",
        b'{"units": ['
        + json.dumps(one_group_unit_body()).encode().replace(b'"schema_version": 1', b'"schema_version": true')
        + b"]}",
        b'{"units": []}',
        b'{"units": [' + b",".join([json.dumps(one_group_unit_body()).encode()] * 513) + b"]}",
        b'{"units": 1}',
        b"[]",
        b"{",
        b"",
    ],
)
def test_hot_parser_on_odd_bodies(raw: bytes) -> None:
    _same_outcome(raw)


_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["2", "1.5", "g1", "grpc://h:1", "a" * 64]),
)
_FIELDS = [*GroupIn.model_fields, *(f"unit.{f}" for f in UnitIn.model_fields if f != "groups")]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(_FIELDS), st.one_of(_JSON_SCALARS, st.lists(_JSON_SCALARS, max_size=3))),
        max_size=3,
    )
)
def test_hot_parser_agrees_with_units_in_on_any_field_value(changes: list[tuple[str, Any]]) -> None:
    """Any JSON value in any field: accepted by both with the same values, or refused by both with the
    same errors."""
    body = one_group_unit_body()
    for field, value in changes:
        if field.startswith("unit."):
            body[field.removeprefix("unit.")] = value
        else:
            body["groups"][0][field] = value
    _same_outcome(json.dumps({"units": [body]}).encode())


def test_hot_path_errors_name_the_field_over_http(tmp_path: Path) -> None:
    """Through the real app: a boolean token count is a 422 naming the field and saying why."""
    with app_client(tmp_path / "cp.db") as c:
        assert c.post("/v1/jobs", json=job_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        body = single_group_units(["math"])
        body[0]["groups"][0]["trajectory_tokens"] = [10, True]
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": body})
        assert r.status_code == 422, r.text
        assert (
            r.json()["detail"] == "body.units.0.groups.0.trajectory_tokens.1: Value error, a boolean is not an integer"
        )
        body[0]["groups"][0]["trajectory_tokens"] = ["10", 11.0]  # lax numbers: accepted as before
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": body})
        assert r.status_code == 200 and r.json()["registered"] == 1, r.text
        group = c.app.state.service.jobs[JOB].groups["g0"]  # type: ignore[attr-defined]  # between requests
        assert group.record.trajectory_tokens == (10, 11)


def test_descriptor_from_the_twin_equals_the_checked_descriptor() -> None:
    body = one_group_unit_body(media_hashes=["0" * 64])
    want = UnitDescriptor.from_dict(body)
    got = descriptor_of(parse_units(json.dumps({"units": [body]}).encode())[0])
    assert to_descriptor(UnitIn.model_validate(body)) == want
    assert got == want and got.to_dict() == want.to_dict()
    assert type(got.groups) is tuple and type(got.groups[0].trajectory_tokens) is tuple
    assert type(got.groups[0].media_hashes) is tuple


def test_group_view_is_the_finished_group() -> None:
    """``GroupEntry.view`` (built without ``FinishedGroup.__init__``) equals the one ``__init__`` builds."""
    from knittrans.api.entries import GroupEntry

    record = descriptor_of(parse_units(json.dumps({"units": [one_group_unit_body()]}).encode())[0]).groups[0]
    view = GroupEntry(record=record, unit_id="u0", node_id="n0").view
    want = FinishedGroup(
        group_id="g0",
        source="math",
        trajectory_tokens=(3, 4),
        finished_at=10.0,
        version_start=1,
        version_end=2,
        version_weighted=1.5,
        unit_id="u0",
        node_id="n0",
        row_start=0,
    )
    assert view == want and repr(view) == repr(want) and vars(view) == vars(want)
    assert view.num_trajectories == 2 and view.num_tokens == 7


def test_encoded_records_are_written_as_they_are(tmp_path: Path) -> None:
    store = RecordStore(str(tmp_path / "s.db"))
    txn = Txn()
    txn.put(Kind.UNITS, JOB, "a", Encoded('[{"x":1.5,"y":[1,2]}]'))
    txn.put(Kind.UNITS, JOB, "b", [{"x": 1.5, "y": (1, 2)}])
    store.commit(txn)
    assert [v for _, _, v in store.load(Kind.UNITS)] == [[{"x": 1.5, "y": [1, 2]}]] * 2
    store.close()


def _state(c: Any) -> dict[str, Any]:
    job = c.app.state.service.jobs[JOB]  # between requests: the state thread is idle
    return {
        "units": dict(job.units),
        "groups": {g: (e.record, e.unit_id, e.node_id, e.status, e.mini_batch, e.view) for g, e in job.groups.items()},
        "unadmitted": sorted(job.unadmitted),
        "counts": {k: v for k, v in job.group_counts.items() if v},
        "finished": dict(job.finished_count),
        "next_n": job.next_n,
        "batches": job.unit_batches,
    }


def test_units_record_and_restart_after_bulk_registration(tmp_path: Path) -> None:
    """A bulk registration (500 units, numbers in several forms, a retried batch) stores the same units
    record as ``json.dumps(unit_json(u))`` would, and a restarted control plane rebuilds exactly the same
    state."""
    db = tmp_path / "cp.db"
    spec = job_spec(quotas={"math": 4, "code": 2}, group_size=2, lookahead=1)
    sources = ["math", "math", "code"] * 167
    units = single_group_units(sources[:500], size=2)
    for i, u in enumerate(units):  # numbers in the forms a writer may send
        g = u["groups"][0]
        g["finished_at"] = 1000 + i if i % 3 else 1000.125 + i
        g["version_weighted"] = 0 if i % 2 else 0.0
        g["trajectory_tokens"] = [7, 2**31 - 1] if i % 5 == 0 else [1, 3]
    units[7]["groups"][0]["media_hashes"] = ["ab" * 32]
    with app_client(db) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units})
        assert r.status_code == 200 and r.json()["registered"] == 500, r.text
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:3]})  # a retried batch: all duplicates
        assert r.json()["registered"] == 0 and r.json()["duplicates"] == 3
        before = _state(c)
        svc = c.app.state.service  # type: ignore[attr-defined]
        records = [v for _, _, v in svc.store.load(Kind.UNITS)]
        job = svc.jobs[JOB]
        descriptors = [job.units[u["unit_id"]] for u in units if u["unit_id"] in job.units]
    assert len(records) == 1 and len(records[0]) == 500
    plain = json.loads(json.dumps([unit_json(UnitDescriptor.from_dict(u)) for u in units]))
    assert records[0] == plain
    assert all(
        isinstance(g["version_weighted"], float) and isinstance(g["finished_at"], float)
        for u in records[0]
        for g in u["groups"]
    )
    assert all(d == UnitDescriptor.from_dict(u) for d, u in zip(descriptors, units, strict=False))
    with app_client(db) as c:
        after = _state(c)
        assert after == before
        for gid, (record, *_) in after["groups"].items():
            assert isinstance(record, GroupRecord) and math.isfinite(record.finished_at), gid
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": units[:3]})  # still duplicates after the restart
        assert r.json()["duplicates"] == 3
        changed = json.loads(json.dumps(units[0]))
        changed["num_bytes"] += 1
        r = c.post(f"/v1/jobs/{JOB}/units", json={"units": [changed]})
        assert r.status_code == 409 and "different descriptor" in r.text


def test_fast_path_registers_plain_bodies_and_leaves_the_rest_to_the_app(tmp_path: Path) -> None:
    """A plain registration is answered before FastAPI's routing with the route's answer; a bad token, an
    unknown job, a bad body, a conflicting repeat, a query string and an oversized body are answered by the app
    (documented errors), and a refused registration changes nothing."""
    with app_client(tmp_path / "cp.db", admin_token="adm", worker_token="wrk", max_body_bytes=4096) as c:
        c.headers["Authorization"] = "Bearer adm"
        assert c.post("/v1/jobs", json=job_spec()).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.headers["Authorization"] = "Bearer wrk"
        counts: dict[str, int] = c.app.state.fast_next  # type: ignore[attr-defined]
        served, to_app = counts["served"], counts["to_app"]
        body = {"units": single_group_units(["math", "code"])}
        r = c.post(f"/v1/jobs/{JOB}/units", json=body)
        assert r.status_code == 200 and r.json() == {"registered": 2, "duplicates": 0, "admitted": []}, r.text
        r = c.post(f"/v1/jobs/{JOB}/units", json=body)  # identical repeat: a no-op, still the fast path
        assert r.json() == {"registered": 0, "duplicates": 2, "admitted": []}
        assert (counts["served"], counts["to_app"]) == (served + 2, to_app)
        changed = {"units": single_group_units(["code"])}  # u-g0 again, with another source
        bad = {"units": single_group_units(["math"], start=5)}
        bad["units"][0]["groups"][0]["trajectory_tokens"] = [1, True]
        cases = [
            (c.post(f"/v1/jobs/{JOB}/units", json=body, headers={"Authorization": "Bearer x"}), 401),
            (c.post("/v1/jobs/nope/units", json=body), 404),
            (c.post(f"/v1/jobs/{JOB}/units", json=bad), 422),
            (c.post(f"/v1/jobs/{JOB}/units", json=changed), 409),
        ]
        for response, status in cases:
            assert response.status_code == status and response.json()["error"], response.text
        # the wrong token never reaches the fast path: the request gate in front of it answers 401
        assert counts["to_app"] == to_app + 3 and counts["served"] == served + 2
        fresh = {"units": single_group_units(["math"], start=7)}
        assert c.post(f"/v1/jobs/{JOB}/units?x=1", json=fresh).status_code == 200  # a query: the app's
        big = {"units": single_group_units(["math"] * 40, start=10)}
        assert c.post(f"/v1/jobs/{JOB}/units", json=big).status_code == 413  # over the body limit: the gate's
        assert counts["served"] == served + 2 and counts["to_app"] == to_app + 3
        groups = c.app.state.service.jobs[JOB].groups  # type: ignore[attr-defined]  # between requests
        assert sorted(groups) == ["g0", "g1", "g7"]  # nothing of the refused ones
