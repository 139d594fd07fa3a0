"""``Registrar``: a writer's unit registrations sent in the background, off the put's critical path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from knittrans.descriptors import UnitDescriptor
from knittrans.errors import KnitTransError, Unavailable

__all__ = ["Registrar"]

logger = logging.getLogger(__name__)

Register = Callable[[str, Sequence[UnitDescriptor]], Any]
"""``ControlClient.register_units``: register units of a job (all or none; a repeat is a no-op)."""
Submit = Callable[[Callable[[], None]], Future[Any]]
"""Run a callable on a sender thread (never raises: the writer's runs it in the caller's thread when it cannot)."""


@dataclass
class _Submission:
    units: list[UnitDescriptor]
    error: BaseException | None = None


class Registrar:
    """Background registrations of one writer, of its job (docs/explanation/rollout.md); thread-safe."""

    def __init__(self, job: str, register: Register, submit: Submit) -> None:
        self.job, self._register, self._submit = job, register, submit
        self._cond = threading.Condition()
        self._queue: list[_Submission] = []
        self._busy = False  # a drain is queued or running
        self._failed: list[_Submission] = []  # failures not raised yet, oldest first

    def submit(self, units: Sequence[UnitDescriptor]) -> None:
        """Queue ``units`` for registration and return."""
        if not units:
            return
        with self._cond:
            self._queue.append(_Submission(list(units)))
            if self._busy:
                return  # the running drain takes it
            self._busy = True
        self._submit(self._drain)

    def check(self) -> None:
        """Raise the oldest background failure not raised yet (once), with its type; its ``units`` are the
        descriptors left unregistered."""
        with self._cond:
            if not self._failed:
                return
            failed = self._failed.pop(0)
        raise _reported(self.job, failed)

    def flush(self) -> None:
        """Wait until every unit submitted so far is registered or has failed, then raise as :meth:`check`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
        self.check()

    def _drain(self) -> None:
        """Register what is queued, coalesced, until the queue is empty (on a sender thread)."""
        while True:
            with self._cond:
                batch, self._queue = self._queue, []
                if not batch:
                    self._busy = False
                    self._cond.notify_all()
                    return
            self._send(batch)
            with self._cond:
                self._failed += [s for s in batch if s.error is not None]

    def _send(self, subs: list[_Submission]) -> None:
        """One request for ``subs``; when the control plane refuses it and it holds several, each again on
        its own (a control plane that cannot be reached after the client's retries fails them all)."""
        try:
            self._register(self.job, [u for s in subs for u in s.units])
            return
        except Exception as exc:
            if len(subs) == 1 or isinstance(exc, Unavailable):
                units = sum(len(s.units) for s in subs)
                logger.warning("registering %d units of job %s failed: %s", units, self.job, exc)
                for s in subs:
                    s.error = exc
                return
        for s in subs:
            self._send([s])


def _reported(job: str, failed: _Submission) -> BaseException:
    """The failure of ``failed`` as the caller sees it: its type and words, the units named, ``units`` set."""
    exc = failed.error
    assert exc is not None
    ids = [u.unit_id for u in failed.units]
    shown = ids if len(ids) <= 8 else [*ids[:8], f"... ({len(ids)} units)"]
    message = f"units {shown} of job {job!r} were stored but not registered: {exc}"
    # register is ControlClient.register_units: its errors are knittrans.errors classes, each made from a message
    error = type(exc)(message) if isinstance(exc, KnitTransError) else KnitTransError(message)
    error.units = failed.units  # type: ignore[attr-defined]
    error.__cause__ = exc
    return error
