"""The mini-batch manifest (knittrans.manifest): strict decoding, its wire round trip, each rank's share, and
the property that every row of a manifest the control plane builds reaches exactly one rank; also the row-range
builder and ticket joins (knittrans.tickets) and the tables the control plane and its clients share (HTTP
statuses, GroupRecord fields)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import pickle
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from api_support import app_client, group, job_spec, unit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knittrans import errors
from knittrans.api.jobstate import JobState
from knittrans.api.models import GroupIn, ManifestOut, UnitIn
from knittrans.api.spec import JobSpec
from knittrans.api.store import Txn
from knittrans.controlclient import _raise_for
from knittrans.descriptors import GROUP_FIELDS, UNIT_FIELDS, GroupRecord, UnitDescriptor
from knittrans.errors import InvalidRequest, InvalidTicket
from knittrans.grants import check_ticket
from knittrans.manifest import MANIFEST_VERSION, Manifest, ManifestGroup, ManifestNode, etag_of
from knittrans.plans import PlanRow
from knittrans.schema import SCHEMA_VERSION
from knittrans.tickets import Ticket, UnitRead, join_tickets, node_reads

WIRE_KEYS = [
    "manifest",
    "job",
    "global_index",
    "attempt",
    "step",
    "mini_batch_index",
    "policy_version",
    "admitted_at",
    "world_size",
    "columns",
    "nodes",
    "units",
    "groups",
    "media",
    "ranks",
]
"""The manifest's fields, in the order docs/reference/wire.md gives them."""


def _hash(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Mini-batch 0's manifest as the real app sends it: two ranks, two nodes, media, signed grants, a projection."""
    db = tmp_path_factory.mktemp("manifest") / "cp.db"
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
            unit(
                "u1",
                [group("g2", "math", size=4, media=[_hash(1)]), group("g3", "code", size=4, media=[_hash(2)])],
                node="n1",
                port=2,
            ),
        ]
        assert c.post("/v1/jobs/job1/units", json={"units": units}).json()["admitted"] == [0]
        r = c.get("/v1/jobs/job1/minibatches/0", params={"timeout_s": 0})
        assert r.status_code == 200, r.text
        assert r.headers["etag"] == etag_of(r.content, 0, 0)
        return r.content


def test_wire_manifest_round_trips_exactly(wire: bytes) -> None:
    """decode then encode gives back the exact bytes the app sent (same keys, same order, same values), and the
    manifest holds what the registration implies: 16 trajectories over 2 ranks, one grant per node, the
    projection, every hash once."""
    m = Manifest.decode(wire)
    assert m.encode() == wire
    assert list(json.loads(wire)) == list(m.to_json()) == WIRE_KEYS
    assert Manifest.from_json(m.to_json()) == m and Manifest.decode(wire.decode()) == m
    assert (m.job, m.global_index, m.attempt, m.step, m.mini_batch_index, m.policy_version) == ("job1", 0, 0, 0, 0, 0)
    assert m.manifest_id == "n0.a0" and m.world_size == 2 and m.trajectories == 16
    assert m.columns == ("prompt_ids", "response_ids")
    assert [(n.node_id, n.endpoint) for n in m.nodes] == [("n0", "grpc://127.0.0.1:1"), ("n1", "grpc://127.0.0.1:2")]
    assert all(n.grant for n in m.nodes) and len({n.grant for n in m.nodes}) == 2
    assert sorted(g.group_id for g in m.groups) == ["g0", "g1", "g2", "g3"]
    assert sorted(h for h, _ in m.media) == sorted(_hash(i) for i in range(3))  # _hash(1) of two groups: once


