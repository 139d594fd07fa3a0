"""``TrainerClient``: one data-parallel rank's view of a job (docs/explanation/on-demand-access.md)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from knittrans.controlclient import ControlClient
from knittrans.errors import InvalidRequest
from knittrans.manifest import RankPlan
from knittrans.trainer.config import TrainerConfig
from knittrans.trainer.convert import warm_up
from knittrans.trainer.feed import Collective, ManifestFeed, Progress, Shared, TorchCollective
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.minibatch import MicroTiming, MiniBatch, RankContext, TrainMicroBatch, Upcoming

__all__ = ["MicroTiming", "MiniBatch", "TrainMicroBatch", "TrainerClient", "TrainerConfig"]

logger = logging.getLogger(__name__)


class TrainerClient:
    """One rank: reads manifests, fetches rows and media on demand, reports fetched, acks."""

    def __init__(self, config: TrainerConfig, *, transform: Callable[[TrainMicroBatch], Any] | None = None) -> None:
        """Build the rank's client; it connects to the store nodes and asks for the first share in the background.

        Args:
            transform: ``transform(micro) -> Any``, run right after a micro-batch is loaded (in the prefetch
                thread in ``iter`` mode) with the result in :attr:`TrainMicroBatch.prepared`, like a
                DataLoader's ``collate_fn``; its exceptions reach the training loop like fetch errors.
        """
        self.config = config
        self.control = ControlClient(config.control_url, token=config.token, retry=config.retry_policy())
        """Control-plane client; its retry policy is the rank's only one (``control_retry_s`` by default)."""
        self.fetcher = Fetcher(
            token=config.store_token,
            local_dirs=dict(config.local_dirs),
            timeout_s=config.fetch_timeout_s,
            data_lane=config.data_lane,
        )
        self._current: MiniBatch | None = None
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        # the ranks' (feed, progress) collectives: two gloo groups under torch.distributed (config.group)
        collectives = _torch_collectives(config) if config.group == "auto" else None
        feed_group, progress_group = collectives if collectives is not None else (None, None)
        self.collective = progress_group
        """The ranks' collective of the training loop's calls (None: each rank talks to the control plane)."""
        self.feed = ManifestFeed(
            self.control,
            config.job,
            config.rank,
            config.world_size,
            collective=feed_group,
            poll_s=config.poll_timeout_s,
        )
        """This rank's shares of the mini-batches, asked for ahead of the loop."""
        self.context = RankContext(
            config=config,
            fetcher=self.fetcher,
            feed=self.feed,
            progress=Progress(self.control, config.job, config.rank, progress_group),
            transform=transform,
        )
        """What this rank's mini-batches use of it."""
        self._first = Upcoming()
        """The first mini-batch, loading as soon as its share is in (unless the loop asked for it first)."""
        self._looped = False
        threading.Thread(target=self._start, name=f"knittrans-start-{config.rank}", daemon=True).start()

    def _start(self) -> None:
        """Background start: warm the conversion, connect to the store nodes, then take the first share and start
        loading it (no hop to the loop's thread between the share and its first fetch)."""
        try:
            warm_up()  # the process's first IPC read and torch conversion, before a manifest is there
            nodes = self.control.list_nodes()
            self.fetcher.warm({n["node_id"]: n["endpoint"] for n in nodes if not n.get("lost") and n.get("endpoint")})
        except Exception as exc:  # warming is an optimisation; reads report their own errors
            logger.debug("rank %d: not warmed: %s", self.config.rank, exc)
        with contextlib.suppress(BaseException):  # raised again where minibatches() asks for the first share
            self._first.load(self.context, self.feed.start())

    def minibatch(self, plan: RankPlan, etag: str = "") -> MiniBatch:
        """A :class:`MiniBatch` of this rank for ``plan`` (its streams open at once), outside :meth:`minibatches`."""
        return MiniBatch(self.context, plan, etag)

    def _minibatch(self, shared: Shared) -> MiniBatch | None:
        """A mini-batch of a share the feed delivered (None: the job has no such mini-batch, or the feed closed)."""
        return MiniBatch(self.context, *shared) if shared is not None else None

    def replan(self, failed: MiniBatch) -> MiniBatch | None:
        """The share of ``failed``'s global index once its manifest changed (re-planned), or the same one again
        after ``replan_wait_s``; None when the job has no such mini-batch any more (or the client was closed).
        Collective with a group."""
        n = failed.global_index
        got = self.feed.deliver(n, self.collective, etag=failed.etag, wait_s=self.config.replan_wait_s)
        self.feed.release_below(n)
        return self._minibatch(got if isinstance(got, tuple) else None)  # else None, or the client was closed

    def minibatches(self) -> Iterator[MiniBatch]:
        """Yield this rank's mini-batches until the job is finished.

        A mini-batch that was fully iterated but not acked is acked before the next one is
        requested; an abandoned one (:meth:`MiniBatch.abandon`) is asked for again (re-planned);
        one that was neither fully iterated nor abandoned raises, since acking it would lose rows.
        """
        if self._looped:
            raise InvalidRequest(
                "minibatches() runs once per client: a second loop would start over at the first share"
            )
        self._looped = True
        mb = self._first.take() or self._minibatch(self.feed.share(self.feed.start()))
        while mb is not None:
            self._current = mb
            if self.config.fetch_mode == "iter":
                mb.start_prefetch()  # now, not at the first ``next``: overlaps whatever the loop does first
            yield mb
            if mb.abandoned and not mb.acked:
                logger.warning(
                    "rank %d: mini-batch %s abandoned; waiting for its re-plan", self.config.rank, mb.plan_id
                )
                mb = self.replan(mb)
                continue
            if not mb.acked and not mb.complete:
                mb.stop()
                raise InvalidRequest(f"mini-batch {mb.plan_id} was neither fully iterated, abandoned nor acked")
            mb.ack()
            nxt = mb.take_successor()
            self.feed.release_below(mb.global_index + 1)
            mb = nxt if nxt is not None else self._minibatch(self.feed.share(mb.global_index + 1))

    def report_version(self, version: int) -> None:
        """Report the policy version after an optimizer step (rank 0 is enough; an ack can carry it instead)."""
        self.control.report_version(self.config.job, version, self.config.rank)

    def close(self) -> None:
        """Stop prefetching and the feed, close the fetcher and the control-plane client."""
        early = self._first.take()
        if early is not None:
            early.stop()
        if self._current is not None:
            self._current.stop()
        self.feed.close()
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_collectives(config: TrainerConfig) -> tuple[Collective, Collective] | None:
    """Two gloo collectives of the trainer's ``torch.distributed`` job when it is this client's world, else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() != config.world_size or dist.get_rank() != config.rank:
        logger.info(
            "rank %d: torch.distributed is rank %d of %d, not this job's rank %d of %d: each rank reads manifests",
            config.rank,
            dist.get_rank(),
            dist.get_world_size(),
            config.rank,
            config.world_size,
        )
        return None
    return TorchCollective(), TorchCollective()
