"""One rank's share of an admitted mini-batch: its micro-batches, loaded on demand or prefetched.

:class:`MiniBatch` is what :meth:`knittrans.trainer.client.TrainerClient.minibatches` yields:
iterate it once for :class:`TrainMicroBatch` es (``eager``: the whole share first; ``iter``: a
background thread loads micro-batch ``i+1``.. while ``i`` trains, then the next mini-batch's first
ones), then ``report_fetched``, step, ``ack`` — or ``abandon`` it when a fetch failed.
Each micro-batch's rows and the media it names are fetched at the same time; the media go
through the mini-batch's :class:`~knittrans.trainer.media.MediaCache`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from knittrans.controlclient import ControlClient
from knittrans.errors import Conflict, DataLost, InvalidRequest, KnitTransError
from knittrans.plans import MediaFetch, MicroBatchReads, PlanRow, RankPlan
from knittrans.trainer.config import TrainerConfig
from knittrans.trainer.convert import MicroBatch, to_micro_batch
from knittrans.trainer.fetch import Fetcher, FetchRead
from knittrans.trainer.media import MediaCache, MediaCacheStats, MediaRecord
from knittrans.trainer.share import ShareStreams, media_records

__all__ = ["MicroTiming", "MiniBatch", "RankContext", "SuccessorPoll", "TrainMicroBatch"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MicroTiming:
    """Where one micro-batch's time went, in seconds."""

    global_index: int
    micro_index: int
    rows: int
    wait_s: float = 0.0
    """Time the training loop blocked waiting for this micro-batch (exposed transfer)."""
    fetch_s: float = 0.0
    """Flight/mmap time for rows and media (media through the cache, decoding included: zero-copy)."""
    convert_s: float = 0.0
    """Arrow -> torch conversion of the rows."""
    transform_s: float = 0.0
    """The client's ``transform`` (if any), run where the micro-batch was loaded."""
    bytes: int = 0
    """Bytes of the fetched trajectory rows."""


@dataclass(frozen=True, kw_only=True)
class TrainMicroBatch:
    """One micro-batch ready to train on."""

    index: int
    batch: MicroBatch
    """Tensors of the rows (see :class:`~knittrans.trainer.convert.MicroBatch`); ``num_rows`` may be 0."""
    media: dict[str, torch.Tensor]
    """Decoded media the rows use, by hex hash (each unique hash once)."""
    rows: tuple[PlanRow, ...]
    """The plan's rows (group id, unit, node, row, tokens), in row order."""
    timing: MicroTiming
    prepared: Any = None
    """What the client's ``transform`` returned for this micro-batch (None without a transform)."""


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a :class:`MiniBatch` uses of its rank, handed in by the rank's
    :class:`~knittrans.trainer.client.TrainerClient` (which owns and closes all of it)."""

    config: TrainerConfig
    """The rank's settings (job, rank, fetch mode, prefetch depth, streams, media, poll timeout)."""
    fetcher: Fetcher
    """Store-node reads (Flight channels or memory maps)."""
    media_pool: Executor
    """Runs a micro-batch's media fetch alongside its row fetch."""
    control: ControlClient
    """Control-plane calls (``next?after=``, ``fetched``, ``ack``), retried under its retry policy."""
    prepare: Callable[[TrainMicroBatch], TrainMicroBatch]
    """The client's ``transform`` applied to a loaded micro-batch (identity without one)."""
    closed: threading.Event
    """Set once the client is closing: calls failing after it are expected, not bugs."""


