"""The control plane's persistence schema: record kinds and their keys (docs/reference/rest.md#persistence)."""

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
