"""What bounds a TransferQueue fetch: the client's own per-call cost, measured with a no-op backend.

    .venv-bench/bin/python -m benchmarks.vs_baselines.tq_floor --out benchmarks/vs_baselines/results/tq_backend

Same set-up as the ``tq`` runner (Ray, ``tq.init`` with ``RankAwareSampler``, 4 consumer actors,
``kv_batch_get`` of each rank's planned keys, conversion to a ``TrainBatch`` counted in the fetch),
with three storage backends in turn:

* ``simple``: TransferQueue's ``SimpleStorage`` (its default, 2 storage units);
* ``knittrans``: the KnitTrans backend (``media_fields: [image]``);
* ``noop``: the KnitTrans backend whose ``get_data`` is replaced, in each consumer, by a lookup of the
  ``TensorDict`` it returned for the same micro-batch in an earlier real pass — the storage read costs nothing,
  everything else (the client call, the controller's metadata round trip, TransferQueue's
  per-call thread setting, conversion) is as with a real backend. Its fetch time is the floor any
  backend's fetch can reach through this client on this host. Measured in the ``knittrans``
  session, its passes alternating with real reads, so both see the same load.

Each consumer drives the harness' own ``rank_loop`` (compute off: fetches back to back; on: the tiny
policy's forward/backward between fetches), all four ranks at once, and records per fetch the whole
wait, the time inside the storage manager's ``get_data`` and the conversion. Medians over ``--reps``
passes over the same stored mini-batch (a first pass per mode is warm-up, not recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from benchmarks.vs_baselines.common import rank_loop
from benchmarks.vs_baselines.harness import machine_info
from benchmarks.vs_baselines.tq_runner import SCALAR_FIELDS, SETUP_HOOK, TOKEN_FIELDS, group_fields, to_train_batch
from benchmarks.vs_baselines.workload import TrainBatch, WorkloadSpec, generate

__all__ = ["main"]

BACKENDS = ("simple", "knittrans")


@ray.remote(num_cpus=0)
class FloorConsumer:
    """One rank: fetches its micro-batches with ``kv_batch_get``, timing the storage manager's share."""

    def __init__(self, rank: int, spec: WorkloadSpec, noop: bool) -> None:
        import transfer_queue as tq

        torch.set_num_threads(1)
        self.rank, self.spec, self.tq, self.noop = rank, spec, tq, noop
        tq.init()
        self.manager = tq.get_client().storage_manager
        self.inner_s = 0.0
        self.memo: dict[int, Any] = {}
        self.micro_batch = 0
        real = self.manager.get_data

        async def timed(metadata: Any) -> Any:
            t0 = time.perf_counter()
            if self.noop and self.micro_batch in self.memo:
                out = self.memo[self.micro_batch]  # its answer in the last real pass
            else:
                out = await real(metadata)
                self.memo[self.micro_batch] = out
            self.inner_s = time.perf_counter() - t0
            return out

        self.manager.get_data = timed

    def ready(self) -> int:
        return os.getpid()

    def set_noop(self, noop: bool) -> None:
        self.noop = noop

    def run(self, partition: str, path: str, task: str, fields: list[str], compute: bool) -> list[dict[str, float]]:
        """One pass over this rank's micro-batches through :func:`rank_loop` (so waits and compute are
        measured as in the harness), recording where each fetch's time went."""
        parts: list[dict[str, float]] = []
        client = self.tq.get_client()

        def batches() -> Iterator[TrainBatch]:
            for m in range(self.spec.micro_batches):
                self.micro_batch = m
                t0 = time.perf_counter()
                if path == "kv":
                    keys = [f"t{i:05d}" for i in self.spec.plan(self.rank, m)]
                    td = self.tq.kv_batch_get(keys=keys, partition_id=partition)
                else:  # a fresh task name per pass: the sampler hands out the partition again
                    config = {"dp_rank": self.rank, "batch_index": m, "task_name": task, "partition_id": partition}
                    meta = client.get_meta(
                        data_fields=fields,
                        batch_size=self.spec.micro_batch_size,
                        partition_id=partition,
                        task_name=task,
                        sampling_config=config,
                    )
                    td = client.get_data(meta)
                t1 = time.perf_counter()
                batch = to_train_batch(td)
                parts.append(
                    {
                        "call_ms": 1e3 * (t1 - t0),
                        "backend_ms": 1e3 * self.inner_s,
                        "convert_ms": 1e3 * (time.perf_counter() - t1),
                    }
                )
                yield batch

        result = rank_loop(self.rank, self.spec, batches(), compute=compute)
        return [{"wait_ms": 1e3 * mb["wait_s"], **p} for mb, p in zip(result["micro"], parts, strict=True)]


