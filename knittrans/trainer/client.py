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
``wait_s`` (time the training loop blocked on data: the *exposed* transfer time), ``fetch_s``,
``convert_s`` and ``transform_s``; :attr:`TrainerClient.timings` keeps them all. An optional
``transform`` (a collate function) runs where the micro-batch is loaded, off the training thread.

Across mini-batches (``iter`` with ``prefetch_next``, the default): once the prefetch thread has
fetched the last micro-batch of mini-batch ``n``, it long-polls the control plane for the plan
*after* ``n`` (``next?after=<plan of n>``: handed out before ``n`` is acked, acks stay in order) and
starts prefetching mini-batch ``n+1`` (its own queue, ``prefetch_depth`` deep) while the training
loop finishes ``n``, steps and acks. So the first micro-batch of ``n+1`` is there when the loop
asks for it, and exactly-once is untouched: ``n`` is acked only after the optimizer step.

Failure (a store node dies under a plan): a fetch error is raised in the training thread; the
loop must not step on that mini-batch. :meth:`MiniBatch.report_fetched` (before the optimizer
step) tells the control plane this rank holds its whole share: False when the plan was withdrawn
(its rows were on a lost node). A loop that gives a mini-batch up calls :meth:`MiniBatch.abandon`;
:meth:`TrainerClient.minibatches` then waits (up to ``replan_wait_s``) for the plan of that global
index to change — the control plane re-plans it with the next attempt once the node is declared
lost — and yields the new plan. :mod:`knittrans.trainer.rank` runs this protocol across ranks.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeVar

import pyarrow as pa
import torch

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import Conflict, DataLost, InvalidRequest, KnitTransError, Unavailable
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
    prefetch_next: bool = True
    """``iter`` only: prefetch mini-batch ``n+1`` (plan via ``next?after=``) while ``n`` finishes."""
    fetch_timeout_s: float | None = 30.0
    """Timeout of one Flight call to a store node (a dead host raises instead of blocking); None: none."""
    replan_wait_s: float = 60.0
    """After an abandoned mini-batch: how long to wait for its re-plan before retrying the same plan."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.fetch_mode not in ("eager", "iter"):
            raise ValueError(f"fetch_mode must be 'eager' or 'iter', not {self.fetch_mode!r}")
        if self.prefetch_depth < 1:
            raise ValueError("prefetch_depth must be >= 1")
        if self.fetch_timeout_s is not None and self.fetch_timeout_s <= 0:
            raise ValueError("fetch_timeout_s must be > 0 (or None)")
        if self.replan_wait_s < 0:
            raise ValueError("replan_wait_s must be >= 0")
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
    rows: list[dict[str, Any]]
    """The plan's row entries (group id, unit, node, row, tokens), in row order."""
    timing: MicroTiming
    prepared: Any = None
    """What the client's ``transform`` returned for this micro-batch (None without a transform)."""


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


