"""One rank's share of an admitted mini-batch: its micro-batches, loaded on demand or prefetched."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from knittrans.errors import InvalidRequest, KnitTransError
from knittrans.manifest import RankPlan
from knittrans.plans import MicroBatchReads, PlanRow
from knittrans.trainer.config import TrainerConfig
from knittrans.trainer.convert import MicroBatch, to_micro_batch
from knittrans.trainer.feed import ManifestFeed, Progress
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.media import MediaCache, MediaCacheStats
from knittrans.trainer.share import ShareStreams

__all__ = ["MicroTiming", "MiniBatch", "RankContext", "TrainMicroBatch", "Upcoming"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MicroTiming:
    """Where one micro-batch's time went, in seconds."""

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
    """The rank's settings (job, rank, fetch mode, prefetch depth, media, timeouts)."""
    fetcher: Fetcher
    """Store-node reads (Flight channels or memory maps)."""
    feed: ManifestFeed
    """This rank's shares of the mini-batches, in order (the successor's comes from here)."""
    progress: Progress
    """This rank's ``fetched`` and ``ack`` reports (collective when the ranks share the control plane)."""
    transform: Callable[[TrainMicroBatch], Any] | None
    """The client's ``transform``, run on each loaded micro-batch (its result is ``prepared``)."""


