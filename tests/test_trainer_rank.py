"""``knittrans train``: two real rank processes (gloo all-reduce) train a multimodal job to completion."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import free_port, knittrans_command, wait_until
from knittrans.rollout.models import build_tiny_qwen2
from tests.trainer_support import job_spec, mm_groups, write_and_register

GROUP_SIZE = 4
IMAGE = (3, 32, 32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 saved like the rollout engines load it."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("model"), vocab_size=256, hidden=64, layers=1, heads=1, head_dim=64)


def _start_ranks(
    c: LocalCluster, job: str, model_dir: Path, tmp_path: Path, *extra: str, modes: tuple[str, str] = ("iter", "eager")
) -> list[Path]:
    port = free_port()
    outs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    for r in range(2):
        argv = c.train_args(
            job, rank=r, world_size=2, model_dir=model_dir, out=outs[r], dist_url=f"tcp://127.0.0.1:{port}"
        )
        argv += ["--fetch-mode", modes[r], "--lr", "1e-2", "--image-channels", str(IMAGE[0]), "--threads", "1", *extra]
        c.procs.start(f"rank-{r}", knittrans_command(*argv))
    return outs


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_ranks(c: LocalCluster) -> None:
    procs = [c.procs.children[f"rank-{r}"] for r in range(2)]
    wait_until(
        lambda: all(p.poll() is not None for p in procs), timeout_s=90, what="both ranks to exit", interval_s=0.2
    )
    for r, p in enumerate(procs):
        assert p.returncode == 0, c.procs.log_tail(f"rank-{r}", 60)


@pytest.mark.timing
def test_two_ranks_train_job_to_completion(cluster: LocalCluster, model_dir: Path, tmp_path: Path) -> None:
    """Two gloo ranks finish the job: weights published per step, versions reported, dedup counters consistent."""
    job = "rankjob"
    control = cluster.control()
    # 4 groups -> 2 mini-batches of 2 groups; each rank gets one whole group (4 rows) = 2 micro-batches of 2.
    control.create_job(job_spec(job, groups=4, group_size=GROUP_SIZE, k=2, world_size=2, micro_batch_size=2))
    write_and_register(control, job, cluster.stores, mm_groups("g", 4, group_size=GROUP_SIZE, image_shape=IMAGE))
    weights = tmp_path / "weights"
    port = free_port()
    outs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    for r in range(2):
        argv = cluster.train_args(
            job,
            rank=r,
            world_size=2,
            model_dir=model_dir,
            out=outs[r],
            weights_dir=weights,
            dist_url=f"tcp://127.0.0.1:{port}",
        )
        argv += ["--fetch-mode", "iter" if r == 0 else "eager", "--lr", "1e-2", "--image-channels", str(IMAGE[0])]
        argv += ["--threads", "1"]
        if r == 1:
            argv += ["--local-dir", f"{cluster.stores[1].node_id}={cluster.stores[1].store_dir}"]
        cluster.procs.start(f"rank-{r}", knittrans_command(*argv))
    procs = [cluster.procs.children[f"rank-{r}"] for r in range(2)]
    wait_until(
        lambda: all(p.poll() is not None for p in procs), timeout_s=90, what="both ranks to exit", interval_s=0.2
    )
    for r, p in enumerate(procs):
        assert p.returncode == 0, cluster.procs.log_tail(f"rank-{r}", 60)

    assert control.get_version(job) == 2
    assert control.status(job)["state"] == "completed"
    initial = load_file(str(model_dir / "model.safetensors"))
    published = {v: load_file(str(weights / f"policy-v{v}.safetensors")) for v in (1, 2)}
    assert not list(weights.glob(".*tmp*")), "a temporary weights file was left behind"
    for state in published.values():
        assert set(state) == set(initial)  # HF checkpoint names, loadable by the rollout engines
    changed = [k for k in initial if not torch.equal(initial[k], published[2][k])]
    assert changed, "two optimizer steps did not change any weight"

    image_bytes = IMAGE[0] * IMAGE[1] * IMAGE[2]
    for r, path in enumerate(outs):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [rec["global_index"] for rec in records] == [0, 1]
        assert [rec["published_version"] for rec in records] == [1, 2]
        for rec in records:
            assert rec["rank"] == r and rec["rows"] == GROUP_SIZE and rec["micro_batches"] == 2
            assert rec["global_trajectories"] == 2 * GROUP_SIZE  # all-reduced over both ranks
            assert rec["media_unique_bytes"] == image_bytes
            assert rec["media_unique_bytes"] * GROUP_SIZE == rec["media_logical_bytes"]
            assert rec["encoded_rows"] == rec["unique_media"] == 1
            assert rec["media_uses"] == GROUP_SIZE
            assert rec["wait_s"] <= rec["step_time_s"] and rec["fetch_s"] > 0
            assert torch.isfinite(torch.tensor(rec["loss"]))
            assert rec["plan_id"] == f"n{rec['global_index']}.a0.r{r}" and len(rec["traj_ids"]) == GROUP_SIZE
    trained = [t for path in outs for rec in _records(path) for t in rec["traj_ids"]]
    assert len(trained) == len(set(trained)) == 4 * GROUP_SIZE  # exactly once, from the records


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster whose store node the test kills."""
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=2)) as c:
        yield c


