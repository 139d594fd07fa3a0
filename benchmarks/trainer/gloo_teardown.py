"""Evidence for the two-rank gloo abort at exit ("terminate called without an active exception"): cause and fix.

Two parts, each printing a table and writing ``gloo_teardown.json`` under ``--out``:

* ``mechanism``: two gloo ranks where rank 0 starts an all-reduce, drops its tensor and its work
  handle, and keeps the GIL (a busy Python loop with a very long switch interval: a loaded
  machine, stretched) while rank 1 joins the collective 1 s late; rank 0 spins until rank 1 says
  (through a shared byte) that the collective is done, so rank 0's gloo worker has finished and
  waits for the GIL to free the tensor; then rank 0 destroys its group and exits.
  Run once with ``torch.distributed.nn.functional`` imported after ``init_process_group`` (what
  DDP's lazy ``torch._dynamo`` import does: its default arguments keep the default group alive
  past ``destroy_process_group()``) and once imported before it (the fix: they hold ``None``).
* ``stress``: the 2-process tests of ``tests/test_dedup_ddp.py`` (toy model in both DDP layouts,
  and the VLM with a rank without images), ``--runs`` times beside two busy-loop processes;
  counts passes and failures (a rank that aborts fails its test).

    python benchmarks/trainer/gloo_teardown.py mechanism [--repeats 5]
    python benchmarks/trainer/gloo_teardown.py stress --runs 50 [--accumulate]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _mechanism_rank(rank: int, init: str, import_first: bool) -> None:
    import mmap

    import torch

    if import_first:
        import torch.distributed.nn.functional  # the fix
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    if not import_first:
        import torch.distributed.nn.functional  # as DDP's first construction does
    with open(f"{init}.flag", "r+b") as f:
        joined = mmap.mmap(f.fileno(), 1)  # rank 1 sets byte 0 once its all-reduce returned
    tensor = torch.ones(1000)
    if rank == 0:
        sys.setswitchinterval(1000.0)  # keep the GIL unless blocking: a worker waiting for it waits long
        work = dist.all_reduce(tensor, async_op=True)
        del tensor, work  # the pending work holds the last reference; PyTorch keeps the Python object for it
        deadline = time.monotonic() + 60.0
        while joined[0] == 0 and time.monotonic() < deadline:  # spin holding the GIL (no blocking call)
            pass
        end = time.monotonic() + 0.5  # rank 0's worker has finished the collective and waits for the GIL
        while time.monotonic() < end:
            pass
    else:
        time.sleep(1.0)
        dist.all_reduce(tensor)
        joined[0] = 1
    dist.destroy_process_group()


def mechanism(repeats: int) -> dict[str, Any]:
    """Both import orders, ``repeats`` two-rank runs each; exit codes and rank 0's stderr tail."""
    cases = []
    for import_first in (False, True):
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                Path(f"{tmp}/init.flag").write_bytes(b"\0")
                procs = [
                    subprocess.Popen(
                        [sys.executable, __file__, "_rank", str(r), f"{tmp}/init", "1" if import_first else "0"],
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for r in range(2)
                ]
                errs = [p.communicate(timeout=120)[1] for p in procs]
            runs.append({"exit_codes": [p.returncode for p in procs], "rank0_stderr_tail": errs[0].strip()[-200:]})
        cases.append(
            {
                "functional_imported": "before init_process_group" if import_first else "after init_process_group",
                "runs": runs,
                "clean_exits": sum(r["exit_codes"] == [0, 0] for r in runs),
                "aborts": sum(-6 in r["exit_codes"] for r in runs),
            }
        )
    lines = [
        "| torch.distributed.nn.functional imported | runs | both ranks exit 0 | a rank SIGABRT | rank 0 stderr |",
        "|---|---|---|---|---|",
    ]
    for c in cases:
        said = "; ".join(sorted({r["rank0_stderr_tail"] for r in c["runs"] if r["rank0_stderr_tail"]})) or "-"
        lines.append(f"| {c['functional_imported']} | {repeats} | {c['clean_exits']} | {c['aborts']} | {said} |")
    print("\n".join(lines))
    return {"cases": cases, "table": "\n".join(lines)}


def stress(runs: int) -> dict[str, Any]:
    """The 2-process tests ``runs`` times beside two busy loops (started and stopped here)."""
    sys.path.insert(0, str(ROOT))
    from tests import test_dedup_ddp as t

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    tests = {
        "toy_ddp_layouts": t.test_ddp_gloo_two_ranks_match_duplicated_baseline,
        "vlm_rank_without_images": t.test_vlm_two_ranks_one_without_images_match_single_process_float64,
    }
    counts = {name: {"passed": 0, "failed": 0} for name in tests}
    failures: list[dict[str, Any]] = []
    seconds: list[float] = []
    try:
        for i in range(runs):
            t0 = time.monotonic()
            for name, test in tests.items():
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        test(Path(tmp))
                        counts[name]["passed"] += 1
                    except BaseException as exc:  # a rank that aborts raises ProcessExitedException here
                        if isinstance(exc, KeyboardInterrupt):
                            raise
                        counts[name]["failed"] += 1
                        failures.append({"run": i, "test": name, "error": traceback.format_exc()[-2000:]})
            seconds.append(time.monotonic() - t0)
            print(f"run {i + 1}/{runs}: {counts} ({seconds[-1]:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return {"runs": runs, "busy_loops": 2, "counts": counts, "failures": failures, "run_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    """Run ``mechanism`` or ``stress`` and merge its result into ``gloo_teardown.json``."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _mechanism_rank(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("mechanism", "stress"))
    ap.add_argument("--runs", type=int, default=50, help="stress: runs of the 2-process tests")
    ap.add_argument("--repeats", type=int, default=5, help="mechanism: two-rank runs per import order")
    ap.add_argument("--accumulate", action="store_true", help="stress: add to the runs already in the JSON")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args(argv)
    result = mechanism(args.repeats) if args.part == "mechanism" else stress(args.runs)
    result.update(load_avg_at_end=os.getloadavg(), torch=__import__("torch").__version__, python=sys.version)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gloo_teardown.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    earlier = merged.get("stress") if args.part == "stress" and args.accumulate else None
    if earlier is not None:  # chunks of runs add up (e.g. one chunk per turn of a shared benchmark lock)
        result["runs"] += earlier["runs"]
        for name, count in result["counts"].items():
            for key in count:
                count[key] += earlier["counts"][name][key]
        result["failures"] = earlier["failures"] + result["failures"]
        result["run_seconds"] = earlier["run_seconds"] + result["run_seconds"]
        result["chunks"] = earlier.get("chunks", 1) + 1
    merged[args.part] = result
    path.write_text(json.dumps(merged, indent=2))
    ok = (
        result["cases"][1]["clean_exits"] == args.repeats
        if args.part == "mechanism"
        else all(c["failed"] == 0 for c in result["counts"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