def test_a_manifest_is_built_with_the_collector_paused(wire: bytes) -> None:
    """A 1,024-rank manifest (8,192 rows) decoded from its JSON and unpickled (the ranks' broadcast) starts no
    collection while it is built, only the young one or two after it (with the collector on during the build,
    about 46 each time, and now and then a full one over the trainer's heap). The collector is on again afterwards,
    and stays off for a caller who turned it off. A small manifest pickles to an equal one too."""
    m = Manifest.decode(wire)
    big = dataclasses.replace(
        m,
        units=tuple((f"u{g}", g % 2) for g in range(1024)),
        groups=tuple(ManifestGroup(f"g{g}", g, ()) for g in range(1024)),
        media=(),
        ranks=tuple((tuple((r, j, 300) for j in range(8)),) for r in range(1024)),
    )
    raw, pickled = big.encode(), pickle.dumps(big)
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    built = []
    for build in (lambda: Manifest.decode(raw), lambda: pickle.loads(pickled)):
        started.clear()
        gc.callbacks.append(count)
        try:
            built.append(build())
        finally:
            gc.callbacks.remove(count)
        # at most the young collection the first allocation after the build starts, and the one after it
        assert len(started) <= 2 and gc.isenabled(), started
    assert built == [big, big] and pickle.loads(pickle.dumps(m)) == m
    assert built[1].share(1023).micro_batches[0].rows[-1].row == 7
    gc.disable()
    try:
        Manifest.decode(raw)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_openapi_model_has_the_manifest_fields() -> None:
    """ManifestOut (the OpenAPI schema) documents exactly the manifest's wire fields, in order."""
    assert list(ManifestOut.model_fields) == WIRE_KEYS
    assert ManifestOut.model_fields["manifest"].annotation is not None and MANIFEST_VERSION == 1


def test_openapi_model_reads_a_wire_manifest(wire: bytes) -> None:
    """The wire manifest validates against ManifestOut and dumps back to the same JSON value."""
    body = json.loads(wire)
    assert json.loads(ManifestOut.model_validate(body).model_dump_json()) == body


