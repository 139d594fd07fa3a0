"""Manifests to ranks: each rank's share of every mini-batch, in order, ahead of the training loop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import DataLost, KnitTransError
from knittrans.manifest import Manifest, RankPlan

__all__ = ["Collective", "ManifestFeed", "Shared", "TorchCollective", "leader_call"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Shared = tuple[RankPlan, str] | None
"""What the feed holds per mini-batch: this rank's share and the manifest's ETag; None: the job has no such
mini-batch (finished)."""


class Collective(Protocol):
    """The collectives the ranks of one trainer share manifests and progress over; rank 0 leads."""

    rank: int
    """This rank in the group (0 leads: it is the one that talks to the control plane)."""
    size: int
    """Ranks in the group."""

    def gather(self, item: Any) -> list[Any] | None:
        """Every rank passes an item; rank 0 returns all of them in rank order, the others None."""

    def broadcast(self, item: Any) -> Any:
        """Rank 0 passes an item; every rank returns it."""


class TorchCollective:
    """:class:`Collective` over a gloo process group of its own, made from the trainer's ``torch.distributed``
    default group (``dist.new_group`` is a collective call: every rank must make its collectives in the
    same order, e.g. when each builds its :class:`~knittrans.trainer.client.TrainerClient`).

    Objects travel pickled (``torch.distributed``'s ``*_object_list`` calls), so a share of a few hundred
    rows is a few kilobytes on the wire.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise KnitTransError("TorchCollective needs torch.distributed initialised (init_process_group)")
        self._dist = dist
        self._group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def gather(self, item: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._dist.gather_object(item, out, dst=0, group=self._group)
        return out

    def broadcast(self, item: Any) -> Any:
        box = [item if self.rank == 0 else None]
        self._dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def leader_call(collective: Collective | None, call: Callable[[], T]) -> T:
    """``call()`` on rank 0 (every rank when ``collective`` is None), its result or exception on every rank."""
    if collective is None:
        return call()
    outcome: tuple[bool, Any] = (True, None)
    if collective.rank == 0:
        try:
            outcome = (True, call())
        except BaseException as exc:  # handed to every rank, raised there
            outcome = (False, exc)
    ok, got = collective.broadcast(outcome)
    if not ok:
        raise got
    result: T = got
    return result


class Progress:
    """A rank's progress reports (``fetched``, ``ack``), collective when the ranks share the control plane:
    every rank calls, rank 0 sends one request for all (with everyone's transfer figures) and every rank
    gets the same answer. Without a collective each rank reports for itself."""

    def __init__(self, control: ControlClient, job: str, rank: int, collective: Collective | None) -> None:
        self.control, self.job, self.rank, self.collective = control, job, rank, collective

    def fetched(self, n: int, attempt: int, ok: bool = True) -> bool:
        """Whether every rank holds its share of mini-batch ``n`` (``ok``: this rank does) and the control
        plane took the report; False when some rank is not ok or the mini-batch was withdrawn."""
        coll = self.collective
        oks = coll.gather(ok) if coll is not None else [ok]

        def report() -> bool:
            if oks is None or not all(oks):
                return False
            try:
                self.control.fetched(self.job, n, attempt, [self.rank] if coll is None else None)
            except DataLost as exc:
                logger.warning("rank %d: mini-batch %d attempt %d was withdrawn: %s", self.rank, n, attempt, exc)
                return False
            return True

        return leader_call(coll, report)

    def ack(self, n: int, attempt: int, *, version: int | None, transfer: dict[str, Any]) -> dict[str, Any]:
        """Ack mini-batch ``n`` for this rank (every rank, through rank 0, with a collective), with this rank's
        transfer figures; the control plane's answer."""
        coll = self.collective
        figures = coll.gather(transfer) if coll is not None else [transfer]
        ranks = None if coll is not None else [self.rank]
        return leader_call(
            coll, lambda: self.control.ack(self.job, n, attempt, ranks, version=version, transfer=figures)
        )


class ManifestFeed:
    """This rank's share of mini-batch ``start``, ``start+1``, ... as soon as each is admitted.

    Args:
        control: the rank's control-plane client (the leader's is the one used with a collective).
        job, rank, world_size: who this is.
        collective: the ranks' shared ``feed`` collective, or None to ask for every rank itself.
        poll_s: longest single long-poll (the feed checks :meth:`close` between them).
    """

    def __init__(
        self,
        control: ControlClient,
        job: str,
        rank: int,
        world_size: int,
        *,
        collective: Collective | None,
        poll_s: float,
    ) -> None:
        if collective is not None and (collective.rank != rank or collective.size != world_size):
            raise KnitTransError(
                f"the collective's rank {collective.rank} of {collective.size} is not this client's rank {rank} "
                f"of world_size {world_size}"
            )
        self.control, self.job, self.rank = control, job, rank
        self.collective = collective
        self.poll_s = poll_s
        self._cond = threading.Condition()
        self._shares: dict[int, Shared | BaseException] = {}
        self._end: int | None = None
        """Index of the first mini-batch the feed will never deliver (finished, failed or closed)."""
        self._first: Future[int] = Future()
        """The first mini-batch it delivers (or the error that stopped the feed before it knew)."""
        self._closed = threading.Event()
        self.requests = 0
        """Manifest requests this rank made (0 on the ranks a leader serves)."""
        self.arrived: dict[int, float] = {}
        """Wall-clock time each share reached this rank (kept until :meth:`release_below` passes it)."""
        self._thread = threading.Thread(target=self._run, name=f"knittrans-feed-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the feed's thread
    def _run(self) -> None:
        try:
            n = leader_call(self.collective, self._start_index)
        except BaseException as exc:
            self._first.set_exception(exc)
            self._finish(0, exc)
            return
        self._first.set_result(n)
        while True:
            try:
                item = self.deliver(n, self.collective)
            except BaseException as exc:  # the control plane unreachable past its retries, a collective broke
                self._finish(n, exc)
                return
            if isinstance(item, _Closed):
                self._finish(n, None)
                return
            with self._cond:
                self._shares[n] = item
                self.arrived[n] = time.time()
                self._cond.notify_all()
            if item is None:
                self._finish(n + 1, None)
                return
            n += 1

    def _finish(self, end: int, exc: BaseException | None) -> None:
        with self._cond:
            if exc is not None:
                self._shares[end] = exc
            self._end = end
            self._cond.notify_all()

    def _start_index(self) -> int:
        """The first mini-batch this rank has not acked (a restarted rank resumes where it stopped)."""
        progress = self.control.progress(self.job)
        n = int(progress["position"])
        for mb in progress["in_flight"]:
            acked = any(start <= self.rank < stop for start, stop in mb["acked_ranks"])
            if mb["global_index"] != n or not acked:
                break
            n += 1
        return n

    def deliver(
        self, n: int, collective: Collective | None, *, etag: str | None = None, wait_s: float = 0.0
    ) -> Shared | _Closed:
        """This rank's share of ``n`` and its ETag (None: never; :class:`_Closed`: the leader closed while
        waiting), :meth:`ask` ed for by rank 0 of ``collective`` (the feed's thread, or the loop's re-plan).

        With a collective rank 0 reads and checks the manifest and broadcasts it (pickled by the
        collective: cheaper than the JSON it came as); every rank cuts its own share, so rank 0's work
        does not grow with the number of ranks."""
        got = leader_call(collective, lambda: self.ask(n, etag=etag, wait_s=wait_s))
        return (got[0].share(self.rank), got[1]) if isinstance(got, tuple) else got

    def ask(self, n: int, *, etag: str | None = None, wait_s: float = 0.0) -> tuple[Manifest, str] | _Closed | None:
        """Long-poll mini-batch ``n`` until it is admitted: ``(manifest, etag)``; None when it never will be;
        a :class:`_Closed` once the feed is closed. ``etag``: a manifest of ``n`` held already, asked for again
        (re-planned) with another ETag for up to ``wait_s``, then as it is."""
        deadline = time.monotonic() + wait_s
        while not self._closed.is_set():
            self.requests += 1
            late = time.monotonic() > deadline
            try:
                got = self.control.manifest(self.job, n, self.poll_s, etag=None if late else etag)
            except JobFinished:
                return None
            except RuntimeError:  # httpx, once the client was closed under the request
                if self._closed.is_set():
                    return _Closed()
                raise
            if got is not None:
                return got
        return _Closed()

    # ------------------------------------------------------------------ the loop's side
    def start(self) -> int:
        """The first mini-batch this feed delivers: the first one this rank has not acked (waits for it)."""
        return self._first.result()

    def share(self, n: int, *, cancel: threading.Event | None = None) -> Shared:
        """This rank's share of ``n`` and its ETag, waiting for it; None when the job will never have ``n``.

        Raises:
            KnitTransError: the feed failed (its error), was closed, or ``cancel`` was set before ``n``
                came (``TimeoutError``).
        """
        with self._cond:
            while True:
                found = self._shares.get(n, _MISSING)
                if isinstance(found, BaseException):
                    raise found
                if found is not _MISSING:
                    shared: Shared = found  # type: ignore[assignment]  # a share or None
                    return shared
                if self._end is not None and n >= self._end:
                    if self._closed.is_set():
                        raise KnitTransError(f"rank {self.rank}: the trainer client is closed")
                    return None
                if cancel is not None and cancel.is_set():
                    raise TimeoutError(f"mini-batch {n}: no longer wanted")
                self._cond.wait(0.1 if cancel is not None else None)

    def release_below(self, n: int) -> None:
        """Forget the shares before ``n`` (the loop is past them)."""
        with self._cond:
            for m in [m for m in self._shares if m < n]:
                del self._shares[m]
                self.arrived.pop(m, None)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop asking; waits up to ``timeout_s`` for the thread (with a collective, until the leader closed too)."""
        self._closed.set()
        self._thread.join(timeout_s)  # never the caller's: the feed's thread runs no code of its users


class _Closed:
    """The leader's feed was closed: the end of every rank's feed (a class, so it survives pickling)."""


_MISSING = object()
