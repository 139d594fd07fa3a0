"""Admission timing, live: control plane + store + rollout worker + trainer rank, training ~3x slower than rollout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import knittrans_command, wait_until
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.sched.timing import staleness_bound

JOB = "live"
QUOTAS = {"a": 2, "b": 2}
K, W, L, STEPS, GROUP = 2, 1, 1, 4, 2
SYNC_LAG = 1
"""Versions that may be on their way to rollout when a group makes its last token: the rank publishes its
weights before the ack that moves the trainer's position, so only one optimizer step may end during a group's
last chunk (a step is slower than a chunk)."""


@pytest.mark.timing
@pytest.mark.slow
def test_slow_trainer_keeps_lookahead_window_and_staleness_bounds(tmp_path: Path) -> None:
    """From the records of a real run: admitted-ahead <= L at every admission, untaken <= W·G (and the window
    filled: training was the bottleneck), end-reading architectural staleness within the derived bound, nothing
    expired, every step exactly at quota, every trajectory trained exactly once."""
    model = build_tiny_qwen2(tmp_path / "model", hidden=64, layers=1, heads=1, seed=5)
    weights = tmp_path / "weights"
    weights.mkdir()
    G = sum(QUOTAS.values())
    bound = max(
        staleness_bound(mini_batches_per_step=K, window=W, train_batch_groups=G, quota=q, sync_lag=SYNC_LAG)
        for q in QUOTAS.values()
    )
    with LocalCluster(ClusterConfig(work_dir=tmp_path / "c", num_stores=1)) as cluster:
        control = cluster.control(admin=True)
        control.create_job(
            {
                "name": JOB,
                "group_size": GROUP,
                "quotas": QUOTAS,
                "mini_batches_per_step": K,
                "policy": "constraint_preserving",
                "world_size": 1,
                "micro_batch_size": 2,
                "total_steps": STEPS,
                "lookahead": L,
                "window": W,
                "max_staleness": bound,
            }
        )
        node = cluster.stores[0]
        cluster.procs.start(
            "rollout",
            knittrans_command(
                *cluster.rollout_args(
                    JOB,
                    worker_id="w0",
                    sources=["a:4-6:3-5", "b:4-6:4-6"],
                    model_dir=model,
                    weights_dir=weights,
                    state_file=tmp_path / "w0.json",
                    group_size=GROUP,
                ),
                *("--groups-per-call", "1", "--chunk-tokens", "2"),
            ),
            env={"OMP_NUM_THREADS": "1"},
        )
        started = time.monotonic()
        # the trainer takes at least 1.5 s per mini-batch of two groups; the worker makes a group in a fraction
        # of that (measured below), so training is the bottleneck
        cluster.procs.start(
            "rank-0",
            knittrans_command(
                *cluster.train_args(
                    JOB, rank=0, world_size=1, model_dir=model, out=tmp_path / "rank-0.jsonl", weights_dir=weights
                ),
                "--local-dir",
                f"{node.node_id}={node.store_dir}",
                "--image-channels",
                "1",
                "--min-step-s",
                "1.5",
            ),
            env={"OMP_NUM_THREADS": "1"},
        )

        def finished() -> bool:
            cluster.procs.check_alive("control-plane", node.name)
            return cluster.procs.children["rank-0"].poll() is not None

        wait_until(finished, timeout_s=240, what="the trainer to finish the job", interval_s=0.2)
        assert cluster.procs.children["rank-0"].returncode == 0
        wall = time.monotonic() - started
        status = control.status(JOB)
        cluster.procs.kill("rollout")

    total = STEPS * K
    records = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(r["global_index"] for r in records) == list(range(total))
    admissions = status["recent_admissions"]
    assert sorted(a["global_index"] for a in admissions) == list(range(total))
    assert max(a["ahead"] for a in admissions) <= L  # admitted-unstarted <= L at every admission
    timing = status["timing"]
    assert timing["peak_admitted_ahead"] <= L
    assert timing["peak_untaken"] <= W * G  # launched but not in a started mini-batch <= W·G
    assert timing["peak_untaken"] == W * G, "the window never filled: training was not the bottleneck"
    end = status["staleness"]["overall"]["end"]["architectural"]
    assert end["count"] == total * G // K * GROUP
    assert end["max"] <= bound, (end, bound)
    by_status = status["counts"]["groups_by_status"]
    assert "expired" not in by_status and not status["to_regenerate"]
    for step in range(STEPS):
        assert sum(r["rows"] for r in records if r["step"] == step) == G * GROUP
    by_step = status["staleness"]["by_step"]
    for step, report in by_step.items():
        got = {s: v["staleness"]["count"] for s, v in report["end"]["by_source"].items()}
        assert got == {s: q * GROUP for s, q in QUOTAS.items()}, (step, got)
    trained = [t for r in records for t in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * G * GROUP  # exactly once
    train_s = sum(r["step_time_s"] for r in records)
    print(
        f"live timing proof: {total} mini-batches in {wall:.1f}s, training {train_s:.1f}s, "
        f"peak untaken {timing['peak_untaken']}/{W * G}, peak ahead {timing['peak_admitted_ahead']}/{L}, "
        f"end arch staleness mean {end['mean']:.2f} max {end['max']:.1f} (bound {bound})"
    )
