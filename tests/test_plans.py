"""The typed rank plan (knittrans.plans), the row-range builder and ticket joins (knittrans.tickets), and
the tables the control plane and its clients share (HTTP statuses, GroupRecord fields)."""

from __future__ import annotations

import copy
import hashlib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, group, job_spec, unit
from pydantic import BaseModel

from knittrans import errors
from knittrans.api.models import GroupIn, RankPlanOut, UnitIn
from knittrans.descriptors import GROUP_FIELDS, UNIT_FIELDS, GroupRecord, group_fields
from knittrans.errors import InvalidRequest, InvalidTicket
from knittrans.plans import MediaFetch, MicroBatchReads, PlanId, PlanRow, RankPlan, RowFetch
from knittrans.sched.assign import assign_mini_batch
from knittrans.sched.types import FinishedGroup
from knittrans.tickets import Ticket, UnitRead, join_tickets, node_reads, row_runs


def _hash(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


@pytest.fixture(scope="module")
def wire_plans(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Plans as the real app sends them: two nodes, media, signed tickets, a projection."""
    db = tmp_path_factory.mktemp("plans") / "cp.db"
    with app_client(db, ticket_key="k" * 32) as c:
        spec = job_spec(
            quotas={"math": 2, "code": 2}, mini_batches_per_step=1, world_size=2, micro_batch_size=3, group_size=4
        )
        spec["columns"] = ["prompt_ids", "response_ids"]
        assert c.post("/v1/jobs", json=spec).status_code == 201
        for n, port in (("n0", 1), ("n1", 2)):
            c.post("/v1/nodes", json={"node_id": n, "endpoint": f"grpc://127.0.0.1:{port}"})
        units = [
            unit("u0", [group("g0", "math", size=4, media=[_hash(0), _hash(1)]), group("g1", "code", size=4)]),
            unit("u1", [group("g2", "math", size=4), group("g3", "code", size=4, media=[_hash(2)])], node="n1", port=2),
        ]
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0]
        out = []
        for rank in (0, 1):
            r = c.get(f"/v1/jobs/job1/ranks/{rank}/next", params={"timeout_s": 0})
            assert r.status_code == 200, r.text
            out.append(r.json())
    return out


def test_wire_plans_round_trip_exactly(wire_plans: list[dict[str, Any]]) -> None:
    """from_json then to_json gives back the exact JSON the app sent (same keys, same order, same values)."""
    seen_media = False
    for body in wire_plans:
        plan = RankPlan.from_json(body)
        assert plan.to_json() == body
        assert list(plan.to_json()) == list(body)
        assert RankPlan.from_json(plan.to_json()) == plan
        assert str(plan.plan_id) == body["plan_id"] and plan.plan_id.rank == plan.rank
        assert plan.mini_batch_trajectories == 16 and plan.admitted_at is not None
        for m in plan.micro_batches:
            assert all(len(f.ticket.grants) == 1 and f.ticket.columns is not None for f in m.fetches)
            seen_media |= bool(m.media)
    assert seen_media


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets (or with ``...`` deletes) the field at ``path`` (``a.0.b``) of a plan body."""

    def apply(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is ...:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return apply


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set("rank", ...), "lacks fields: \\['rank'\\]"),
        (_set("surprise", 1), "unknown fields: \\['surprise'\\]"),
        (_set("step", "3"), "'step' must be an integer"),
        (_set("step", True), "'step' must be an integer"),
        (_set("num_tokens", -1), "'num_tokens' must be an integer"),
        (_set("plan_id", "n0-a0-r0"), "'plan_id' 'n0-a0-r0' is not of the form"),
        (_set("plan_id", "n0.a0.r1"), "does not match rank 0"),
        (_set("global_index", 5), "does not match rank 0 and global_index 5"),
        (_set("micro_batches", {}), "'micro_batches' must be a list"),
        (_set("micro_batches.0", []), "'micro_batches\\[0\\]' must be a JSON object"),
        (_set("micro_batches.0.rows.0.row", 1.5), "'micro_batches\\[0\\].rows\\[0\\].row' must be an integer"),
        (_set("micro_batches.0.rows.0.group_id", ""), "'micro_batches\\[0\\].rows\\[0\\].group_id' must be a non-emp"),
        (_set("micro_batches.0.fetches.0.extra", 1), "'micro_batches\\[0\\].fetches\\[0\\]' has unknown fields"),
        (_set("micro_batches.0.fetches.0.ticket", "{"), "'micro_batches\\[0\\].fetches\\[0\\].ticket': ticket is not"),
        (_set("micro_batches.0.media", ...), "'micro_batches\\[0\\]' lacks fields: \\['media'\\]"),
        (_set("admitted_at", "now"), "'admitted_at' must be a number or null"),
    ],
)
def test_from_json_names_the_bad_field(
    wire_plans: list[dict[str, Any]], mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    body = copy.deepcopy(wire_plans[0])
    mutate(body)
    with pytest.raises(InvalidRequest, match=match):
        RankPlan.from_json(body)


def test_from_json_checks_ticket_kinds_and_media_hashes(wire_plans: list[dict[str, Any]]) -> None:
    body = next(b for b in wire_plans if any(m["media"] for m in b["micro_batches"]))
    i = next(i for i, m in enumerate(body["micro_batches"]) if m["media"])
    bad = copy.deepcopy(body)
    bad["micro_batches"][i]["media"][0]["hash"] = "ABC"
    with pytest.raises(InvalidRequest, match=f"micro_batches\\[{i}\\].media\\[0\\].hash' must be 64 lower-case hex"):
        RankPlan.from_json(bad)
    swapped = copy.deepcopy(body)
    swapped["micro_batches"][i]["fetches"][0]["ticket"] = body["micro_batches"][i]["media"][0]["ticket"]
    with pytest.raises(InvalidRequest, match="must be a 'rows' ticket, not 'media'"):
        RankPlan.from_json(swapped)
    with pytest.raises(InvalidRequest, match="a plan must be a JSON object"):
        RankPlan.from_json([body])
    # the two fields an older control plane may leave out are optional
    older = {k: v for k, v in body.items() if k not in ("mini_batch_trajectories", "admitted_at")}
    plan = RankPlan.from_json(older)
    assert plan.mini_batch_trajectories is None and plan.admitted_at is None


def test_plan_id_format_and_parse() -> None:
    pid = PlanId(n=12, attempt=3, rank=7)
    assert str(pid) == "n12.a3.r7" and PlanId.parse("n12.a3.r7") == pid
    parsed = PlanId.parse("n12.a3.r7")
    assert parsed is not None and hash(parsed) == hash(pid) and repr(parsed) == repr(pid)
    assert (parsed.n, parsed.attempt, parsed.rank) == (12, 3, 7) and type(parsed.n) is int
    for text in ("", "n1.a2", "n1.a2.r3.x", "a1.n2.r3", "n1.ax.r3", "n-1.a0.r0", "bogus"):
        assert PlanId.parse(text) is None, text
    with pytest.raises(InvalidRequest, match="plan id field 'rank'"):
        PlanId(n=0, attempt=0, rank=-1)
    assert sorted([PlanId(n=1, attempt=0, rank=0), PlanId(n=0, attempt=1, rank=0)])[0].n == 0


def _shape(t: Any) -> Any:
    """A comparable form of a type: dataclasses and pydantic models become their fields' shapes."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return ("optional", *sorted(repr(_shape(a)) for a in typing.get_args(t)))
    if origin in (list, tuple):
        return ("list", _shape(typing.get_args(t)[0]))
    if isinstance(t, type) and issubclass(t, BaseModel):
        return {name: _shape(f.annotation) for name, f in t.model_fields.items()}
    if isinstance(t, type) and hasattr(t, "__dataclass_fields__"):
        if t in (PlanId, Ticket):  # strings on the wire
            return "str"
        hints = typing.get_type_hints(t)
        return {name: _shape(hints[name]) for name in t.__dataclass_fields__}
    return {int: "int", float: "float", str: "str", type(None): "null"}[t]


def test_openapi_model_agrees_with_the_dataclasses() -> None:
    """RankPlanOut (the OpenAPI schema, made from the dataclasses) has the fields and JSON types of RankPlan."""
    assert _shape(RankPlanOut) == _shape(RankPlan)
    assert list(RankPlanOut.model_fields) == list(RankPlan.__dataclass_fields__)
    for cls in (PlanRow, RowFetch, MediaFetch, MicroBatchReads):
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_group_fields_are_listed_once() -> None:
    """The API's GroupIn and the JSON of a unit follow GroupRecord's own field list."""
    assert list(GroupIn.model_fields) == list(GROUP_FIELDS)
    assert list(UnitIn.model_fields) == list(UNIT_FIELDS)
    body = group("g0", "math", size=2, media=[_hash(1)])
    record = GroupRecord(
        **{**body, "trajectory_tokens": tuple(body["trajectory_tokens"]), "media_hashes": tuple(body["media_hashes"])}
    )
    assert group_fields(record) == {**body, "trajectory_tokens": (10, 11), "media_hashes": (_hash(1),)}
    assert group_fields(GroupIn(**body)) == body


def test_http_status_table_is_read_back_by_the_client() -> None:
    """Every mapped error comes back as itself from its status, except request errors (told apart by kind)."""
    for kind, status in errors.HTTP_STATUS:
        assert errors.http_status(kind("x")) == status
        back = errors.error_of_status(status)
        assert back is (errors.Conflict if issubclass(kind, InvalidRequest) else kind)
    assert errors.http_status(errors.KnitTransError("x")) == 500
    assert errors.error_of_status(418) is errors.KnitTransError


def test_row_runs_merge_contiguous_rows_of_a_unit() -> None:
    rows = [("n0", "u0", 3), ("n0", "u0", 4), ("n0", "u0", 7), ("n0", "u1", 0), ("n1", "u2", 5), ("n1", "u2", 6)]
    assert row_runs(rows) == [
        ("n0", "u0", ((3, 5), (7, 8))),
        ("n0", "u1", ((0, 1),)),
        ("n1", "u2", ((5, 7),)),
    ]
    assert row_runs([]) == []
    assert node_reads(rows) == {
        "n0": (UnitRead(unit_id="u0", row_ranges=((3, 5), (7, 8))), UnitRead(unit_id="u1", row_ranges=((0, 1),))),
        "n1": (UnitRead(unit_id="u2", row_ranges=((5, 7),)),),
    }
    with pytest.raises(InvalidTicket, match="rows of node 'n0' are not contiguous"):
        node_reads([("n0", "u0", 0), ("n1", "u1", 0), ("n0", "u0", 1)])
    with pytest.raises(InvalidTicket, match="overlap or are unsorted"):
        node_reads([("n0", "u0", 5), ("n0", "u0", 2)])


def test_assignment_reads_are_the_row_runs_of_its_trajectories() -> None:
    """sched's reads per micro-batch are exactly what the shared builder makes of its rows."""
    groups = [
        FinishedGroup(
            group_id=f"g{i}",
            source="math",
            trajectory_tokens=(10 + i, 20, 5, 7),
            finished_at=0.0,
            unit_id=f"u{i // 3}",
            node_id=f"n{(i // 3) % 2}",
            row_start=4 * (i % 3),
        )
        for i in range(9)
    ]
    plans = assign_mini_batch(groups, 2, micro_batch_tokens=40, keep_groups=False)
    for p in plans:
        for m in p.micro_batches:
            runs = row_runs((t.node_id, t.unit_id, t.row) for t in m.trajectories)
            assert [(r.node_id, r.unit_id, r.row_ranges) for r in m.reads] == runs


def test_join_tickets() -> None:
    a = Ticket(job="j", reads=(UnitRead(unit_id="u0", row_ranges=((0, 2),)),), columns=("x",), grants=("g1",))
    b = Ticket(job="j", reads=(UnitRead(unit_id="u1", row_ranges=((4, 5),)),), columns=("x",), grants=("g1", "g2"))
    joined = join_tickets([a, b])
    assert joined.reads == a.reads + b.reads and joined.columns == ("x",) and joined.grants == ("g1", "g2")
    assert join_tickets([a]) is a and join_tickets([a], grants=["g9"]).grants == ("g9",)
    m1 = Ticket(job="j", kind="media", reads=(UnitRead(unit_id="u0"),), media_hashes=(_hash(1),))
    m2 = Ticket(job="j", kind="media", reads=(UnitRead(unit_id="u0"),), media_hashes=(_hash(2),))
    media = join_tickets([m1, m2])
    assert media.reads == (UnitRead(unit_id="u0"),) and media.media_hashes == (_hash(1), _hash(2))
    with pytest.raises(InvalidTicket, match="one kind, job and projection"):
        join_tickets([a, m1])
    with pytest.raises(InvalidTicket, match="one kind, job and projection"):
        join_tickets([a, Ticket(job="j", reads=b.reads)])
    with pytest.raises(InvalidTicket, match="read more than once"):
        join_tickets([a, a])
    with pytest.raises(InvalidTicket, match="at least one"):
        join_tickets([])


def test_rank_plan_json_has_no_string_key_access_outside_plans(tmp_path: Path) -> None:
    """The plan's wire keys are read in knittrans/plans.py only (the rest of the package uses attributes)."""
    root = Path(__file__).resolve().parents[1] / "knittrans"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "plans.py" and path.parent == root:
            continue
        text = path.read_text()
        for key in ('["micro_batches"]', '["fetches"]', '["plan_id"]', '.get("mini_batch_trajectories")'):
            if key in text:
                offenders.append(f"{path.relative_to(root)}: {key}")
    assert offenders == []
