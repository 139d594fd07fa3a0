"""The persistence schema of the control plane: record kinds and the keys of their records, in one place.

Every record is addressed by ``(kind, job, key)`` (:mod:`knittrans.api.store`). What the values are:

==================  ============================  ====================================================
kind                key                           value
==================  ============================  ====================================================
``node``            node id (job ``""``)          the node's registration (:class:`~knittrans.api.service.Node`)
``job``             ``meta``                      spec, lifecycle state, next index, attempts, quotas
``units``           :func:`index_key`             the units registered in one request
``group``           group id                      ``{unit_id, status}`` of a lost or expired group
``mb``              :func:`index_key`             one admitted mini-batch
``ack``             :func:`index_key`             ``{attempt, ranks}``: the ranks (``[start, stop)`` runs)
                                                  that acked the mini-batch
``fetched``         :func:`index_key`             ``{attempt, ranks}``: the ranks that hold their share
``version``         :func:`version_key`           a rank's policy version
``supply``          source                        groups started, dropped and finished
``started``         group id                      the source of a group reported started
``request``         request id                    ``1``: a supply report already applied
``consumed``        :func:`index_key`             staleness rows of a consumed mini-batch
``lost``            group id                      a group to regenerate (see :attr:`Kind.TO_REGENERATE`)
==================  ============================  ====================================================

The strings are on disk: changing one needs a new ``STORE_FORMAT`` or a reader for the old spelling.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "JOB_KINDS",
    "META_KEY",
    "Kind",
    "index_key",
    "version_key",
]


class Kind(str, Enum):
    """Record kinds (the ``kind`` column); the values are the on-disk spelling."""

    NODE = "node"
    JOB = "job"
    UNITS = "units"
    GROUP = "group"
    MINI_BATCH = "mb"
    ACK = "ack"
    FETCHED = "fetched"
    VERSION = "version"
    SUPPLY = "supply"
    STARTED = "started"
    REQUEST = "request"
    CONSUMED = "consumed"
    TO_REGENERATE = "lost"
    """Lost *and* expired groups offered for regeneration (``reason`` says which); ``"lost"``: the format's spelling."""


JOB_KINDS: tuple[Kind, ...] = tuple(k for k in Kind if k is not Kind.NODE)
"""Record kinds that belong to one job (every kind but ``node``)."""

META_KEY = "meta"
"""Key of a job's one ``job`` record."""


def index_key(n: int) -> str:
    """Store key of mini-batch ``n`` or of a job's ``n``-th registration of units (zero-padded: keys sort
    numerically)."""
    return f"{n:012d}"


def version_key(rank: int) -> str:
    """Store key of ``rank``'s policy version."""
    return str(rank)
