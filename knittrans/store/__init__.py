"""Node-local storage of sealed trajectory units (memory-mapped Arrow IPC files); no Flight here."""

from knittrans.store.store import PendingUnit, SealSpec, StoreConfig, UnitStore, writer_temp_name
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, LocalReader, SealedUnit

__all__ = [
    "MEDIA_FILE",
    "TRAJ_FILE",
    "LocalReader",
    "PendingUnit",
    "SealSpec",
    "SealedUnit",
    "StoreConfig",
    "UnitStore",
    "writer_temp_name",
]
