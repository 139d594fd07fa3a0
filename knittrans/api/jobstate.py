"""Plain-Python state of one job: unit index, supply, admission, manifests, acks, versions, staleness.

No HTTP and no SQL here: every method that changes state records its writes in a :class:`Txn`
that the service commits before answering. Methods validate first and mutate after, so a
rejected request leaves the state untouched.

Where each part lives (:class:`JobState` is their union):

* :mod:`~knittrans.api.jobbase`: the fields, the views every part reads (pool, step state, cursor,
  headroom), the lifecycle (pause/resume/drain, settling) and the record writes the parts share.
* :mod:`~knittrans.api.supply`: units registered and groups started or dropped.
* :mod:`~knittrans.api.admit`: admission of mini-batches, expiry of stale groups.
* :mod:`~knittrans.api.delivery`: manifests, fetched, ack, policy versions.
* :mod:`~knittrans.api.nodeloss`: a lost store node, an admin's unit removal.
* :mod:`~knittrans.api.records` names the records written; :mod:`~knittrans.api.restore` reads
  them back; :mod:`knittrans.lifecycle` holds the statuses and their one transition table.
"""

from __future__ import annotations

from knittrans.api.admit import Admission
from knittrans.api.delivery import Delivery
from knittrans.api.nodeloss import NodeLoss
from knittrans.api.supply import Supply

__all__ = ["JobState"]


class JobState(Supply, Admission, Delivery, NodeLoss):
    """State and rules of one job; the service owns persistence and the node registry.

    Threading: a ``JobState`` has no locks and needs none, because one thread at a time touches
    it. In the app every call (state change or read) goes through the
    :class:`~knittrans.api.routes.deps.StateRunner`, one worker thread that runs calls in arrival
    order; route handlers are ``async def`` and hand their work to it (a plain ``def`` handler
    would run in FastAPI's thread pool, beside the state thread). The service checks the thread
    at every entry (:meth:`~knittrans.api.service.ControlPlane.job`); ``tests/test_api_threads.py``
    fails if a route or a call breaks the rule. Outside an app (tests, simulations) the caller's
    one thread plays the state thread.
    """
