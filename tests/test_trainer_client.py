"""TrainerClient against real processes: control plane + store nodes (LocalCluster), real writer units."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from knittrans.errors import InvalidRequest, NotFound, Unavailable
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.manifest import RankPlan
from knittrans.procs import knittrans_command, wait_until
from knittrans.trainer.client import MiniBatch, TrainerClient, TrainerConfig, TrainMicroBatch
from knittrans.trainer.minibatch import Upcoming
from knittrans.trainer.share import ShareStreams
from tests.gc_support import assert_no_cycles_of_ours, cyclic_gc_off
from tests.trainer_support import job_spec, mm_groups, write_and_register

BIG_IMAGE = (4, 256, 256)  # 256 KiB per group


def _client(
    c: LocalCluster, job: str, mode: str, *, rank: int = 0, world: int = 1, transform: Any = None, **kw: Any
) -> TrainerClient:
    return TrainerClient(
        TrainerConfig(
            control_url=c.control_url, job=job, rank=rank, world_size=world, fetch_mode=mode, poll_timeout_s=5, **kw
        ),  # type: ignore[arg-type]
        transform=transform,
    )


def _tensors(m: TrainMicroBatch) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in vars(m.batch).items() if isinstance(v, torch.Tensor)}
    out.update({f"media:{h}": t for h, t in m.media.items()})
    return out


def _one_rank_plan(c: LocalCluster, job: str, *, groups: int, micro_batch_size: int, groups_per_unit: int) -> RankPlan:
    """A one-rank job of ``groups`` multimodal groups of 4, written and registered; its first plan."""
    control = c.control()
    control.create_job(job_spec(job, groups=groups, group_size=4, k=1, world_size=1, micro_batch_size=micro_batch_size))
    write_and_register(control, job, c.stores, mm_groups(job, groups, group_size=4), groups_per_unit=groups_per_unit)
    got = control.manifest(job, 0, timeout_s=10)
    assert got is not None
    return got[0].share(0)


def test_eager_and_iter_give_identical_tensors(cluster: LocalCluster) -> None:
    """The same plan iterated eagerly and with prefetching yields equal tensors, media and row entries."""
    job = "same"
    plan = _one_rank_plan(cluster, job, groups=4, micro_batch_size=3, groups_per_unit=2)
    assert len(plan.micro_batches) == 6  # 16 rows / 3, over two nodes
    results, waits = {}, {}
    for mode in ("eager", "iter"):
        with _client(cluster, job, mode) as client:
            mb = client.minibatch(plan)
            results[mode] = [(_tensors(m), m.rows) for m in mb]
            waits[mode] = [t.wait_s for t in mb.timings]
    # the loop waited (exposed transfer): eager for the whole share at its first micro-batch, iter at each
    assert waits["eager"][0] > 0 and waits["eager"][1:] == [0.0] * 5 and all(w > 0 for w in waits["iter"])
    assert len(results["eager"]) == len(results["iter"]) == 6
    for (te, re_), (ti, ri) in zip(results["eager"], results["iter"], strict=True):
        assert re_ == ri and te.keys() == ti.keys()
        torch.testing.assert_close(te, ti, rtol=0, atol=0)
    assert sum(int(t["rewards"].numel()) for t, _ in results["iter"]) == 16


def test_without_fetch_media_the_rows_come_without_their_media(cluster: LocalCluster) -> None:
    """``fetch_media=False``: the micro-batches' rows still name their media, but none is fetched or decoded."""
    job = "no-media"
    plan = _one_rank_plan(cluster, job, groups=2, micro_batch_size=4, groups_per_unit=1)
    assert all(micro.media for micro in plan.micro_batches)
    for mode in ("eager", "iter"):
        with _client(cluster, job, mode, fetch_media=False) as client:
            mb = client.minibatch(plan)
            got = list(mb)
        assert [m.batch.num_rows for m in got] == [4, 4] and all(m.batch.media_hex() for m in got)
        assert [m.media for m in got] == [{}, {}] and mb.transfer()["media_logical_bytes"] == 0


