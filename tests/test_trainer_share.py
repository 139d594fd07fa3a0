"""ShareStreams: a rank's share read through one DoGet per node and kind, against real store processes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa
import pytest

from knittrans.errors import DataLost, InvalidRequest, NotFound
from knittrans.flight.client import StoreClient
from knittrans.local import LocalCluster
from knittrans.manifest import Manifest, RankPlan
from knittrans.plans import MicroBatchReads, RowFetch
from knittrans.tickets import Ticket, UnitRead
from knittrans.trainer.client import TrainerClient, TrainerConfig
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.share import ShareStreams, _MediaStream, _RowTaker, media_records
from tests.trainer_support import job_spec, mm_groups, write_and_register


def _plan(c: LocalCluster, job: str, *, groups: int = 6, unit: int = 2, micro: int = 4) -> RankPlan:
    control = c.control()
    control.create_job(job_spec(job, groups=groups, group_size=2, k=1, world_size=1, micro_batch_size=micro))
    write_and_register(control, job, c.stores, mm_groups(job, groups, group_size=2), groups_per_unit=unit)
    got = control.manifest(job, 0, timeout_s=30)
    assert got is not None
    return got[0].share(0)


def _doget(endpoint: str, ticket: Ticket) -> pa.Table:
    """One read of ``ticket`` from the node at ``endpoint``, on a client of its own."""
    with StoreClient(endpoint) as client:
        return client.get(ticket)


def _per_micro(micro: MicroBatchReads) -> pa.Table:
    """A micro-batch's rows read with one call per ticket, in plan order."""
    return pa.concat_tables([_doget(f.endpoint, f.ticket) for f in micro.fetches])


@pytest.mark.parametrize("local", [False, True])
def test_streams_return_what_per_micro_batch_calls_return(cluster: LocalCluster, local: bool) -> None:
    """Every micro-batch's rows and media equal the per-micro-batch DoGets', with at most 2 calls per node."""
    plan = _plan(cluster, f"share-eq-{int(local)}")
    # one node as a plain directory, the other as a (store dir, spill dir)-style sequence of roots
    dirs = {s.node_id: [str(s.store_dir)] if i else str(s.store_dir) for i, s in enumerate(cluster.stores)}
    dirs = dirs if local else {}
    with Fetcher(local_dirs=dirs) as fetcher:
        streams = ShareStreams(fetcher, plan)
        nodes = {f.node_id for m in plan.micro_batches for f in [*m.fetches, *m.media]}
        assert len(nodes) == 2 and len(plan.micro_batches) == 3
        for i, micro in enumerate(plan.micro_batches):
            got = streams.rows(i)
            assert got is not None and got.equals(_per_micro(micro))
            hashes = [m.hash for m in micro.media]
            expected = {
                h: bytes(r.data) for m in micro.media for h, r in media_records(_doget(m.endpoint, m.ticket)).items()
            }
            assert {h: bytes(r.data) for h, r in streams.media(hashes).items()} == expected
        assert streams.calls == 2 * len(nodes)
        streams.close()


def test_streams_are_read_in_order_and_only_name_planned_media(cluster: LocalCluster) -> None:
    """A micro-batch out of order and a hash not in the plan are refused with a clear error."""
    plan = _plan(cluster, "share-order")
    with Fetcher() as fetcher:
        streams = ShareStreams(fetcher, plan)
        with pytest.raises(InvalidRequest, match="out of order"):
            streams.rows(1)
        with pytest.raises(InvalidRequest, match="not in this share's plan"):
            streams.media(["ab" * 32])
        streams.close()


def test_unstreamable_plan_is_refused() -> None:
    """A rows ticket without explicit row ranges cannot be split per micro-batch (a manifest's shares never
    have one): the share is refused, naming the plan, instead of being read some other way."""
    whole = Ticket.decode(b'{"v":1,"kind":"rows","job":"j","reads":[{"unit":"u1","rows":[]}]}')
    micro = MicroBatchReads(
        index=0,
        rows=(),
        fetches=(RowFetch(node_id="n0", endpoint="grpc://127.0.0.1:1", ticket=whole),),
        media=(),
    )
    plan = RankPlan(manifest=_bare_manifest(((),)), rank=0, micro_batches=(micro,))
    with (
        Fetcher() as fetcher,
        pytest.raises(InvalidRequest, match=r"plan n0\.a0\.r0: its rows tickets cannot be streamed"),
    ):
        ShareStreams(fetcher, plan)


def test_a_micro_batch_without_rows_opens_and_reads_nothing() -> None:
    """A share whose micro-batch has no rows (the manifest format allows it) opens no call; its rows are None."""
    with Fetcher() as fetcher:
        streams = ShareStreams(fetcher, _bare_manifest((((),),)).share(0))
        assert streams.calls == 0 and streams.rows(0) is None and streams.media([]) == {}