class SuccessorPoll:
    """Long-polls the plan after one mini-batch's (``next?after=``) and starts loading it.

    :meth:`run` is called by the mini-batch's prefetch thread once its last micro-batch is loaded; the
    training thread later :meth:`take` s the successor (a :class:`MiniBatch` already prefetching) or
    nothing. One request waits at most :attr:`POLL_S`, so a stopped poll ends within that; ``take`` after
    the ack may let the request in flight finish (:meth:`take_after_ack`) since the plan it waits for is
    the one the caller needs next.
    """

    POLL_S = 2.0
    """Longest single ``next?after=`` request (the poll_timeout_s of the rank caps it)."""

    def __init__(
        self,
        poll: Callable[[float], RankPlan | None],
        start: Callable[[RankPlan], MiniBatch],
        *,
        acked: Callable[[], bool],
        poll_timeout_s: float,
        closed: threading.Event,
        what: str,
    ) -> None:
        self._poll, self._start, self._acked, self._closed, self._what = poll, start, acked, closed, what
        self.poll_s = min(poll_timeout_s, self.POLL_S)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        """No successor any more: end the loop at once, discard a plan that comes back."""
        self._last = threading.Event()
        """Let the request in flight finish (its plan is kept), then end the loop."""
        self._done = threading.Event()
        self._running = False
        self._successor: MiniBatch | None = None

    def run(self) -> None:
        """Poll until a plan comes (then start loading it), the job has no further one, or :meth:`take`."""
        with self._lock:
            if self._cancel.is_set():
                return
            self._running = True
        try:
            self._loop()
        finally:
            self._done.set()

    def _loop(self) -> None:
        while not self._cancel.is_set():
            try:
                plan = self._poll(self.poll_s)
            except Conflict:  # the mini-batch before this one is not acked yet (or this one already is)
                if self._acked() or self._last.is_set():
                    return
                self._cancel.wait(0.1)
                continue
            except KnitTransError as exc:  # finished, withdrawn (DataLost), control plane down
                logger.debug("no prefetch after %s: %s", self._what, exc)
                return
            except RuntimeError as exc:  # httpx after the client was closed
                (logger.debug if self._closed.is_set() else logger.warning)("no prefetch after %s: %r", self._what, exc)
                return
            if plan is None:
                if self._last.is_set():
                    return
                continue
            with self._lock:
                if self._cancel.is_set():
                    return
                self._successor = self._start(plan)
            return

    @property
    def polling(self) -> bool:
        """The poll has started (in the prefetch thread) and not ended yet."""
        with self._lock:
            return self._running and not self._done.is_set()

    def take(self, wait_s: float = 0.0) -> MiniBatch | None:
        """The successor if its plan came (already prefetching), else None; the poll stops.

        ``wait_s > 0``: a request in flight may finish first (up to ``wait_s``) instead of being abandoned.
        """
        with self._lock:
            running = self._running
        if wait_s > 0 and running:
            self._last.set()
            self._done.wait(wait_s)
        with self._lock:
            self._cancel.set()
            successor, self._successor = self._successor, None
        return successor

    def take_after_ack(self) -> MiniBatch | None:
        """:meth:`take`, letting the request in flight run to its own timeout: after the ack the plan it
        waits for is the caller's next one, which a new request could not get sooner."""
        return self.take(wait_s=self.poll_s + 1.0)


