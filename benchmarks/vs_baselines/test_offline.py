"""Offline checks of the vs_baselines plumbing (no Ray cluster, no TransferQueue services).

Run in the bench venv: ``pytest benchmarks/vs_baselines/test_offline.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch

from benchmarks.vs_baselines.aggregate import check_run
from benchmarks.vs_baselines.common import rank_loop
from benchmarks.vs_baselines.procmem import TreeMemorySampler, classify
from benchmarks.vs_baselines.workload import WorkloadSpec, batch_from_rows, generate, row_digests

SPEC = WorkloadSpec(kind="multimodal", num_trajectories=128, micro_batches=2, image_shape=(32, 48))


def test_generate_is_deterministic_and_seed_sensitive() -> None:
    """Same spec -> same digests; another seed -> different digests."""
    assert generate(SPEC).digests == generate(SPEC).digests
    assert generate(SPEC).digests != generate(WorkloadSpec(**{**SPEC.__dict__, "seed": 1})).digests


def test_row_digest_independent_of_image_dedup_and_detects_corruption() -> None:
    """Per-row and deduplicated image layouts digest alike; one flipped image byte is caught."""
    w = generate(SPEC)
    rows = list(SPEC.plan(1, 1))
    dup, dedup = batch_from_rows(w, rows, dedup_images=False), batch_from_rows(w, rows, dedup_images=True)
    assert row_digests(dup) == row_digests(dedup) == {i: w.digests[i] for i in rows}
    assert dedup.images is not None and dedup.images.shape[0] == 2
    assert dup.images is not None
    dup.images = dup.images.clone()
    dup.images[3, 0, 0] ^= 1
    bad = row_digests(dup)
    assert [i for i in rows if bad[i] != w.digests[i]] == [rows[3]]


def test_ray_packs_round_trip() -> None:
    """Group packs and sliced shard packs convert back to the reference rows."""
    ray_runner = pytest.importorskip("benchmarks.vs_baselines.ray_runner")
    w = generate(SPEC)
    g = SPEC.group_size
    packs = [ray_runner.pack_rows(w, list(range(k * g, (k + 1) * g)), image="group") for k in (2, 3)]
    batch = ray_runner.batch_from_packs(packs)
    assert row_digests(batch) == {i: w.digests[i] for i in range(2 * g, 4 * g)}
    shard = ray_runner.pack_rows(w, list(SPEC.rank_rows(1)), image="row")
    b = SPEC.micro_batch_size
    sliced = ray_runner.batch_from_packs([ray_runner.slice_pack(shard, b, 2 * b)])
    assert sorted(row_digests(sliced)) == list(SPEC.plan(1, 1))
    assert all(row_digests(sliced)[i] == w.digests[i] for i in SPEC.plan(1, 1))


def test_tq_conversion_handles_nested_columns() -> None:
    """A TensorDict with jagged token columns and a jagged image column converts to the right rows."""
    tq_runner = pytest.importorskip("benchmarks.vs_baselines.tq_runner")
    w = generate(SPEC)
    _, td = tq_runner.group_fields(w, 5)
    td["image"] = torch.nested.nested_tensor(list(td["image"].unbind(0)), layout=torch.jagged)
    batch = tq_runner.to_train_batch(td)
    assert row_digests(batch) == {i: w.digests[i] for i in range(5 * 8, 6 * 8)}


def test_rank_loop_and_check_run_flag_missing_rows() -> None:
    """rank_loop with compute digests every row; check_run notices a row delivered twice."""
    w = generate(SPEC)
    ranks = []
    for r in range(SPEC.ranks):
        it = (batch_from_rows(w, list(SPEC.plan(r, m)), dedup_images=True) for m in range(SPEC.micro_batches))
        ranks.append(rank_loop(r, SPEC, it, compute=True, hidden=8))
    run = {"ranks": ranks}
    assert check_run(run, w.digests, SPEC) == {"wrong_rows": 0, "exactly_once": True, "canonical_plan": True}
    ranks[0]["micro"][0]["rows"] = ranks[0]["micro"][1]["rows"]
    assert check_run(run, w.digests, SPEC)["exactly_once"] is False


def test_memory_sampler_sees_own_process() -> None:
    """The tree sampler records this process as the driver with a non-zero RSS."""
    sampler = TreeMemorySampler(os.getpid())
    sampler.sample_once()
    assert classify(psutil.Process(os.getpid()), os.getpid()) == "driver"
    assert sampler.peak_per_role()["driver"] > 0


def test_put_batches_cover_every_group_once() -> None:
    """Producer batches are consecutive, of groups_per_put groups (the last one shorter), covering all groups."""
    spec = WorkloadSpec(kind="text", num_trajectories=80, micro_batches=2, ranks=5, groups_per_put=3)
    batches = spec.put_batches()
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert [g for b in batches for g in b] == list(range(spec.num_groups))
    with pytest.raises(ValueError, match="groups_per_put"):
        WorkloadSpec(groups_per_put=0)


def test_tq_batch_fields_hold_every_row_of_the_batch() -> None:
    """One kv_batch_put of a batch of groups carries each row once, with its own group's image."""
    tq_runner = pytest.importorskip("benchmarks.vs_baselines.tq_runner")
    w = generate(SPEC)
    keys, td = tq_runner.group_fields(w, range(4, 6))
    assert keys == [w.traj_id(i) for i in range(32, 48)]
    assert row_digests(tq_runner.to_train_batch(td)) == {i: w.digests[i] for i in range(32, 48)}


def test_local_runner_ranks_deliver_the_canonical_rows() -> None:
    """The no-transfer reference: real rank subprocesses return every planned row, digests equal the generator's."""
    from benchmarks.vs_baselines.common import RunnerOptions
    from benchmarks.vs_baselines.local_runner import LocalRunner

    spec = WorkloadSpec(kind="multimodal", num_trajectories=32, ranks=2, micro_batches=2, image_shape=(16, 16))
    runner = LocalRunner("memory")
    runner.setup(spec, RunnerOptions(compute_hidden=8))
    try:
        assert runner.put(generate(spec), "t") == {"put_s": 0.0}
        ranks = runner.consume("t", compute=True)
    finally:
        runner.teardown()
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["process_cpu_s"] > 0 for r in ranks)
    assert check_run({"ranks": ranks}, generate(spec).digests, spec) == {
        "wrong_rows": 0,
        "exactly_once": True,
        "canonical_plan": True,
    }
    with pytest.raises(ValueError, match="unknown local variant"):
        LocalRunner("disk")


def test_resummarising_an_interleaved_run_keeps_its_meta_and_lists_every_round(tmp_path: Path) -> None:
    """``--from-json`` of a committed interleaved run: the run's own commit and round loads stay, and each
    system's fetch p50 is listed per round (the values the docs quote for the quiet first round)."""
    from benchmarks.vs_baselines.harness import main

    run = Path(__file__).parent / "results" / "tq_backend" / "multimodal_interleaved_r3" / "results.json"
    assert main(["--from-json", str(run), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "commit 53232b8" in md and "0.35/1.08/1.50" in md
    table = md.split("## Fetch p50 per round (ms)")[1].split("\n\n")[1].splitlines()
    assert table[0] == "| workload | compute | system | round 1 (load 0.4) | round 2 (load 6.6) | round 3 (load 8.7) |"
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line for line in table[2:]}
    assert rows[("multimodal", "off", "tq_kv")].split("|")[4].strip() == "135"
    assert rows[("multimodal", "off", "tq_kt_kv")].split("|")[4].strip() == "33.5"
    assert len(rows) == 8
