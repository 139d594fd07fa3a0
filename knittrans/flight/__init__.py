"""Arrow Flight shell over the node-local store: ``StoreServer`` (and its data lane), ``StoreClient``, error mapping."""

from knittrans.flight.client import StoreClient
from knittrans.flight.server import StoreServer, StoreServerConfig

__all__ = ["StoreClient", "StoreServer", "StoreServerConfig"]
