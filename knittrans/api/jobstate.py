"""Plain-Python state of one job (no HTTP, no SQL): the union of supply, admission, delivery and node loss."""

from __future__ import annotations

from knittrans.api.admit import Admission
from knittrans.api.delivery import Delivery
from knittrans.api.nodeloss import NodeLoss
from knittrans.api.supply import Supply

__all__ = ["JobState"]


class JobState(Supply, Admission, Delivery, NodeLoss):
    """State and rules of one job; the service owns persistence and the node registry.

    No locks: one thread touches it (:class:`~knittrans.api.routes.deps.StateRunner` in the app, the
    caller's one thread outside it).
    """
