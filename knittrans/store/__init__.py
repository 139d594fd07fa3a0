"""Node-local storage of sealed trajectory units (memory-mapped Arrow IPC files); no Flight here.

API: ``UnitStore(StoreConfig(root=..., budget_bytes=..., spill_dir=...))`` with ``begin``/``seal_units``/
``publish_units``/``delete``/``read(ticket)``/``stats``; ``LocalReader(roots).read(ticket)`` for the same-host
short-circuit; ``ByteBudget`` for backpressure.
"""

from knittrans.store.budget import ByteBudget
from knittrans.store.store import (
    DEFAULT_ROOT,
    PendingUnit,
    SealSpec,
    StoreConfig,
    UnitStore,
    writer_temp_name,
)
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, LocalReader, SealedUnit

__all__ = [
    "DEFAULT_ROOT",
    "MEDIA_FILE",
    "TRAJ_FILE",
    "ByteBudget",
    "LocalReader",
    "PendingUnit",
    "SealSpec",
    "SealedUnit",
    "StoreConfig",
    "UnitStore",
    "writer_temp_name",
]
