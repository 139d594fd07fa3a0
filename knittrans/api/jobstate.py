"""Plain-Python state of one job: unit index, supply, admission, manifests, acks, versions, staleness.

No HTTP and no SQL here: every method that changes state records its writes in a :class:`Txn`
that the service commits before answering, after running :meth:`~knittrans.api.admit.Admission.admit`
(which also settles the lifecycle and writes the job's meta record). Methods validate first and mutate
after, so a rejected request leaves the state untouched.

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

    No locks: one thread touches it (:class:`~knittrans.api.routes.deps.StateRunner` in the app, the
    caller's one thread outside it).
    """
