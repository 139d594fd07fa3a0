"""``TrainerClient``: one data-parallel rank's view of a job — plans in, torch micro-batches out.

::

    with TrainerClient(TrainerConfig(control_url=url, job="grpo", rank=r, world_size=w)) as client:
        for mini_batch in client.minibatches():          # long-polls the control plane
            for micro in mini_batch:                      # fetched on demand (``iter``: one ahead)
                loss = step(micro.batch, micro.media)     # MicroBatch + {hash: decoded tensor}
                loss.backward()
            optimizer.step()
            mini_batch.ack()                              # all ranks acked -> mini-batch consumed
            client.report_version(mini_batch.policy_version + 1)

In ``iter`` mode a background thread fetches and converts micro-batch ``i+1`` (up to
``prefetch_depth`` ahead) while the training thread computes ``i``; an error in that thread is
re-raised in the training thread at the micro-batch it belongs to. Every micro-batch records
``wait_s`` (time the training loop blocked on data: the *exposed* transfer time), ``fetch_s`` and
``convert_s``; :attr:`TrainerClient.timings` keeps them all.

``lookahead=True`` (``iter`` mode only) keeps the pipeline full *across* mini-batches: once the
last micro-batch of mini-batch ``n`` is fetched, the prefetch thread acks ``n`` and starts
fetching mini-batch ``n+1`` (the control plane hands a rank its next plan only after the ack).
That hides the first micro-batch's transfer of every mini-batch but acks before the optimizer
step: a rank that crashes between the early ack and its step loses that mini-batch. Off by
default.

Errors: a failed fetch is re-raised in the training thread with the plan, micro-batch and the
store node(s) (id and endpoint) it involved; control-plane calls (``next``, ``ack``, versions)
are retried with backoff for ``control_retry_s`` while the control plane is unreachable.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import pyarrow as pa
import torch

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import InvalidRequest, KnitTransError, Unavailable
from knittrans.tickets import Ticket
from knittrans.trainer.convert import MicroBatch, to_micro_batch
from knittrans.trainer.fetch import Fetcher, FetchRead
from knittrans.trainer.media import MediaCache, MediaCacheStats, MediaRecord

__all__ = ["MicroTiming", "MiniBatch", "TrainMicroBatch", "TrainerClient", "TrainerConfig"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How one rank talks to the control plane and the store nodes."""

    control_url: str
    """Base URL of the control plane, e.g. ``http://127.0.0.1:8000``."""
    job: str
    """Job name."""
    rank: int
    """This rank, ``0 <= rank < world_size``."""
    world_size: int
    """Data-parallel ranks of the job."""
    token: str | None = None
    """Worker bearer token of the control plane."""
    store_token: str | None = None
    """Bearer token of the store nodes."""
    fetch_mode: Literal["eager", "iter"] = "iter"
    """``eager``: fetch the whole share first; ``iter``: fetch micro-batch i+1 while i computes."""
    prefetch_depth: int = 2
    """Micro-batches fetched ahead in ``iter`` mode."""
    poll_timeout_s: float = 30.0
    """Long-poll timeout of one ``next`` request."""
    control_retry_s: float = 120.0
    """How long to keep retrying while the control plane is unreachable (e.g. restarting)."""
    local_dirs: Mapping[str, str] = field(default_factory=dict)
    """Store node id -> its store directory, for nodes on this host (memory-mapped reads)."""
    fetch_media: bool = True
    """Fetch and decode the media each micro-batch references (through a per-mini-batch cache)."""
    lookahead: bool = False
    """``iter`` only: ack a mini-batch once fully fetched and prefetch the next one (see module doc)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.fetch_mode not in ("eager", "iter"):
            raise ValueError(f"fetch_mode must be 'eager' or 'iter', not {self.fetch_mode!r}")
        if self.prefetch_depth < 1:
            raise ValueError("prefetch_depth must be >= 1")
        if self.lookahead and self.fetch_mode != "iter":
            raise ValueError("lookahead needs fetch_mode='iter'")
        if self.poll_timeout_s <= 0 or self.control_retry_s < 0:
            raise ValueError("poll_timeout_s must be > 0 and control_retry_s >= 0")


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
    rows: list[dict[str, Any]]
    """The plan's row entries (group id, unit, node, row, tokens), in row order."""
    timing: MicroTiming