def _at(body: Any, path: str) -> tuple[Any, Any]:
    """The container and key of ``path`` (``a.0.b``) in ``body``."""
    *parents, last = path.split(".")
    node = body
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    return node, int(last) if last.isdigit() else last


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets (or with ``...`` deletes) the field at ``path`` of a manifest body."""

    def apply(body: dict[str, Any]) -> None:
        node, key = _at(body, path)
        if value is ...:
            del node[key]
        else:
            node[key] = value

    return apply


def _duplicate_row(body: dict[str, Any]) -> None:
    body["ranks"][1][0].append(list(body["ranks"][0][0][0]))


def _same_unit_row(body: dict[str, Any]) -> None:
    """Rank 1's first row: the unit row of rank 0's first row, named through another group of that unit."""
    g, row, tokens = body["ranks"][0][0][0]
    unit = body["groups"][g][1]
    other = next(i for i, x in enumerate(body["groups"]) if x[1] == unit and i != g)
    body["ranks"][1][0][0] = [other, row, tokens]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set("manifest", 2), r"manifest version 2 is not 1"),
        (_set("manifest", True), r"field 'manifest' must be an integer >= 0, not True"),
        (_set("ranks", ...), r"lacks fields: \['ranks'\]"),
        (_set("surprise", 1), r"unknown fields: \['surprise'\]"),
        (_set("step", "3"), r"field 'step' must be an integer >= 0, not '3'"),
        (_set("step", True), r"field 'step' must be an integer >= 0, not True"),
        (_set("attempt", -1), r"field 'attempt' must be an integer >= 0"),
        (_set("global_index", 1.0), r"field 'global_index' must be an integer >= 0"),
        (_set("policy_version", None), r"field 'policy_version' must be an integer >= 0"),
        (_set("job", "../etc"), r"manifest field 'job'"),
        (_set("admitted_at", "now"), r"field 'admitted_at' must be a number, not 'now'"),
        (_set("admitted_at", True), r"field 'admitted_at' must be a number, not True"),
        (_set("world_size", 3), r"'world_size' is 3 but 'ranks' lays out 2 ranks"),
        (_set("columns", "prompt_ids"), r"field 'columns' must be a list"),
        (_set("columns.1", ""), r"field 'columns\[1\]' must be a column name"),
        (_set("nodes", {}), r"field 'nodes' must be a list, not dict"),
        (_set("nodes.0", ["n0", "grpc://127.0.0.1:1"]), r"field 'nodes\[0\]' must have 3 items, not 2"),
        (_set("nodes.0.0", "bad..id"), r"manifest field 'nodes\[0\]\[0\]'"),
        (_set("nodes.1.1", "127.0.0.1:2"), r"field 'nodes\[1\]\[1\]' must be a Flight location"),
        (_set("nodes.0.2", ""), r"field 'nodes\[0\]\[2\]' must be a grant string or null"),
        (_set("units.0.1", 2), r"field 'units\[0\]\[1\]': 2 is not an index into nodes \(0..1\)"),
        (_set("units.1.1", True), r"field 'units\[1\]\[1\]': True is not an index into nodes"),
        (_set("groups.0.1", 9), r"field 'groups\[0\]\[1\]': 9 is not an index into units \(0..1\)"),
        (_set("groups.0.2", [0, 3]), r"field 'groups\[0\]\[2\]\[1\]': 3 is not an index into media \(0..2\)"),
        (_set("groups.1.2", 0), r"field 'groups\[1\]\[2\]' must be a list"),
        (_set("media.0.0", "AB" * 32), r"field 'media\[0\]\[0\]' must be 64 lower-case hex characters"),
        (_set("media.0.1", -1), r"field 'media\[0\]\[1\]': -1 is not an index into units"),
        (_set("ranks", []), r"field 'ranks' must lay out at least one rank"),
        (_set("ranks.0", {}), r"field 'ranks\[0\]' must be a list"),
        (_set("ranks.0.0.0", [0, 0]), r"field 'ranks\[0\]\[0\]\[0\]' must have 3 items, not 2"),
        (_set("ranks.0.0.0.0", 4), r"field 'ranks\[0\]\[0\]\[0\]\[0\]': 4 is not an index into groups \(0..3\)"),
        (_set("ranks.0.0.0.0", -1), r"field 'ranks\[0\]\[0\]\[0\]\[0\]': -1 is not an index into groups"),
        (_set("ranks.1.0.1.1", -1), r"field 'ranks\[1\]\[0\]\[1\]\[1\]' must be an integer >= 0, not -1"),
        (_set("ranks.0.0.0.2", 1.5), r"field 'ranks\[0\]\[0\]\[0\]\[2\]' must be an integer >= 0, not 1.5"),
        (_duplicate_row, r"field 'ranks\[1\]\[0\]\[\d+\]': row \d+ of unit 'u\d' is assigned twice"),
        (_same_unit_row, r"field 'ranks\[1\]\[0\]\[0\]': row \d+ of unit 'u\d' is assigned twice"),
        (_set("nodes.1.0", "n0"), r"field 'nodes\[1\]\[0\]': node 'n0' is also nodes\[0\]"),
        (_set("units.1.0", "u0"), r"field 'units\[1\]\[0\]': unit 'u0' is also units\[0\]"),
        (_set("groups.3.0", "g0"), r"field 'groups\[3\]\[0\]': group 'g0' is also groups\[0\]"),
        (_set("media.2.0", _hash(0)), r"field 'media\[2\]\[0\]': content hash '[0-9a-f]{64}' is also media\[0\]"),
    ],
)
def test_decode_names_the_bad_field(wire: bytes, mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    """Each malformed field is refused with an InvalidRequest that names it (index paths for nested ones)."""
    body = json.loads(wire)
    mutate(body)
    with pytest.raises(InvalidRequest, match=match):
        Manifest.decode(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"{", "manifest is not JSON"),
        (b"", "manifest is not JSON"),
        (b"[]", "a manifest must be a JSON object, not list"),
        (b"null", "a manifest must be a JSON object, not NoneType"),
        (b'{"manifest": NaN}', "a manifest lacks fields"),
    ],
)
def test_decode_refuses_what_is_not_a_manifest_object(raw: bytes, match: str) -> None:
    """Bytes that are not JSON, or JSON that is not an object with the manifest's fields, are refused by name."""
    with pytest.raises(InvalidRequest, match=match):
        Manifest.decode(raw)