class MiniBatch:
    """A rank's share of one admitted mini-batch; iterate it once for its micro-batches."""

    def __init__(self, ctx: RankContext, plan: RankPlan, etag: str = "") -> None:
        self._ctx = ctx
        self.plan = plan
        self.etag = etag
        """ETag of the manifest the share was taken from (a re-plan is a manifest with another one)."""
        manifest = plan.manifest
        self.plan_id: str = plan.plan_id
        self.step: int = manifest.step
        self.index: int = manifest.mini_batch_index
        self.global_index: int = manifest.global_index
        self.attempt: int = manifest.attempt
        """Re-plan attempt of this global index."""
        self.policy_version: int = manifest.policy_version
        self.num_micro_batches = len(plan.micro_batches)
        self.received_at = time.time()
        """Wall-clock time the share reached this rank."""
        self.admitted_at: float = manifest.admitted_at
        """Wall-clock admission time of the mini-batch."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self.acked = False
        self.acked_at: float | None = None
        """Wall-clock time of the ack (None until acked)."""
        self.consumed = False
        self.complete = False
        """Every micro-batch was handed to the training loop."""
        self.abandoned = False
        self._streams = ShareStreams(ctx.fetcher, plan, media=ctx.config.fetch_media)
        """One DoGet per node and kind for the whole share (they connect and flow now, before the first ``next``)."""
        # No reference back to this object from what it owns (the cache's fetch, the prefetch thread's
        # successor): a finished mini-batch, its plan and its tensors are then freed by reference counting
        # the moment the loop drops it, instead of waiting for the cyclic GC, whose collections of such
        # graphs paused the training thread at random mini-batches.
        self._cache = MediaCache(self._streams.media)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._ack_lock = threading.Lock()
        self._successor = Upcoming()
        """The next mini-batch, loading, once the prefetch thread got its share."""

    @property
    def mini_batch_trajectories(self) -> int:
        """Trajectories of the whole mini-batch over all ranks (a global loss normaliser without an all-reduce)."""
        return self.plan.manifest.trajectories

    def _fetch_error(self, i: int, micro: MicroBatchReads, exc: KnitTransError) -> KnitTransError:
        """``exc`` with the plan, micro-batch and store node(s) it concerns in the message."""
        nodes = {f.node_id: f.endpoint for f in micro.fetches} | {m.node_id: m.endpoint for m in micro.media}
        named = [f"{n} ({e})" for n, e in nodes.items() if e in str(exc)] or [f"{n} ({e})" for n, e in nodes.items()]
        # every KnitTransError class takes just its message
        return type(exc)(f"plan {self.plan_id} micro-batch {i}: fetch from store node {', '.join(named)} failed: {exc}")

    def _load(self, i: int) -> TrainMicroBatch:
        micro = self.plan.micro_batches[i]
        timing = MicroTiming(rows=len(micro.rows))
        t0 = time.perf_counter()
        try:
            table = self._streams.rows(i)
        except KnitTransError as exc:
            raise self._fetch_error(i, micro, exc) from exc
        t1 = time.perf_counter()
        batch = to_micro_batch(table) if table is not None else MicroBatch(num_rows=0)
        t2 = time.perf_counter()
        media: dict[str, torch.Tensor] = {}
        if self._ctx.config.fetch_media and micro.media:
            # One request per trajectory use (the rows' own references when the media column was
            # fetched), so the cache's logical bytes are what per-trajectory copies would move.
            refs = [h for row in batch.media_hex() for h in row]  # none without the media column
            try:
                media = self._cache.get(refs or [m.hash for m in micro.media])
            except KnitTransError as exc:
                raise self._fetch_error(i, micro, exc) from exc
        t3 = time.perf_counter()
        timing.fetch_s = (t1 - t0) + (t3 - t2)
        timing.convert_s = t2 - t1
        timing.bytes = table.nbytes if table is not None else 0
        loaded = TrainMicroBatch(index=i, batch=batch, media=media, rows=micro.rows, timing=timing)
        transform = self._ctx.transform
        if transform is None:
            return loaded
        prepared = transform(loaded)
        timing.transform_s = time.perf_counter() - t3
        return replace(loaded, prepared=prepared)

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
            self._streams.close()

    def start_prefetch(self) -> None:
        """Start the ``iter`` prefetch thread now (iterating starts it otherwise); idempotent.

        Once it loaded the last micro-batch it waits for the next mini-batch's share (its manifest
        admitted) and starts loading that one, while the loop finishes this one, steps and acks.
        """
        if self._worker is not None:
            return
        depth = self._ctx.config.prefetch_depth
        q: queue.Queue[TrainMicroBatch | BaseException | None] = queue.Queue(depth)
        self._queue = q
        stop, ctx, successor, n = self._stop, self._ctx, self._successor, self.global_index

        def put(item: TrainMicroBatch | BaseException | None) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for i in range(self.num_micro_batches):
                    if stop.is_set() or not put(self._load(i)):
                        return
            except BaseException as exc:  # re-raised in the training thread
                put(exc)
                return
            if put(None):
                successor.load(ctx, n + 1)

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
            # Once every micro-batch was handed out the thread goes on to prefetch the next mini-batch; a loop
            # that left early stops it, also where it already waits for the next share (the successor's wait).
            if len(self.timings) != self.num_micro_batches:
                self.stop()

    def take_successor(self) -> MiniBatch | None:
        """The next mini-batch if the prefetch thread already started loading it, else None (it stops waiting)."""
        return self._successor.take()

    def stop(self) -> None:
        """Stop a running prefetch thread and any prefetched successor, e.g. when abandoning the mini-batch."""
        self._stop.set()
        successor = self._successor.take()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=30)
        self._streams.close()  # calls of a share not read to its end are cancelled
        if successor is not None:
            successor.stop()

    def abandon(self) -> None:
        """Give this mini-batch up without acking it (no optimizer step was taken on it).

        :meth:`TrainerClient.minibatches` then asks the control plane for this global index again
        (waiting for its re-plan); the prefetched successor, if any, is dropped. With a collective every
        rank must give it up (``report_fetched`` answers every rank the same, so they do).
        """
        self.abandoned = True
        self.stop()
        self._cache.clear()

    def report_fetched(self, ok: bool = True) -> bool:
        """Tell the control plane this rank holds its whole share (call before the optimizer step).

        ``ok``: False when this rank's fetch failed. With a collective every rank calls it and gets the
        same answer: True only when every rank was ok and the control plane took the report. Returns False
        when the mini-batch was withdrawn (a store node with its rows was lost): then no rank may step on
        it. Once every rank is reported, a node loss no longer withdraws the mini-batch.
        """
        return self._ctx.progress.fetched(self.global_index, self.attempt, ok)

    def ack(self, version: int | None = None) -> None:
        """Tell the control plane this rank finished the mini-batch (after its optimizer step).

        ``version``: the policy version the step produced, sent with the ack once its weights are where
        rollout loads them from; the control plane records it in the same change, so the launches the
        freed window allows see it. With a collective every rank calls it (rank 0's ``version`` counts).
        """
        with self._ack_lock:
            if self.acked:
                return
            self._ctx.progress.ack(self.global_index, self.attempt, version=version, transfer=self.transfer())
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


class Upcoming:
    """A mini-batch started as soon as its share is in the feed (by the rank's start thread for the first one, by
    the previous one's prefetch thread for the others), unless :meth:`take` came first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._mini_batch: MiniBatch | None = None

    def load(self, ctx: RankContext, n: int) -> None:
        """Wait for mini-batch ``n``'s share and start loading it, unless :meth:`take` came first."""
        try:
            shared = ctx.feed.share(n, cancel=self._cancel)
        except (TimeoutError, KnitTransError) as exc:  # taken meanwhile, the job's feed ended or failed
            logger.debug("no prefetch of mini-batch %d: %s", n, exc)
            return
        if shared is None:
            return
        with self._lock:
            if self._cancel.is_set():
                return
            self._mini_batch = MiniBatch(ctx, *shared)
            if ctx.config.fetch_mode == "iter":
                self._mini_batch.start_prefetch()

    def take(self) -> MiniBatch | None:
        """The mini-batch if it was started (then it is the caller's), else None; either way the wait ends."""
        with self._lock:
            self._cancel.set()
            found, self._mini_batch = self._mini_batch, None
        return found