class MiniBatch:
    """A rank's share of one admitted mini-batch; iterate it once for its micro-batches."""

    def __init__(self, ctx: RankContext, plan: RankPlan) -> None:
        self._ctx = ctx
        self.plan = plan
        self.plan_id: str = str(plan.plan_id)
        self.step: int = plan.step
        self.index: int = plan.mini_batch_index
        self.global_index: int = plan.global_index
        self.attempt: int = plan.plan_id.attempt
        """Re-plan attempt of this global index (``n{n}.a{attempt}.r{rank}``)."""
        self.policy_version: int = plan.policy_version
        self.num_tokens: int = plan.num_tokens
        self.num_micro_batches = len(plan.micro_batches)
        self.received_at = time.time()
        """Wall-clock time the plan reached this rank."""
        self.admitted_at: float | None = plan.admitted_at
        """Wall-clock admission time, when the control plane puts it in the plan (else None)."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self.acked = False
        self.acked_at: float | None = None
        """Wall-clock time of the ack (None until acked)."""
        self.consumed = False
        self.complete = False
        """Every micro-batch was handed to the training loop."""
        self.abandoned = False
        self._media_of: dict[str, MediaFetch] = {}
        for micro in plan.micro_batches:
            for m in micro.media:
                self._media_of.setdefault(m.hash, m)
        cfg = ctx.config
        self._streams: ShareStreams | None = None
        """One DoGet per node and kind for the whole share (None: one per micro-batch and kind)."""
        if cfg.stream:
            try:
                self._streams = ShareStreams.from_plan(ctx.fetcher, plan, media=cfg.fetch_media)
            except KnitTransError as exc:  # a bad ticket: the per-micro-batch path reports it where it is used
                logger.debug("plan %s is fetched per micro-batch: %s", self.plan_id, exc)
        if self._streams is not None and cfg.warm_connections:
            self._streams.open()  # the calls connect and start flowing now, before the first ``next``
        # No reference back to this object from what it owns (the cache's fetch, the successor poll's
        # callbacks): a finished mini-batch, its plan and its tensors are then freed by reference counting
        # the moment the loop drops it, instead of waiting for the cyclic GC, whose collections of such
        # graphs (~160 objects per mini-batch, with httpx's ~150: see controlclient._unbound) paused the
        # training thread 6-22 ms at random mini-batches (benchmarks/trainer/README.md).
        fetch_media = functools.partial(_fetch_media, ctx.fetcher, self._media_of, self.plan_id)
        self._cache = MediaCache(self._streams.media if self._streams is not None else fetch_media)
        self._queue: queue.Queue[TrainMicroBatch | BaseException | None] | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._ack_lock = threading.Lock()
        plan_id, me = self.plan_id, weakref.ref(self)
        self.successor = SuccessorPoll(
            lambda timeout_s: ctx.control.next_plan(cfg.job, cfg.rank, timeout_s, after=plan_id),
            functools.partial(_start_successor, ctx),
            acked=lambda: (m := me()) is None or m.acked,  # dropped unacked: nobody takes a successor
            poll_timeout_s=cfg.poll_timeout_s,
            closed=ctx.closed,
            what=f"rank {cfg.rank} plan {self.plan_id}",
        )
        """The poll for the next mini-batch's plan, run by the prefetch thread after the last micro-batch."""

    @property
    def local_trajectories(self) -> int:
        """Trajectories of this rank's share (known from the plan, before any fetch)."""
        return self.plan.local_trajectories

    @property
    def mini_batch_trajectories(self) -> int | None:
        """Trajectories of the whole mini-batch over all ranks, when the plan carries the count.

        None when the control plane does not put ``mini_batch_trajectories`` in the plan; a trainer
        then sums :attr:`local_trajectories` over ranks (one all-reduce) for a global normaliser.
        """
        return self.plan.mini_batch_trajectories

    def _fetch_error(self, i: int, micro: MicroBatchReads, exc: KnitTransError) -> KnitTransError:
        """``exc`` with the plan, micro-batch and store node(s) it concerns in the message."""
        nodes = {f.node_id: f.endpoint for f in micro.fetches} | {m.node_id: m.endpoint for m in micro.media}
        named = [f"{n} ({e})" for n, e in nodes.items() if e in str(exc)] or [f"{n} ({e})" for n, e in nodes.items()]
        message = f"plan {self.plan_id} micro-batch {i}: fetch from store node {', '.join(named)} failed: {exc}"
        try:
            return type(exc)(message)
        except TypeError:  # an exception type with another constructor
            return KnitTransError(message)

    def _load(self, i: int) -> TrainMicroBatch:
        micro = self.plan.micro_batches[i]
        timing = MicroTiming(global_index=self.global_index, micro_index=i, rows=len(micro.rows))
        t0 = time.perf_counter()
        table = None
        want_media = self._ctx.config.fetch_media and bool(micro.media)
        streams = self._streams
        # Per micro-batch calls: the plan names the micro-batch's media, so their DoGet runs (in another
        # thread) while the rows' DoGet does. Streams: both already flow, read one after the other.
        ahead = (
            self._ctx.media_pool.submit(self._cache.prefetch, [m.hash for m in micro.media])
            if want_media and streams is None
            else None
        )
        try:
            if streams is not None:
                table = streams.rows(i)
            elif micro.fetches:
                reads = [FetchRead(node_id=f.node_id, endpoint=f.endpoint, ticket=f.ticket) for f in micro.fetches]
                table = self._ctx.fetcher.fetch(reads)
        except KnitTransError as exc:
            if ahead is not None and not ahead.cancel():
                ahead.exception()  # let it finish before the error ends the mini-batch (cache cleared)
            raise self._fetch_error(i, micro, exc) from exc
        t1 = time.perf_counter()
        batch = to_micro_batch(table) if table is not None else MicroBatch(num_rows=0)
        t2 = time.perf_counter()
        media: dict[str, torch.Tensor] = {}
        if want_media:
            # One request per trajectory use (the rows' own references when the media column was
            # fetched), so the cache's logical bytes are what per-trajectory copies would move.
            refs = [h for row in batch.media_hex() for h in row] if batch.media_hashes is not None else []
            try:
                if ahead is not None:
                    ahead.result()
                media = self._cache.get(refs or [m.hash for m in micro.media])
            except KnitTransError as exc:
                raise self._fetch_error(i, micro, exc) from exc
        t3 = time.perf_counter()
        timing.fetch_s = (t1 - t0) + (t3 - t2)
        timing.convert_s = t2 - t1
        timing.bytes = table.nbytes if table is not None else 0
        loaded = TrainMicroBatch(index=i, batch=batch, media=media, rows=micro.rows, timing=timing)
        return self._ctx.prepare(loaded)

    def __iter__(self) -> Iterator[TrainMicroBatch]:
        if self.consumed:
            raise InvalidRequest(f"mini-batch {self.plan_id} was already iterated")
        self.consumed = True
        try:
            if self._ctx.config.fetch_mode == "eager":
                t0 = time.perf_counter()
                loaded = [self._load(i) for i in range(self.num_micro_batches)]
                wait = time.perf_counter() - t0
                for j, m in enumerate(loaded):
                    m.timing.wait_s = wait if j == 0 else 0.0
                    self.timings.append(m.timing)
                    yield m
            else:
                yield from self._consume_prefetched()
            self.complete = True
        finally:
            self.media_stats = self._cache.clear()
            self._close_streams()

    def _close_streams(self) -> None:
        if self._streams is not None:
            self._streams.close()

    def start_prefetch(self) -> None:
        """Start the ``iter`` prefetch thread now (iterating starts it otherwise); idempotent."""
        if self._worker is not None:
            return
        depth = self._ctx.config.prefetch_depth
        q: queue.Queue[TrainMicroBatch | BaseException | None] = queue.Queue(depth)
        self._queue = q

        def put(item: TrainMicroBatch | BaseException | None) -> bool:
            while not self._stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for i in range(self.num_micro_batches):
                    if self._stop.is_set() or not put(self._load(i)):
                        return
            except BaseException as exc:  # re-raised in the training thread
                put(exc)
                return
            if put(None) and self._ctx.config.prefetch_next:
                self.successor.run()

        self._worker = threading.Thread(target=produce, name=f"knittrans-prefetch-{self.global_index}", daemon=True)
        self._worker.start()

    def _consume_prefetched(self) -> Iterator[TrainMicroBatch]:
        self.start_prefetch()
        assert self._queue is not None and self._worker is not None
        try:
            while True:
                t0 = time.perf_counter()
                item = self._queue.get()
                wait = time.perf_counter() - t0
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                item.timing.wait_s = wait
                self.timings.append(item.timing)
                yield item
        finally:
            # Once every micro-batch was handed out the thread goes on to prefetch the next mini-batch.
            if len(self.timings) != self.num_micro_batches:
                self._stop.set()
                self._worker.join(timeout=30)

    def stop(self) -> None:
        """Stop a running prefetch thread and any prefetched successor, e.g. when abandoning the mini-batch."""
        self._stop.set()
        successor = self.successor.take()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=30)
        self._close_streams()  # calls of a share not read to its end are cancelled
        if successor is not None:
            successor.stop()

    def abandon(self) -> None:
        """Give this mini-batch up without acking it (no optimizer step was taken on it).

        :meth:`TrainerClient.minibatches` then asks the control plane for this global index again
        (waiting for its re-plan); the prefetched successor, if any, is dropped.
        """
        self.abandoned = True
        self.stop()
        self._cache.clear()

    def report_fetched(self) -> bool:
        """Tell the control plane this rank holds its whole share (call before the optimizer step).

        Returns False when the plan was withdrawn (a store node with its rows was lost): then no rank
        may step on it. Once every rank reported it, a node loss no longer withdraws the mini-batch.
        """
        cfg = self._ctx.config
        try:
            self._ctx.control.fetched(cfg.job, cfg.rank, self.plan_id)
        except DataLost as exc:
            logger.warning("rank %d: plan %s was withdrawn: %s", cfg.rank, self.plan_id, exc)
            return False
        return True

    def ack(self) -> None:
        """Tell the control plane this rank finished the mini-batch (after its optimizer step)."""
        with self._ack_lock:
            if not self.acked:
                cfg = self._ctx.config
                self._ctx.control.ack(cfg.job, cfg.rank, self.plan_id, transfer=self.transfer())
                self.acked, self.acked_at = True, time.time()

    def transfer(self) -> dict[str, Any]:
        """This rank's transfer figures of the mini-batch (sent with the ack; shown by /metrics and /ui)."""
        return {
            "exposed_s": sum(t.wait_s for t in self.timings),
            "fetch_s": sum(t.fetch_s for t in self.timings),
            "row_bytes": sum(t.bytes for t in self.timings),
            "media_logical_bytes": self.media_stats.logical_bytes,
            "media_physical_bytes": self.media_stats.unique_bytes,
        }


def _start_successor(ctx: RankContext, plan: RankPlan) -> MiniBatch:
    """The next mini-batch of the rank, already prefetching (the successor poll's ``start``)."""
    successor = MiniBatch(ctx, plan)
    successor.start_prefetch()
    return successor


def _fetch_media(
    fetcher: Fetcher, media_of: dict[str, MediaFetch], plan_id: str, hashes: Sequence[str]
) -> dict[str, MediaRecord]:
    """The media records of ``hashes`` of one plan, read per micro-batch (the cache's fetch without share streams)."""
    reads = []
    for h in hashes:
        entry = media_of.get(h)
        if entry is None:
            raise InvalidRequest(f"media hash {h} is not in plan {plan_id}")
        reads.append(FetchRead(node_id=entry.node_id, endpoint=entry.endpoint, ticket=entry.ticket))
    return media_records(fetcher.fetch(reads))