def test_transform_runs_off_the_training_thread(cluster: LocalCluster) -> None:
    """``transform`` runs in the prefetch thread (iter) and its errors reach the loop at their micro-batch."""
    job = "transform"
    plan = _one_rank_plan(cluster, job, groups=2, micro_batch_size=4, groups_per_unit=1)
    assert len(plan.micro_batches) == 2

    def collate(m: TrainMicroBatch) -> tuple[str, int, torch.Tensor]:
        return threading.current_thread().name, m.index, m.batch.rewards.sum()

    main = threading.current_thread().name
    for mode in ("eager", "iter"):
        with _client(cluster, job, mode, transform=collate) as client:
            got = list(client.minibatch(plan))
        assert [m.prepared[1] for m in got] == [0, 1]
        for m in got:
            torch.testing.assert_close(m.prepared[2], m.batch.rewards.sum())
            assert m.timing.transform_s > 0
        threads = {m.prepared[0] for m in got}
        assert (threads == {main}) if mode == "eager" else (main not in threads), (mode, threads)

    def broken(m: TrainMicroBatch) -> None:
        if m.index == 1:
            raise InvalidRequest("collate cannot pad micro-batch 1")

    with _client(cluster, job, "iter", transform=broken) as client:
        seen = []
        with pytest.raises(InvalidRequest, match="cannot pad micro-batch 1"):
            for m in client.minibatch(plan):
                seen.append(m.index)
        assert seen == [0]


