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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

import torch

from knittrans.controlclient import ControlClient, JobFinished, PlanStreamReader, StreamUnsupported
from knittrans.errors import InvalidRequest
from knittrans.plans import RankPlan
from knittrans.trainer.config import TrainerConfig
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.media import MediaCacheStats
from knittrans.trainer.minibatch import MicroTiming, MiniBatch, RankContext, TrainMicroBatch

__all__ = ["MicroTiming", "MiniBatch", "TrainMicroBatch", "TrainerClient", "TrainerConfig"]

logger = logging.getLogger(__name__)


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
        self._prepare = _Prepare(transform)
        self.control = control or ControlClient(config.control_url, token=config.token, retry=config.retry_policy())
        """Control-plane client; its retry policy is the rank's only one (``control_retry_s`` by default)."""
        self.fetcher = Fetcher(
            token=config.store_token,
            local_dirs=dict(config.local_dirs),
            timeout_s=config.fetch_timeout_s,
            data_lane=config.data_lane,
        )
        self.media_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="knittrans-media")
        """Runs a micro-batch's media fetch alongside its row fetch."""
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self._current: MiniBatch | None = None
        self._closed = threading.Event()
        self._first: Future[MiniBatch | None] | None = None
        self._stream: PlanStreamReader | None = None
        if config.plan_stream:
            keepalive = min(10.0, config.poll_timeout_s)
            self._stream = self.control.plan_stream(
                config.job, config.rank, keepalive_s=keepalive, gateway=config.plan_gateway
            )
        self.context = RankContext(
            config=config,
            fetcher=self.fetcher,
            media_pool=self.media_pool,
            control=self.control,
            prepare=self._prepare,
            closed=self._closed,
        )
        """What this rank's mini-batches use of it (a subclass of :class:`MiniBatch` is built with it)."""
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
            mb = self.minibatch(plan) if plan is not None else None  # its streams open here, at once
            if mb is not None and self.config.fetch_mode == "iter":
                mb.start_prefetch()  # no hop to the loop's thread between the plan and its first fetch
            first.set_result(mb)
        except BaseException as exc:  # handed to minibatches()
            first.set_exception(exc)

    @property
    def transform(self) -> Callable[[TrainMicroBatch], Any] | None:
        """``transform(micro) -> Any``, run right after a micro-batch is loaded — in the prefetch thread
        in ``iter`` mode — with the result in :attr:`TrainMicroBatch.prepared`: a model-specific
        collate (padding, image stacking, pinning) then happens off the training thread, like a
        DataLoader's ``collate_fn``. Its exceptions reach the training loop like fetch errors."""
        return self._prepare.transform

    @transform.setter
    def transform(self, transform: Callable[[TrainMicroBatch], Any] | None) -> None:
        self._prepare.transform = transform

    def prepare(self, micro: TrainMicroBatch) -> TrainMicroBatch:
        """``micro`` with :attr:`~TrainMicroBatch.prepared` set by :attr:`transform` (timed); as is without one."""
        return self._prepare(micro)

    def minibatch(self, plan: RankPlan) -> MiniBatch:
        """A :class:`MiniBatch` of this rank for ``plan`` (its streams open at once with ``warm_connections``)."""
        return MiniBatch(self.context, plan)

    def next_plan(self) -> RankPlan | None:
        """The next plan (from the plan stream, else long-polls until one comes); None when the job is finished."""
        cfg = self.config
        while not self._closed.is_set():
            stream = self._stream
            if stream is not None:
                try:
                    plan = stream.next(cfg.poll_timeout_s)
                except JobFinished:
                    return None
                except StreamUnsupported as exc:
                    logger.info("rank %d: %s; long-polling 'next' instead", cfg.rank, exc)
                    self._stream = None
                    continue
                if plan is not None:
                    return plan
                continue
            try:
                plan = self.control.next_plan(cfg.job, cfg.rank, cfg.poll_timeout_s)
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
        return self.minibatch(plan) if plan is not None else None

    def replan(self, failed: str) -> RankPlan | None:
        """The rank's current plan once it differs from ``failed`` (re-planned), or after ``replan_wait_s``."""
        cfg = self.config
        deadline = time.monotonic() + cfg.replan_wait_s
        while True:
            try:
                plan = self.control.next_plan(cfg.job, cfg.rank, 1.0)
            except JobFinished:
                return None
            if plan is not None and (str(plan.plan_id) != failed or time.monotonic() > deadline):
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
                mb = self.minibatch(plan) if plan is not None else None
                continue
            if not mb.acked and not mb.complete:
                mb.stop()
                raise InvalidRequest(f"mini-batch {mb.plan_id} was neither fully iterated, abandoned nor acked")
            mb.ack()
            if self._stream is not None:
                self._stream.acked(mb.plan_id)  # its line, if still in the stream, is skipped
            nxt = mb.successor.take_after_ack()
            if nxt is None:
                plan = self.next_plan()
                nxt = self.minibatch(plan) if plan is not None else None
            mb = nxt

    def report_version(self, version: int) -> None:
        """Report the policy version after an optimizer step (rank 0 is enough); retried like ``next``."""
        self.control.report_version(self.config.job, version, self.config.rank)

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
        if self._stream is not None:
            self._stream.close()
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Prepare:
    """A rank's :attr:`TrainerClient.transform`, applied by its mini-batches (:attr:`RankContext.prepare`).

    A callable of its own rather than the client's bound method: the client holds its context, so a
    bound method there made every client a reference cycle, freed only by the cyclic GC.
    """

    def __init__(self, transform: Callable[[TrainMicroBatch], Any] | None) -> None:
        self.transform = transform

    def __call__(self, micro: TrainMicroBatch) -> TrainMicroBatch:
        if self.transform is None:
            return micro
        t0 = time.perf_counter()
        prepared = self.transform(micro)
        micro.timing.transform_s = time.perf_counter() - t0
        return replace(micro, prepared=prepared)
