"""Per-job user fields: declared in the job spec, written, stored, projected by DoGet and converted to torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from knittrans.api.spec import JobSpec
from knittrans.errors import InvalidJobSpec, InvalidRequest, SchemaMismatch
from knittrans.local import LocalCluster
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TRAJECTORY_COLUMNS, TrajectoryGroup, build_unit_tables, build_user_column, check_schema
from knittrans.store.store import SealSpec, StoreConfig, UnitStore
from knittrans.trainer.client import TrainerClient, TrainerConfig
from knittrans.trainer.convert import to_micro_batch
from knittrans.userfields import parse_arrow_type, parse_user_fields, user_column_to_torch
from tests.trainer_support import job_spec, mm_groups

USER = {
    "ref_logprobs": "list<float32>",
    "values": "tensor<float32>[2,3]",
    "uid": "string",
    "pair": "fixed_size_list<int64>[2]",
    "old_lp_bf16": "list<uint16>",
}


def _with_user(groups: list[TrajectoryGroup], seed: int = 1) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in groups:
        n = g.num_responses
        lens = [len(r) for r in g.response_ids]
        out.append(
            TrajectoryGroup(
                **{
                    **{k: getattr(g, k) for k in g.__dataclass_fields__},
                    "user_fields": {
                        "ref_logprobs": [rng.standard_normal(m).astype(np.float32) for m in lens],
                        "values": torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(seed)),
                        "uid": f"uid-{g.group_id}",
                        "pair": [[i, -i] for i in range(n)],
                        "old_lp_bf16": [
                            torch.randn(m).bfloat16().view(torch.int16).numpy().view(np.uint16) for m in lens
                        ],
                    },
                    "shared_user_fields": frozenset({"uid"}),
                }
            )
        )
    return out


def test_type_strings_round_trip_and_bad_types_are_named() -> None:
    """Every accepted type string parses to the Arrow type; a bad one names the field and the type."""
    for text, want in [
        ("list<float32>", pa.list_(pa.float32())),
        ("large_list<int8>", pa.large_list(pa.int8())),
        ("fixed_size_list<int64>[2]", pa.list_(pa.int64(), 2)),
        ("string", pa.string()),
        ("tensor<uint8>[3,4]", pa.fixed_shape_tensor(pa.uint8(), [3, 4])),
        ("list<list<int32>>", pa.list_(pa.list_(pa.int32()))),
    ]:
        assert parse_arrow_type(text).equals(want)
        assert parse_user_fields({"x": text})[0].type_string == text
    with pytest.raises(InvalidJobSpec, match=r"user_fields.v: unknown type 'float128'"):
        parse_user_fields({"v": "float128"})
    with pytest.raises(InvalidJobSpec, match=r"tensor<float32>.*needs a size"):
        parse_user_fields({"v": "tensor<float32>"})
    with pytest.raises(InvalidJobSpec, match="'reward' is a fixed trajectory column"):
        parse_user_fields({"reward": "float32"})


def test_job_spec_declares_user_fields_and_checks_columns() -> None:
    """The spec round-trips its user fields; ``columns`` may name them but nothing undeclared."""
    base = job_spec("uf", groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2)
    spec = JobSpec.from_dict({**base, "user_fields": USER, "columns": ["response_ids", "values"]})
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_dict(base).user_fields == {}
    with pytest.raises(InvalidJobSpec, match=r"columns: \['valuez'\] are neither"):
        JobSpec.from_dict({**base, "user_fields": USER, "columns": ["valuez"]})


def test_builder_validates_user_fields_naming_group_field_and_row() -> None:
    """Missing, undeclared, mis-sized and mis-shaped user values are refused with the field named."""
    fields = parse_user_fields(USER)
    good = _with_user(mm_groups("b", 2, group_size=3, with_media=False))
    tables = build_unit_tables(good, user_fields=fields)
    assert tables.traj.column_names == [*TRAJECTORY_COLUMNS, *USER]
    check_schema(tables.traj.schema)
    assert [f.type for f in tables.traj.schema][len(TRAJECTORY_COLUMNS) :] == [f.type for f in fields]
    g = good[0]
    with pytest.raises(InvalidRequest, match=r"declared user fields \['values'\] are missing"):
        build_unit_tables(
            [TrajectoryGroup(**{**vars(g), "user_fields": {k: v for k, v in g.user_fields.items() if k != "values"}})],
            user_fields=fields,
        )
    with pytest.raises(InvalidRequest, match=r"\['extra'\] are not declared"):
        build_unit_tables(
            [TrajectoryGroup(**{**vars(g), "user_fields": {**g.user_fields, "extra": [1, 2, 3]}})], user_fields=fields
        )
    with pytest.raises(InvalidRequest, match=r"'values' row 0: shape \(3, 2\) != declared \(2, 3\)"):
        build_unit_tables(
            [TrajectoryGroup(**{**vars(g), "user_fields": {**g.user_fields, "values": torch.zeros(3, 3, 2)}})],
            user_fields=fields,
        )
    with pytest.raises(InvalidRequest, match="'pair' has 2 values for 3 responses"):
        build_unit_tables(
            [TrajectoryGroup(**{**vars(g), "user_fields": {**g.user_fields, "pair": [[1, 2]] * 2}})], user_fields=fields
        )


def test_store_keeps_user_columns_and_refuses_a_user_column_before_the_fixed_ones(tmp_path: Path) -> None:
    """A unit with user columns after the fixed ones is stored and re-read; one that reorders them is not."""
    store = UnitStore(StoreConfig(root=tmp_path / "s"))
    tables = build_unit_tables(_with_user(mm_groups("s", 1, group_size=2)), user_fields=parse_user_fields(USER))

    def put(unit_id: str, traj: pa.Table) -> None:  # as DoPut does: begun, each part written, then sealed
        pending = store.begin("j", unit_id)
        for part, table in (("traj", traj), ("media", tables.media)):
            for batch in table.to_batches():
                pending.write(part, batch)  # type: ignore[arg-type]
        store.seal_units("j", [SealSpec(unit_id=unit_id)])

    put("u1", tables.traj)
    assert store.get("j", "u1").traj.equals(tables.traj)
    with pytest.raises(SchemaMismatch, match="columns differ"):
        put("u2", tables.traj.select(["values", *TRAJECTORY_COLUMNS]))


def test_user_fields_reach_the_trainer_projected_and_as_torch(cluster: LocalCluster) -> None:
    """Written through the real writer and control plane, DoGet projects the user columns the spec names and
    the trainer gets them as torch tensors equal to what was written."""
    control = cluster.control()
    spec = {
        **job_spec("ufe2e", groups=2, group_size=3, k=1, world_size=1, micro_batch_size=6),
        "user_fields": USER,
        "columns": ["response_ids", "ref_logprobs", "values", "uid", "old_lp_bf16"],
    }
    control.create_job(spec)
    groups = _with_user(mm_groups("e", 2, group_size=3, with_media=False))
    store = cluster.stores[0]
    with TrajectoryWriter(job="ufe2e", node_id=store.node_id, endpoint=store.endpoint, user_fields=USER) as w:
        control.register_units("ufe2e", [w.write_groups(groups)])
    config = TrainerConfig(
        control_url=cluster.control_url, job="ufe2e", rank=0, world_size=1, fetch_mode="eager", poll_timeout_s=5
    )
    got = control.manifest("ufe2e", 0, timeout_s=30)
    assert got is not None
    with TrainerClient(config) as client:
        [mb] = list(client.minibatch(got[0].share(0)))
    batch = mb.batch
    assert batch.table is not None and batch.table.column_names == spec["columns"]
    assert set(batch.user) == {"ref_logprobs", "values", "uid", "old_lp_bf16"}
    want = build_unit_tables(groups, user_fields=parse_user_fields(USER)).traj
    want_mb = to_micro_batch(want.take([int(r.row) for r in mb.rows]))  # one unit: its row index
    values, cu = batch.user["ref_logprobs"]
    torch.testing.assert_close(values, want_mb.user["ref_logprobs"][0], rtol=0, atol=0)
    assert torch.equal(cu, want_mb.user["ref_logprobs"][1])
    assert batch.user["values"].shape == (6, 2, 3) and torch.equal(batch.user["values"], want_mb.user["values"])
    assert batch.user["uid"] == want_mb.user["uid"]
    bf16 = batch.user["old_lp_bf16"][0].view(torch.bfloat16)
    assert torch.equal(bf16.view(torch.int16), want_mb.user["old_lp_bf16"][0].view(torch.int16))


def test_plain_transfer_needs_no_versions_and_may_give_a_prompt_per_response() -> None:
    """Versions default to 0 (end = start), and response_prompt_ids gives each row its own prompt; giving
    neither prompt form is refused by name."""
    g = TrajectoryGroup(
        group_id="p",
        source="s",
        response_prompt_ids=[[1, 2], [3]],
        response_ids=[[4], [5, 6]],
        response_logprobs=[[0.0], [0.0, 0.0]],
        rewards=[1.0, 0.0],
    )
    t = build_unit_tables([g]).traj
    assert t.column("prompt_ids").to_pylist() == [[1, 2], [3]]
    assert t.column("version_start").to_pylist() == [0, 0] and t.column("version_end").to_pylist() == [0, 0]
    g2 = TrajectoryGroup(
        group_id="q",
        source="s",
        prompt_ids=[1],
        response_ids=[[4]],
        response_logprobs=[[0.0]],
        rewards=[1.0],
        version_start=3,
    )
    assert build_unit_tables([g2]).traj.column("version_end").to_pylist() == [3]
    with pytest.raises(InvalidRequest, match=r"give prompt_ids .shared. or response_prompt_ids"):
        TrajectoryGroup(group_id="r", source="s", response_ids=[[4]], response_logprobs=[[0.0]], rewards=[1.0])
    with pytest.raises(InvalidRequest, match="response_prompt_ids has 1 entries for 2 responses"):
        build_unit_tables(
            [
                TrajectoryGroup(
                    group_id="x",
                    source="s",
                    response_prompt_ids=[[1]],
                    response_ids=[[4], [5]],
                    response_logprobs=[[0.0], [0.0]],
                    rewards=[1.0, 0.0],
                )
            ]
        )


def test_type_strings_that_cannot_be_parsed_name_what_is_wrong() -> None:
    """Each malformed type string (or a declaration that is no mapping) is an InvalidJobSpec saying why."""
    for text, why in [
        ("list<float32", "unbalanced '<'"),
        ("tensor<float32>[2,0]", "non-positive dimension"),
        ("fixed_size_list<int8>[2,3]", r"fixed_size_list takes one size, got \[2, 3\]"),
        ("tensor<string>[2]", "tensor elements must be numeric or bool, not string"),
        ("list<int8>[2]", r"unexpected '\[2\]' after list<...>"),
    ]:
        with pytest.raises(InvalidJobSpec, match=why):
            parse_user_fields({"v": text})
    for name in ("1v", "a b", "v" * 129, 3):
        with pytest.raises(InvalidJobSpec, match=f"name {name!r} is not valid: start with a letter"):
            parse_user_fields({name: "int8"})  # type: ignore[dict-item]
    assert parse_user_fields(None) == ()  # a writer or spec without user fields
    with pytest.raises(InvalidJobSpec, match="type must be a string"):
        parse_arrow_type(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobSpec, match="user_fields must be an object"):
        parse_user_fields(["v"])  # type: ignore[arg-type]


def test_user_columns_of_every_kind_build_and_convert_to_torch() -> None:
    """A primitive and a large_list user field build from per-row values and convert to torch; values that do not
    fit the declared type (a fixed size, a number) are refused naming field and row; a column with nulls does not
    convert."""
    num, big, pair = parse_user_fields(
        {"score": "float32", "ids": "large_list<int64>", "pair": "fixed_size_list<int8>[2]"}
    )
    score = build_user_column(num, [np.float64(0.5), torch.tensor(1.5), 2])
    assert score.type == pa.float32() and torch.equal(user_column_to_torch(score), torch.tensor([0.5, 1.5, 2.0]))
    ids = build_user_column(big, [[1, 2], [], [3]])
    assert ids.type == pa.large_list(pa.int64())
    values, cu = user_column_to_torch(pa.chunked_array([ids]))
    assert values.tolist() == [1, 2, 3] and cu.tolist() == [0, 2, 2, 3]
    pairs = user_column_to_torch(build_user_column(pair, [[1, 2], [3, 4], [5, 6]]))
    assert pairs.dtype == torch.int8 and pairs.tolist() == [[1, 2], [3, 4], [5, 6]]
    (uid,) = parse_user_fields({"uid": "string"})
    assert user_column_to_torch(build_user_column(uid, ["a", "b"])) == ["a", "b"]
    with pytest.raises(InvalidRequest, match=r"^user field 'pair' row 1: 3 values != declared size 2$"):
        build_user_column(pair, [[1, 2], [1, 2, 3]])
    one_each = build_user_column(num, [torch.tensor([0.5]), np.array([[1.5]])])  # one-element rows are numbers
    assert one_each.type == pa.float32() and one_each.to_pylist() == [0.5, 1.5]
    (ref,) = parse_user_fields({"ref": "list<float32>"})
    assert build_user_column(ref, [np.ones(2), [0.5]]).type == pa.list_(pa.float32())  # not large_list
    with pytest.raises(InvalidRequest, match="user field 'score' does not fit declared type float32"):
        build_user_column(num, ["high"])
    with pytest.raises(InvalidRequest, match="has 1 null rows; cannot convert"):
        user_column_to_torch(pa.array([1.0, None], pa.float32()))