def test_a_failed_media_fetch_names_plan_micro_batch_and_node(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A media read that fails is raised in the loop as its own error class, naming the plan, the micro-batch and
    the store node(s) it reads, like a failed rows read."""
    job = "media-fail"
    plan = _one_rank_plan(cluster, job, groups=2, micro_batch_size=4, groups_per_unit=1)
    micro = plan.micro_batches[0]
    assert micro.media

    def lost(self: ShareStreams, hashes: Sequence[str]) -> dict[str, Any]:
        raise NotFound(f"media {hashes[0]} is gone")

    monkeypatch.setattr(ShareStreams, "media", lost)
    with _client(cluster, job, "eager") as client, pytest.raises(NotFound) as info:
        list(client.minibatch(plan))
    message = str(info.value)
    assert message.startswith(f"plan {plan.plan_id} micro-batch 0: fetch from store node ") and "is gone" in message
    assert all(f"{f.node_id} ({f.endpoint})" in message for f in [*micro.fetches, *micro.media]), message


def _compute(cost: int) -> None:
    """A real, known amount of CPU work (matmuls), no sleeping."""
    a = torch.randn(96, 96)
    for _ in range(cost):
        a = torch.tanh(a @ a)


def _calibrate(target_s: float) -> int:
    _compute(5)
    t0 = time.perf_counter()
    _compute(50)
    per = (time.perf_counter() - t0) / 50
    return max(1, int(target_s / per))


def _train(client: TrainerClient, cost: int) -> list[MiniBatch]:
    done = []
    for mb in client.minibatches():
        for _ in mb:
            _compute(cost)
        done.append(mb)
    return done


@pytest.mark.timing
def test_iter_prefetches_and_plans_ahead(cluster: LocalCluster) -> None:
    """Eager, iter and plan-ahead modes deliver every micro-batch; eager waits for all its fetches before
    the first micro-batch; with prefetch_next (default) the next mini-batch's plan arrives (via
    ``next?after=``) before the current one is acked. How much transfer iter hides is a speed property,
    measured by ``benchmarks/trainer`` (exposed/fetch ratios), not asserted here."""
    control = cluster.control()
    for job, k in (("ovl-eager", 1), ("ovl-iter", 1), ("ovl-ahead", 2)):
        control.create_job(job_spec(job, groups=8, group_size=8, k=k, world_size=1, micro_batch_size=8))
        write_and_register(control, job, cluster.stores, mm_groups(job, 8, group_size=8, image_shape=BIG_IMAGE))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _client(cluster, "ovl-eager", "eager") as client:
            eager = _train(client, 1)
        cost = _calibrate(0.03)
        with _client(cluster, "ovl-iter", "iter", prefetch_depth=2) as client:
            it = _train(client, cost)
        with _client(cluster, "ovl-ahead", "iter") as client:  # prefetch_next is the default
            ahead = _train(client, cost)
    finally:
        torch.set_num_threads(threads)
    assert len(eager) == len(it) == 1 and len(ahead) == 2
    assert all(len(mb.timings) == 8 for mb in [*eager, *it]) and all(len(mb.timings) == 4 for mb in ahead)
    eager_wait = sum(t.wait_s for t in eager[0].timings)
    eager_fetch = sum(t.fetch_s for t in eager[0].timings)
    assert eager_wait >= eager_fetch  # eager waits for every fetch before the first micro-batch
    # the second mini-batch's plan came before the first was acked (after its optimizer step, in a real loop)
    assert ahead[0].acked_at is not None and ahead[1].received_at < ahead[0].acked_at


def test_every_row_reaches_exactly_one_rank(cluster: LocalCluster) -> None:
    """Two ranks (threads) consume a 3-mini-batch job: every written trajectory arrives once, at one rank."""
    job = "once"
    control = cluster.control()
    control.create_job(job_spec(job, groups=6, group_size=4, k=3, world_size=2, micro_batch_size=3))
    descs = write_and_register(control, job, cluster.stores, mm_groups("o", 6, group_size=4), groups_per_unit=3)
    seen: dict[int, list[str]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with _client(cluster, job, "iter", rank=r, world=2) as client:
                for mb in client.minibatches():
                    for m in mb:
                        assert m.batch.table is not None
                        seen[r] += m.batch.table.column("traj_id").to_pylist()
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    expected = {f"{g.group_id}.{i}" for d in descs for g in d.groups for i in range(g.num_trajectories)}
    assert seen[0] and seen[1]
    assert len(seen[0]) + len(seen[1]) == len(expected) == 24
    assert set(seen[0]) | set(seen[1]) == expected and not set(seen[0]) & set(seen[1])
    assert control.status(job)["state"] == "completed"


@pytest.mark.timing
def test_mini_batch_admitted_after_the_ack_is_loaded_by_the_waiting_prefetch_thread(cluster: LocalCluster) -> None:
    """Once a mini-batch is loaded its prefetch thread waits for the next share; a mini-batch admitted only
    after the ack reaches it through the feed, starts loading there, and is what the loop gets next."""
    job = "late"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=1, world_size=1, micro_batch_size=4, total_steps=2))
    write_and_register(control, job, cluster.stores, mm_groups("late-a", 4, group_size=2))
    with _client(cluster, job, "iter") as client:
        loop = iter(client.minibatches())
        first = next(loop)
        assert len(list(first)) == 2
        first.ack()
        write_and_register(control, job, cluster.stores, mm_groups("late-b", 4, group_size=2))
        # the prefetch thread of the first mini-batch builds the second (private: no public handle on it)
        wait_until(lambda: first._successor._mini_batch is not None, timeout_s=20, what="the successor started")
        second = next(loop)
        assert second.global_index == 1 and second.step == first.step + 1
        assert [m.batch.num_rows for m in second] == [4, 4]
        second.ack()
        assert next(loop, None) is None


def test_leaving_a_loaded_mini_batch_early_does_not_wait_for_the_next_share(cluster: LocalCluster) -> None:
    """The loop leaving a mini-batch early (its training step raised) while the prefetch thread, done with it,
    waits for the next mini-batch's share (not admitted yet): the loop goes on at once, not after the thread's
    30 s join timeout, and no successor is started behind the loop's back."""
    job = "early-exit"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=1, world_size=1, micro_batch_size=4, total_steps=2))
    write_and_register(control, job, cluster.stores, mm_groups("early-a", 4, group_size=2))  # mini-batch 0 only
    with _client(cluster, job, "iter", prefetch_depth=4) as client:
        first = next(iter(client.minibatches()))
        micro = iter(first)
        next(micro)
        assert first._queue is not None
        wait_until(lambda: first._queue.qsize() == 2, timeout_s=20, what="the last micro-batch and the end queued")
        time.sleep(0.2)  # the thread is now waiting for mini-batch 1's share
        t0 = time.monotonic()
        micro.close()  # what an exception in the loop's step does to the generator
        assert time.monotonic() - t0 < 5
        assert first.take_successor() is None and not first.complete
        first.abandon()


