"""Rollout worker: real engine, real stores and control plane; restarts neither duplicate nor lose groups."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import httpx
import pytest
from data_support import make_groups

from knittrans.errors import InvalidRequest, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import knittrans_command, wait_until
from knittrans.retry import RetryPolicy
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.rollout.worker import RolloutWorker, RolloutWorkerConfig, SourceProfile, load_reward, parity_reward
from knittrans.schema import build_unit_tables

JOB = "rw"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("model") / "m", seed=3)


def _spec(quotas: dict[str, int], steps: int) -> dict[str, object]:
    return {
        "name": JOB,
        "group_size": 2,
        "quotas": quotas,
        "mini_batches_per_step": 2,
        "policy": "constraint_preserving",
        "world_size": 1,
        "micro_batch_size": 2,
        "total_steps": steps,
    }


def _config(cluster: LocalCluster, tmp: Path, model: Path, **kw: object) -> RolloutWorkerConfig:
    node = cluster.stores[0]
    args: dict[str, object] = dict(
        control_url=cluster.control_url,
        job=JOB,
        worker_id="w0",
        node_id=node.node_id,
        store_endpoint=node.endpoint,
        store_dir=str(node.store_dir),
        model_dir=str(model),
        weights_dir=str(tmp / "weights"),
        state_file=str(tmp / "w0.json"),
        group_size=2,
        groups_per_call=1,
        sources=(
            SourceProfile(name="a", max_new_tokens=(3, 5)),
            SourceProfile(name="b", max_new_tokens=(6, 9), image_shape=(1, 8, 8)),
        ),
    )
    args.update(kw)
    return RolloutWorkerConfig(**args)  # type: ignore[arg-type]


def test_worker_fills_the_window_and_tags_versions(tmp_path: Path, model_dir: Path) -> None:
    """a worker launches up to window x quota per source, writes units, and tags versions and media."""
    (tmp_path / "weights").mkdir()
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 2, "b": 2}, steps=1))
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir, chunk_tokens=2))
        try:
            assert worker.run(max_groups=4) == 4
        finally:
            worker.close()
        status = control.status(JOB)
        assert sum(status["counts"]["groups_by_status"].values()) == 4
        assert all(v == 0 for v in status["counts"]["pending"].values())
        units = json.loads((tmp_path / "w0.json").read_text())
        assert units["announced"] == {} and units["next_seq"] == 4


@pytest.mark.timing
@pytest.mark.slow  # ~60 s: two worker processes, a kill and a restart
def test_restart_mid_step_neither_duplicates_nor_loses(tmp_path: Path, model_dir: Path) -> None:
    """kill -9 while groups are announced but unregistered; the restarted worker completes them under the same ids."""
    (tmp_path / "weights").mkdir()
    state = tmp_path / "w0.json"
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 3, "b": 3}, steps=1))
        node = cluster.stores[0]
        args = cluster.rollout_args(
            JOB,
            worker_id="w0",
            sources=["a:4-6:3-5", "b:4-6:40-60"],
            model_dir=model_dir,
            weights_dir=tmp_path / "weights",
            state_file=state,
            group_size=2,
        )
        argv = knittrans_command(*args, "--groups-per-call", "1", "--chunk-tokens", "4")
        cluster.procs.start("worker", argv)

        def announced_after_progress() -> bool:
            cluster.procs.check_alive("worker")
            if not state.exists():
                return False
            s = json.loads(state.read_text())
            return s["next_seq"] >= 3 and bool(s["announced"])

        wait_until(announced_after_progress, timeout_s=120, what="worker mid-generation", interval_s=0.01)
        cluster.procs.kill("worker")
        killed = json.loads(state.read_text())
        assert killed["announced"], "the kill must land while groups are announced"
        cluster.procs.start("worker", argv)  # same state file
        wait_until(
            lambda: (
                control.status(JOB)["state"] == "completed"
                or sum(control.status(JOB)["counts"]["groups_by_status"].values()) >= 6
            ),
            timeout_s=180,
            what="the restarted worker to finish the step",
        )
        cluster.procs.kill("worker")  # it may be filling the next step's window: stop it anywhere
        after = json.loads(state.read_text())
        counts = control.status(JOB)["counts"]
        registered = sum(counts["groups_by_status"].values())
        assert registered >= 6, counts
        # every group counted as pending is one the state file will resume (the journal is written first,
        # so it may also hold a group killed before its supply report went out)
        for source, pending in counts["pending"].items():
            assert pending <= sum(1 for s in after["announced"].values() if s == source), (counts, after)
        on_disk = _groups_on_disk(node.store_dir / JOB)
        assert len(on_disk) == len(set(on_disk)), "a group was stored twice"
        sealed_only = sum(len(d["groups"]) for d in after["sealed"].values())
        sealed_groups = {g["group_id"] for d in after["sealed"].values() for g in d["groups"]}
        # A kill between sealing a unit and journaling it leaves the unit on disk with its groups still
        # announced: the next start regenerates them under the same unit id and replaces it (resumable too).
        unjournaled = len((set(after["announced"]) & set(on_disk)) - sealed_groups)
        assert registered <= len(on_disk) <= registered + sealed_only + unjournaled, (
            "a stored unit is neither registered nor resumable"
        )
        assert set(killed["announced"]) <= set(on_disk)  # the interrupted groups were completed


def _groups_on_disk(job_dir: Path) -> list[str]:
    import pyarrow as pa

    found: list[str] = []
    for traj in sorted(job_dir.glob("*/traj.arrow")):
        if traj.parent.name.startswith("."):  # an unsealed temporary unit (the kill interrupted its write)
            continue
        with pa.memory_map(str(traj)) as source:
            found += sorted(set(pa.ipc.open_file(source).read_all().column("group_id").to_pylist()))
    return found


def test_reward_loader_and_source_parsing() -> None:
    """the parity reward, the module:function loader and the source profile syntax."""
    import numpy as np

    assert parity_reward("a", np.zeros(1, np.int32), np.array([2, 3, 4, 6], np.int32)) == 0.75
    assert load_reward("parity") is parity_reward
    assert load_reward("knittrans.rollout.worker:parity_reward") is parity_reward
    with pytest.raises(InvalidRequest, match="not a callable"):
        load_reward("knittrans.rollout.worker:nope")
    p = SourceProfile.parse("mm:8-16:32-64:image=4x16x16")
    assert p.prompt_len == (8, 16) and p.max_new_tokens == (32, 64) and p.image_shape == (4, 16, 16)
    with pytest.raises(InvalidRequest, match="expected NAME"):
        SourceProfile.parse("mm:8")


def test_bad_sources_rewards_engines_and_worker_settings_are_refused_by_name() -> None:
    """what a worker refuses before it loads a model or connects anywhere."""
    from knittrans.rollout.engines import open_engine

    with pytest.raises(InvalidRequest, match="use 'parity'"):
        load_reward("parity_reward")
    with pytest.raises(InvalidRequest, match="unknown engine"):
        open_engine("tgi", "m")  # type: ignore[arg-type]
    for text, words in (("a:8-4:4-8", "prompt_len"), ("a:4-8:4-8:image=3x8-4x8", "size ranges"), ("a:4:4:x=1", "'x'")):
        with pytest.raises(InvalidRequest, match=words):
            SourceProfile.parse(text)
    base: dict[str, object] = dict(
        control_url="http://127.0.0.1:9",
        job=JOB,
        worker_id="w0",
        node_id="node-0",
        store_endpoint="grpc://127.0.0.1:9",
        store_dir=None,
        sources=(SourceProfile(name="a"),),
        model_dir="m",
        weights_dir="w",
        state_file="s",
    )
    for bad, words in (
        ({"sources": ()}, "at least one source"),
        ({"groups_per_call": 0}, "groups_per_call"),
        ({"wait_s": 0.0}, "wait_s must be > 0"),
        ({"weights_wait_s": float("nan")}, "weights_wait_s"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ):
        with pytest.raises(ValueError, match=words):
            RolloutWorkerConfig(**(base | bad))  # type: ignore[arg-type]


def test_a_unit_refused_because_its_node_was_declared_lost_is_registered_once_the_node_is_back(
    tmp_path: Path, model_dir: Path
) -> None:
    """the store node is declared lost between sealing a unit and registering it (the control plane refuses units
    on it, Conflict): the worker retries until the node's store registers it again (its next heartbeat) instead of
    deleting the unit, which left its groups counted as started, never finished, holding the window forever."""
    (tmp_path / "weights").mkdir()
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control, admin = cluster.control(), cluster.control(admin=True)
        control.create_job(_spec({"a": 2, "b": 2}, steps=1))
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir))
        write = worker.writer.write_groups

        def write_then_lose(groups: list[object], *, unit_id: str | None = None) -> object:
            sealed = write(groups, unit_id=unit_id)  # type: ignore[arg-type]
            admin.declare_lost(cluster.stores[0].node_id, "partitioned from the control plane")
            return sealed

        worker.writer.write_groups = write_then_lose  # type: ignore[assignment,method-assign]
        try:
            assert worker.run(max_groups=1) == 1
        finally:
            worker.close()
            admin.close()
        counts = control.status(JOB)["counts"]
        assert counts["units"] == 1 and sum(counts["pending"].values()) == 0, counts


def test_a_regeneration_claim_another_worker_won_is_announced_without_claims(tmp_path: Path, model_dir: Path) -> None:
    """lost groups in the worker's headroom view that another worker claimed meanwhile: the control plane refuses
    the whole report (409 Conflict, nothing applied) and the worker announces its new groups without claims."""
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 2, "b": 2}, steps=1))
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir))
        try:
            stale_view = {"to_regenerate": [{"group_id": "w1-g0", "source": "a", "at": 1.0}]}
            worker._announce("a", ["w0-g0"], stale_view)
        finally:
            worker.close()
        assert control.status(JOB)["counts"]["pending"] == {"a": 1, "b": 0}


@pytest.mark.timing
def test_a_store_that_restarts_while_a_unit_is_stored_is_retried_not_fatal(tmp_path: Path, model_dir: Path) -> None:
    """The worker's store node is down (kill -9) when a unit is stored: the worker retries under ``store_retry``
    until the store is back on its port and directory, then writes and registers; with a store that never
    comes back it gives up after the budget with the store's ``Unavailable``."""
    (tmp_path / "weights").mkdir()
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 2, "b": 2}, steps=1))
        port = int(cluster.stores[0].endpoint.rsplit(":", 1)[1])
        cluster.procs.kill("store-0")
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir))
        retries: list[str] = []

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                retries.append(record.getMessage())

        seen = Seen(logging.WARNING)
        logging.getLogger("knittrans.rollout.worker").addHandler(seen)
        written: list[int] = []
        try:
            runner = threading.Thread(target=lambda: written.append(worker.run(max_groups=2)))
            runner.start()
            wait_until(lambda: any("retrying" in m for m in retries), timeout_s=60, what="a store retry")
            cluster.stores[0] = cluster.start_store(0, port=port)
            runner.join(120)
            assert not runner.is_alive() and written == [2]
        finally:
            logging.getLogger("knittrans.rollout.worker").removeHandler(seen)
            worker.close()
        assert sum(control.status(JOB)["counts"]["groups_by_status"].values()) == 2
        assert "cannot be reached" in retries[0]

        cluster.procs.kill("store-0")
        quick = RolloutWorker(_config(cluster, tmp_path, model_dir, store_retry=RetryPolicy(budget_s=0.5)))
        try:
            with pytest.raises(Unavailable, match="cannot be reached"):
                quick.run(max_groups=1)
        finally:
            quick.close()


