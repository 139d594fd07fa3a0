"""Arrow Flight shell over the node-local store: ``StoreServer``, ``StoreClient``, error mapping.

API: ``StoreServer(StoreServerConfig(store=StoreConfig(root=...), host=, port=, token=))`` (listening
once constructed; ``.endpoint``, ``.serve()``, ``.shutdown()``) and ``StoreClient(endpoint, token=)``.
Opt-in bulk data lane for reads beside Flight: ``StoreServerConfig(data_lane_port=0)`` and
``StoreClient(..., data_lane=True)`` (:mod:`knittrans.flight.lane`).
"""

from knittrans.flight.client import StoreClient
from knittrans.flight.server import StoreServer, StoreServerConfig

__all__ = ["StoreClient", "StoreServer", "StoreServerConfig"]