def test_leaving_a_mini_batch_ends_its_prefetch_thread_blocked_on_a_full_queue(cluster: LocalCluster) -> None:
    """A prefetch thread waiting to hand over a micro-batch (its queue full: the loop is behind) ends when the
    mini-batch is abandoned, or the loop over it left early, instead of blocking for ever on the queue."""
    job = "abandon-full"
    plan = _one_rank_plan(cluster, job, groups=4, micro_batch_size=2, groups_per_unit=2)
    assert len(plan.micro_batches) == 8
    with _client(cluster, job, "iter", prefetch_depth=1) as client:
        mb = client.minibatch(plan)
        micro = iter(mb)
        assert next(micro).index == 0
        wait_until(lambda: mb._queue.full(), timeout_s=20, what="the prefetch queue full")
        mb.abandon()
        assert mb._worker is not None and not mb._worker.is_alive()
        # leaving the loop over a mini-batch early stops its thread too (it would hold the mini-batch for ever)
        left = client.minibatch(plan)
        for _ in left:
            wait_until(lambda: left._queue.full(), timeout_s=20, what="the prefetch queue full")
            break
        assert left._worker is not None
        wait_until(lambda: not left._worker.is_alive(), timeout_s=20, what="the prefetch thread ended")


def test_abandoning_a_mini_batch_stops_the_successor_its_thread_started(cluster: LocalCluster) -> None:
    """The prefetch thread of a read mini-batch starts loading the next one; abandoning the first stops that one
    too (its thread ends and its calls are closed), and the loop asks for the first one again."""
    job = "abandon-next"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=2, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 4, group_size=2))
    with _client(cluster, job, "iter", prefetch_depth=1, replan_wait_s=0) as client:
        loop = iter(client.minibatches())
        first = next(loop)
        assert len(list(first)) == 2
        wait_until(lambda: first._successor._mini_batch is not None, timeout_s=20, what="the successor started")
        second = first._successor._mini_batch
        assert second is not None and second.global_index == 1
        first.abandon()
        assert second._worker is not None and not second._worker.is_alive() and not second._streams._rows
        again = next(loop)  # not re-planned (no node was lost): the same plan again, at once (replan_wait_s=0)
        assert (again.global_index, again.plan_id) == (0, first.plan_id) and len(list(again)) == 2


def test_a_mini_batch_given_up_before_its_share_came_is_not_started(cluster: LocalCluster) -> None:
    """``Upcoming.take`` (the loop asking itself, or leaving) ends a load waiting for its share, quietly; a share
    already on its way is then not started behind the loop's back (a prefetch thread nobody would stop)."""
    job = "taken-first"
    control = cluster.control()
    control.create_job(job_spec(job, groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2, total_steps=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 2, group_size=2))  # mini-batch 0, not 1
    with _client(cluster, job, "iter") as client:
        assert client.feed.share(0) is not None  # in the feed: the next load finds it at once
        upcoming = Upcoming()
        assert upcoming.take() is None
        upcoming.load(client.context, 0)
        assert upcoming._mini_batch is None
        upcoming.load(client.context, 1)  # not admitted: gives up at once, without an error
        waiting = Upcoming()
        loader = threading.Thread(target=waiting.load, args=(client.context, 1))
        loader.start()
        assert waiting.take() is None
        wait_until(lambda: not loader.is_alive(), timeout_s=20, what="the load to stop waiting")
        assert waiting._mini_batch is None


def test_an_eager_first_mini_batch_started_before_the_loop_is_read_by_the_loop_alone(cluster: LocalCluster) -> None:
    """The client's start thread starts the first mini-batch as soon as its share is in; in ``eager`` mode it
    gets no prefetch thread (the loop reads the whole share itself, and a share's streams have one reader)."""
    job = "eager-first"
    control = cluster.control()
    control.create_job(job_spec(job, groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 2, group_size=2))
    with _client(cluster, job, "eager") as client:
        wait_until(lambda: client._first._mini_batch is not None, timeout_s=20, what="the first mini-batch started")
        started = client._first._mini_batch
        assert started is not None and started._worker is None
        read = [(mb, [m.batch.num_rows for m in mb]) for mb in client.minibatches()]
        assert len(read) == 1 and read[0][0] is started and read[0][1] == [2, 2]


def _earlier_ranks_done() -> None:
    """Wait for earlier tests' prefetch and start threads to end (they take well under a second): each may hold
    a client of its test, which would be freed, cycles and all, during the next test's count of cycles. Only
    isolation, no check: the count goes on after 30 s all the same."""
    names = ("knittrans-prefetch", "knittrans-start", "knittrans-feed")
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name.startswith(names)],
            timeout_s=30,
            what="earlier tests' rank threads to end",
        )


def _rows(m: TrainMicroBatch) -> int:
    return m.batch.num_rows


