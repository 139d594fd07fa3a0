"""GPU path check: ``to_device`` correctness and host-to-device bandwidth vs a pinned ``cudaMemcpy``.

Run by ``scripts/device_check.sh`` (under 5 minutes on one GPU). On a machine without CUDA it says so and
exits 0. What it does, on ``cuda:0``:

1. correctness: micro-batches of 16 / 64 / 256 rows (prompt 256, responses ~2048 tokens) built from Arrow
   by ``to_micro_batch``, moved by ``to_device`` and copied back, equal the host tensors bit for bit;
   a CuPy array made from a moved tensor through DLPack shares its memory (when CuPy is installed);
2. bandwidth, median of ``--runs`` (each synchronised):
   * ``to_device`` of each micro-batch (pins every tensor per call, then non-blocking copies);
   * baseline ``cudaMemcpy`` of a pinned buffer of the same bytes (``cupy.cuda.runtime.memcpy`` when CuPy
     is installed, else a pinned torch tensor's ``copy_``, which is one cudaMemcpyAsync);
   * a pageable (not pinned) copy of the same bytes, for reference.

Writes JSON + markdown to ``benchmarks/transfer/results/device_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from knittrans.schema import TrajectoryGroup, build_unit_tables  # noqa: E402
from knittrans.trainer.convert import MicroBatch, to_device, to_micro_batch  # noqa: E402


def log(msg: str) -> None:
    print(f"[device_check] {msg}", file=sys.stderr, flush=True)


def groups(rows: int, seed: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(max(1, rows // 8)):
        lens = rng.integers(1024, 3072, 8)
        out.append(
            TrajectoryGroup(
                group_id=f"g{g}",
                source="math",
                prompt_ids=rng.integers(0, 150_000, 256, dtype=np.int32),
                response_ids=[rng.integers(0, 150_000, n, dtype=np.int32) for n in lens],
                response_logprobs=[-rng.random(n, dtype=np.float32) for n in lens],
                rewards=rng.random(8).astype(np.float32),
                version_start=0,
                version_end=1,
            )
        )
    return out


def tensors(batch: MicroBatch) -> dict[str, torch.Tensor]:
    return {f.name: v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)}


def timed(fn: Callable[[], Any], runs: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "device_check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log(f"no CUDA device visible to torch {torch.__version__}: nothing to check on this machine")
        return 0
    try:
        import cupy
    except ImportError:
        cupy = None
    device = torch.device("cuda:0")
    log(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, cupy "
        f"{getattr(cupy, '__version__', 'not installed')}"
    )
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cupy": getattr(cupy, "__version__", None),
        "machine": platform.platform(),
        "runs": args.runs,
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "unknown",
        "micro_batches": {},
    }
    table = build_unit_tables(groups(256, seed=1)).traj
    for rows in (16, 64, 256):
        host = to_micro_batch(table.slice(0, rows))
        moved = to_device(host, device)
        torch.cuda.synchronize()
        for name, value in tensors(host).items():
            back = getattr(moved, name)
            assert back.device == device, f"{name} stayed on {back.device}"
            assert torch.equal(back.cpu(), value), f"{name} differs after the round trip"
        if cupy is not None and moved.response_ids is not None:
            view = cupy.from_dlpack(moved.response_ids)
            assert view.data.ptr == moved.response_ids.data_ptr(), "DLPack made a copy"
        nbytes = sum(v.numel() * v.element_size() for v in tensors(host).values())
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if cupy is not None:

            def memcpy(src: torch.Tensor = pinned, dst: torch.Tensor = target, n: int = nbytes) -> None:
                cupy.cuda.runtime.memcpy(dst.data_ptr(), src.data_ptr(), n, cupy.cuda.runtime.memcpyHostToDevice)
        else:

            def memcpy(src: torch.Tensor = pinned, dst: torch.Tensor = target, n: int = nbytes) -> None:
                dst.copy_(src, non_blocking=True)

        t_to_device = timed(lambda h=host: to_device(h, device), args.runs)
        t_memcpy = timed(memcpy, args.runs)
        t_pageable = timed(lambda s=pageable, d=target: d.copy_(s), args.runs)
        gbps = {
            "to_device": nbytes / t_to_device / 1e9,
            "pinned_memcpy": nbytes / t_memcpy / 1e9,
            "pageable_copy": nbytes / t_pageable / 1e9,
        }
        report["micro_batches"][str(rows)] = {
            "bytes": nbytes,
            "GBps": gbps,
            "to_device_vs_memcpy": gbps["to_device"] / gbps["pinned_memcpy"],
        }
        log(
            f"{rows} rows, {nbytes / 2**20:.1f} MiB: to_device {gbps['to_device']:.1f} GB/s, pinned memcpy "
            f"{gbps['pinned_memcpy']:.1f} GB/s, pageable {gbps['pageable_copy']:.1f} GB/s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [
        "| rows | MiB | to_device GB/s | pinned cudaMemcpy GB/s | pageable GB/s | to_device / memcpy |",
        "|---|---|---|---|---|---|",
    ]
    for rows, r in report["micro_batches"].items():
        g = r["GBps"]
        lines.append(
            f"| {rows} | {r['bytes'] / 2**20:.1f} | {g['to_device']:.1f} | {g['pinned_memcpy']:.1f} | "
            f"{g['pageable_copy']:.1f} | {r['to_device_vs_memcpy']:.2f} |"
        )
    md = (
        f"# GPU path check\n\n{report['device']}, torch {report['torch']}, cupy {report['cupy']}, commit "
        f"{report['commit']}, median of {args.runs} runs; correctness checks passed\n\n" + "\n".join(lines) + "\n"
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
