"""Dependencies shared by the routers: the service and its state thread of the running app."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from knittrans.api.service import ControlPlane
from knittrans.errors import NotFound

__all__ = ["KnownJob", "Run", "Service", "StateRunner"]

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
    a heartbeat's timestamp, ``/v1/health``'s counts and reads of the manifest board, single reads
    and writes that need no lock.
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


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency giving ``request.app.state.<name>`` (``async def``: FastAPI runs a plain ``def``
    dependency in its thread pool, a thread hop per dependency and request)."""

    async def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    return get


Service = Annotated[ControlPlane, Depends(_app_state("service"))]
"""The app's :class:`ControlPlane`."""
Run = Annotated[StateRunner, Depends(_app_state("runner"))]
"""The app's :class:`StateRunner`: ``await run(svc.method, ...)``."""


async def _known_job(job: str, request: Request) -> str:
    """The path's ``job``; :class:`NotFound` unless it exists (read on the event loop: jobs are never removed)."""
    if job not in request.app.state.service.jobs:
        raise NotFound(f"job {job!r} does not exist; create it with POST /v1/jobs")
    return job


KnownJob = Annotated[str, Depends(_known_job)]
"""The ``{job}`` of the path, checked to exist before a route keeps anything for it (a long-poll's waiter);
declare it after the token dependency, so that a caller without a token learns nothing of which jobs exist."""