@pytest.mark.parametrize("kw", [{}, {"fetch_mode": "eager", "transform": _rows}], ids=["iter", "eager"])
def test_a_closed_client_is_freed_without_the_cyclic_gc(cluster: LocalCluster, kw: dict[str, Any]) -> None:
    """A rank's client, once it has served a mini-batch and is closed, is freed by reference counting with
    all it owns (control client, feed, fetcher, media cache): before, its mini-batches' context held the
    client's bound ``prepare``, so every dropped client waited for the cyclic GC, and a test counting
    cycles failed whenever an earlier test's client was freed during it."""
    job = f"drop-{len(kw)}-{kw.get('fetch_mode', 'iter')}"
    control = cluster.control()
    control.create_job(job_spec(job, groups=3, group_size=4, k=3, world_size=1, micro_batch_size=4))
    write_and_register(control, job, cluster.stores, mm_groups(job, 3, group_size=4), groups_per_unit=1)
    kw = dict(kw)
    mode, transform = kw.pop("fetch_mode", "iter"), kw.pop("transform", None)
    _earlier_ranks_done()
    with cyclic_gc_off():
        client = _client(cluster, job, mode, transform=transform, **kw)
        with client:
            served = []
            for mb in client.minibatches():
                served += [(m.batch.num_rows, m.prepared) for m in mb]
                mb.ack()
            assert served == [(4, None if transform is None else 4)] * 3
        freed = weakref.ref(client)
        del client, mb
        wait_until(lambda: freed() is None, timeout_s=20, what="the closed client freed")
        assert_no_cycles_of_ours()


def test_a_finished_mini_batch_is_freed_without_the_cyclic_gc(cluster: LocalCluster) -> None:
    """Nothing a mini-batch owns (media cache, successor poll, prefetch thread) refers back to it, so once
    the loop moves on the mini-batch and its micro-batches' tables and tensors are freed by reference
    counting. With the cyclic GC off they are gone all the same, and the loop leaves no reference cycle of
    ours or of httpx's behind; before, each mini-batch left ~310 objects in cycles, whose collections
    paused the training thread for milliseconds at random mini-batches."""
    job = "freed"
    control = cluster.control()
    control.create_job(job_spec(job, groups=6, group_size=4, k=3, world_size=1, micro_batch_size=4))
    write_and_register(control, job, cluster.stores, mm_groups(job, 6, group_size=4), groups_per_unit=2)
    refs: list[tuple[int, weakref.ref[Any]]] = []
    _earlier_ranks_done()
    with cyclic_gc_off(), _client(cluster, job, "iter") as client:
        for mb in client.minibatches():
            for m in mb:
                tensors = [weakref.ref(t) for t in _tensors(m).values()]
                refs += [(mb.global_index, r) for r in [weakref.ref(m.batch.table), *tensors]]
            refs.append((mb.global_index, weakref.ref(mb)))
            mb.ack()
        del mb, m, tensors
        assert {n for n, _ in refs} == {0, 1, 2}
        # a mini-batch's prefetch thread (its successor poll) holds it until the thread ends
        wait_until(lambda: [n for n, r in refs if r() is not None and n < 2] == [], timeout_s=20, what="refcount frees")
        # and the loop left no cycles of ours or of the HTTP client's (each control-plane response was one)
        assert_no_cycles_of_ours()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster these failure tests may break."""
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=2)) as c:
        yield c


def test_a_second_loop_over_one_client_is_refused(cluster: LocalCluster) -> None:
    """minibatches() runs once per client: a second loop would start over at the first share (already acked and
    released), so it raises at once instead of waiting."""
    control, job = cluster.control(), "twice"
    control.create_job(job_spec(job, groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 2, group_size=2))
    with _client(cluster, job, "iter") as client:
        assert len(_train(client, 1)) == 1
        with pytest.raises(InvalidRequest, match="runs once per client"):
            next(iter(client.minibatches()))


def test_torch_threads_sets_the_process_torch_threads(cluster: LocalCluster) -> None:
    """``torch_threads`` is applied with ``torch.set_num_threads`` when the client is built (None leaves it)."""
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        with _client(cluster, "threads", "iter", torch_threads=want):
            assert torch.get_num_threads() == want
        with _client(cluster, "threads", "iter"):
            assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_the_loop_forgets_the_shares_it_is_past(cluster: LocalCluster) -> None:
    """Once a mini-batch is acked the feed drops its share (and the shares before it): they do not pile up."""
    control, job = cluster.control(), "forget"
    control.create_job(job_spec(job, groups=6, group_size=2, k=3, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 6, group_size=2))
    seen = []
    with _client(cluster, job, "iter") as client:
        for mb in client.minibatches():
            assert min(client.feed.arrived) == mb.global_index
            seen.append(mb.global_index)
            list(mb)
    assert seen == [0, 1, 2]


def test_replan_forgets_the_shares_before_the_replanned_one(cluster: LocalCluster) -> None:
    """``replan`` (public: a loop of its own may call it) gives the share of the same global index again and drops
    the feed's shares before it."""
    control, job = cluster.control(), "replan-forget"
    control.create_job(job_spec(job, groups=6, group_size=2, k=3, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 6, group_size=2))
    with _client(cluster, job, "eager", replan_wait_s=0) as client:
        wait_until(lambda: {0, 1} <= set(client.feed.arrived), timeout_s=20, what="two shares")
        failed = client._minibatch(client.feed.share(1))
        assert failed is not None
        again = client.replan(failed)
        assert again is not None and again.global_index == 1
        assert min(client.feed.arrived) == 1
        failed.stop()
        again.stop()