def _bare_manifest(ranks: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]) -> Manifest:
    """A manifest of job ``j`` that names no node, unit or group: only ``ranks``' empty layout."""
    return Manifest(
        job="j",
        global_index=0,
        attempt=0,
        step=0,
        mini_batch_index=0,
        policy_version=0,
        admitted_at=0.0,
        columns=None,
        nodes=(),
        units=(),
        groups=(),
        media=(),
        ranks=ranks,
    )


def _batches(sizes: list[int]) -> Iterator[pa.RecordBatch]:
    start = 0
    for n in sizes:
        yield pa.record_batch({"x": pa.array(range(start, start + n), type=pa.int64())})
        start += n


def _opened(batches: Iterator[pa.RecordBatch]) -> Future[Iterator[pa.RecordBatch]]:
    """A call already opened (what the fetcher's pool hands a stream)."""
    done: Future[Iterator[pa.RecordBatch]] = Future()
    done.set_result(batches)
    return done


def test_row_taker_splits_batches_where_counts_end() -> None:
    """Counts that cut through and across batches get exactly their rows; a short stream raises DataLost."""
    taker = _RowTaker(_opened(_batches([3, 0, 5, 2])), "test stream")
    got = [pa.Table.from_batches(taker.take(n)).column("x").to_pylist() for n in (2, 4, 3)]
    assert got == [[0, 1], [2, 3, 4, 5], [6, 7, 8]]
    with pytest.raises(DataLost, match="test stream ended after 10 rows; 11 were asked for"):
        taker.take(2)


def test_closing_a_call_still_queued_cancels_it() -> None:
    """A call the fetcher's pool has not started opening yet is cancelled by close(), which neither waits for it
    nor raises."""
    queued: Future[Iterator[pa.RecordBatch]] = Future()
    _RowTaker(queued, "queued stream").close()
    assert queued.cancelled()


def test_media_stream_serves_hashes_in_any_order(cluster: LocalCluster) -> None:
    """Records that arrive before they are asked for are kept; a hash the stream lacks is NotFound."""
    plan = _plan(cluster, "share-media")
    media = [m for micro in plan.micro_batches for m in micro.media]
    node = media[0].node_id
    mine = list(dict.fromkeys(m.hash for m in media if m.node_id == node))
    assert len(mine) >= 2
    tickets = [m.ticket for m in media if m.node_id == node]
    units = tuple(dict.fromkeys(r for t in tickets for r in t.reads))
    ticket = Ticket(job=tickets[0].job, kind="media", reads=units, media_hashes=tuple(mine))
    with Fetcher() as fetcher:
        stream = _MediaStream(_opened(fetcher.stream(node, media[0].endpoint, ticket)), "media of the test")
        last = stream.get(mine[-1])  # the other records arrive first and are kept
        first = stream.get(mine[0])
        one = Ticket(job=ticket.job, kind="media", reads=units, media_hashes=(mine[0], mine[-1]))
        expected = media_records(_doget(media[0].endpoint, one))
        assert bytes(first.data) == bytes(expected[mine[0]].data) and bytes(last.data) == bytes(expected[mine[-1]].data)
        assert len(bytes(first.data)) == 3 * 32 * 32 and first.shape == [3, 32, 32]
        with pytest.raises(NotFound, match="not in media of the test"):
            stream.get("cd" * 32)
        stream.close()


def test_abandoned_share_cancels_its_streams(cluster: LocalCluster) -> None:
    """Stopping after one micro-batch cancels the open calls; the nodes keep serving the next fetch."""
    plan = _plan(cluster, "share-cancel", groups=8, micro=2)
    with TrainerClient(
        TrainerConfig(
            control_url=cluster.control_url,
            job="share-cancel",
            rank=0,
            world_size=1,
            fetch_mode="eager",
            data_lane=False,  # DoGet streams (a lane read arrives whole: nothing left open to cancel)
        )
    ) as client:
        mb = client.minibatch(plan)
        first = mb._load(0)
        assert first.batch.num_rows == 2
        streams = mb._streams
        assert streams is not None and streams._rows
        calls = [*streams._rows.values(), *streams._media.values()]
        generators = [c._opening.result(timeout=10) for c in calls]
        assert len(generators) == len(calls) == streams.calls == 4
        assert any(g.gi_frame is not None for g in generators)  # left open mid-share
        mb.abandon()
        assert all(g.gi_frame is None for g in generators)  # closed: the unread calls were cancelled
        assert _per_micro(plan.micro_batches[1]).num_rows == 2
    for s in cluster.stores:
        with Fetcher() as fetcher:
            assert fetcher._client(s.endpoint).health()["ok"]