def test_share_builds_the_tickets_grants_and_media_the_rows_imply(wire: bytes) -> None:
    """Each rank's share: its rows (group, unit, node, row, tokens as the manifest's tables say), one rows
    ticket per node (the row runs, the projection, the node's grant), one media ticket per unique hash of its
    groups (first-use order, the holding unit and node's grant); the shares together hold every row once."""
    m = Manifest.decode(wire)
    grants = {n.node_id: n.grant for n in m.nodes}
    endpoints = {n.node_id: n.endpoint for n in m.nodes}
    seen: list[tuple[str, int]] = []
    for rank in range(m.world_size):
        plan = m.share(rank)
        assert (plan.manifest, plan.rank, plan.plan_id) == (m, rank, f"n0.a0.r{rank}")
        assert m.trajectories == 16 and len(plan.micro_batches) == len(m.ranks[rank])
        for i, (micro, rows) in enumerate(zip(plan.micro_batches, m.ranks[rank], strict=True)):
            want = []
            for g, row, tokens in rows:
                unit_id, node = m.units[m.groups[g].unit]
                want.append(
                    PlanRow(
                        group_id=m.groups[g].group_id,
                        unit_id=unit_id,
                        node_id=m.nodes[node].node_id,
                        row=row,
                        num_tokens=tokens,
                    )
                )
            assert micro.index == i and list(micro.rows) == want
            runs = node_reads((r.node_id, r.unit_id, r.row) for r in want)
            assert [f.node_id for f in micro.fetches] == list(runs)
            for f in micro.fetches:
                assert f.endpoint == endpoints[f.node_id]
                assert f.ticket == Ticket(
                    job="job1", reads=runs[f.node_id], columns=m.columns, grants=(grants[f.node_id],)
                )
            used = list(dict.fromkeys(m.media[x][0] for g, _, _ in rows for x in m.groups[g].media))
            assert [x.hash for x in micro.media] == used
            for x in micro.media:
                unit_id, node = m.units[dict(m.media)[x.hash]]
                assert (x.node_id, x.endpoint) == (m.nodes[node].node_id, m.nodes[node].endpoint)
                assert x.ticket == Ticket(
                    job="job1",
                    kind="media",
                    reads=(UnitRead(unit_id=unit_id),),
                    media_hashes=(x.hash,),
                    grants=(grants[x.node_id],),
                )
            seen += [(r.group_id, r.row) for r in micro.rows]
    assert len(seen) == len(set(seen)) == 16


def test_share_of_an_unsigned_manifest_has_no_grants(wire: bytes) -> None:
    """Nodes without a grant (no ticket key): the tickets carry none."""
    m = Manifest.decode(wire)
    unsigned = dataclasses.replace(m, nodes=tuple(dataclasses.replace(n, grant=None) for n in m.nodes))
    assert Manifest.decode(unsigned.encode()) == unsigned
    for rank in range(2):
        for micro in unsigned.share(rank).micro_batches:
            assert all(f.ticket.grants == () for f in [*micro.fetches, *micro.media])


def test_share_refuses_an_unknown_rank_and_rows_it_cannot_read_in_one_call(wire: bytes) -> None:
    """A rank outside the world size, or a micro-batch whose rows of one node are not contiguous in read
    order, is refused, naming the manifest and micro-batch."""
    m = Manifest.decode(wire)
    for rank in (-1, 2):
        with pytest.raises(InvalidRequest, match=f"rank {rank} is outside the manifest's world_size 2"):
            m.share(rank)
    node = ManifestNode("n0", "grpc://127.0.0.1:1", None)
    split = Manifest(
        job="j",
        global_index=3,
        attempt=1,
        step=1,
        mini_batch_index=1,
        policy_version=3,
        admitted_at=0.0,
        columns=None,
        nodes=(node, ManifestNode("n1", "grpc://127.0.0.1:2", None)),
        units=(("u0", 0), ("u1", 1)),
        groups=(ManifestGroup("g0", 0, ()), ManifestGroup("g1", 1, ())),
        media=(),
        ranks=((((0, 0, 5), (1, 0, 5), (0, 1, 5)),),),
    )
    assert Manifest.decode(split.encode()) == split  # well-formed: only its read order is impossible
    with pytest.raises(InvalidRequest, match=r"manifest n3\.a1 micro-batch 0: .*not contiguous"):
        split.share(0)


