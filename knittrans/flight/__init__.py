"""Arrow Flight shell over the node-local store: ``StoreServer``, ``StoreClient``, error mapping.

API: ``StoreServer(StoreServerConfig(store=StoreConfig(root=...), host=, port=, token=))`` (listening
once constructed; ``.endpoint``, ``.serve()``, ``.shutdown()``) and ``StoreClient(endpoint, token=)``.
Reads go over the bulk data lane beside Flight by default where it can be reached (the store opens
it unless TLS or ``data_lane=False``; ``StoreClient(..., data_lane=False)`` always uses DoGet;
:mod:`knittrans.flight.lane`, receive buffers :mod:`knittrans.flight.recv_pool`).
"""

from knittrans.flight.client import StoreClient
from knittrans.flight.server import StoreServer, StoreServerConfig

__all__ = ["StoreClient", "StoreServer", "StoreServerConfig"]