def test_a_unit_left_by_a_killed_predecessor_is_replaced_even_when_it_vanishes_meanwhile(
    tmp_path: Path, model_dir: Path
) -> None:
    """The node still has the first unit's id pending from a publish of a killed predecessor: the worker's write
    gets ``Conflict`` and it deletes that unit, but the publish ends (aborted) just before the delete, which then
    finds nothing. The worker writes the unit anyway and registers it (CI's chaos run once died of the
    ``NotFound``); with the unit still there, the delete takes it and the write goes through."""
    (tmp_path / "weights").mkdir()
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 2, "b": 2}, steps=1))
        node = cluster.stores[0]
        predecessor = StoreClient(node.endpoint)
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir, sources=(SourceProfile(name="a"),)))
        deletes: list[str] = []
        delete = worker.writer.client.delete

        def predecessor_aborted_first(job: str, unit_id: str) -> None:
            if not deletes:  # the predecessor's publish ends, aborted, right before the first delete
                predecessor.delete(job, unit_id)
            deletes.append(unit_id)
            delete(job, unit_id)

        worker.writer.client.delete = predecessor_aborted_first  # type: ignore[method-assign]
        try:
            traj = build_unit_tables(make_groups(1, 2)).traj
            for unit_id in ("u-w0-g0", "u-w0-g1"):  # the predecessor's uploads in flight: pending, never sealed
                predecessor.put_part(JOB, unit_id, "traj", traj)
            assert worker.run(max_groups=2) == 2
        finally:
            worker.close()
            predecessor.close()
        assert deletes == ["u-w0-g0", "u-w0-g1"]  # the first found nothing, the second took the pending unit
        assert sum(control.status(JOB)["counts"]["groups_by_status"].values()) == 2
        with StoreClient(node.endpoint) as store:
            assert sorted(u["unit_id"] for u in store.list_units(JOB)) == ["u-w0-g0", "u-w0-g1"]


