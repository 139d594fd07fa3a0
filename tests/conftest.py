"""Shared fixtures: a store directory on tmpfs, a running store server (synthetic groups: data_support), a
per-module local cluster (control plane + two stores as real processes)."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from knittrans.flight import StoreServer, StoreServerConfig
from knittrans.store import StoreConfig

if TYPE_CHECKING:
    from knittrans.local import LocalCluster

# The vLLM suite runs in its own venv (scripts/setup_vllm_env.sh); elsewhere it is not even collected,
# so `pytest -m vllm` without vLLM fails with "no tests ran" instead of passing.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["test_adapters_vllm.py"]


@pytest.fixture
def store_dir() -> Iterator[Path]:
    """A fresh store directory, on /dev/shm when it exists (the real deployment filesystem)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="knittrans-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_server(store_dir: Path) -> Iterator[Callable[..., StoreServer]]:
    """Factory starting StoreServers on 127.0.0.1:0 (default root: ``store_dir``); all shut down after."""
    servers: list[StoreServer] = []

    def start(*, root: Path | None = None, token: str | None = None, **store_kw: Any) -> StoreServer:
        server_kw = {
            k: store_kw.pop(k)
            for k in ("max_put_bytes", "batch_bytes", "node_id", "data_lane", "data_lane_port", "ticket_key")
            if k in store_kw
        }
        config = StoreServerConfig(store=StoreConfig(root=root or store_dir, **store_kw), token=token, **server_kw)
        servers.append(StoreServer(config))
        return servers[-1]

    yield start
    for s in servers:
        s.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``compose`` tests (image builds, minutes on a Docker engine) run only when a ``-m`` names them.

    ``scripts/test.sh`` runs them in their own step with ``-m compose``; any other run deselects them
    (reported as deselected, never as skipped or passed).
    """
    if "compose" in (config.option.markexpr or ""):
        return
    keep = [item for item in items if item.get_closest_marker("compose") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("compose")])
        items[:] = keep


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A control plane and two store nodes as real processes, shared by one module's tests.

    Tests that break a node (kill it, restart the control plane) start a cluster of their own instead.
    """
    from knittrans.local import ClusterConfig, LocalCluster

    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    with LocalCluster(ClusterConfig(work_dir=tmp_path_factory.mktemp(name), num_stores=2)) as c:
        yield c