def test_close_stops_the_mini_batches_the_feed_and_the_connections(cluster: LocalCluster) -> None:
    """``close`` stops a first mini-batch loading before the loop asked for it, or the loop's current one, the
    feed's thread, and closes the store and control-plane connections; ``report_version`` reaches the control
    plane."""
    control, job = cluster.control(), "closing"
    control.create_job(job_spec(job, groups=4, group_size=2, k=1, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 4, group_size=2))
    client = _client(cluster, job, "iter")
    wait_until(lambda: client._first._mini_batch is not None, timeout_s=20, what="the first mini-batch")
    early = client._first._mini_batch
    assert early is not None
    client.close()
    assert early._stop.is_set()
    with _client(cluster, job, "iter") as client:
        mb = next(client.minibatches())
        client.report_version(7)
        assert control.get_version(job) == 7
    assert mb._stop.is_set()
    assert client.feed._closed.is_set()
    assert client.fetcher._closed
    assert client.control._http.is_closed


def test_a_mini_batch_left_half_done_is_refused(cluster: LocalCluster) -> None:
    """A mini-batch iterated once cannot be iterated again; the loop moving past one that was neither fully
    iterated, abandoned nor acked raises (acking it would lose rows) instead of acking it."""
    control, job = cluster.control(), "half"
    control.create_job(job_spec(job, groups=2, group_size=2, k=2, world_size=1, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups(job, 2, group_size=2))
    with _client(cluster, job, "eager") as client:
        loop = client.minibatches()
        mb = next(loop)
        assert len(list(mb)) == mb.num_micro_batches
        with pytest.raises(InvalidRequest, match="already iterated"):
            next(iter(mb))
        mb = next(loop)
        with pytest.raises(InvalidRequest, match=f"{mb.plan_id} was neither fully iterated, abandoned nor acked"):
            next(loop)
        assert mb._stop.is_set()  # its prefetch stopped before the error reached the loop
    assert control.progress(job)["position"] == 1  # the first one acked, the second not


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"rank": 2}, "outside world_size 2"),
        ({"fetch_mode": "lazy"}, "fetch_mode must be"),
        ({"prefetch_depth": 0}, "prefetch_depth"),
        ({"fetch_timeout_s": 0}, "fetch_timeout_s"),
        ({"replan_wait_s": -1}, "replan_wait_s"),
        ({"torch_threads": 0}, "torch_threads"),
        ({"group": "all"}, "group must be"),
        ({"poll_timeout_s": 0}, "poll_timeout_s must be > 0"),
        ({"control_retry_s": -1}, "control_retry_s >= 0"),
    ],
)
def test_trainer_config_refuses_bad_settings(bad: dict[str, Any], needle: str) -> None:
    """Each setting out of range raises at construction, naming the setting."""
    with pytest.raises(ValueError, match=needle):
        TrainerConfig(control_url="http://127.0.0.1:1", job="j", **{"rank": 0, "world_size": 2, **bad})


