"""The live loop's weight-update timings, measured: publish delay, load time, and what in-flight updates cost.

Runs the demo's policy (the tiny VLM of ``knittrans demo``: hidden 512, 4 layers) and sources on this
machine with a real control plane and store node (``LocalCluster``) and the real rollout worker
(``RolloutWorker.generate``, which asks the control plane for the version before every group and every
chunk) on one engine (transformers or vLLM on CPU), and measures:

* **publish delay**: what the trainer's rank 0 does between its optimizer step and its ack —
  ``knittrans.demo.rank.save_weights`` (safetensors, temp name + rename) and the version report;
* **load time**: ``engine.load_weights`` of a published file (what blocks a rollout engine per version);
* **generation** of the same groups (same prompts, budgets and seeds) without chunks and with
  ``chunk_tokens`` 8 and 16, interleaved (the cost of partial rollout without any weight change: one more
  generate call, version poll and re-prefill per chunk).

Every figure is the median (mean, p99) over ``--repeats`` rounds, the configurations alternated within a
round. Writes ``results/live_timings_<engine>.json``.

    flock /tmp/knittrans-bench.lock .venv/bin/python benchmarks/sim_report/live_timings.py --engine hf
    flock /tmp/knittrans-bench.lock .venv-vllm/bin/python benchmarks/sim_report/live_timings.py --engine vllm
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "timings"
SOURCES = {"math": "math:8-16:4-12", "mm_qa": "mm_qa:8-16:24-48:image=3x96-160x96-160"}
"""The demo's sources (``knittrans.demo.config.DemoConfig.sources``)."""
CHUNKS: tuple[int | None, ...] = (None, 8, 16)


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "p99": p99, "n": len(values)}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def measure(engine_kind: str, repeats: int, groups: int) -> dict[str, Any]:
    """Run every measurement on one engine; return the JSON document."""
    from knittrans.demo.rank import load_policy, save_weights
    from knittrans.local import ClusterConfig, LocalCluster
    from knittrans.rollout.engines import open_engine
    from knittrans.rollout.vlm import TinyVLMSpec, build_tiny_vlm
    from knittrans.rollout.worker import RolloutWorker, RolloutWorkerConfig, SourceProfile

    with tempfile.TemporaryDirectory(prefix="knittrans-timings-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_tiny_vlm(tmp / "model", TinyVLMSpec(hidden=512, layers=4), seed=0)
        weights = tmp / "weights"
        weights.mkdir()
        engine = open_engine(engine_kind, model)  # type: ignore[arg-type]
        out: dict[str, Any] = {}
        try:
            with LocalCluster(ClusterConfig(work_dir=tmp / "c", num_stores=1)) as cluster:
                admin = cluster.control(admin=True)
                admin.create_job(
                    {
                        "name": JOB,
                        "group_size": 4,
                        "quotas": {"math": 4, "mm_qa": 4},
                        "mini_batches_per_step": 4,
                        "policy": "constraint_preserving",
                        "world_size": 1,
                        "micro_batch_size": 2,
                        "total_steps": 1000,
                    }
                )
                node = cluster.stores[0]
                workers = {
                    chunk: RolloutWorker(
                        RolloutWorkerConfig(
                            control_url=cluster.control_url,
                            job=JOB,
                            worker_id=f"w-{chunk or 'whole'}",
                            node_id=node.node_id,
                            store_endpoint=node.endpoint,
                            store_dir=str(node.store_dir),
                            sources=tuple(SourceProfile.parse(p) for p in SOURCES.values()),
                            model_dir=str(model),
                            weights_dir=str(weights),
                            state_file=str(tmp / f"w-{chunk}.json"),
                            engine=engine_kind,
                            group_size=4,
                            chunk_tokens=chunk,
                        ),
                        engine=engine,
                    )
                    for chunk in CHUNKS
                }
                # publish: rank 0's save + version report; load: the engine reading that file
                policy = load_policy(model, image_channels=3)
                publish_s, save_s, report_s, load_s = [], [], [], []
                for version in range(1, repeats + 1):
                    t0 = time.perf_counter()
                    path = save_weights(policy.backbone, weights, version)
                    t1 = time.perf_counter()
                    admin.report_version(JOB, version, rank=0)
                    t2 = time.perf_counter()
                    engine.load_weights(path)
                    t3 = time.perf_counter()
                    save_s.append(t1 - t0)
                    report_s.append(t2 - t1)
                    publish_s.append(t2 - t0)
                    load_s.append(t3 - t2)
                for w in workers.values():  # every worker on the newest version: no load while generating below
                    w.version = repeats
                out["weights_bytes"] = path.stat().st_size
                out["publish_s"] = _stats(publish_s)
                out["save_s"] = _stats(save_s)
                out["report_s"] = _stats(report_s)
                out["load_s"] = _stats(load_s)
                gen: dict[str, dict[str, list[float]]] = {src: {str(c): [] for c in CHUNKS} for src in SOURCES}
                for r in range(repeats):
                    for src in SOURCES:
                        ids = [f"bench-{src}-{r}-{i}" for i in range(groups)]
                        for chunk in CHUNKS if r % 2 == 0 else CHUNKS[::-1]:
                            t0 = time.perf_counter()
                            workers[chunk].generate(src, ids)
                            gen[src][str(chunk)].append((time.perf_counter() - t0) / groups)
                out["group_generation_s"] = {src: {c: _stats(v) for c, v in by.items()} for src, by in gen.items()}
                out["chunk_overhead_ratio"] = {
                    src: {c: statistics.median(by[c]) / statistics.median(by["None"]) for c in by if c != "None"}
                    for src, by in gen.items()
                }
                for w in workers.values():
                    w.writer.close()
                    w.control.close()
        finally:
            engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--groups", type=int, default=3, help="groups per source per round and configuration")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()
    started = time.time()
    result = measure(args.engine, args.repeats, args.groups)
    doc = {
        "engine": args.engine,
        "repeats": args.repeats,
        "groups_per_round": args.groups,
        "commit": _commit(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": load,
        "load_after": os.getloadavg(),
        "wall_s": time.time() - started,
        "command": f"benchmarks/sim_report/live_timings.py --engine {args.engine} --repeats {args.repeats}",
        **result,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"live_timings_{args.engine}.json"
    path.write_text(json.dumps(doc, indent=1))
    pub, ld = doc["publish_s"], doc["load_s"]
    print(f"{args.engine}: weights {doc['weights_bytes'] / 2**20:.1f} MiB")
    ms = {k: pub[k] * 1e3 for k in ("median", "mean", "p99")}
    print(f"  publish (save + report) median {ms['median']:.1f} ms (mean {ms['mean']:.1f}, p99 {ms['p99']:.1f})")
    print(f"  load median {ld['median'] * 1e3:.1f} ms (mean {ld['mean'] * 1e3:.1f}, p99 {ld['p99'] * 1e3:.1f})")
    for src, by in doc["group_generation_s"].items():
        parts = ", ".join(f"chunk {c}: {s['median'] * 1e3:.0f} ms" for c, s in by.items())
        print(f"  {src} per group: {parts}; chunked/whole {doc['chunk_overhead_ratio'][src]}")
    print(f"wrote {path} (load {load[0]:.2f} -> {doc['load_after'][0]:.2f})")


if __name__ == "__main__":
    main()
