"""KnitTransRTensorBackend inside AReaL 1.0.4's own RTensor code (``areal.infra.rpc.rtensor``): remotize, a
batched localize, the fetch buffer and clear_node, over a real store server (bench venv, AReaL installed
without its dependency set by scripts/setup_bench_env.sh)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from areal.infra.rpc import rtensor

from knittrans.flight.server import StoreServer, StoreServerConfig
from knittrans.integrations.areal import KnitTransRTensorBackend
from knittrans.store.store import StoreConfig


@pytest.fixture()
def backend(tmp_path: Path) -> Iterator[tuple[KnitTransRTensorBackend, StoreServer]]:
    server = StoreServer(StoreServerConfig(store=StoreConfig(root=tmp_path), node_id="node-a"))
    kt = KnitTransRTensorBackend(stores={"node-a": server.endpoint}, store_dirs={"node-a": str(tmp_path)})
    rtensor.set_backend(kt)
    try:
        yield kt, server
    finally:
        rtensor.set_backend(None)
        rtensor.clear_fetch_buffer()
        kt.close()
        server.shutdown()


def _trajectory(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 32000, (1, 17 + seed), generator=g),
        "logprobs": torch.randn(1, 17 + seed, generator=g).bfloat16(),
        "rewards": torch.tensor(0.25 * seed),
        "pixel_values": torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8, generator=g),
        "meta": ("not a tensor", [torch.arange(seed + 1)]),
    }


def _equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b


def test_remotize_localize_and_clear_through_knittrans_units(
    backend: tuple[KnitTransRTensorBackend, StoreServer],
) -> None:
    """RTensor.remotize stores every tensor of two trajectories as a unit (handles keep meta tensors only);
    RTensor.localize fetches them in one batch, equal in dtype, shape and value; a fresh handle of a fetched
    shard is served by AReaL's fetch buffer; RTensor.clear_node deletes the units and empties the buffer."""
    _, server = backend
    trajectories = [_trajectory(0), _trajectory(1)]
    remote = rtensor.RTensor.remotize(trajectories, node_addr="worker-0:1234")
    assert remote[0]["input_ids"].data.is_meta and isinstance(remote[0]["input_ids"], rtensor.RTensor)
    assert len(server.store.units("areal")) == 10
    local = rtensor.RTensor.localize(remote)
    _equal(local, trajectories)
    assert rtensor.fetch_buffer_stats()["num_entries"] == 10
    handle = rtensor.RTensor(shard=remote[1]["logprobs"].shard, data=torch.empty(1, 18, device="meta"))
    _equal(handle.to_local(), trajectories[1]["logprobs"])  # a fresh handle: served by the fetch buffer
    shards = rtensor.RTensor.collect_shards(remote)
    assert list(shards) == ["worker-0:1234"] and len(shards["worker-0:1234"]) == 10
    asyncio.run(rtensor.RTensor.clear_node("worker-0:1234", shards["worker-0:1234"]))
    assert server.store.units("areal") == []
    assert rtensor.fetch_buffer_stats()["num_entries"] == 0