@pytest.mark.parametrize("mode", ["eager", "iter"])
def test_a_mini_batch_read_to_its_end_closes_its_streams(cluster: LocalCluster, mode: str) -> None:
    """Once the loop has every micro-batch, the share's calls (not yet at their end-of-stream) are closed at
    once, not when the mini-batch is freed."""
    plan = _plan(cluster, f"share-done-{mode}", groups=8, micro=2)
    with TrainerClient(
        TrainerConfig(
            control_url=cluster.control_url,
            job=f"share-done-{mode}",
            rank=0,
            world_size=1,
            fetch_mode=mode,  # type: ignore[arg-type]
            data_lane=False,  # DoGet streams (a lane read arrives whole: nothing left open)
        )
    ) as client:
        mb = client.minibatch(plan)
        streams = mb._streams
        calls = [*streams._rows.values(), *streams._media.values()]
        generators = [c._opening.result(timeout=10) for c in calls]
        assert len(generators) == 4 and all(g.gi_frame is not None for g in generators)
        assert sum(m.batch.num_rows for m in mb) == 16
        assert all(g.gi_frame is None for g in generators)


def test_local_node_reads_a_spilled_unit_through_the_node(tmp_path: Path) -> None:
    """A unit the store spilled is not under the store directory ``local_dirs`` maps: the node serves it."""
    from data_support import make_groups

    from knittrans.flight import StoreServer, StoreServerConfig
    from knittrans.schema import build_unit_tables
    from knittrans.store import StoreConfig

    root, spill = tmp_path / "store", tmp_path / "spill"
    srv = StoreServer(StoreServerConfig(store=StoreConfig(root=root, budget_bytes=1, spill_dir=spill), node_id="n0"))
    try:
        t = build_unit_tables(make_groups(1, 2))
        ticket = Ticket(job="job", reads=(UnitRead(unit_id="u0"),))
        with StoreClient(srv.endpoint) as c, Fetcher(local_dirs={"n0": str(root)}) as fetcher:
            c.put_unit("job", "u0", t.traj, t.media)
            assert (spill / "job" / "u0").is_dir() and not (root / "job" / "u0").exists()
            assert pa.Table.from_batches(list(fetcher.stream("n0", srv.endpoint, ticket))).equals(c.get(ticket))
    finally:
        srv.shutdown()


def test_local_node_is_read_from_its_directory_not_through_the_node(tmp_path: Path) -> None:
    """A node in ``local_dirs`` is read from its store directory: its units read the same with the node gone."""
    from data_support import make_groups

    from knittrans.flight import StoreServer, StoreServerConfig
    from knittrans.schema import build_unit_tables
    from knittrans.store import StoreConfig

    root = tmp_path / "store"
    srv = StoreServer(StoreServerConfig(store=StoreConfig(root=root), node_id="n0"))
    ticket = Ticket(job="job", reads=(UnitRead(unit_id="u0"),))
    try:
        t = build_unit_tables(make_groups(1, 2))
        with StoreClient(srv.endpoint) as c:
            c.put_unit("job", "u0", t.traj, t.media)
            expected = c.get(ticket)
    finally:
        srv.shutdown()
    with Fetcher(local_dirs={"n0": str(root)}, timeout_s=2) as fetcher:
        assert pa.Table.from_batches(list(fetcher.stream("n0", srv.endpoint, ticket))).equals(expected)


def test_media_on_a_node_without_the_shares_rows_is_read_from_that_node(cluster: LocalCluster) -> None:
    """A share whose rows are all on one node but whose images are on the other (the media index may place a
    hash on a node holding another rank's unit): the media stream opens on the node the media names."""
    plan = _plan(cluster, "share-media-elsewhere")
    media_node = plan.micro_batches[0].media[0].node_id
    only = [
        dataclasses.replace(m, fetches=tuple(f for f in m.fetches if f.node_id != media_node))
        for m in plan.micro_batches
    ]
    elsewhere = dataclasses.replace(plan, micro_batches=tuple(only))
    assert all(f.node_id != media_node for m in elsewhere.micro_batches for f in m.fetches)
    with Fetcher() as fetcher:
        streams = ShareStreams(fetcher, elsewhere)
        for i, micro in enumerate(elsewhere.micro_batches):
            streams.rows(i)
            hashes = [m.hash for m in micro.media if m.node_id == media_node]
            expected = {
                h: bytes(r.data)
                for m in micro.media
                if m.node_id == media_node
                for h, r in media_records(_doget(m.endpoint, m.ticket)).items()
            }
            assert {h: bytes(r.data) for h, r in streams.media(hashes).items()} == expected
        streams.close()
