"""TrajectoryWriter: shared dir and DoPut, read back through the node."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from data_support import make_groups

from knittrans.descriptors import UnitDescriptor
from knittrans.errors import Conflict, OverBudget
from knittrans.flight import StoreServer
from knittrans.flight.client import StoreClient
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import SCHEMA_VERSION, build_unit_tables
from knittrans.tickets import Ticket, UnitRead

Start = Callable[..., StoreServer]


def fetch(server: StoreServer, unit: str) -> pa.Table:
    """A whole unit of job ``job`` read back from the node (DoGet or its data lane)."""
    with StoreClient(server.endpoint) as client:
        return client.get(Ticket(job="job", reads=(UnitRead(unit_id=unit),)))


def test_local_and_remote_writers_store_the_same_unit(start_server: Start, store_dir: Path) -> None:
    """Shared-dir and DoPut writers seal identical rows and describe them identically."""
    server = start_server()
    groups = make_groups(3, 4)
    local = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir)
    remote = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint)
    with local, remote:
        a, b = local.write_groups(groups, unit_id="a"), remote.write_groups(groups, unit_id="b")
    assert isinstance(a, UnitDescriptor) and a.schema_version == SCHEMA_VERSION
    assert UnitDescriptor.from_dict(a.to_dict()) == a
    assert (store_dir / "job" / "a" / "traj.arrow").exists()
    ta, tb = (fetch(server, u) for u in ("a", "b"))
    assert ta.drop_columns(["finished_at"]).equals(tb.drop_columns(["finished_at"]))
    g0 = a.groups[0]
    assert [g.group_id for g in a.groups] == ["g0", "g1", "g2"] and a.num_rows == 12
    assert g0.trajectory_tokens == tuple(len(groups[0].prompt_ids) + len(r) for r in groups[0].response_ids)
    assert (g0.version_start, g0.version_end) == (0, 1)
    resp = [len(r) for r in groups[0].response_ids]
    vw = [(0 + k % 2) / 2 for k in range(4)]
    assert g0.version_weighted == pytest.approx(sum(v * n for v, n in zip(vw, resp, strict=True)) / sum(resp))
    assert g0.media_hashes[0] == groups[0].media[0].hex and len(g0.media_hashes) == 3
    assert a.num_bytes == server.store.get("job", "a").num_bytes
    assert a.groups == tuple(g for g in b.groups)  # same content, same description


def test_writer_refuses_a_store_dir_that_is_not_the_nodes(start_server: Start, tmp_path: Path) -> None:
    """A writer whose store_dir differs from the node's directory gets Conflict, and nothing is left pending."""
    server = start_server()
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=tmp_path)
    with pytest.raises(Conflict, match="is the node on another host"):
        writer.write_groups(make_groups(1))
    assert server.store.stats()["pending"] == 0


@pytest.mark.parametrize("shared_dir", [True, False], ids=["publish", "doput"])
def test_a_unit_id_the_node_has_is_refused_and_the_existing_unit_kept(
    start_server: Start, store_dir: Path, shared_dir: bool
) -> None:
    """Writing a unit id the node already holds gets Conflict and leaves that unit as it was: the refused write
    must not clean up what is not its own (it deleted it). The units of the same call before the refused one are
    removed; a pending unit a same-host publish is refused stays too."""
    server = start_server()
    kw = {"store_dir": store_dir} if shared_dir else {}
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, **kw)  # type: ignore[arg-type]
    first = writer.write_groups(make_groups(2, 4, prefix="a"), unit_id="u1")
    before = fetch(server, "u1")
    with pytest.raises(Conflict, match="'u1' of job 'job' already exists"):
        writer.write_groups(make_groups(2, 4, prefix="b"), unit_id="u1")
    assert server.store.get("job", "u1").num_bytes == first.num_bytes
    assert fetch(server, "u1").equals(before)
    units = [(u, build_unit_tables(make_groups(1, 4, prefix=u))) for u in ("u3", "u1")]
    with pytest.raises(Conflict, match="'u1' of job 'job' already exists"):
        writer.write_tables_many(units)
    assert fetch(server, "u1").equals(before)
    assert sorted(u.unit_id for u in server.store.units("job")) == ["u1"]  # u3, before the refused one, is gone
    assert server.store.stats()["pending"] == 0
    if shared_dir:  # a same-host publish is refused a pending unit too (a DoPut takes over a pending upload)
        server.store.begin("job", "u2")  # another writer's unit in the middle of its upload
        with pytest.raises(Conflict, match="'u2' of job 'job' already exists"):
            writer.write_groups(make_groups(1, 4, prefix="e"), unit_id="u2")
        assert server.store.stats()["pending"] == 1  # u2's, still there


@pytest.mark.timing
def test_local_writer_waits_for_budget_then_times_out(start_server: Start, store_dir: Path) -> None:
    """publish_units applies the node's budget to same-host writers: OverBudget after the timeout."""
    t = build_unit_tables(make_groups(20, 4))
    server = start_server(budget_bytes=int((t.traj.nbytes + t.media.nbytes) * 1.5))
    writer = TrajectoryWriter(job="job", node_id="node-0", endpoint=server.endpoint, store_dir=store_dir, timeout_s=0.2)
    writer.write_groups(make_groups(20, 4, prefix="a"))
    with pytest.raises(OverBudget, match="stayed full"):
        writer.write_groups(make_groups(20, 4, prefix="b"))
