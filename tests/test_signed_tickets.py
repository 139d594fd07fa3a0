"""Signed ticket grants: each manifest carries one HMAC grant per store node; stores with the key serve only
what the grants cover."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.flight as flight
import pytest
import torch

from knittrans.errors import Unauthenticated
from knittrans.flight import StoreClient, StoreServer
from knittrans.grants import MAX_GRANTS, check_listing, check_ticket, sign_grant
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.manifest import Manifest, RankPlan
from knittrans.tickets import Ticket, UnitRead
from knittrans.trainer.client import TrainerClient, TrainerConfig
from tests.trainer_support import job_spec, mm_groups, write_and_register

KEY = "ticket-key-for-the-test-0123456789"


@pytest.fixture(scope="module")
def signed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Control plane and two stores sharing a ticket key (passed in the environment, never as a flag)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KNITTRANS_TICKET_KEY", KEY)
    try:
        with LocalCluster(ClusterConfig(work_dir=tmp_path_factory.mktemp("signed"), num_stores=2)) as c:
            yield c
    finally:
        mp.undo()


def _manifest(c: LocalCluster, job: str, world: int = 1) -> Manifest:
    control = c.control()
    control.create_job(job_spec(job, groups=4, group_size=4, k=1, world_size=world, micro_batch_size=3))
    write_and_register(control, job, c.stores, mm_groups(job, 4, group_size=4), groups_per_unit=2)
    got = control.manifest(job, 0, timeout_s=30)
    assert got is not None
    return got[0]


def _plan(c: LocalCluster, job: str, world: int = 1) -> RankPlan:
    return _manifest(c, job, world).share(0)


def test_trainer_fetches_a_signed_plan_through_merged_and_shared_tickets(signed_cluster: LocalCluster) -> None:
    """Eager and iter (merged DoGets, share streams, media dedup) read every row of a signed plan."""
    plan = _plan(signed_cluster, "signed-train")
    tickets = [f.ticket for m in plan.micro_batches for f in m.fetches]
    assert tickets and all(len(t.grants) == 1 for t in tickets)
    for mode in ("eager", "iter"):
        cfg = TrainerConfig(
            control_url=signed_cluster.control_url,
            job="signed-train",
            rank=0,
            world_size=1,
            fetch_mode=mode,
            poll_timeout_s=5,
        )  # type: ignore[arg-type]
        with TrainerClient(cfg) as client:
            got = list(client.minibatch(plan))
        assert sum(int(m.batch.rewards.numel()) for m in got) == 16
        assert all(isinstance(t, torch.Tensor) for m in got for t in m.media.values())


def test_one_grant_per_node_serves_every_ranks_share_and_only_that_node(signed_cluster: LocalCluster) -> None:
    """A two-rank manifest has one grant per node; every rank's tickets to a node carry that node's grant, each
    rank reads its rows with it, and a grant of one node does not cover the rows on the other."""
    m = _manifest(signed_cluster, "signed-world", world=2)
    grants = {n.node_id: n.grant for n in m.nodes}
    assert len(grants) == 2 and all(grants.values()) and len(set(grants.values())) == 2
    rows = 0
    for rank in range(2):
        for micro in m.share(rank).micro_batches:
            for f in micro.fetches:
                assert f.ticket.grants == (grants[f.node_id],)
                with StoreClient(f.endpoint) as c:
                    rows += c.get(f.ticket).num_rows
            assert all(x.ticket.grants == (grants[x.node_id],) for x in micro.media)
    assert rows == m.trajectories == 16
    fetch = m.share(0).micro_batches[0].fetches[0]
    other = next(g for node, g in grants.items() if node != fetch.node_id)
    assert other is not None
    with StoreClient(fetch.endpoint) as c, pytest.raises(Unauthenticated, match="not granted"):
        c.get(dataclasses.replace(fetch.ticket, grants=(other,)))


def test_store_refuses_unsigned_forged_widened_and_foreign_tickets(signed_cluster: LocalCluster) -> None:
    """Without a grant, with a bad MAC, with rows or columns beyond the grant, or for another job: 401."""
    plan = _plan(signed_cluster, "signed-probe")
    fetch = plan.micro_batches[0].fetches[0]
    ticket = fetch.ticket
    with StoreClient(fetch.endpoint) as c:
        assert c.get(ticket).num_rows == sum(stop - start for r in ticket.reads for start, stop in r.row_ranges)
        first = ticket.reads[0]
        wider = dataclasses.replace(first, row_ranges=((0, 10_000),))
        forged_mac = ticket.grants[0][:-4] + ("0000" if not ticket.grants[0].endswith("0000") else "1111")
        bad = {
            "unsigned": dataclasses.replace(ticket, grants=()),
            "forged": dataclasses.replace(ticket, grants=(forged_mac,)),
            "wider rows": dataclasses.replace(ticket, reads=(wider,)),
            "other unit": dataclasses.replace(ticket, reads=(UnitRead(unit_id="u-elsewhere", row_ranges=((0, 1),)),)),
            "other job": dataclasses.replace(ticket, job="signed-train"),
            "whole unit": dataclasses.replace(ticket, reads=(UnitRead(unit_id=first.unit_id),)),
        }
        for what, t in bad.items():
            with pytest.raises(Unauthenticated):
                c.get(t)
            assert what


def test_grants_expire_and_bind_columns() -> None:
    """A grant past its expiry, or a ticket asking for columns outside the grant, is refused."""
    key = KEY.encode()
    grant = sign_grant(key, job="j", expires_at=time.time() + 60, reads={"u": [(0, 4)]}, columns=["reward"], media={})
    ok = Ticket(job="j", reads=(UnitRead(unit_id="u", row_ranges=((1, 3),)),), columns=("reward",), grants=(grant,))
    check_ticket(key, ok, now=time.time())
    with pytest.raises(Unauthenticated, match="not granted"):
        check_ticket(key, dataclasses.replace(ok, columns=("reward", "response_ids")), now=time.time())
    with pytest.raises(Unauthenticated, match="not granted"):
        check_ticket(key, dataclasses.replace(ok, columns=None), now=time.time())
    with pytest.raises(Unauthenticated, match="expired"):
        check_ticket(key, ok, now=time.time() + 3600)
    with pytest.raises(Unauthenticated, match="signature"):
        check_ticket(b"another key", ok, now=time.time())


def test_media_tickets_and_grant_counts_are_checked() -> None:
    """A media ticket passes only with its hashes and searched units granted; more than MAX_GRANTS grants, or a
    signed payload that is not a grant, is refused."""
    key, now = KEY.encode(), time.time()
    h1, h2 = "ab" * 32, "cd" * 32
    grant = sign_grant(key, job="j", expires_at=now + 60, reads={}, columns=None, media={h1: "u1"})
    ok = Ticket(job="j", kind="media", reads=(UnitRead(unit_id="u1"),), media_hashes=(h1,), grants=(grant,))
    check_ticket(key, ok, now=now)
    with pytest.raises(Unauthenticated, match="media hash cdcdcdcd"):
        check_ticket(key, dataclasses.replace(ok, media_hashes=(h1, h2)), now=now)
    with pytest.raises(Unauthenticated, match="unit 'u2' is not granted for media reads"):
        check_ticket(key, dataclasses.replace(ok, reads=(UnitRead(unit_id="u2"),)), now=now)
    with pytest.raises(Unauthenticated, match=f"more than {MAX_GRANTS}"):
        check_ticket(key, dataclasses.replace(ok, grants=(grant,) * (MAX_GRANTS + 1)), now=now)
    payload = base64.urlsafe_b64encode(b'{"job": "j"}').decode().rstrip("=")
    signed = f"{payload}.{hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()}"
    with pytest.raises(Unauthenticated, match="malformed"):
        check_ticket(key, dataclasses.replace(ok, grants=(signed,)), now=now)


def test_store_without_a_key_still_serves_unsigned_tickets(tmp_path: Path, store_dir: Path) -> None:
    """Signing is opt-in: a store with no key serves plain tickets as before (ListFlights tickets work)."""
    from data_support import make_groups

    from knittrans.flight import StoreServer, StoreServerConfig
    from knittrans.schema import build_unit_tables
    from knittrans.store import StoreConfig

    srv = StoreServer(StoreServerConfig(store=StoreConfig(root=store_dir)))
    try:
        t = build_unit_tables(make_groups(1, 2))
        with StoreClient(srv.endpoint) as c:
            c.put_unit("job", "u0", t.traj, t.media)
            assert c.get(Ticket(job="job", reads=(UnitRead(unit_id="u0"),))).num_rows == 2
    finally:
        srv.shutdown()


def test_signed_store_lists_a_jobs_units_only_to_a_grant_of_that_job(signed_cluster: LocalCluster) -> None:
    """ListFlights/GetFlightInfo on a signed store: no grant -> 401; a grant of job A lists A's units only,
    cannot list or describe job B's, and the listed tickets (no grant) are not served."""
    plan_a = _plan(signed_cluster, "list-a")
    _plan(signed_cluster, "list-b")
    grant = plan_a.micro_batches[0].fetches[0].ticket.grants[0]
    node = plan_a.micro_batches[0].fetches[0].endpoint
    with StoreClient(str(node), token=signed_cluster.config.worker_token) as c:
        with pytest.raises(Unauthenticated, match="grant"):
            c.list_units("list-a")
        with pytest.raises(Unauthenticated, match="grant"):
            c.list_units()
        listed = c.list_units("list-a", grant=grant)
        assert listed and {u["job"] for u in listed} == {"list-a"}
        assert {u["job"] for u in c.list_units(grant=grant)} == {"list-a"}  # the grant names the job
        with pytest.raises(Unauthenticated, match="list-b"):
            c.list_units("list-b", grant=grant)
        unit = listed[0]["unit_id"]
        assert c.unit_info("list-a", unit, grant=grant)["unit_id"] == unit
        with pytest.raises(Unauthenticated, match="grant"):
            c.unit_info("list-a", unit)
        with pytest.raises(Unauthenticated, match="no grant"):
            c.get(Ticket(job="list-a", reads=(UnitRead(unit_id=unit),)))