# ---------------------------------------------------------------- property: the real server's manifests
@st.composite
def _workloads(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(1, 2))
    group_size = draw(st.integers(1, 4))
    quotas = {"a": draw(st.integers(1, 3)) * k, "b": draw(st.integers(1, 3)) * k}
    smallest = min(quotas.values()) // k  # at least this many groups per mini-batch
    world = draw(st.integers(1, max(1, smallest * group_size)))
    nodes = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 2))
    sources = [s for s, q in quotas.items() for _ in range(q * steps)]
    order = draw(st.permutations(sources))
    groups = [
        {
            "source": s,
            "tokens": draw(st.lists(st.integers(1, 50), min_size=group_size, max_size=group_size)),
            "media": draw(st.lists(st.integers(0, 5), max_size=3, unique=True)),
        }
        for s in order
    ]
    cuts = draw(st.lists(st.integers(1, 3), min_size=len(groups), max_size=len(groups)))
    micro = draw(st.one_of(st.just(None), st.integers(1, 4)))
    return {
        "k": k,
        "group_size": group_size,
        "quotas": quotas,
        "world": world,
        "nodes": nodes,
        "groups": groups,
        "cuts": cuts,
        "micro_batch_size": micro,
        "micro_batch_tokens": None if micro is not None else 64,
        "signed": draw(st.booleans()),
    }


def _units(w: dict[str, Any]) -> list[UnitDescriptor]:
    """The workload's groups packed into units of 1..3 groups each, spread over its nodes."""
    units, i, u = [], 0, 0
    while i < len(w["groups"]):
        members = w["groups"][i : i + w["cuts"][u]]
        records, row = [], 0
        for j, g in enumerate(members, start=i):
            records.append(
                GroupRecord(
                    group_id=f"g{j}",
                    source=g["source"],
                    row_start=row,
                    num_trajectories=len(g["tokens"]),
                    trajectory_tokens=tuple(g["tokens"]),
                    version_start=0,
                    version_end=0,
                    version_weighted=0.0,
                    finished_at=float(j),
                    media_hashes=tuple(_hash(m) for m in g["media"]),
                )
            )
            row += len(g["tokens"])
        units.append(
            UnitDescriptor(
                unit_id=f"u{u}",
                job="j",
                node_id=f"n{u % w['nodes']}",
                endpoint=f"grpc://127.0.0.1:{9000 + u % w['nodes']}",
                num_rows=row,
                num_bytes=row,
                schema_version=SCHEMA_VERSION,
                groups=tuple(records),
            )
        )
        i += len(members)
        u += 1
    return units


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_workloads())
def test_every_row_of_a_built_manifest_goes_to_exactly_one_ranks_share(w: dict[str, Any]) -> None:
    """Property: for any workload the control plane's job state admits, every manifest it publishes decodes to
    itself, and its ranks' shares hold every row of its groups exactly once (nothing else), each share
    reading its rows with the tickets and media its groups imply, which the grants of a signed one allow."""
    spec = JobSpec(
        name="j",
        group_size=w["group_size"],
        quotas=w["quotas"],
        mini_batches_per_step=w["k"],
        policy="constraint_preserving",
        world_size=w["world"],
        micro_batch_size=w["micro_batch_size"],
        micro_batch_tokens=w["micro_batch_tokens"],
        lookahead=64,
    )
    job = JobState(
        spec,
        endpoint=lambda node: f"grpc://127.0.0.1:{9000 + int(node[1:])}",
        node_state=lambda node: "alive",
        ticket_key=b"k" * 32 if w["signed"] else None,
    )
    units = _units(w)
    job.add_units(units, Txn())
    job.admit_all(Txn())
    published = job.published()
    assert sorted(published.manifests) == list(range(job.next_n)) and job.next_n >= 1
    records = {g.group_id: g for u in units for g in u.groups}
    for n, (etag, raw) in published.manifests.items():
        m = Manifest.decode(raw)
        assert m.encode() == raw and etag == etag_of(raw, n, 0) and m == job.build_manifest(job.minibatches[n])
        assert all((node.grant is not None) == w["signed"] for node in m.nodes)
        want = {
            (gid, row)
            for gid in job.minibatches[n].group_ids
            for row in range(records[gid].row_start, records[gid].row_start + records[gid].num_trajectories)
        }
        got: list[tuple[str, int]] = []
        for rank in range(m.world_size):
            for micro in m.share(rank).micro_batches:
                got += [(r.group_id, r.row) for r in micro.rows]
                reads = [
                    (f.node_id, read.unit_id, row)
                    for f in micro.fetches
                    for read in f.ticket.reads
                    for a, b in read.row_ranges
                    for row in range(a, b)
                ]
                assert reads == [(r.node_id, r.unit_id, r.row) for r in micro.rows]
                used = dict.fromkeys(h for r in micro.rows for h in records[r.group_id].media_hashes)
                assert [x.hash for x in micro.media] == list(used)  # each hash once, in first-use order
                if w["signed"]:  # a store node with the key serves every read of the share
                    for ticket in [f.ticket for f in micro.fetches] + [x.ticket for x in micro.media]:
                        check_ticket(b"k" * 32, ticket, now=m.admitted_at)
        assert len(got) == len(set(got)) and set(got) == want