@contextlib.contextmanager
def tq_session(backend: str, spec: WorkloadSpec, partition: str, prefix: str) -> Iterator[Any]:
    """Ray and TransferQueue with ``backend`` ("simple": SimpleStorage; any other: the KnitTrans backend,
    registered through the worker setup hook), the workload of ``spec`` put into ``partition``; yields the
    ``transfer_queue`` module. Shuts both down (and removes the store root) on exit."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    knit = backend != "simple"
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=8,
        logging_level="WARNING",
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": SETUP_HOOK} if knit else None,
    )
    root = None
    try:
        if knit:
            from knittrans.integrations.transferqueue import register

            register()
            root = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
            conf_backend: dict[str, Any] = {
                "storage_backend": "KnitTrans",
                "KnitTrans": {"media_fields": ["image"], "store_root": root, "host": "127.0.0.1"},
            }
        else:
            conf_backend = {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2}}
        tq.init(
            OmegaConf.create(
                {"controller": {"sampler": tq.RankAwareSampler()}, "backend": conf_backend},
                flags={"allow_objects": True},
            )
        )
        workload = generate(spec)
        for groups in spec.put_batches():
            keys, fields = group_fields(workload, groups)
            tq.kv_batch_put(keys=keys, partition_id=partition, fields=fields)
        yield tq
    finally:
        tq.close()
        ray.shutdown()
        if root:
            shutil.rmtree(root, ignore_errors=True)


def measure(backend: str, spec: WorkloadSpec, reps: int, path: str, modes: list[str]) -> list[dict[str, Any]]:
    knit = backend != "simple"
    with tq_session(backend, spec, "floor", "knittrans_tq_floor_"):
        actors = [
            FloorConsumer.remote(r, spec, False)  # type: ignore[attr-defined]
            for r in range(spec.ranks)
        ]
        ray.get([a.ready.remote() for a in actors])
        fields = [*SCALAR_FIELDS, *TOKEN_FIELDS] + (["image"] if spec.kind == "multimodal" else [])
        # with the KnitTrans backend, passes alternate real reads and the no-op (same load window)
        variants = [backend] + (["noop"] if knit else [])
        results = []
        for mode in modes:
            compute = mode == "compute"
            # warm-up pass: real reads (fills the no-op memo; its fetches are not recorded)
            ray.get([a.set_noop.remote(False) for a in actors])
            ray.get([a.run.remote("floor", path, f"warm-{mode}", fields, compute) for a in actors])
            passes: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for i in range(reps):
                for v in variants:
                    ray.get([a.set_noop.remote(v == "noop") for a in actors])
                    load = os.getloadavg()[0]
                    rows = [
                        x
                        for per_rank in ray.get(
                            [a.run.remote("floor", path, f"{mode}{i}{v}", fields, compute) for a in actors]
                        )
                        for x in per_rank
                    ]
                    passes[v].append(
                        {
                            "load1": load,
                            **{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                            "wait_p99_ms": sorted(r["wait_ms"] for r in rows)[int(0.99 * len(rows))],
                        }
                    )
            for v in variants:
                results.append(
                    {
                        "backend": v,
                        "path": path,
                        "mode": mode,
                        "passes": passes[v],
                        **{k: statistics.median(p[k] for p in passes[v]) for k in passes[v][0] if k != "load1"},
                    }
                )
        for a in actors:
            ray.kill(a)
        return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kind", default="multimodal", choices=["text", "multimodal"])
    p.add_argument("--paths", default="kv,sampler", help="kv (kv_batch_get) and/or sampler (get_meta+get_data)")
    p.add_argument("--modes", default="none,compute", help="none (fetch only) and/or compute (tiny policy step)")
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"some of {BACKENDS}; knittrans also measures the no-op, pass by pass in the same session",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    spec = WorkloadSpec(kind=args.kind)
    meta = {
        "argv": sys.argv[1:],
        **machine_info(),
        "loadavg_start": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reps": args.reps,
        "kind": args.kind,
    }
    paths = args.paths.split(",")
    if not set(paths) <= {"kv", "sampler"}:
        raise SystemExit(f"--paths must list kv and/or sampler, got {args.paths!r}")
    modes = args.modes.split(",")
    if not set(modes) <= {"none", "compute"}:
        raise SystemExit(f"--modes must list none and/or compute, got {args.modes!r}")
    backends = args.backends.split(",")
    if not set(backends) <= set(BACKENDS):
        raise SystemExit(f"--backends must list some of {BACKENDS}, got {args.backends!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for path in paths:
        for b in backends:
            results += measure(b, spec, args.reps, path, modes)
            meta["loadavg_end"] = list(os.getloadavg())
            (out / "floor.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"# TransferQueue fetch floor ({args.kind}, 4 ranks concurrently, median of "
        f"{args.reps} passes; {meta['time']})",
        "",
        f"Machine: {meta['host']} ({meta['cpu_model']}); commit {meta['commit']}; load average at start "
        f"{'/'.join(f'{v:.2f}' for v in meta['loadavg_start'])}, at end "
        f"{'/'.join(f'{v:.2f}' for v in meta['loadavg_end'])}. `noop` = KnitTrans backend whose `get_data` "
        "returns its answer for the same micro-batch in the last real pass (no storage work). "
        "`sampler` = `get_meta` (RankAwareSampler) + `get_data`; `kv` = `kv_batch_get`.",
        "",
        "| path | compute | backend | fetch p50 (ms) | fetch p99 (ms) | client call p50 (ms) "
        "| in get_data p50 (ms) | call outside get_data (ms) | conversion p50 (ms) |",
        "|---" * 9 + "|",
    ]
    for r in results:
        compute = "on" if r["mode"] == "compute" else "off"
        lines.append(
            f"| {r['path']} | {compute} | {r['backend']} | {r['wait_ms']:.1f} | {r['wait_p99_ms']:.1f} | "
            f"{r['call_ms']:.1f} | {r['backend_ms']:.1f} | {r['call_ms'] - r['backend_ms']:.1f} | "
            f"{r['convert_ms']:.1f} |"
        )
    (out / "floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
