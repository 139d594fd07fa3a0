"""The manifest board: each job's published manifests and their waiters, held on the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from knittrans.api.delivery import Published

__all__ = ["ManifestBoard"]

logger = logging.getLogger(__name__)

Compute = Callable[[str], Published | None]
"""``ControlPlane.published``: a job's :class:`Published` view; None when the job does not exist."""


class ManifestBoard:
    """Per job: the last :class:`Published` view and the events its waiters wait on."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compute: Compute | None = None
        self._views: dict[str, Published] = {}
        self._waiters: dict[tuple[str, str], asyncio.Event] = {}

    def bind(self, loop: asyncio.AbstractEventLoop, compute: Compute) -> None:
        """Publish to ``loop`` from now on, computing views with ``compute(job)`` on the state thread."""
        self._views, self._waiters = {}, {}
        self._loop, self._compute = loop, compute

    def unbind(self) -> None:
        """Stop publishing (the app shut down)."""
        self._loop, self._compute = None, None
        self._views, self._waiters = {}, {}

    def view(self, job: str) -> Published | None:
        """The job's view as last published (on the event loop); None before the first publication."""
        return self._views.get(job)

    def store(self, job: str, view: Published) -> None:
        """On the state thread: publish a view computed on a board miss, waking no one."""
        self._post(job, view, wake=False)

    def event(self, job: str, kind: str = "changed") -> asyncio.Event:
        """The event the next change of ``job`` sets: ``changed`` (any change) or ``delivery`` (what the
        manifest long-polls answer changed). Called on the event loop."""
        return self._waiters.setdefault((job, kind), asyncio.Event())

    def notify(self, job: str) -> None:
        """After a committed change of ``job`` (state thread): publish its view and wake its waiters."""
        view = None
        try:
            view = self._compute(job) if self._compute is not None else None
        except Exception:  # the board must not break the change that notifies it: drop the job's view
            logger.exception("manifest board: the view of job %s could not be computed", job)
        self._post(job, view, wake=True)

    def _post(self, job: str, view: Published | None, *, wake: bool) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():  # unbound: nobody waits
            loop.call_soon_threadsafe(self._apply, job, view, wake)

    def _apply(self, job: str, view: Published | None, wake: bool) -> None:
        """On the loop: store the view (None: forget it), then wake."""
        old = self._views.pop(job, None) if view is None else self._views.get(job)
        if view is not None:
            self._views[job] = view
        if wake:
            self._wake(job, delivery=view is None or old is None or _answers_differ(old, view))

    def _wake(self, job: str, *, delivery: bool) -> None:
        for kind in ("changed", "delivery") if delivery else ("changed",):
            event = self._waiters.pop((job, kind), None)
            if event is not None:
                event.set()


def _answers_differ(old: Published, new: Published) -> bool:
    """Whether a manifest long-poll could answer differently under ``new`` than under ``old``."""
    if (old.position, old.final, old.state) != (new.position, new.final, new.state):
        return True
    if old.manifests.keys() != new.manifests.keys():
        return True
    return any(old.manifests[n][0] != tag for n, (tag, _) in new.manifests.items())
