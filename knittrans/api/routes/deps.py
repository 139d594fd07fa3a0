"""Dependencies shared by the routers: the service and the plan board of the running app."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings

__all__ = ["Board", "PlanBoard", "Run", "Service", "SettingsDep", "StateRunner"]

T = TypeVar("T")


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
    """Wakes the requests long-polling a job when what they wait for may have changed.

    Two kinds of waiters: a rank waiting for its next plan (one event per ``(job, rank)``) and a
    job-wide waiter (``/headroom``), woken by any change of the job. The service says which ranks'
    plans a change concerns (:meth:`notify`): admitting or withdrawing a mini-batch concerns every
    rank, an ack only the rank that acked, a registration that admits nothing none. So 1,024 ranks
    waiting for the next admission are not all woken (and do not all probe the state thread) by
    every registration batch or every other rank's ack.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._ranks: dict[str, dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self.probes: dict[tuple[str, int], int] = {}
        """Plan probes per ``(job, rank)`` (one per wake-up of a long-poll, plus its first look)."""

        self._lock = threading.Lock()  # the event loop takes events while the state thread pops them

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
        """Wake ``job``'s job-wide waiters and the waiters of ``ranks`` (None: every rank).

        Called from any thread (the state thread); later waiters get fresh events.
        """
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
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for loop, event in woken:
            if running is loop:
                event.set()
            elif not loop.is_closed():
                by_loop.setdefault(loop, []).append(event)
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


def _service(request: Request) -> ControlPlane:
    service: ControlPlane = request.app.state.service
    return service


def _board(request: Request) -> PlanBoard:
    board: PlanBoard = request.app.state.board
    return board


def _runner(request: Request) -> StateRunner:
    runner: StateRunner = request.app.state.runner
    return runner


def _settings(request: Request) -> Settings:
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
