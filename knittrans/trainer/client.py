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
lost — and yields the new plan. :mod:`knittrans.demo.rank` runs this protocol across ranks.

Errors: a failed fetch is re-raised in the training thread with the plan, micro-batch and the
store node(s) (id and endpoint) it involved; control-plane calls (``next``, ``ack``, versions)
are retried with backoff for ``control_retry_s`` while the control plane is unreachable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeVar

import torch

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import InvalidRequest, Unavailable
from knittrans.retry import RetryPolicy
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.media import MediaCacheStats
from knittrans.trainer.minibatch import MicroTiming, MiniBatch, TrainMicroBatch

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
    stream: bool = True
    """Read the share through one ``DoGet`` per store node and kind (rows, media), each micro-batch
    taking its rows as they arrive (:class:`~knittrans.trainer.share.ShareStreams`); False: one
    ``DoGet`` per micro-batch and kind."""
    prefetch_next: bool = True
    """``iter`` only: prefetch mini-batch ``n+1`` (plan via ``next?after=``) while ``n`` finishes."""
    fetch_timeout_s: float | None = 30.0
    """Timeout of one Flight call to a store node (a dead host raises instead of blocking); None: none."""
    replan_wait_s: float = 60.0
    """After an abandoned mini-batch: how long to wait for its re-plan before retrying the same plan."""
    warm_connections: bool = True
    """Connect to every store node the control plane lists when the client starts (one Flight channel
    per node, kept for every later read), and open a plan's streams as soon as the plan arrives. False:
    each node is connected at its first ``DoGet``, a share's streams at its first read (the old cold path)."""
    poll_early: bool = True
    """Start the first long-poll (and the first plan's loading) in a background thread when the client
    is created, so it already waits when the first mini-batch is admitted, instead of at the first
    ``next`` of :meth:`TrainerClient.minibatches`. False: the previous behaviour."""
    torch_threads: int | None = None
    """When set, the client calls ``torch.set_num_threads`` with it at start. Several ranks (or a rank and
    its rollout) on one host each using every core slow each other down badly: give each rank its share
    (1 on a small machine; also set ``OMP_NUM_THREADS`` before Python starts). None: leave torch as is."""

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
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1 (or None)")
        if self.poll_timeout_s <= 0 or self.control_retry_s < 0:
            raise ValueError("poll_timeout_s must be > 0 and control_retry_s >= 0")


class TrainerClient:
    """One rank: long-polls plans, fetches rows and media on demand, acks, reports versions."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        control: ControlClient | None = None,
        transform: Callable[[TrainMicroBatch], Any] | None = None,
    ) -> None:
        self.config = config
        self.transform = transform
        """``transform(micro) -> Any``, run right after a micro-batch is loaded — in the prefetch thread
        in ``iter`` mode — with the result in :attr:`TrainMicroBatch.prepared`: a model-specific
        collate (padding, image stacking, pinning) then happens off the training thread, like a
        DataLoader's ``collate_fn``. Its exceptions reach the training loop like fetch errors."""
        self.control = control or ControlClient(config.control_url, token=config.token)
        self.fetcher = Fetcher(
            token=config.store_token, local_dirs=dict(config.local_dirs), timeout_s=config.fetch_timeout_s
        )
        self.media_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="knittrans-media")
        """Runs a micro-batch's media fetch alongside its row fetch."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self._current: MiniBatch | None = None
        self._closed = threading.Event()
        self._first: Future[MiniBatch | None] | None = None
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        if config.poll_early or config.warm_connections:
            self._first = Future() if config.poll_early else None
            threading.Thread(
                target=self._start_early, args=(self._first,), name=f"knittrans-start-{config.rank}", daemon=True
            ).start()

    def _start_early(self, first: Future[MiniBatch | None] | None) -> None:
        """Background start: connect to the store nodes, then long-poll the first plan and start loading it
        (its :class:`MiniBatch` into ``first``)."""
        try:
            if self.config.warm_connections:
                nodes = self.control.list_nodes()
                self.fetcher.warm(
                    {n["node_id"]: n["endpoint"] for n in nodes if not n.get("lost") and n.get("endpoint")}
                )
        except Exception as exc:  # warming is an optimisation; reads report their own errors
            logger.debug("rank %d: store nodes not warmed: %s", self.config.rank, exc)
        if first is None or not first.set_running_or_notify_cancel():
            return
        try:
            plan = self.next_plan()
            mb = MiniBatch(self, plan) if plan is not None else None  # its streams open here, at once
            if mb is not None and self.config.fetch_mode == "iter":
                mb.start_prefetch()  # no hop to the loop's thread between the plan and its first fetch
            first.set_result(mb)
        except BaseException as exc:  # handed to minibatches()
            first.set_exception(exc)

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
        pauses = RetryPolicy(budget_s=self.config.control_retry_s, first_backoff_s=0.2, max_backoff_s=5.0).pauses()
        while True:
            try:
                return call()
            except Unavailable:
                delay = next(pauses, None)
                if delay is None:
                    raise
                logger.warning("control plane %s unavailable; retrying in %.1f s", self.config.control_url, delay)
                time.sleep(delay)

    def next_plan(self) -> dict[str, Any] | None:
        """The next plan (long-polls until one comes); None when the job is finished."""
        cfg = self.config
        while not self._closed.is_set():
            try:
                plan = self.call_control(lambda: self.control.next_plan(cfg.job, cfg.rank, cfg.poll_timeout_s))
            except JobFinished:
                return None
            if plan is not None:
                return plan
        raise InvalidRequest(f"rank {cfg.rank}: the trainer client is closed")

    def _first_minibatch(self) -> MiniBatch | None:
        """The mini-batch of the early poll's plan (waiting for it; already loading), else a new poll's."""
        first, self._first = self._first, None
        if first is not None:
            return first.result()
        plan = self.next_plan()
        return MiniBatch(self, plan) if plan is not None else None

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
        mb = self._first_minibatch()
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
                logger.warning(
                    "rank %d: mini-batch %s abandoned; waiting for its re-plan", self.config.rank, mb.plan_id
                )
                plan = self.replan(mb.plan_id)
                mb = MiniBatch(self, plan) if plan is not None else None
                continue
            if not mb.acked and not mb.complete:
                mb.stop()
                raise InvalidRequest(f"mini-batch {mb.plan_id} was neither fully iterated, abandoned nor acked")
            mb.ack()
            nxt = mb.take_successor(wait_s=min(self.config.poll_timeout_s, 2.0) + 1.0)  # the poll's own timeout
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
        self._closed.set()
        if self._first is not None and not self._first.cancel() and self._first.done():
            with contextlib.suppress(Exception):
                early = self._first.result()
                if early is not None:
                    early.stop()
        if self._current is not None:
            self._current.stop()
        self.media_pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
