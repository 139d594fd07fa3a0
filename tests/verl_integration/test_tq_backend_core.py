"""The TransferQueue backend's storage logic without TransferQueue's client: real store servers, counted DoGets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from knittrans.errors import InvalidRequest
from knittrans.flight.server import StoreServer, StoreServerConfig
from knittrans.integrations.tqstore import NODE_ENV, StoreNodeLost, TQBackendConfig
from knittrans.integrations.tqstore import TQStoreCore as _Core
from knittrans.store.store import StoreConfig


class CountingStore(StoreServer):
    """A store server that counts the reads it serves (DoGet or its data lane), by ticket kind."""

    def __init__(self, config: StoreServerConfig) -> None:
        super().__init__(config)
        self.gets: list[bytes] = []

    def read_ticket(self, raw: bytes) -> pa.Table:
        self.gets.append(raw)
        return super().read_ticket(raw)


@pytest.fixture()
def stores(tmp_path: Path) -> Iterator[dict[str, CountingStore]]:
    servers = {
        n: CountingStore(StoreServerConfig(store=StoreConfig(root=tmp_path / n), node_id=n))
        for n in ("node-a", "node-b")
    }
    yield servers
    for s in servers.values():
        s.shutdown()


def _put(core: _Core, node: str, first: int, n: int) -> list[dict[str, Any]]:
    os.environ[NODE_ENV] = node
    try:
        g = torch.Generator().manual_seed(first)
        image = torch.randint(0, 255, (n // 4, 8, 8), dtype=torch.uint8, generator=g).repeat_interleave(4, 0)
        data = {
            "reward": torch.rand(n, generator=g),
            "logp": torch.randn(n, 5, generator=g).bfloat16(),
            "tokens": torch.nested.nested_tensor([torch.arange(i % 7 + 1) for i in range(n)], layout=torch.jagged),
            "image": image,
            "uid": [f"u{first + i}" for i in range(n)],
        }
        return core.put(data, n, list(range(first, first + n)), "train")
    finally:
        os.environ.pop(NODE_ENV, None)


def test_get_is_one_rows_and_one_media_doget_per_node(stores: dict[str, CountingStore]) -> None:
    """Rows of two puts on each of two nodes, requested out of order: each node serves exactly one rows DoGet
    (only the requested fields) and one media DoGet; images are stored once per group, returned per row."""
    core = _Core(TQBackendConfig(stores={n: s.endpoint for n, s in stores.items()}, media_fields=("image",)))
    meta: list[dict[str, Any]] = []
    for node, first in (("node-a", 0), ("node-b", 8), ("node-a", 16), ("node-b", 24)):
        meta += _put(core, node, first, 8)
    assert [len(s.store.units("transferqueue")) for s in stores.values()] == [2, 2]
    assert all(u.media.num_rows == 2 for s in stores.values() for u in s.store.units("transferqueue"))
    want = [30, 1, 17, 9, 2, 25]
    got = core.get(["reward", "image", "uid", "tokens"], want, [meta[i] for i in want])
    for s in stores.values():
        kinds = sorted(b'"kind":"media"' in t for t in s.gets)
        assert kinds == [False, True], s.gets
        assert b"tq.logp" not in s.gets[0] and b"tq.reward" in s.gets[0]
    ref = {i: _put_values(i) for i in want}
    assert torch.equal(got["reward"], torch.stack([ref[i]["reward"] for i in want]))
    assert got["image"].is_nested  # SimpleStorage's container: rows of one shape in a jagged nested tensor
    assert torch.equal(torch.stack(got["image"].unbind()), torch.stack([ref[i]["image"] for i in want]))
    assert got["uid"].tolist() == [f"u{i}" for i in want]
    assert [t.tolist() for t in got["tokens"]] == [list(range(i % 8 % 7 + 1)) for i in want]
    core.close()


def _put_values(index: int) -> dict[str, torch.Tensor]:
    """What ``_put`` wrote for global index ``index`` (re-generated from its seed)."""
    first = index - index % 8
    g = torch.Generator().manual_seed(first)
    image = torch.randint(0, 255, (2, 8, 8), dtype=torch.uint8, generator=g).repeat_interleave(4, 0)
    reward = torch.rand(8, generator=g)
    return {"reward": reward[index - first], "image": image[index - first]}


def test_lost_node_and_unknown_location_are_named(stores: dict[str, CountingStore]) -> None:
    """A stopped node raises StoreNodeLost naming it; a row with no location names the field and index."""
    core = _Core(TQBackendConfig(stores={n: s.endpoint for n, s in stores.items()}, timeout_s=10))
    meta = _put(core, "node-b", 0, 4)
    stores["node-b"].shutdown()
    with pytest.raises(StoreNodeLost, match=r"store node 'node-b' \(grpc://127.0.0.1:\d+\) is unreachable"):
        core.get(["reward"], [0, 1], meta[:2])
    with pytest.raises(Exception, match=r"field 'reward' of global index 7 has no KnitTrans location"):
        core.get(["reward"], [7], [{}])
    core.close()


def test_a_column_of_the_wrong_length_is_refused_by_name(stores: dict[str, CountingStore]) -> None:
    """A put whose field holds fewer rows than the put is refused naming the field (nothing is stored)."""
    core = _Core(TQBackendConfig(stores={"node-a": stores["node-a"].endpoint}))
    with pytest.raises(InvalidRequest, match=r"field 'extra' has 1 rows, expected 2"):
        core.put({"extra": ["a"], "ok": torch.zeros(2)}, 2, [0, 1], "p")
    assert stores["node-a"].store.units("transferqueue") == []
    core.close()


def test_same_host_batch_in_order_is_served_from_the_units_as_batched_tensors(
    stores: dict[str, CountingStore], tmp_path: Path
) -> None:
    """With the node's directory on this host, a whole put read in order touches no server; jagged rows and
    media rows come back as jagged nested tensors (SimpleStorage's containers), scalars as a dense tensor."""
    store_dir = str(tmp_path / "node-a")
    core = _Core(
        TQBackendConfig(
            stores={"node-a": stores["node-a"].endpoint}, store_dirs={"node-a": store_dir}, media_fields=("image",)
        )
    )
    meta = _put(core, "node-a", 0, 8)
    assert core.all_local(meta) and not _Core(TQBackendConfig(stores={"node-a": stores["node-a"].endpoint})).all_local(
        meta
    )
    stores["node-a"].gets.clear()
    got = core.get(["tokens", "image", "logp"], list(range(8)), meta)
    assert stores["node-a"].gets == []
    assert got["tokens"].is_nested and got["tokens"].layout == torch.jagged
    assert [t.tolist() for t in got["tokens"].unbind(0)] == [list(range(i % 7 + 1)) for i in range(8)]
    assert got["image"].layout == torch.jagged and got["image"].values().shape == (64, 8)
    assert torch.equal(torch.stack(got["image"].unbind()), torch.stack([_put_values(i)["image"] for i in range(8)]))
    assert got["logp"].dtype == torch.bfloat16 and [r.shape for r in got["logp"].unbind()] == [(5,)] * 8
    # out of order: same rows, reordered, as a list of rows for the jagged field
    back = core.get(["tokens", "image"], [5, 3], [meta[5], meta[3]])
    assert [t.tolist() for t in back["tokens"].unbind(0)] == [list(range(6)), list(range(4))]
    assert [r.tolist() for r in back["image"].unbind()] == [got["image"][5].tolist(), got["image"][3].tolist()]
    core.close()


def test_media_rows_equal_to_a_non_adjacent_earlier_row_are_stored_once(stores: dict[str, CountingStore]) -> None:
    """Image rows A, B, copy of A: the unit's media table holds each content hash once (its schema's hashes are
    unique; the copy was stored a second time before), and every row reads back its own bytes."""
    core = _Core(TQBackendConfig(stores={"node-a": stores["node-a"].endpoint}, media_fields=("image",)))
    a = torch.arange(64, dtype=torch.uint8).reshape(8, 8)
    meta = core.put({"image": torch.stack([a, a + 1, a.clone()])}, 3, [0, 1, 2], "p")
    (unit,) = stores["node-a"].store.units("transferqueue")
    assert unit.media.num_rows == 2
    got = core.get(["image"], [0, 1, 2], meta, packed=False)["image"]
    assert [r.tolist() for r in got] == [a.tolist(), (a + 1).tolist(), a.tolist()]
    core.close()
