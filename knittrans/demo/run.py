"""``run_demo``: the whole pipeline as real processes on this machine, then a per-step report."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from knittrans.demo.config import JOB, DemoConfig
from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import free_port, knittrans_command

__all__ = ["run_demo"]


def _start_rollout(cluster: LocalCluster, config: DemoConfig, run_dir: Path, model_dir: Path) -> None:
    for i, (source, profile) in enumerate(config.sources.items()):
        argv = cluster.rollout_args(
            JOB,
            worker_id=f"w-{source}",
            sources=[profile],
            model_dir=model_dir,
            weights_dir=run_dir / "weights",
            state_file=run_dir / f"rollout-{source}.json",
            group_size=config.group_size,
            store=i % len(cluster.stores),
        )
        argv += [
            "--engine",
            config.engine,
            "--groups-per-call",
            str(config.groups_per_call),
            "--seed",
            str(config.seed + i),
        ]
        if config.chunk_tokens:
            argv += ["--chunk-tokens", str(config.chunk_tokens)]
        env = {"OMP_NUM_THREADS": "1"} | ({"VLLM_CPU_KVCACHE_SPACE": "1"} if config.engine == "vllm" else {})
        cluster.procs.start(f"rollout-{source}", knittrans_command(*argv), env=env)


def _start_trainers(cluster: LocalCluster, config: DemoConfig, run_dir: Path, model_dir: Path) -> list[str]:
    dist_url = f"tcp://127.0.0.1:{free_port()}"
    names = []
    for rank in range(config.ranks):
        argv = cluster.train_args(
            JOB,
            rank=rank,
            world_size=config.ranks,
            model_dir=model_dir,
            out=run_dir / f"rank-{rank}.jsonl",
            weights_dir=run_dir / "weights",
            dist_url=dist_url,
        )
        argv += ["--fetch-mode", config.fetch_mode, "--lr", str(config.lr)]
        argv += ["--min-step-s", str(config.min_step_s)]
        for node in cluster.stores:
            argv += ["--local-dir", f"{node.node_id}={node.store_dir}"]
        name = f"rank-{rank}"
        cluster.procs.start(name, knittrans_command(*argv), env={"OMP_NUM_THREADS": "1"})
        names.append(name)
    return names


def _progress_line(status: dict[str, Any], total: int, started: float) -> str:
    consumed = status["counts"]["consumed_mini_batches"]
    arch = status["staleness"]["overall"]["end"]["architectural"]["mean"]
    fill = " ".join(f"{s}={v['admitted']}/{v['quota']}" for s, v in status["quota_fill"].items())
    arch_txt = "-" if arch is None else f"{arch:.2f}"
    return (
        f"[{time.monotonic() - started:6.1f}s] mini-batches trained {consumed}/{total}  "
        f"step {status['step']} fill {fill}  units {status['counts']['units']}  arch.staleness(end) {arch_txt}"
    )


def run_demo(config: DemoConfig, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo once; return (and write to ``<out_dir>/<label>/results.json``) its results."""
    from knittrans.demo.report import collect_results
    from knittrans.rollout.vlm import TinyVLMSpec, build_tiny_vlm

    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    run_dir = Path(config.out_dir) / config.label
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "weights").mkdir(parents=True)
    # One tiny VLM for every source: mm_qa prompts carry images, math prompts are text only.
    model_dir = build_tiny_vlm(
        run_dir / "model", TinyVLMSpec(hidden=config.hidden, layers=config.layers), seed=config.seed
    )
    total = config.steps * config.mini_batches_per_step
    started = time.monotonic()
    cluster_config = ClusterConfig(work_dir=run_dir, num_stores=config.stores)
    say(
        f"demo: {config.label}: policy={config.policy} engine={config.engine} steps={config.steps} "
        f"K={config.mini_batches_per_step} "
        f"ranks={config.ranks} stores={config.stores} sources={list(config.quotas)}; logs in {run_dir / 'logs'}"
    )
    with LocalCluster(cluster_config) as cluster:
        control = cluster.control(admin=True)
        control.create_job(config.job_spec())
        _start_rollout(cluster, config, run_dir, model_dir)
        ranks = _start_trainers(cluster, config, run_dir, model_dir)
        last = ""
        while any(cluster.procs.children[r].poll() is None for r in ranks):
            cluster.procs.check_alive()
            if time.monotonic() - started > config.timeout_s:
                raise TimeoutError(f"demo did not finish within {config.timeout_s:.0f} s; logs in {run_dir / 'logs'}")
            line = _progress_line(control.status(JOB), total, started)
            if line.split("]", 1)[1] != last:
                say(line)
                last = line.split("]", 1)[1]
            time.sleep(1.0)
        cluster.procs.check_alive(*ranks)
        status = control.status(JOB)
        wall = time.monotonic() - started
    results = collect_results(config, run_dir, status, wall_s=wall)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results
