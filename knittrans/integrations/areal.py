"""An AReaL ``RTensorBackend`` whose shards live in KnitTrans stores (docs/how-to/frameworks.md, section 3)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from knittrans.errors import InvalidRequest
from knittrans.integrations.tqstore import Loc, TQBackendConfig, TQStoreCore

__all__ = ["KnitTransRTensorBackend"]

_FIELD = "tensor"
_PARTITION = "areal"


class KnitTransRTensorBackend:
    """AReaL ``RTensorBackend`` (``fetch`` / ``store`` / ``delete``) over KnitTrans store nodes."""

    def __init__(
        self,
        *,
        stores: Mapping[str, str],
        store_dirs: Mapping[str, str] | None = None,
        job: str = "areal",
        token: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """Args:
        stores: store node name -> Flight endpoint.
        store_dirs: store node name -> its directory, for the nodes on this host (files, no DoPut).
        job: job directory of the shards on every node.
        token: the stores' bearer token, None for none.
        timeout_s: deadline of one store call.
        """
        config = TQBackendConfig(
            job=job, stores=dict(stores), store_dirs=dict(store_dirs or {}), token=token, timeout_s=timeout_s
        )
        self.core = TQStoreCore(config)
        self._next = 0

    def store(self, tensor: Any) -> str:
        """Write ``tensor`` (on CPU) as a one-row unit on this host's node; its shard id."""
        self._next += 1
        (loc,) = self.core.put({_FIELD: tensor.detach().cpu().unsqueeze(0)}, 1, [self._next], _PARTITION)
        node, unit, _, _, layout = loc[_FIELD]
        return f"{node}|{unit}|{layout}"

    def fetch(self, shards: Sequence[Any]) -> list[Any]:
        """The tensors of ``shards`` (AReaL ``TensorShardInfo``), in order: one DoGet per node and layout."""
        metas = [_meta(s.shard_id) for s in shards]
        rows: list[Any] = self.core.get([_FIELD], list(range(len(shards))), metas, packed=False)[_FIELD]
        return rows

    async def delete(self, node_addr: str, shard_ids: list[Any]) -> None:
        """Delete the units of ``shard_ids`` (``node_addr`` is AReaL's worker address; the ids name the node)."""
        metas = [_meta(s) for s in shard_ids]
        await asyncio.to_thread(self.core.clear, [_FIELD], list(range(len(metas))), metas)

    def close(self) -> None:
        """Close the store clients."""
        self.core.close()


def _meta(shard_id: Any) -> dict[str, Loc]:
    """The backend meta of a shard: its one row's location."""
    parts = str(shard_id).split("|", 2)
    if len(parts) != 3:
        raise InvalidRequest(f"{shard_id!r} is not a KnitTrans shard id ('<node>|<unit>|<layout>')")
    return {_FIELD: (parts[0], parts[1], 0, 1, parts[2])}