def test_a_bare_grant_lists_its_job_and_a_grant_describes_only_units_of_its_job(
    start_server: Callable[..., StoreServer],
) -> None:
    """ListFlights criteria that is just a grant (no job and newline before it) lists that grant's job only;
    GetFlightInfo with a grant of job ``a`` describes a unit of ``a`` and refuses one of ``b``."""
    from data_support import make_groups

    from knittrans.schema import build_unit_tables

    server = start_server(ticket_key=KEY)
    t = build_unit_tables(make_groups(1, 2))
    with StoreClient(server.endpoint) as c:
        c.put_unit("a", "u0", t.traj, t.media)
        c.put_unit("b", "u1", t.traj, t.media)
    grant = sign_grant(KEY.encode(), job="a", expires_at=time.time() + 60, reads={}, columns=None, media={})
    raw = flight.connect(server.endpoint)
    assert [info.descriptor.path for info in raw.list_flights(grant.encode())] == [[b"a", b"u0"]]
    assert raw.get_flight_info(flight.FlightDescriptor.for_path("a", "u0", grant)).total_records == 2
    with pytest.raises(flight.FlightUnauthenticatedError, match="the grant is for job 'a'; it cannot list job 'b'"):
        raw.get_flight_info(flight.FlightDescriptor.for_path("b", "u1", grant))
    raw.close()