class MiniBatch:
    """A rank's share of one admitted mini-batch; iterate it once for its micro-batches."""

    def __init__(self, client: TrainerClient, plan: dict[str, Any]) -> None:
        self._client = client
        self.plan = plan
        self.plan_id: str = plan["plan_id"]
        self.step: int = plan["step"]
        self.index: int = plan["mini_batch_index"]
        self.global_index: int = plan["global_index"]
        parts = self.plan_id.split(".")
        self.attempt: int = int(parts[1][1:]) if len(parts) == 3 and parts[1][1:].isdigit() else 0
        """Re-plan attempt of this global index (``n{n}.a{attempt}.r{rank}``)."""
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
        self.acked_at: float | None = None
        """Wall-clock time of the ack (None until acked)."""
        self.consumed = False
        self.complete = False
        """Every micro-batch was handed to the training loop."""
        self.abandoned = False
        self._media_of: dict[str, dict[str, Any]] = {}
        for micro in plan["micro_batches"]:
            for m in micro.get("media", ()):
                self._media_of.setdefault(m["hash"], m)
        self._cache = MediaCache(self._fetch_media)
        self._queue: queue.Queue[TrainMicroBatch | BaseException | None] | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._ack_lock = threading.Lock()
        self._successor: MiniBatch | None = None
        self._successor_lock = threading.Lock()
        self._successor_stop = threading.Event()

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
        want_media = self._client.config.fetch_media and bool(micro.get("media"))
        # The plan names the micro-batch's media, so they are fetched (another thread, another
        # DoGet) while the rows are: one round trip per micro-batch instead of two.
        ahead = (self._client.media_pool.submit(self._cache.prefetch, [m["hash"] for m in micro["media"]])
                 if want_media else None)
        try:
            if micro["fetches"]:
                reads = [FetchRead(node_id=f["node_id"], endpoint=f["endpoint"],
                                   ticket=Ticket.decode(f["ticket"].encode())) for f in micro["fetches"]]
                table = self._client.fetcher.fetch(reads)
        except KnitTransError as exc:
            if ahead is not None and not ahead.cancel():
                ahead.exception()  # let it finish before the error ends the mini-batch (cache cleared)
            raise self._fetch_error(i, micro, exc) from exc
        t1 = time.perf_counter()
        batch = to_micro_batch(table) if table is not None else MicroBatch(num_rows=0)
        t2 = time.perf_counter()
        media: dict[str, torch.Tensor] = {}
        if ahead is not None:
            # One request per trajectory use (the rows' own references when the media column was
            # fetched), so the cache's logical bytes are what per-trajectory copies would move.
            refs = [h for row in batch.media_hex() for h in row] if batch.media_hashes is not None else []
            try:
                ahead.result()
                media = self._cache.get(refs or [m["hash"] for m in micro["media"]])
            except KnitTransError as exc:
                raise self._fetch_error(i, micro, exc) from exc
        t3 = time.perf_counter()
        timing.fetch_s = (t1 - t0) + (t3 - t2)
        timing.convert_s = t2 - t1
        timing.bytes = table.nbytes if table is not None else 0
        loaded = TrainMicroBatch(index=i, batch=batch, media=media, rows=micro["rows"], timing=timing)
        return self._client.prepare(loaded)

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
            self.complete = True
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
                        return
            except BaseException as exc:  # re-raised in the training thread
                put(exc)
                return
            if put(None) and self._client.config.prefetch_next:
                self._prefetch_successor()

        self._worker = threading.Thread(target=produce, name=f"knittrans-prefetch-{self.global_index}", daemon=True)
        self._worker.start()

    def _prefetch_successor(self) -> None:
        """Prefetch thread, after the last micro-batch: long-poll the plan after this one and prefetch it."""
        client, cfg = self._client, self._client.config
        while not (self._successor_stop.is_set() or self._stop.is_set()):
            try:
                plan = client.control.next_plan(cfg.job, cfg.rank, min(cfg.poll_timeout_s, 2.0), after=self.plan_id)
            except Conflict:  # the mini-batch before this one is not acked yet (or this one already is)
                if self.acked:
                    return
                self._successor_stop.wait(0.1)
                continue
            except KnitTransError as exc:  # finished, withdrawn (DataLost), control plane down
                logger.debug("rank %d: no prefetch after %s: %s", cfg.rank, self.plan_id, exc)
                return
            if plan is None:
                continue
            with self._successor_lock:
                if self._successor_stop.is_set():
                    return
                successor = MiniBatch(client, plan)
                successor.start_prefetch()
                self._successor = successor
            return

    def take_successor(self) -> MiniBatch | None:
        """The already prefetching next mini-batch, if the prefetch thread got its plan in time; stops the poll."""
        with self._successor_lock:
            self._successor_stop.set()
            successor, self._successor = self._successor, None
        return successor

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
        successor = self.take_successor()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=30)
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
        cfg = self._client.config
        try:
            self._client.call_control(lambda: self._client.control.fetched(cfg.job, cfg.rank, self.plan_id))
        except DataLost as exc:
            logger.warning("rank %d: plan %s was withdrawn: %s", cfg.rank, self.plan_id, exc)
            return False
        return True

    def ack(self) -> None:
        """Tell the control plane this rank finished the mini-batch (after its optimizer step)."""
        with self._ack_lock:
            if not self.acked:
                cfg = self._client.config
                self._client.call_control(lambda: self._client.control.ack(cfg.job, cfg.rank, self.plan_id))
                self.acked, self.acked_at = True, time.time()


