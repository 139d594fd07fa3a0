"""Where one sampler-path fetch spends its time: get_meta vs get_data, consumer CPU, controller CPU.

    .venv-bench/bin/python -m benchmarks.vs_baselines.tq_profile --backends simple,knittrans --out /tmp/x

Diagnostic (not a result generator): same set-up as ``tq_floor`` (Ray, ``RankAwareSampler``, 4
consumer actors), each rank timing ``get_meta`` and ``get_data`` separately and its own thread CPU,
plus the controller actor's process CPU per pass; ``--cprofile`` writes rank 0's profile per pass.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from benchmarks.vs_baselines.tq_floor import tq_session
from benchmarks.vs_baselines.tq_runner import SCALAR_FIELDS, TOKEN_FIELDS, to_train_batch
from benchmarks.vs_baselines.workload import WorkloadSpec


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@ray.remote(num_cpus=0)
class ProfConsumer:
    def __init__(self, rank: int, spec: WorkloadSpec) -> None:
        import transfer_queue as tq

        torch.set_num_threads(1)
        self.rank, self.spec, self.tq = rank, spec, tq
        tq.init()
        self.client = tq.get_client()
        self.manager = self.client.storage_manager
        self.inner = 0.0
        real = self.manager.get_data

        async def timed(metadata: Any) -> Any:
            t0 = time.perf_counter()
            out = await real(metadata)
            self.inner = time.perf_counter() - t0
            return out

        self.manager.get_data = timed

    def run(
        self, partition: str, task: str, fields: list[str], profile: bool, path: str = "sampler", compute: bool = False
    ) -> dict[str, Any]:
        from benchmarks.vs_baselines.common import TinyPolicy

        model = TinyPolicy(self.spec.vocab_size, 64) if compute else None
        prof = cProfile.Profile() if profile else None
        rows = []
        cpu0 = time.process_time()
        for m in range(self.spec.micro_batches):
            config = {"dp_rank": self.rank, "batch_index": m, "task_name": task, "partition_id": partition}
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            if path == "kv":
                keys = [f"t{i:05d}" for i in self.spec.plan(self.rank, m)]
                t1 = time.perf_counter()
                td = self.tq.kv_batch_get(keys=keys, partition_id=partition)
            else:
                meta = self.client.get_meta(
                    data_fields=fields,
                    batch_size=self.spec.micro_batch_size,
                    partition_id=partition,
                    task_name=task,
                    sampling_config=config,
                )
                t1 = time.perf_counter()
                td = self.client.get_data(meta)
            t2 = time.perf_counter()
            batch = to_train_batch(td)
            t3 = time.perf_counter()
            if model is not None:
                model.loss(batch).backward()
            if prof:
                prof.disable()
            rows.append(
                {
                    "meta_ms": 1e3 * (t1 - t0),
                    "data_ms": 1e3 * (t2 - t1),
                    "inner_ms": 1e3 * self.inner,
                    "convert_ms": 1e3 * (t3 - t2),
                }
            )
        out: dict[str, Any] = {"rows": rows, "cpu_s": time.process_time() - cpu0}
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
            out["profile"] = s.getvalue()
        return out


def measure(
    backend: str, spec: WorkloadSpec, reps: int, out: Path, profile: bool, path: str, compute: bool
) -> list[dict[str, Any]]:
    with tq_session(backend, spec, "p", "knittrans_tq_prof_"):
        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        cpid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))
        actors = [ProfConsumer.remote(r, spec) for r in range(spec.ranks)]  # type: ignore[attr-defined]
        fields = [*SCALAR_FIELDS, *TOKEN_FIELDS] + (["image"] if spec.kind == "multimodal" else [])
        ray.get([a.run.remote("p", "warm", fields, False) for a in actors])
        results = []
        spy = None
        if profile:
            import subprocess

            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-p",
                    str(cpid),
                    "-r",
                    "200",
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"controller_{backend}.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(2)  # py-spy attaches and starts sampling (it gives no ready signal)
        for i in range(reps):
            for ranks in ("one", "all"):
                use = actors[:1] if ranks == "one" else actors
                c0 = _proc_cpu(cpid)
                t0 = time.perf_counter()
                res = ray.get(
                    [
                        a.run.remote("p", f"{ranks}{i}", fields, profile and k == 0, path, compute)
                        for k, a in enumerate(use)
                    ]
                )
                wall = time.perf_counter() - t0
                ctrl = _proc_cpu(cpid) - c0
                rows = [r for x in res for r in x["rows"]]
                calls = len(rows)
                rec = {
                    "backend": backend,
                    "path": path,
                    "compute": compute,
                    "ranks": ranks,
                    "rep": i,
                    "load1": os.getloadavg()[0],
                    "wall_s": wall,
                    "controller_cpu_ms_per_call": 1e3 * ctrl / calls,
                    "consumer_cpu_ms_per_call": 1e3 * sum(x["cpu_s"] for x in res) / calls,
                    **{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                }
                print(json.dumps(rec), flush=True)
                results.append(rec)
                if profile and "profile" in res[0]:
                    (out / f"prof_{backend}_{ranks}{i}.txt").write_text(res[0]["profile"])
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        for a in actors:
            ray.kill(a)
        return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backends", default="simple,knittrans")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--path", default="sampler", choices=["sampler", "kv"])
    p.add_argument("--compute", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(kind="multimodal")
    results = []
    for b in args.backends.split(","):
        results += measure(b, spec, args.reps, out, args.profile, args.path, args.compute)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
