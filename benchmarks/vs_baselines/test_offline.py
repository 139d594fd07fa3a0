"""Offline checks of the vs_baselines plumbing (no Ray cluster, no TransferQueue services).

Run in the bench venv: ``pytest benchmarks/vs_baselines/test_offline.py``.
"""

from __future__ import annotations

import os

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
