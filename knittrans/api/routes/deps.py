"""Dependencies shared by the routers: the service and the plan board of the running app."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Depends, Request

from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings

__all__ = ["Board", "PlanBoard", "Service", "SettingsDep"]


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


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


Service = Annotated[ControlPlane, Depends(_service)]
"""The app's :class:`ControlPlane`."""
Board = Annotated[PlanBoard, Depends(_board)]
"""The app's :class:`PlanBoard`."""
SettingsDep = Annotated[Settings, Depends(_settings)]
"""The app's settings."""
