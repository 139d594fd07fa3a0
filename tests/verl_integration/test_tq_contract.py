"""The KnitTrans backend returns what SimpleStorage returns, containers included: a hypothesis property test
over generated TensorDicts put through TransferQueue 0.1.11's own client into both backends (one controller,
one client per backend), two puts of different shapes per partition, read back in a shuffled order."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
import transfer_queue as tq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict
from tq_support import client_of, kv_get, kv_put, ray_session, same, shm_dir, tq_conf
from transfer_queue.client import TransferQueueClient

from knittrans.flight.server import StoreServer, StoreServerConfig
from knittrans.store.store import StoreConfig

MEDIA = ["image", "multi_modal_inputs.pixel_values"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.complex64]  # fmt: skip


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TransferQueueClient, TransferQueueClient]]:
    """(SimpleStorage client, KnitTrans client) of one TransferQueue controller."""
    with ray_session(), tempfile.TemporaryDirectory(dir=shm_dir()) as root:
        store = StoreServer(StoreServerConfig(store=StoreConfig(root=__import__("pathlib").Path(root)), node_id="n0"))
        conf = tq.init(tq_conf({"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2}}))
        knit = client_of(
            conf, "KnitTrans", {"stores": {"n0": store.endpoint}, "store_dirs": {"n0": root}, "media_fields": MEDIA}
        )
        try:
            yield tq.get_client(), knit
        finally:
            knit.close()
            tq.close()
            store.shutdown()


def _tensor(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-100, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(t.float(), t.float() / 3).to(dtype)
    if dtype.is_floating_point:
        t = t.float() / 7
        if t.numel() and draw(st.booleans()):
            t.view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        return t.to(dtype)
    return (t > 0) if dtype == torch.bool else t.to(dtype)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.fractions(max_denominator=9).map(Fraction),
)


@st.composite
def _array(draw: st.DrawFn) -> Any:
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    if draw(st.booleans()):
        return _tensor(draw, draw(st.sampled_from(DTYPES)), shape)
    return np.arange(int(np.prod(shape)), dtype=draw(st.sampled_from(["int64", "float32", "uint8"]))).reshape(shape)


_values = st.recursive(
    st.one_of(_scalars, _array()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-5, 5)), inner, max_size=3),
    ),
    max_leaves=6,
)


@st.composite
def _column(draw: st.DrawFn, kind: str, n: int) -> Any:
    """One column of ``n`` rows of a field of ``kind`` (shapes drawn anew for each put)."""
    if kind.startswith("dense"):
        dtype = DTYPES[int(kind.split(":")[1])]
        return _tensor(draw, dtype, (n, *draw(st.lists(st.integers(0, 3), max_size=2))))
    if kind.startswith("jagged"):
        dtype = DTYPES[int(kind.split(":")[1])]
        tail = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
        rows = [_tensor(draw, dtype, (draw(st.integers(0, 4)), *tail)) for _ in range(n)]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    if kind == "strided":
        rows = [_tensor(draw, torch.float32, (draw(st.integers(1, 3)), draw(st.integers(1, 3)))) for _ in range(n)]
        with warnings.catch_warnings():  # "prototype stage": strided nested tensors are what a user may put
            warnings.simplefilter("ignore", UserWarning)
            return torch.nested.as_nested_tensor(rows, layout=torch.strided)
    if kind == "image":
        side = draw(st.integers(1, 3))
        uniq = [_tensor(draw, torch.uint8, (side, 2)) for _ in range(draw(st.integers(1, n)))]
        return torch.stack([uniq[draw(st.integers(0, len(uniq) - 1))] for _ in range(n)])
    if kind == "multi_modal_inputs":
        pixels = [_tensor(draw, torch.float32, (draw(st.integers(1, 3)), 2)) for _ in range(2)]
        rows = [
            {"pixel_values": pixels[draw(st.integers(0, 1))], "image_grid_thw": torch.tensor([1, 2, 2])}
            if draw(st.booleans())
            else draw(st.sampled_from([None, {}, {"pixel_values": None}]))
            for _ in range(n)
        ]
        return NonTensorStack(*rows)
    if kind == "strs":
        return NonTensorStack(*[draw(st.text(max_size=4)) for _ in range(n)])
    return NonTensorStack(*[draw(_values) for _ in range(n)])


KINDS = [*(f"dense:{i}" for i in range(len(DTYPES))), *(f"jagged:{i}" for i in range(len(DTYPES)))]
KINDS += ["strided", "image", "multi_modal_inputs", "strs", "objects", "objects"]


@st.composite
def _puts(draw: st.DrawFn) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    names = {f"f{i}" if k not in ("image", "multi_modal_inputs") else k: k for i, k in enumerate(kinds)}
    puts = []
    for _ in range(2):
        n = draw(st.integers(1, 5))
        puts.append((n, {name: draw(_column(kind, n)) for name, kind in names.items()}))
    total = sum(n for n, _ in puts)
    return puts, draw(st.permutations(list(range(total))))


PARTITIONS = iter(range(10**6))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=_puts())
def test_every_value_comes_back_as_simple_storage_returns_it(
    clients: tuple[TransferQueueClient, TransferQueueClient], case: tuple[list[tuple[int, dict[str, Any]]], list[int]]
) -> None:
    """Generated TensorDicts (tensors of 10 dtypes, dense / jagged / strided, media fields, verl-style
    ``multi_modal_inputs`` dict rows with ``pixel_values`` deduplicated by path, NonTensorStacks of None, ints,
    NaN/inf floats, strings, bytes, tuples, lists, dicts with str and int keys, numpy arrays, tensors and
    Fractions): two puts of different shapes into each backend, then gets of all rows in a shuffled order and
    of one field of the second put; both backends' answers are equal, container types included."""
    puts, order = case
    part = f"p{next(PARTITIONS)}"
    answers = []
    for client in clients:
        keys: list[str] = []
        for i, (n, cols) in enumerate(puts):
            batch = [f"k{i}-{j}" for j in range(n)]
            kv_put(client, batch, part, TensorDict(cols, batch_size=n))
            keys += batch
        everything = kv_get(client, [keys[i] for i in order], part)
        field = sorted(puts[0][1])[0]
        one = kv_get(client, keys[puts[0][0] :], part, [field])
        answers.append((everything, one))
        client.clear_partition(part)
    same(answers[0], answers[1], "SimpleStorage vs KnitTrans")
