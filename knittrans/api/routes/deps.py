"""Dependencies shared by the routers: the service and the plan board of the running app."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from knittrans.api.delivery import Answer
from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings
from knittrans.errors import KnitTransError, Unavailable

__all__ = ["AckBatcher", "Board", "PlanBoard", "Run", "Service", "SettingsDep", "StateRunner"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Compute = Callable[[str, Collection[int] | None], Iterable[dict[int, Answer]] | None]
"""``ControlPlane.rank_answers``: the answers of a job's ranks (None: every rank) in chunks; None: no such job."""


class StateRunner:
    """Runs every state change and read of the service on one worker thread, in arrival order.

    Keeps the event loop free (health, heartbeats, metrics and long-polls answer while a large
    registration is admitted) and keeps the service single-threaded like before.

    This is the concurrency rule of the control plane: the service and its ``JobState`` objects
    have no locks because only this one thread touches them while the app runs. Routes are
    ``async def`` and pass their work here (``await run(svc.method, ...)``); a plain ``def`` route
    would run in FastAPI's thread pool, concurrently with this thread. :meth:`check` enforces the
    rule (the service calls it at every entry); the only things done on the event loop itself are
    a heartbeat's timestamp and ``/v1/health``'s counts, single reads and writes that need no lock.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._thread: int | None = None

    def _started(self) -> None:
        self._thread = threading.get_ident()

    def start(self) -> None:
        """Start the state thread now (the app's startup), so the rule holds from the first request on."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="knittrans-state", initializer=self._started
            )
            self._pool.submit(lambda: None).result()

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the state thread (started on first use); its result or exception."""
        if self._pool is None:
            self.start()
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the state thread, from a thread of our own that is neither the event
        loop nor the state thread (the control plane's lane connections, :mod:`knittrans.api.lane`): blocks
        until it is done; its result or exception. ``Unavailable`` while the thread is not running."""
        pool = self._pool
        if threading.get_ident() == self._thread:
            raise RuntimeError("StateRunner.call from the state thread would wait for itself")
        try:
            if pool is None:
                raise RuntimeError("not started")
            future = pool.submit(functools.partial(fn, *args, **kwargs))
        except RuntimeError:  # not started yet, or shutting down
            raise Unavailable("the control plane is starting or stopping; try again") from None
        return future.result()

    def check(self) -> None:
        """Raise :class:`RuntimeError` unless the caller may touch the state now: on the state thread
        while it runs; any one thread while it does not (startup, shutdown, a service used without an app)."""
        if self._pool is not None and threading.get_ident() != self._thread:
            raise RuntimeError(
                f"control-plane state touched from thread {threading.current_thread().name!r}; it may only "
                "be touched on the state thread: an async route must call `await run(svc.method, ...)`, "
                "and routes must be `async def`"
            )

    def close(self) -> None:
        """Finish queued calls and stop the thread (a later call starts a new one)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._thread = None


class PlanBoard:
    """Wakes the requests long-polling a job when what they wait for may have changed, and holds
    what ``next`` answers each rank (its plan as JSON bytes) on the event loop.

    Two kinds of waiters: a rank waiting for its next plan (one event per ``(job, rank)``) and a
    job-wide waiter (``/headroom``), woken by any change of the job. The service says which ranks'
    plans a change concerns (:meth:`notify`): admitting or withdrawing a mini-batch concerns every
    rank, an ack only the rank that acked, a registration that admits nothing none. So 1,024 ranks
    waiting for the next admission are not all woken by every registration batch or every other
    rank's ack.

    While the app runs (:meth:`bind`), :meth:`notify` (on the state thread, after the change
    committed) also computes the concerned ranks' answers there (each plan rendered once) and posts
    them to the event loop with ``call_soon_threadsafe``; the loop stores them and wakes the waiters
    in the same callback. A ``next`` then reads its answer on the loop (:meth:`answer`), with no
    state-thread hop. The loop's copy is never ahead of the state, and is never behind it for a
    client: the post is queued before the state-thread call that made the change returns, so an ack
    (or any change) is on the board before its own response goes out.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._ranks: dict[str, dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self.probes: dict[tuple[str, int], int] = {}
        """Plan probes per ``(job, rank)`` (one per wake-up of a long-poll, plus its first look)."""

        self._lock = threading.Lock()  # the event loop takes events while the state thread pops them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compute: Compute | None = None
        self._answers: dict[str, dict[int, Answer]] = {}  # owned by the loop: read and written only there
        self.listeners: list[Callable[[str, dict[int, Answer] | None], None]] = []
        """Called on the loop with each publication (``job``, its answers; None: the job's were dropped):
        the plan gateway's link forwards them (``knittrans.api.gatewaylink``)."""

    def bind(self, loop: asyncio.AbstractEventLoop, compute: Compute) -> None:
        """Publish answers to ``loop`` from now on, computed by ``compute(job, ranks)`` on the state
        thread (the service's ``rank_answers``: chunks of answers, None when the job does not exist)."""
        self._answers = {}
        self._loop, self._compute = loop, compute

    def unbind(self) -> None:
        """Stop publishing (the app shut down); later reads miss and go to the state thread."""
        self._loop, self._compute = None, None
        self._answers = {}

    def answer(self, job: str, rank: int) -> Answer | None:
        """What ``next`` answers ``rank`` of ``job`` now, as last published; None when nothing is
        published for it yet (ask the state thread, ``ControlPlane.rank_answer``, and :meth:`store` the
        answer there). Called on the event loop."""
        table = self._answers.get(job)
        return None if table is None else table.get(rank)

    def store(self, job: str, rank: int, answer: Answer) -> None:
        """On the state thread: publish ``rank``'s answer just computed, waking no one (a board miss:
        the rank's first look, or its first after a restart of the app)."""
        self._post(job, {rank: answer}, (), wake=False)

    def _take(self, table: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Event]], key: Any) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        found = table.get(key)
        if found is None or found[0] is not loop:
            found = (loop, asyncio.Event())
            table[key] = found
        return found[1]

    def event(self, job: str) -> asyncio.Event:
        """The event the next change of ``job`` will set, whatever it concerns (called on the event loop)."""
        with self._lock:
            return self._take(self._jobs, job)

    def rank_event(self, job: str, rank: int) -> asyncio.Event:
        """The event the next change of ``rank``'s plans in ``job`` will set (called on the event loop)."""
        with self._lock:
            return self._take(self._ranks.setdefault(job, {}), rank)

    def probed(self, job: str, rank: int) -> None:
        """Count one plan probe of ``rank`` (observability and tests: who was woken for nothing)."""
        key = (job, rank)
        self.probes[key] = self.probes.get(key, 0) + 1

    def notify(self, job: str, ranks: Collection[int] | None = None) -> None:
        """Publish the answers of ``ranks`` (None: every rank) of ``job`` and wake its job-wide waiters
        and the waiters of ``ranks``.

        Called from any thread (the state thread); later waiters get fresh events.
        """
        compute = self._compute
        if compute is None or self._loop is None:
            self._wake(job, ranks)
            return
        if ranks is not None and not ranks:
            self._post(job, {}, ranks, wake=True)  # job-wide waiters only
            return
        try:
            chunks = compute(job, ranks)
            if chunks is None:  # no such job (any more)
                self._post(job, None, ranks, wake=True)
                return
            for chunk in chunks:  # each chunk is posted as soon as it is rendered
                self._post(job, chunk, chunk.keys(), wake=True)
        except Exception:  # the board must not break the change that notifies it: drop the job's answers
            logger.exception("plan board: answers of job %s could not be computed", job)
            self._post(job, None, ranks, wake=True)

    def _post(self, job: str, answers: dict[int, Answer] | None, ranks: Collection[int] | None, *, wake: bool) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            if wake:
                self._wake(job, ranks)
            return
        running = _running_loop()
        if running is loop:
            self._apply(job, answers, ranks, wake)
        else:
            loop.call_soon_threadsafe(self._apply, job, answers, ranks, wake)

    def _apply(self, job: str, answers: dict[int, Answer] | None, ranks: Collection[int] | None, wake: bool) -> None:
        """On the loop: store the answers (None: forget the job's), then wake."""
        if answers is None:
            self._answers.pop(job, None)
        elif answers:
            self._answers.setdefault(job, {}).update(answers)
        if answers is None or answers:
            for listener in self.listeners:
                listener(job, answers)
        if wake:
            self._wake(job, ranks)

    def _wake(self, job: str, ranks: Collection[int] | None) -> None:
        with self._lock:
            woken = [e for e in (self._jobs.pop(job, None),) if e is not None]
            table = self._ranks.get(job)
            if table:
                if ranks is None:
                    woken.extend(table.values())
                    table.clear()
                else:
                    woken.extend(e for e in (table.pop(r, None) for r in ranks) if e is not None)
        if not woken:
            return
        running = _running_loop()
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for loop, event in woken:
            if running is loop:
                event.set()
            elif not loop.is_closed():
                by_loop.setdefault(loop, []).append(event)
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_set_all, events)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop of the calling thread, or None (the state thread has none)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class AckBatcher:
    """Group commit of acks: acks that arrive while the state thread is busy are applied together, in
    one state-thread call and one SQLite transaction per job (``ControlPlane.ack_many``); each
    request still gets its own result or error (a refused ack does not fail the others).

    The first ack of a quiet moment goes at once (after acks already queued on the loop join it);
    later ones queue behind the batch in flight and go together when it returns. An unexpected
    failure of the whole call (not a refused ack) fails every ack of the batch, as it would have
    failed each of them alone.
    """

    def __init__(self, service: ControlPlane, runner: StateRunner) -> None:
        self.service, self.runner = service, runner
        self._pending: dict[str, list[tuple[int, str, asyncio.Future[dict[str, Any]]]]] = {}
        self._draining: asyncio.Task[None] | None = None
        self.batches = 0
        """State-thread calls made (observability and tests: acks per batch = acks / batches)."""

    async def ack(self, job: str, rank: int, plan_id: str) -> dict[str, Any]:
        """Ack ``plan_id`` of ``rank``; the service's result, or its error raised."""
        return await self.submit(job, rank, plan_id)

    def submit(self, job: str, rank: int, plan_id: str) -> asyncio.Future[dict[str, Any]]:
        """Queue the ack of ``plan_id`` of ``rank`` (on the event loop); the future gets :meth:`ack`'s result
        or error. For a caller that needs no task of its own per ack (the plan stream's ack lines)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(job, []).append((rank, plan_id, future))
        if self._draining is None or self._draining.done():
            self._draining = asyncio.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # acks whose requests the loop is reading now join this batch
        while self._pending:
            batch, self._pending = self._pending, {}
            work = {job: [(rank, plan_id) for rank, plan_id, _ in items] for job, items in batch.items()}
            self.batches += 1
            try:
                results = await self.runner(self._apply, work)
            except BaseException as exc:  # the state thread failed the whole call: every ack in it fails
                for items in batch.values():
                    for _, _, future in items:
                        if not future.done():
                            future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for job, items in batch.items():
                outcome = results[job]
                for i, (_, _, future) in enumerate(items):
                    got = outcome if isinstance(outcome, BaseException) else outcome[i]
                    if future.done():  # the request went away; its ack still applied
                        continue
                    if isinstance(got, BaseException):
                        future.set_exception(got)
                    else:
                        future.set_result(got)

    def _apply(
        self, work: dict[str, list[tuple[int, str]]]
    ) -> dict[str, list[dict[str, Any] | KnitTransError] | KnitTransError]:
        """On the state thread: each job's acks in one change; a job-level error (unknown job) fails its acks."""
        out: dict[str, list[dict[str, Any] | KnitTransError] | KnitTransError] = {}
        for job, acks in work.items():
            try:
                out[job] = self.service.ack_many(job, acks)
            except KnitTransError as exc:
                out[job] = exc
        return out


# The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool, a thread
# hop (two context switches) per dependency and request, the largest cost of a ``next`` or ``ack`` at scale.


async def _service(request: Request) -> ControlPlane:
    service: ControlPlane = request.app.state.service
    return service


async def _board(request: Request) -> PlanBoard:
    board: PlanBoard = request.app.state.board
    return board


async def _runner(request: Request) -> StateRunner:
    runner: StateRunner = request.app.state.runner
    return runner


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


Service = Annotated[ControlPlane, Depends(_service)]
"""The app's :class:`ControlPlane`."""
Board = Annotated[PlanBoard, Depends(_board)]
"""The app's :class:`PlanBoard`."""
SettingsDep = Annotated[Settings, Depends(_settings)]
"""The app's settings."""
Run = Annotated[StateRunner, Depends(_runner)]
"""The app's :class:`StateRunner`: ``await run(svc.method, ...)``."""