def _media_records(table: pa.Table) -> dict[str, MediaRecord]:
    hashes = table.column("media_hash").to_pylist()
    kinds = table.column("kind").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data").chunks
    out: dict[str, MediaRecord] = {}
    i = 0
    for chunk in data:
        for j in range(len(chunk)):
            buf = chunk[j].as_buffer()
            out[hashes[i].hex()] = MediaRecord(kinds[i], shapes[i], dtypes[i], buf)
            i += 1
    return out


class _NoLookahead:
    """Marker: the prefetch thread did not look ahead (stopped early); ask the control plane."""


_NO_LOOKAHEAD = _NoLookahead()


class MiniBatch:
    """A rank's share of one admitted mini-batch; iterate it once for its micro-batches."""

    def __init__(self, client: TrainerClient, plan: dict[str, Any]) -> None:
        self._client = client
        self.plan = plan
        self.plan_id: str = plan["plan_id"]
        self.step: int = plan["step"]
        self.index: int = plan["mini_batch_index"]
        self.global_index: int = plan["global_index"]
        self.policy_version: int = plan["policy_version"]
        self.num_tokens: int = plan.get("num_tokens", 0)
        self.num_micro_batches = len(plan["micro_batches"])
        self.received_at = time.time()
        """Wall-clock time the plan reached this rank."""
        admitted = plan.get("admitted_at")
        self.admitted_at: float | None = float(admitted) if admitted is not None else None
        """Wall-clock admission time, when the control plane puts it in the plan (else None)."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self.acked = False
        self.consumed = False
        self._media_of: dict[str, dict[str, Any]] = {}
        for micro in plan["micro_batches"]:
            for m in micro.get("media", ()):
                self._media_of.setdefault(m["hash"], m)
        self._cache = MediaCache(self._fetch_media)
        self._queue: queue.Queue[TrainMicroBatch | BaseException | None] | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._ack_lock = threading.Lock()
        self.next_mini_batch: Future[MiniBatch | _NoLookahead | None] | None = (
            Future() if client.config.lookahead else None
        )
        """``lookahead`` only: resolves to the next mini-batch (None: job finished)."""

    @property
    def local_trajectories(self) -> int:
        """Trajectories of this rank's share (known from the plan, before any fetch)."""
        return sum(len(m["rows"]) for m in self.plan["micro_batches"])

    @property
    def mini_batch_trajectories(self) -> int | None:
        """Trajectories of the whole mini-batch over all ranks, when the plan carries the count.

        None when the control plane does not put ``mini_batch_trajectories`` in the plan; a trainer
        then sums :attr:`local_trajectories` over ranks (one all-reduce) for a global normaliser.
        """
        value = self.plan.get("mini_batch_trajectories")
        return int(value) if value is not None else None

    def _fetch_media(self, hashes: Sequence[str]) -> dict[str, MediaRecord]:
        reads = []
        for h in hashes:
            entry = self._media_of.get(h)
            if entry is None:
                raise InvalidRequest(f"media hash {h} is not in plan {self.plan_id}")
            reads.append(FetchRead(node_id=entry["node_id"], endpoint=entry["endpoint"],
                                   ticket=Ticket.decode(entry["ticket"].encode())))
        return _media_records(self._client.fetcher.fetch(reads))

    def _fetch_error(self, i: int, micro: dict[str, Any], exc: KnitTransError) -> KnitTransError:
        """``exc`` with the plan, micro-batch and store node(s) it concerns in the message."""
        nodes = {f["node_id"]: f["endpoint"] for f in [*micro["fetches"], *micro.get("media", ())]}
        named = [f"{n} ({e})" for n, e in nodes.items() if e in str(exc)] or [f"{n} ({e})" for n, e in nodes.items()]
        message = (f"plan {self.plan_id} micro-batch {i}: fetch from store node {', '.join(named)} failed: {exc}")
        try:
            return type(exc)(message)
        except TypeError:  # an exception type with another constructor
            return KnitTransError(message)

    def _load(self, i: int) -> TrainMicroBatch:
        micro = self.plan["micro_batches"][i]
        timing = MicroTiming(global_index=self.global_index, micro_index=i, rows=len(micro["rows"]))
        t0 = time.perf_counter()
        table = None
        try:
            if micro["fetches"]:
                reads = [FetchRead(node_id=f["node_id"], endpoint=f["endpoint"],
                                   ticket=Ticket.decode(f["ticket"].encode())) for f in micro["fetches"]]
                table = self._client.fetcher.fetch(reads)
        except KnitTransError as exc:
            raise self._fetch_error(i, micro, exc) from exc
        t1 = time.perf_counter()
        batch = to_micro_batch(table) if table is not None else MicroBatch(num_rows=0)
        t2 = time.perf_counter()
        media: dict[str, torch.Tensor] = {}
        if self._client.config.fetch_media and micro.get("media"):
            # One request per trajectory use (the rows' own references when the media column was
            # fetched), so the cache's logical bytes are what per-trajectory copies would move.
            refs = [h for row in batch.media_hex() for h in row] if batch.media_hashes is not None else []
            try:
                media = self._cache.get(refs or [m["hash"] for m in micro["media"]])
            except KnitTransError as exc:
                raise self._fetch_error(i, micro, exc) from exc
        t3 = time.perf_counter()
        timing.fetch_s = (t1 - t0) + (t3 - t2)
        timing.convert_s = t2 - t1
        timing.bytes = table.nbytes if table is not None else 0
        return TrainMicroBatch(index=i, batch=batch, media=media, rows=micro["rows"], timing=timing)

    def __iter__(self) -> Iterator[TrainMicroBatch]:
        if self.consumed:
            raise InvalidRequest(f"mini-batch {self.plan_id} was already iterated")
        self.consumed = True
        try:
            if self._client.config.fetch_mode == "eager":
                t0 = time.perf_counter()
                loaded = [self._load(i) for i in range(self.num_micro_batches)]
                wait = time.perf_counter() - t0
                for j, m in enumerate(loaded):
                    m.timing.wait_s = wait if j == 0 else 0.0
                    self.timings.append(m.timing)
                    yield m
            else:
                yield from self._consume_prefetched()
        finally:
            self.media_stats = self._cache.clear()

    def start_prefetch(self) -> None:
        """Start the ``iter`` prefetch thread now (iterating starts it otherwise); idempotent."""
        if self._worker is not None:
            return
        depth = self._client.config.prefetch_depth
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
                        self._resolve_lookahead(_NO_LOOKAHEAD)
                        return
            except BaseException as exc:  # re-raised in the training thread
                self._resolve_lookahead(_NO_LOOKAHEAD)
                put(exc)
                return
            put(None)
            if self.next_mini_batch is not None:
                self._look_ahead()

        self._worker = threading.Thread(target=produce, name=f"knittrans-prefetch-{self.global_index}", daemon=True)
        self._worker.start()

    def _resolve_lookahead(self, value: MiniBatch | _NoLookahead | None) -> None:
        if self.next_mini_batch is not None and not self.next_mini_batch.done():
            self.next_mini_batch.set_result(value)

    def _look_ahead(self) -> None:
        """Prefetch thread, ``lookahead`` mode: ack now, fetch the next plan, start its prefetch."""
        assert self.next_mini_batch is not None
        try:
            self.ack()
            plan = self._client.next_plan(stop=self._stop)
            nxt = MiniBatch(self._client, plan) if plan is not None else None
            if nxt is not None:
                nxt.start_prefetch()
            self._resolve_lookahead(nxt)
        except BaseException as exc:
            if not self.next_mini_batch.done():
                self.next_mini_batch.set_exception(exc)

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
            # In lookahead mode a fully consumed mini-batch's thread goes on to fetch the next one.
            if self.next_mini_batch is None or not self._all_yielded():
                self._stop.set()
                self._worker.join(timeout=30)

    def _all_yielded(self) -> bool:
        return len(self.timings) == self.num_micro_batches

    def stop(self) -> None:
        """Stop a running prefetch (and lookahead) thread, e.g. when abandoning the mini-batch."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=30)
        ahead = self.next_mini_batch
        if ahead is not None and ahead.done() and ahead.exception() is None:
            value = ahead.result()
            if isinstance(value, MiniBatch):
                value.stop()

    def ack(self) -> None:
        """Tell the control plane this rank finished the mini-batch (after its optimizer step)."""
        with self._ack_lock:
            if not self.acked:
                cfg = self._client.config
                self._client.call_control(lambda: self._client.control.ack(cfg.job, cfg.rank, self.plan_id))
                self.acked = True


class TrainerClient:
    """One rank: long-polls plans, fetches rows and media on demand, acks, reports versions."""

    def __init__(self, config: TrainerConfig, *, control: ControlClient | None = None) -> None:
        self.config = config
        self.control = control or ControlClient(config.control_url, token=config.token)
        self.fetcher = Fetcher(token=config.store_token, local_dirs=dict(config.local_dirs))
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self._current: MiniBatch | None = None

    def call_control(self, call: Callable[[], T]) -> T:
        """Run a control-plane call, retrying with backoff for ``control_retry_s`` while it is unreachable."""
        deadline = time.monotonic() + self.config.control_retry_s
        delay = 0.2
        while True:
            try:
                return call()
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                logger.warning("control plane %s unavailable; retrying in %.1f s", self.config.control_url, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def next_plan(self, *, stop: threading.Event | None = None) -> dict[str, Any] | None:
        """The next plan (long-polls until one comes); None when the job is finished.

        With ``stop`` (the lookahead thread), polls in 1 s slices and returns None once it is set.
        """
        cfg = self.config
        timeout = cfg.poll_timeout_s if stop is None else min(cfg.poll_timeout_s, 1.0)
        while stop is None or not stop.is_set():
            try:
                plan = self.call_control(lambda: self.control.next_plan(cfg.job, cfg.rank, timeout))
            except JobFinished:
                return None
            if plan is not None:
                return plan
        return None

    def minibatches(self) -> Iterator[MiniBatch]:
        """Yield this rank's mini-batches until the job is finished.

        A mini-batch that was fully iterated but not acked is acked before the next one is
        requested; one that was not fully iterated raises, since acking it would lose rows.
        """
        nxt: MiniBatch | _NoLookahead | None = _NO_LOOKAHEAD
        while True:
            if isinstance(nxt, _NoLookahead):
                plan = self.next_plan()
                mb = MiniBatch(self, plan) if plan is not None else None
            else:
                mb = nxt
            if mb is None:
                return
            self._current = mb
            try:
                yield mb
            finally:
                self.timings.extend(mb.timings)
                self.media_stats = self.media_stats + mb.media_stats
            if not mb.acked and not mb.consumed:
                raise InvalidRequest(f"mini-batch {mb.plan_id} was neither iterated nor acked")
            nxt = mb.next_mini_batch.result() if mb.next_mini_batch is not None else _NO_LOOKAHEAD
            if not mb.acked:
                mb.ack()

    def report_version(self, version: int) -> None:
        """Report the policy version after an optimizer step (rank 0 is enough); retried like ``next``."""
        self.call_control(lambda: self.control.report_version(self.config.job, version, self.config.rank))

    def timings_dicts(self) -> list[dict[str, Any]]:
        """Recorded per-micro-batch timings as plain dicts (for JSON export)."""
        return [asdict(t) for t in self.timings]

    def close(self) -> None:
        """Stop prefetching, close the fetcher and the control-plane client."""
        if self._current is not None:
            self._current.stop()
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
