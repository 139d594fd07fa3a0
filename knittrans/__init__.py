"""KnitTrans: trajectory transfer layer for disaggregated LLM reinforcement learning (public API, imported lazily)."""

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
    "RolloutWorkerConfig": "knittrans.rollout.worker",
    "open_engine": "knittrans.rollout.engines",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # `X as X`: explicit re-exports for type checkers
    from knittrans.api.app import create_app as create_app
    from knittrans.api.settings import Settings as Settings
    from knittrans.controlclient import ControlClient as ControlClient
    from knittrans.descriptors import GroupRecord as GroupRecord
    from knittrans.descriptors import UnitDescriptor as UnitDescriptor
    from knittrans.flight import StoreServer as StoreServer
    from knittrans.flight import StoreServerConfig as StoreServerConfig
    from knittrans.flight.client import StoreClient as StoreClient
    from knittrans.rollout.engines import open_engine as open_engine
    from knittrans.rollout.worker import RolloutWorkerConfig as RolloutWorkerConfig
    from knittrans.rollout.writer import TrajectoryWriter as TrajectoryWriter
    from knittrans.sched.admission import make_policy as make_policy
    from knittrans.sched.assign import assign_mini_batch as assign_mini_batch
    from knittrans.schema import Media as Media
    from knittrans.schema import TrajectoryGroup as TrajectoryGroup
    from knittrans.store import StoreConfig as StoreConfig
    from knittrans.store import UnitStore as UnitStore
    from knittrans.tickets import Ticket as Ticket
    from knittrans.tickets import UnitRead as UnitRead
    from knittrans.trainer.client import TrainerClient as TrainerClient
    from knittrans.trainer.client import TrainerConfig as TrainerConfig
    from knittrans.trainer.convert import MicroBatch as MicroBatch
    from knittrans.trainer.convert import to_micro_batch as to_micro_batch
    from knittrans.trainer.dedup import DedupEncoder as DedupEncoder
    from knittrans.trainer.fetch import Fetcher as Fetcher
    from knittrans.trainer.media import MediaCache as MediaCache


# Lazy: ``import knittrans`` (and the ``knittrans`` command) pays for torch or pyarrow only when a name needs them.
def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'knittrans' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
