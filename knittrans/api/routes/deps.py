"""Dependencies shared by the routers: the service and the plan board of the running app."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
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
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the state thread (started on first use); its result or exception."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knittrans-state")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Finish queued calls and stop the thread (a later call starts a new one)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class PlanBoard:
    """Wakes every rank long-polling a job when that job's plans may have changed (one event per job)."""

    def __init__(self) -> None:
        self._events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}

    def event(self, job: str) -> asyncio.Event:
        """The event the next change of ``job`` will set (called on the event loop)."""
        loop = asyncio.get_running_loop()
        found = self._events.get(job)
        if found is None or found[0] is not loop:
            found = (loop, asyncio.Event())
            self._events[job] = found
        return found[1]

    def notify(self, job: str) -> None:
        """Wake the waiters of ``job``; later waiters get a fresh event."""
        found = self._events.pop(job, None)
        if found is None:
            return
        loop, event = found
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(event.set)


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
