"""KnitTrans: trajectory transfer layer for disaggregated LLM reinforcement learning.

The public API is re-exported here and imported lazily on first use, so ``import knittrans``
(and the ``knittrans`` command) does not pay for torch or pyarrow until a name needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # shared contracts
    "Ticket": "knittrans.tickets",
    "UnitRead": "knittrans.tickets",
    "UnitDescriptor": "knittrans.descriptors",
    "GroupRecord": "knittrans.descriptors",
    "TrajectoryGroup": "knittrans.schema",
    "Media": "knittrans.schema",
    "TRAJECTORY_SCHEMA": "knittrans.schema",
    "MEDIA_SCHEMA": "knittrans.schema",
    "SCHEMA_VERSION": "knittrans.schema",
    # data plane
    "UnitStore": "knittrans.store",
    "StoreConfig": "knittrans.store",
    "StoreServer": "knittrans.flight",
    "StoreServerConfig": "knittrans.flight",
    "StoreClient": "knittrans.flight.client",
    "TrajectoryWriter": "knittrans.rollout.writer",
    "Fetcher": "knittrans.trainer.fetch",
    "MicroBatch": "knittrans.trainer.convert",
    "to_micro_batch": "knittrans.trainer.convert",
    # control plane
    "ControlClient": "knittrans.controlclient",
    "create_app": "knittrans.api.app",
    "Settings": "knittrans.api.settings",
    # scheduling core
    "make_policy": "knittrans.sched.admission",
    "assign_mini_batch": "knittrans.sched.assign",
    # trainer side
    "TrainerClient": "knittrans.trainer.client",
    "TrainerConfig": "knittrans.trainer.client",
    "MediaCache": "knittrans.trainer.media",
    "DedupEncoder": "knittrans.trainer.dedup",
    # rollout side
    "RolloutWorker": "knittrans.rollout.worker",
    "RolloutWorkerConfig": "knittrans.rollout.worker",
    "open_engine": "knittrans.rollout.engines",
}

__all__ = [
    "MEDIA_SCHEMA",
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "ControlClient",
    "DedupEncoder",
    "Fetcher",
    "GroupRecord",
    "Media",
    "MediaCache",
    "MicroBatch",
    "RolloutWorker",
    "RolloutWorkerConfig",
    "Settings",
    "StoreClient",
    "StoreConfig",
    "StoreServer",
    "StoreServerConfig",
    "Ticket",
    "TrainerClient",
    "TrainerConfig",
    "TrajectoryGroup",
    "TrajectoryWriter",
    "UnitDescriptor",
    "UnitRead",
    "UnitStore",
    "__version__",
    "assign_mini_batch",
    "create_app",
    "make_policy",
    "open_engine",
    "to_micro_batch",
]

if TYPE_CHECKING:
    from knittrans.api.app import create_app
    from knittrans.api.settings import Settings
    from knittrans.controlclient import ControlClient
    from knittrans.descriptors import GroupRecord, UnitDescriptor
    from knittrans.flight import StoreServer, StoreServerConfig
    from knittrans.flight.client import StoreClient
    from knittrans.rollout.engines import open_engine
    from knittrans.rollout.worker import RolloutWorker, RolloutWorkerConfig
    from knittrans.rollout.writer import TrajectoryWriter
    from knittrans.sched.admission import make_policy
    from knittrans.sched.assign import assign_mini_batch
    from knittrans.schema import MEDIA_SCHEMA, SCHEMA_VERSION, TRAJECTORY_SCHEMA, Media, TrajectoryGroup
    from knittrans.store import StoreConfig, UnitStore
    from knittrans.tickets import Ticket, UnitRead
    from knittrans.trainer.client import TrainerClient, TrainerConfig
    from knittrans.trainer.convert import MicroBatch, to_micro_batch
    from knittrans.trainer.dedup import DedupEncoder
    from knittrans.trainer.fetch import Fetcher
    from knittrans.trainer.media import MediaCache


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'knittrans' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
