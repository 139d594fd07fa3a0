"""Byte budget with backpressure: writers wait on a condition variable until space is freed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from knittrans.errors import Conflict, OverBudget

__all__ = ["ByteBudget"]

_POLL_S = 0.2


class ByteBudget:
    """Counts bytes held on the store's memory filesystem against an optional limit.

    ``reserve`` blocks up to a timeout while the budget is full and raises :class:`OverBudget`
    naming the limit, the bytes in use and the bytes needed; ``release`` wakes every waiter.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        """Most bytes (:class:`~knittrans.store.StoreConfig` checks it is positive); None: unlimited."""
        self.used = 0
        """Bytes reserved or held right now."""
        self.waiting = 0
        """Writers blocked in :meth:`reserve` right now, waiting for space."""
        self._cond = threading.Condition()

    def reserve(self, nbytes: int, timeout: float, *, abandoned: Callable[[], bool] | None = None) -> None:
        """Reserve ``nbytes``, waiting up to ``timeout`` seconds for space; else raise OverBudget.

        ``abandoned`` is polled while waiting: once it answers True (the caller's call was
        cancelled) the wait ends with :class:`Conflict` and nothing is reserved.
        """
        if self.limit is not None and nbytes > self.limit:
            raise OverBudget(f"need {nbytes} bytes but the store budget is only {self.limit} bytes in total")
        deadline = time.monotonic() + timeout
        with self._cond:
            self.waiting += 1
            try:
                while True:
                    if abandoned is not None and abandoned():
                        raise Conflict(f"reservation of {nbytes} bytes abandoned by its caller")
                    if self.limit is None or self.used + nbytes <= self.limit:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise OverBudget(
                            f"store budget of {self.limit} bytes stayed full for {timeout:.1f}s: "
                            f"{self.used} bytes in use, need {nbytes} more"
                        )
                    self._cond.wait(min(left, _POLL_S) if abandoned is not None else left)
            finally:
                self.waiting -= 1
            self.used += nbytes

    def force(self, nbytes: int) -> None:
        """Account bytes that already exist (recovered units), even above the limit."""
        with self._cond:
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        """Give bytes back and wake waiting writers."""
        with self._cond:
            self.used = max(0, self.used - nbytes)
            self._cond.notify_all()