@pytest.mark.timing
def test_store_killed_under_a_plan_no_partial_step(own_cluster: LocalCluster, model_dir: Path, tmp_path: Path) -> None:
    """A store node is SIGKILLed while the ranks hold plans with its rows: no rank steps on them, the plans are
    re-issued (next attempt) once the node is declared lost and its groups regenerated, and the job completes
    with every trained trajectory trained exactly once (checked from the rank records)."""
    c, job = own_cluster, "lossjob"
    control = c.control()
    control.create_job(
        job_spec(job, groups=4, group_size=GROUP_SIZE, k=2, world_size=2, micro_batch_size=2, total_steps=2)
    )
    step0 = write_and_register(control, job, c.stores, mm_groups("a", 4, group_size=GROUP_SIZE, image_shape=IMAGE))
    control.pause(job)  # step 1 is written now but admitted only after the kill
    step1 = write_and_register(
        control, job, c.stores, mm_groups("b", 4, group_size=GROUP_SIZE, image_shape=IMAGE, seed=1)
    )
    outs = _start_ranks(c, job, model_dir, tmp_path, "--fetch-timeout-s", "5", modes=("iter", "iter"))
    wait_until(lambda: all(len(_records(p)) == 2 for p in outs), timeout_s=60, what="step 0 trained", interval_s=0.2)
    dead = c.stores[1]
    c.procs.kill(dead.name)
    control.resume(job)  # mini-batches 2 and 3 are planned with rows on the dead node
    wait_until(
        lambda: all("abandoned" in c.procs.log_tail(f"rank-{r}", 200) for r in range(2)),
        timeout_s=60,
        what="both ranks to give up their plan",
        interval_s=0.2,
    )
    assert all(len(_records(p)) == 2 for p in outs), "a rank stepped on a mini-batch with rows on a dead node"
    lost = control.declare_lost(dead.node_id, "killed by the test")
    assert lost["withdrawn"] == {job: [2, 3]}
    regen = [g["group_id"] for g in control.status(job)["to_regenerate"]]
    assert sorted(regen) == ["b1", "b3"]  # round-robin: the dead node held b1 and b3
    control.report_supply(job, group_ids={"mm": ["c0", "c1"]}, regenerates=regen)
    replacements = write_and_register(
        control, job, c.stores[:1], mm_groups("c", 2, group_size=GROUP_SIZE, image_shape=IMAGE, seed=2)
    )
    _wait_ranks(c)

    assert control.status(job)["state"] == "completed" and control.get_version(job) == 4
    records = [rec for p in outs for rec in _records(p)]
    for r, path in enumerate(outs):
        recs = _records(path)
        assert [rec["global_index"] for rec in recs] == [0, 1, 2, 3]  # each global index trained once
        assert [rec["attempt"] for rec in recs] == [0, 0, 1, 1]  # the re-plans, never the withdrawn plans
        assert all(rec["plan_id"] == f"n{rec['global_index']}.a{rec['attempt']}.r{r}" for rec in recs)
    trained = [t for rec in records for t in rec["traj_ids"]]
    expected = {
        f"{g.group_id}.{i}"
        for d in [*step0, *step1, *replacements]
        for g in d.groups
        if g.group_id not in regen
        for i in range(g.num_trajectories)
    }
    assert len(trained) == len(set(trained)) == 8 * GROUP_SIZE and set(trained) == expected
