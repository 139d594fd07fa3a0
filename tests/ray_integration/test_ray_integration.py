"""The Ray integration for real: a local Ray cluster on loopback runs the demo workload (examples/ray_demo.py)."""

from __future__ import annotations

import builtins
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ray_demo_runs_end_to_end(tmp_path: Path) -> None:
    """One store per Ray node on 127.0.0.1, control plane actor, ranks and workers as tasks: the job completes."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "ray_demo.py"),
            "--steps",
            "1",
            "--mini-batches",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    results = json.loads((out / "results.json").read_text())
    status = results["status"]
    assert status["state"] == "completed"
    assert status["counts"]["consumed_mini_batches"] == 2 and status["counts"]["consumed_groups"] == 8
    assert len(results["stores"]) == results["ray_nodes"] == 1, "one store per Ray node"
    store = results["stores"][0]
    assert store["endpoint"].startswith("grpc://127.0.0.1:") and results["control_url"].startswith("http://127.0.0.1:")
    for step in ("0",):  # quotas exact per train batch
        by_source = status["staleness"]["by_step"][step]["end"]["by_source"]
        assert {s: v["staleness"]["count"] // 4 for s, v in by_source.items()} == {"math": 4, "mm_qa": 4}
    records: list[dict[str, Any]] = results["rank_records"]
    assert sorted((r["global_index"], r["rank"]) for r in records) == [(n, k) for n in range(2) for k in range(2)]
    assert results["rollout_exit_codes"] == [0, 0]
    assert "ray demo: 2 mini-batches" in proc.stdout


def test_missing_ray_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Ray the integration raises ImportError naming the extra to install."""
    from knittrans.integrations import ray as integration

    real_import = builtins.__import__

    def no_ray(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"pip install 'knittrans\[ray\]'"):
        integration._ray()
    monkeypatch.undo()
    importlib.reload(integration)


def test_stores_refuse_unknown_node(tmp_path: Path) -> None:
    """start_stores names the Ray node that is not alive instead of scheduling a store nowhere, and checks every
    node before it starts any store (a store started for an earlier, alive node would outlive the failed call)."""
    import ray

    from knittrans.integrations.ray import start_stores

    ray.init(_node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        alive = ray.get_runtime_context().get_node_id()
        with pytest.raises(KeyError, match="ffff is not alive"):
            start_stores("http://127.0.0.1:1", work_dir=tmp_path, ray_node_ids=[alive, "ffff"])
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # a started store's actor makes its log directory within moments
            assert not (tmp_path / "logs").exists(), "a store was started for the alive node"
            time.sleep(0.2)
    finally:
        ray.shutdown()


def test_tq_bootstrap_stops_its_stores_when_a_later_one_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tq.init's bootstrap starts a store per alive Ray node; when one cannot start (here: its node is gone before
    the store is placed), the stores it already started are stopped and their directories deleted."""
    import ray
    from omegaconf import OmegaConf

    from knittrans.integrations import tqbootstrap

    ray.init(_node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        alive = [n for n in ray.nodes() if n["Alive"]]
        node_id = alive[0]["NodeID"]
        gone = {**alive[0], "NodeID": node_id[:-4] + ("0000" if node_id[-4:] != "0000" else "1111")}
        monkeypatch.setattr(ray, "nodes", lambda: [*alive, gone])
        conf = OmegaConf.create({"backend": {"KnitTrans": {"store_root": str(tmp_path), "host": "127.0.0.1"}}})
        with pytest.raises(Exception, match="not schedulable"):
            tqbootstrap.bootstrap(conf)
        assert list(tmp_path.iterdir()) == [], "the first node's store directory is left"
        assert not tqbootstrap._OWNED
    finally:
        ray.shutdown()