def test_a_grant_covers_reads_across_the_rows_it_lists_and_only_for_its_job() -> None:
    """The rows a grant lists one by one (unsorted, adjacent, overlapping) cover a read spanning them; a whole-unit
    read, a unit it does not list, a ticket of another job or one without a grant is refused."""
    key, now = KEY.encode(), time.time()
    rows = [(3, 4), (0, 1), (2, 3), (1, 2), (1, 3), (6, 7)]
    grant = sign_grant(key, job="j", expires_at=now + 60, reads={"u": rows}, columns=None, media={})
    ok = Ticket(job="j", reads=(UnitRead(unit_id="u", row_ranges=((0, 4), (6, 7))),), grants=(grant,))
    check_ticket(key, ok, now=now)
    refused = {
        r"rows \[\(0, 5\)\] of unit 'u'": dataclasses.replace(ok, reads=(UnitRead(unit_id="u", row_ranges=((0, 5),)),)),
        "rows all of unit 'u'": dataclasses.replace(ok, reads=(UnitRead(unit_id="u"),)),
        "unit 'v'": dataclasses.replace(ok, reads=(UnitRead(unit_id="v", row_ranges=((0, 1),)),)),
        "ticket grant is for job 'j', not 'k'": dataclasses.replace(ok, job="k"),
        r"only serves tickets signed by the control plane \(no grant\)": dataclasses.replace(ok, grants=()),
    }
    for match, ticket in refused.items():
        with pytest.raises(Unauthenticated, match=match):
            check_ticket(key, ticket, now=now)


def test_a_grant_lists_only_its_own_job() -> None:
    """check_listing: a valid grant names its job (for any job asked, or none); an empty, forged, expired or other
    job's grant is refused."""
    key, now = KEY.encode(), time.time()
    grant = sign_grant(key, job="j", expires_at=now + 60, reads={}, columns=None, media={})
    assert check_listing(key, grant, job=None, now=now) == check_listing(key, grant, job="j", now=now) == "j"
    for bad, job, match in [
        ("", None, "only with a grant of their job"),
        (grant, "k", "the grant is for job 'j'; it cannot list job 'k'"),
        (grant + "0", "j", "signature"),
        (grant.partition(".")[0], "j", "signature"),
    ]:
        with pytest.raises(Unauthenticated, match=match):
            check_listing(key, bad, job=job, now=now)
    with pytest.raises(Unauthenticated, match="expired"):
        check_listing(key, grant, job="j", now=now + 3600)
