"""Arrow Flight shell over the node-local store: ``StoreServer`` (with its bulk data lane,
:mod:`knittrans.flight.lane`), ``StoreClient`` and the error mapping."""

from knittrans.flight.client import StoreClient
from knittrans.flight.server import StoreServer, StoreServerConfig

__all__ = ["StoreClient", "StoreServer", "StoreServerConfig"]