def _versions_on_disk(job_dir: Path) -> dict[str, tuple[int, int]]:
    """group id -> (version_start, largest version_end) of the trajectories in the node's sealed units."""
    import pyarrow as pa

    found: dict[str, tuple[int, int]] = {}
    for traj in sorted(job_dir.glob("*/traj.arrow")):
        if traj.parent.name.startswith("."):
            continue
        with pa.memory_map(str(traj)) as source:
            table = pa.ipc.open_file(source).read_all().to_pydict()
        for gid, v0, v1 in zip(table["group_id"], table["version_start"], table["version_end"], strict=True):
            old = found.get(gid, (v0, v1))
            found[gid] = (min(old[0], v0), max(old[1], v1))
    return found


def _save_policy(model: Path, path: Path) -> None:
    """The initial policy's weights as a trainer would publish them (HF names, safetensors, temp name + rename)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    tmp = path.with_name("." + path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    tmp.rename(path)


def _metric(text: str, name: str, worker: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") and f'worker="{worker}"' in ln)
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.timing
def test_a_reported_version_whose_file_comes_late_is_waited_for_then_counted_late(
    tmp_path: Path, model_dir: Path
) -> None:
    """Told of version 1 with no file: the worker waits ``weights_wait_s``, generates with version 0 (its rows say
    0), logs and counts the version late (status and /metrics); a file that appears during the wait is loaded and
    the rows say 1."""
    weights = tmp_path / "weights"
    weights.mkdir()
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control()
        control.create_job(_spec({"a": 2}, steps=2))
        cluster.control(admin=True).report_version(JOB, 1, rank=0)
        one = (SourceProfile(name="a", max_new_tokens=(2, 3)),)
        worker = RolloutWorker(_config(cluster, tmp_path, model_dir, sources=one, weights_wait_s=0.3))
        warned: list[str] = []

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warned.append(record.getMessage())

        seen = Seen(logging.WARNING)
        logging.getLogger("knittrans.rollout.worker").addHandler(seen)
        try:
            assert worker.run(max_groups=1) == 1
        finally:
            logging.getLogger("knittrans.rollout.worker").removeHandler(seen)
        assert worker.version == 0 and worker.weights.late == 1 and worker.weights.loads == 0
        assert worker.weights.wait_s >= 0.3
        assert any("version 1 was reported" in m and "generating with version 0" in m for m in warned)
        assert _versions_on_disk(cluster.stores[0].store_dir / JOB) == {"w0-g0": (0, 0)}
        late = control.status(JOB)["rollout_weights"]["w0"]
        assert (late["version"], late["told"], late["late"], late["loads"]) == (0, 1, 1, 0)
        scrape = httpx.get(f"{cluster.control_url}/metrics").text
        assert _metric(scrape, "knittrans_rollout_weights_late_total", "w0") == 1.0
        assert _metric(scrape, "knittrans_rollout_weights_version", "w0") == 0.0

        # version 2 is reported; its file is written while the worker waits for it (a slow shared filesystem)
        cluster.control(admin=True).report_version(JOB, 2, rank=0)
        writer = threading.Timer(0.5, _save_policy, args=(model_dir, weights / "policy-v2.safetensors"))
        patient = RolloutWorker(_config(cluster, tmp_path, model_dir, sources=one, weights_wait_s=60.0))
        writer.start()
        try:
            assert patient.run(max_groups=1) == 1
        finally:
            writer.join()
            patient.close()
            worker.close()
        assert patient.version == 2 and patient.weights.loads == 1 and patient.weights.late == 0
        assert patient.weights.wait_s > 0
        assert _versions_on_disk(cluster.stores[0].store_dir / JOB)["w0-g1"] == (2, 2)
        loaded = control.status(JOB)["rollout_weights"]["w0"]
        assert (loaded["version"], loaded["told"], loaded["late"], loaded["loads"]) == (2, 2, 0, 1)