def test_group_fields_are_listed_once() -> None:
    """The API's GroupIn and the JSON of a unit follow GroupRecord's own field list."""
    assert list(GroupIn.model_fields) == list(GROUP_FIELDS)
    assert list(UnitIn.model_fields) == list(UNIT_FIELDS)
    body = group("g0", "math", size=2, media=[_hash(1)])
    assert GroupIn(**body).model_dump() == body


def test_http_error_answers_are_read_back_as_their_class() -> None:
    """The client raises the class an answer's error kind names (request errors share 409 with Conflict),
    and falls back on the status for a kind that names none."""
    for kind, status in errors.HTTP_STATUS:
        assert errors.http_status(kind("x")) == status
    assert errors.http_status(errors.KnitTransError("x")) == 500
    for cls in (errors.InvalidJobSpec, errors.InvalidName, errors.SchemaMismatch, errors.Conflict, errors.DataLost):
        answer = httpx.Response(errors.http_status(cls("x")), json={"error": errors.error_kind(cls), "detail": "why"})
        with pytest.raises(cls, match="why") as caught:
            _raise_for(answer)
        assert type(caught.value) is cls
    assert errors.error_of("", 409) is errors.Conflict and errors.error_of("", 422) is errors.InvalidRequest
    assert errors.error_of("not_found", 404) is errors.NotFound
    assert errors.error_of("method_not_allowed", 405) is errors.error_of("", 418) is errors.KnitTransError


def test_node_reads_merge_contiguous_rows_of_a_unit() -> None:
    rows = [("n0", "u0", 3), ("n0", "u0", 4), ("n0", "u0", 7), ("n0", "u1", 0), ("n1", "u2", 5), ("n1", "u2", 6)]
    assert node_reads([]) == {}
    assert node_reads(rows) == {
        "n0": (UnitRead(unit_id="u0", row_ranges=((3, 5), (7, 8))), UnitRead(unit_id="u1", row_ranges=((0, 1),))),
        "n1": (UnitRead(unit_id="u2", row_ranges=((5, 7),)),),
    }
    with pytest.raises(InvalidTicket, match="rows of node 'n0' are not contiguous"):
        node_reads([("n0", "u0", 0), ("n1", "u1", 0), ("n0", "u0", 1)])
    with pytest.raises(InvalidTicket, match="overlap or are unsorted"):
        node_reads([("n0", "u0", 5), ("n0", "u0", 2)])


def test_join_tickets() -> None:
    a = Ticket(job="j", reads=(UnitRead(unit_id="u0", row_ranges=((0, 2),)),), columns=("x",), grants=("g1",))
    b = Ticket(job="j", reads=(UnitRead(unit_id="u1", row_ranges=((4, 5),)),), columns=("x",), grants=("g1", "g2"))
    joined = join_tickets([a, b])
    assert joined.reads == a.reads + b.reads and joined.columns == ("x",) and joined.grants == ("g1", "g2")
    assert join_tickets([a]) is a
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