class TrainerClient:
    """One rank: long-polls plans, fetches rows and media on demand, acks, reports versions."""

    def __init__(self, config: TrainerConfig, *, control: ControlClient | None = None,
                 transform: Callable[[TrainMicroBatch], Any] | None = None) -> None:
        self.config = config
        self.transform = transform
        """``transform(micro) -> Any``, run right after a micro-batch is loaded — in the prefetch thread
        in ``iter`` mode — with the result in :attr:`TrainMicroBatch.prepared`: a model-specific
        collate (padding, image stacking, pinning) then happens off the training thread, like a
        DataLoader's ``collate_fn``. Its exceptions reach the training loop like fetch errors."""
        self.control = control or ControlClient(config.control_url, token=config.token)
        self.fetcher = Fetcher(token=config.store_token, local_dirs=dict(config.local_dirs),
                               timeout_s=config.fetch_timeout_s)
        self.media_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="knittrans-media")
        """Runs a micro-batch's media fetch alongside its row fetch."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self._current: MiniBatch | None = None

    def prepare(self, micro: TrainMicroBatch) -> TrainMicroBatch:
        """``micro`` with :attr:`~TrainMicroBatch.prepared` set by :attr:`transform` (timed); as is without one."""
        if self.transform is None:
            return micro
        t0 = time.perf_counter()
        prepared = self.transform(micro)
        micro.timing.transform_s = time.perf_counter() - t0
        return replace(micro, prepared=prepared)

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

    def next_plan(self) -> dict[str, Any] | None:
        """The next plan (long-polls until one comes); None when the job is finished."""
        cfg = self.config
        while True:
            try:
                plan = self.call_control(lambda: self.control.next_plan(cfg.job, cfg.rank, cfg.poll_timeout_s))
            except JobFinished:
                return None
            if plan is not None:
                return plan

    def replan(self, failed: str) -> dict[str, Any] | None:
        """The rank's current plan once it differs from ``failed`` (re-planned), or after ``replan_wait_s``."""
        cfg = self.config
        deadline = time.monotonic() + cfg.replan_wait_s
        while True:
            try:
                plan = self.call_control(lambda: self.control.next_plan(cfg.job, cfg.rank, 1.0))
            except JobFinished:
                return None
            if plan is not None and (plan["plan_id"] != failed or time.monotonic() > deadline):
                return plan
            if plan is not None:
                time.sleep(0.2)

    def minibatches(self) -> Iterator[MiniBatch]:
        """Yield this rank's mini-batches until the job is finished.

        A mini-batch that was fully iterated but not acked is acked before the next one is
        requested; an abandoned one (:meth:`MiniBatch.abandon`) is asked for again (re-planned);
        one that was neither fully iterated nor abandoned raises, since acking it would lose rows.
        """
        plan = self.next_plan()
        mb = MiniBatch(self, plan) if plan is not None else None
        while mb is not None:
            self._current = mb
            if self.config.fetch_mode == "iter":
                mb.start_prefetch()  # now, not at the first ``next``: overlaps whatever the loop does first
            try:
                yield mb
            finally:
                self.timings.extend(mb.timings)
                self.media_stats = self.media_stats + mb.media_stats
            if mb.abandoned and not mb.acked:
                logger.warning("rank %d: mini-batch %s abandoned; waiting for its re-plan", self.config.rank,
                               mb.plan_id)
                plan = self.replan(mb.plan_id)
                mb = MiniBatch(self, plan) if plan is not None else None
                continue
            if not mb.acked and not mb.complete:
                mb.stop()
                raise InvalidRequest(f"mini-batch {mb.plan_id} was neither fully iterated, abandoned nor acked")
            mb.ack()
            nxt = mb.take_successor()
            if nxt is None:
                plan = self.next_plan()
                nxt = MiniBatch(self, plan) if plan is not None else None
            mb = nxt

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
        self.media_pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
