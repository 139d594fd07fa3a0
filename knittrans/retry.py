"""``RetryPolicy``: the one retry rule (time budget, exponential backoff, jitter) every client shares."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["DEFAULT_RETRY", "RetryPolicy"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often to retry a call that failed for a transient reason."""

    budget_s: float = 120.0
    """Total time to keep retrying after the first failure; then the error is raised."""
    first_backoff_s: float = 0.05
    """First pause; doubles after every failure."""
    max_backoff_s: float = 2.0
    """Largest single pause."""
    jitter: float = 0.5
    """Each pause is scaled by a uniform factor in ``[1 - jitter, 1 + jitter]`` (spreads herds)."""

    def __post_init__(self) -> None:
        for name in ("budget_s", "first_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], not {self.jitter!r}")

    def pauses(self) -> Iterator[float]:
        """Pauses to sleep between attempts; ends when the next pause would pass the budget."""
        deadline = time.monotonic() + self.budget_s
        delay = self.first_backoff_s
        while True:
            pause = delay * (1 + self.jitter * (2 * random.random() - 1))
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield min(pause, left)
            delay = min(self.max_backoff_s, max(delay, 0.01) * 2)


DEFAULT_RETRY = RetryPolicy()
"""120 s budget, 50 ms first pause doubling to 2 s, ±50 % jitter."""