def test_store_node_killed_mid_mini_batch_names_the_node(own_cluster: LocalCluster) -> None:
    """Micro-batches on the live node arrive; the first one on the killed node raises naming node and endpoint."""
    c, job = own_cluster, "kill"
    control = c.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=1, world_size=1, micro_batch_size=2))
    write_and_register(control, job, c.stores, mm_groups("k", 4, group_size=2))  # round-robin: 2 groups per node
    dead = c.stores[1]
    c.procs.kill(dead.name)  # before the manifest is read: the node is not declared lost (30 s timeout)
    for mode in ("iter", "eager"):
        got: list[int] = []
        with _client(c, job, mode) as client:
            mb = next(iter(client.minibatches()))
            with pytest.raises(Unavailable) as info:
                for m in mb:
                    got.append(m.index)
        message = str(info.value)
        assert dead.node_id in message and dead.endpoint in message and mb.plan_id in message, message
        assert got == ([0, 1] if mode == "iter" else [])  # node-0's micro-batches come first in read order


@pytest.mark.timing
def test_control_plane_restart_mid_job(own_cluster: LocalCluster) -> None:
    """The control plane is killed after the first mini-batch is fetched; ack and next retry until it is back."""
    c, job = own_cluster, "restart"
    control = c.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=2, world_size=1, micro_batch_size=2))
    write_and_register(control, job, c.stores, mm_groups("r", 4, group_size=2))
    port = c.control_url.rsplit(":", 1)[1]
    argv = knittrans_command(
        "control-plane",
        "--db",
        str(c.work_dir / "control.db"),
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--node-timeout-s",
        "30",
    )
    rows, indices = 0, []
    with _client(c, job, "iter") as client:
        for n, mb in enumerate(client.minibatches()):
            rows += sum(m.batch.num_rows for m in mb)
            indices.append(mb.global_index)
            if n == 0:
                c.procs.kill("control-plane")
                restart = threading.Timer(1.0, lambda: c.procs.start("control-plane", argv))
                restart.start()
            client.report_version(mb.policy_version + 1)
    restart.join()
    assert indices == [0, 1] and rows == 8
    wait_until(lambda: control.status(job)["state"] == "completed", timeout_s=20, what="job completion")
    assert control.get_version(job) == 2


def test_a_mini_batch_carries_its_manifests_identity_and_reports_no_transfer_before_it_is_read(
    cluster: LocalCluster,
) -> None:
    """Each mini-batch the loop gets names its manifest (ETag, step, index within the step, policy version,
    admission time, trajectories over all ranks: what the demo rank's records, the re-plan wait and a global loss
    normaliser use); before it is read its transfer
    figures (what an ack sends) are zeros and it has no ack time; once read and acked it has both."""
    job = "identity"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=2, k=2, world_size=1, micro_batch_size=2, total_steps=2))
    write_and_register(control, job, cluster.stores, mm_groups("id-a", 4, group_size=2))
    seen, acked = [], []
    with _client(cluster, job, "eager") as client:
        for mb in client.minibatches():
            got = control.manifest(job, mb.global_index, timeout_s=5)
            assert got is not None
            manifest, etag = got
            seen.append((mb.global_index, mb.step, mb.index, mb.policy_version))
            assert (mb.etag, mb.admitted_at, mb.attempt) == (etag, manifest.admitted_at, manifest.attempt) != ("", 0, 0)
            assert (mb.step, mb.index, mb.policy_version) == (
                manifest.step,
                manifest.mini_batch_index,
                manifest.policy_version,
            )
            assert mb.acked_at is None and set(mb.transfer().values()) == {0}
            assert sum(m.batch.num_rows for m in mb) == mb.mini_batch_trajectories == manifest.trajectories == 4
            assert mb.report_fetched() is True
            mb.ack(version=mb.policy_version + 1)
            assert mb.acked_at is not None and len(mb.timings) == 2
            acked.append((mb, mb.acked_at))
            # every micro-batch's figures were measured, and the ack sent their sums
            assert all(t.fetch_s > 0 and t.convert_s > 0 and t.bytes > 0 for t in mb.timings)
            figures = mb.transfer()
            assert figures["row_bytes"] == sum(t.bytes for t in mb.timings)
            # each group's one image is used by its 2 responses, fetched once
            assert figures["media_logical_bytes"] == 2 * figures["media_physical_bytes"] > 0
            if mb.global_index == 1:
                write_and_register(control, job, cluster.stores, mm_groups("id-b", 4, group_size=2))
    assert seen == [(0, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 2), (3, 1, 1, 3)]  # one version per mini-batch
    assert all(mb.acked_at == at for mb, at in acked)  # the loop's own ack of an acked mini-batch sends nothing
