"""Paired A/B of the trainer client across checkouts: each tree's worker measures in turn, round by round.

On a shared host the load moves by more than a change to the client saves, so two whole benchmark
invocations one after the other compare the hours they ran in. Here one long-lived worker per tree
(``PYTHONPATH`` = that tree, its own cluster and ranks, started once) waits for a word on stdin, and
the coordinator asks each in turn for one step (the order rotating every round), so the trees see the
same load within seconds. Every tree runs with its shipped defaults; the measuring code is this
checkout's (only API every tree since 7fe2783 has), the library is the tree's.

Benches (what one step is):

* ``trainer``: ``run.py``'s default variant (``iter`` fetch, dedup encoding): a fresh client trains one
  rank's share of a job for ``1 + --mini-batches`` mini-batches (the first unmeasured); per mini-batch the
  exposed transfer (the training loop's waits for data, summed) and the first micro-batch's wait.
* ``baselines``: the KnitTrans side of ``benchmarks/vs_baselines`` (its ``flight`` runner of the tree: 4 rank
  processes, the multimodal workload, a tiny policy's compute, the next mini-batch put before the current
  one is consumed, as its driver's compute mode does): one mini-batch per step; per rank the exposed
  transfer of the mini-batch (its 8 waits summed) and the first micro-batch's wait.
* ``cold``: ``cold_path.py``'s run (a fresh job, rank process and rollout process): admission -> first
  micro-batch ready for the first mini-batch of the process (``cold``) and the later ones (``warm``).

    python benchmarks/trainer/pair.py BENCH --tree d326a64 [--tree LABEL=DIR ...] [--rounds 8] [--steps 2]

``--tree`` is a commit of this repository (extracted with ``git archive`` into ``--trees-dir``) or
``LABEL=DIR`` (a checkout or an extracted tree); this checkout (``this``) is added last unless named or
``--no-this``. Ratios are to the first tree. Every tree's ``knittrans`` and ``benchmarks`` are
byte-compiled first (an uncompiled tree measured 15-32 % slower once). Writes ``pair_<bench>_<tag>.json``
and ``.md`` under ``--out`` (default benchmarks/trainer/results) and prints the table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from common import REPO, commit_of, distribution, machine

SCRIPT = Path(__file__).resolve()
METRICS = {
    "trainer": {"warm": ("exposed_ms", "first_micro_ms")},
    "baselines": {"warm": ("exposed_ms", "first_micro_ms", "max_micro_ms")},
    "cold": {"cold": ("ready_ms", "share_ms"), "warm": ("ready_ms", "share_ms")},
}
"""bench -> record kind -> the figures (ms) each record of that kind has."""


# ---------------------------------------------------------------------------------------------- workers
def _alias_moved_modules() -> None:
    """Point the modules that moved since 7fe2783 at their old homes when the tree measured is that old:
    ``knittrans.demo.rank`` (was ``knittrans.trainer.rank``), ``knittrans.local`` (was ``knittrans.demo.cluster``)."""
    import knittrans

    package = Path(next(iter(knittrans.__path__)))
    for new, old in (("demo/rank.py", "knittrans.trainer.rank"), ("local.py", "knittrans.demo.cluster")):
        if not (package / new).exists():
            sys.modules["knittrans." + new[:-3].replace("/", ".")] = importlib.import_module(old)


def _worker_trainer(opts: dict[str, Any]) -> Iterator[Callable[[int], list[dict[str, Any]]]]:
    _alias_moved_modules()
    from run import GROUP_SIZE, IMAGE, VARIANTS, delete_job, train_rank, write_job

    from knittrans.demo.rank import load_policy
    from knittrans.local import ClusterConfig, LocalCluster
    from knittrans.rollout.models import build_tiny_qwen2

    variant = next(v for v in VARIANTS if v.name == opts["variant"])
    work = Path(tempfile.mkdtemp(prefix="knittrans-pair-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    with LocalCluster(ClusterConfig(work_dir=work, num_stores=2)) as cluster:
        model_dir = build_tiny_qwen2(work / "model", hidden=64, layers=2, heads=1, head_dim=64)
        base = load_policy(model_dir, image_channels=IMAGE[0])

        def step(i: int) -> list[dict[str, Any]]:
            job = f"pair{i}"
            descs = write_job(
                cluster,
                job,
                mini_batches=1 + opts["mini_batches"],
                groups=16,
                group_size=GROUP_SIZE,
                image=IMAGE,
                seed=i,
                world=1,
            )
            records = train_rank(cluster, job, variant, base, mini_batches=opts["mini_batches"], warmup=1)
            delete_job(cluster, job, descs)
            return [
                {"kind": "warm", "exposed_ms": 1e3 * r["wait_s"], "first_micro_ms": 1e3 * r["first_wait_s"]}
                for r in records
                if not r["warmup"]
            ]

        yield step


def _worker_baselines(opts: dict[str, Any]) -> Iterator[Callable[[int], list[dict[str, Any]]]]:
    from benchmarks.vs_baselines.common import RunnerOptions
    from benchmarks.vs_baselines.knittrans_runner import make_runner
    from benchmarks.vs_baselines.workload import WorkloadSpec, generate

    spec = WorkloadSpec(kind=opts["kind"])
    workload = generate(spec)
    runner = make_runner(opts["variant"])
    runner.setup(spec, RunnerOptions())
    put: set[int] = set()
    consumed = 0

    def consume_next() -> list[dict[str, Any]]:
        nonlocal consumed
        n = consumed
        for m in (n, n + 1):  # the next mini-batch is put before this one is consumed (the driver's compute mode)
            if m not in put:
                runner.put(workload, f"m{m}")
                put.add(m)
        ranks = runner.consume(f"m{n}", compute=True)
        runner.clear(f"m{n}")
        consumed += 1
        out = []
        for r in ranks:
            waits = [1e3 * m["wait_s"] for m in r["micro"]]
            out.append(
                {
                    "kind": "warm",
                    "rank": r["rank"],
                    "exposed_ms": sum(waits),
                    "first_micro_ms": waits[0],
                    "max_micro_ms": max(waits),
                    "waits_ms": waits,
                }
            )
        return out

    try:
        for _ in range(opts["warmup"]):  # unrecorded, as the driver's warm-up mini-batch
            consume_next()
        yield lambda i: consume_next()
    finally:
        runner.teardown()


def _worker_cold(opts: dict[str, Any]) -> Iterator[Callable[[int], list[dict[str, Any]]]]:
    _alias_moved_modules()
    from cold_path import run_once

    from knittrans.local import ClusterConfig, LocalCluster

    with tempfile.TemporaryDirectory() as tmp, LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl:

        def step(i: int) -> list[dict[str, Any]]:
            out = run_once(cl, f"pc{i}", warm=opts["warm"])
            return [
                {
                    "kind": r["kind"],
                    "ready_ms": 1e3 * r["admission_to_ready_s"],
                    "share_ms": 1e3 * r["admission_to_plan_s"],
                }
                for r in out["records"]
            ]

        yield step


WORKERS = {"trainer": _worker_trainer, "baselines": _worker_baselines, "cold": _worker_cold}


def worker(bench: str, opts: dict[str, Any]) -> None:
    """``--worker BENCH``: set up, say ready, then one step per ``{"step": i}`` line; answers on the original
    stdout (anything else printing to stdout goes to stderr)."""
    proto: IO[str] = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import knittrans

    gen = WORKERS[bench](opts)
    step = next(gen)
    proto.write(json.dumps({"ready": True, "knittrans": str(Path(knittrans.__file__).parent)}) + "\n")
    proto.flush()
    try:
        for line in sys.stdin:
            i = json.loads(line)["step"]
            t0 = time.perf_counter()
            records = step(i)
            proto.write(json.dumps({"records": records, "seconds": time.perf_counter() - t0}) + "\n")
            proto.flush()
    finally:
        gen.close()


# ---------------------------------------------------------------------------------------------- coordinator
class Tree:
    """One checkout under test and its worker process."""

    def __init__(self, label: str, path: Path, commit: str) -> None:
        self.label, self.path, self.commit = label, path, commit
        self.proc: subprocess.Popen[str] | None = None

    def start(self, bench: str, opts: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.path)}
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", bench, "--opts", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=self.path,  # ``python -m knittrans.cli`` children put their cwd first on sys.path
            env=env,
        )

    def ready(self) -> None:
        answer = self._read()
        if Path(answer["knittrans"]) != self.path / "knittrans":
            raise RuntimeError(f"{self.label}: imported {answer['knittrans']}, not {self.path / 'knittrans'}")

    def step(self, i: int) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"step": i}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker of {self.label} ended (exit {self.proc.wait(60)})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def resolve_tree(spec: str, trees_dir: Path) -> Tree:
    """``this``, ``LABEL=DIR`` or a commit of this repository (extracted once under ``trees_dir``)."""
    if spec == "this":
        return Tree("this", REPO, commit_of(REPO))
    if "=" in spec:
        label, path = spec.split("=", 1)
        p = Path(path).resolve()
        return Tree(label, p, commit_of(p) or label)
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{spec}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    short = sha[:7]
    path = trees_dir / short
    if not (path / ".extracted").exists():
        path.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", sha], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive.stdout, check=True)
        (path / ".extracted").write_text(sha + "\n")
    return Tree(short, path, short)


def compile_trees(trees: list[Tree]) -> None:
    """Byte-compile each tree's ``knittrans`` and ``benchmarks`` (writes the caches a first import would)."""
    dirs = [str(t.path / d) for t in trees for d in ("knittrans", "benchmarks") if (t.path / d).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True, stdout=subprocess.DEVNULL)


def summarise(bench: str, trees: list[Tree], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tree, kind and figure: p50 / mean / p99 over every record; per round the ratio of each tree's mean
    (and p50) to the reference tree's, and their median over rounds."""
    ref = trees[0].label
    rounds = sorted({s["round"] for s in steps})
    out: dict[str, Any] = {}
    for kind, figures in METRICS[bench].items():
        for fig in figures:
            values: dict[tuple[str, int], list[float]] = {(t.label, rnd): [] for t in trees for rnd in rounds}
            for s in steps:
                values[s["tree"], s["round"]] += [r[fig] for r in s["records"] if r["kind"] == kind]
            entry: dict[str, Any] = {
                t.label: distribution([v for rnd in rounds for v in values[t.label, rnd]]) for t in trees
            }
            for t in trees[1:]:
                per_round_mean, per_round_p50 = [], []
                for rnd in rounds:
                    a, b = values[t.label, rnd], values[ref, rnd]
                    if a and b and statistics.fmean(b) > 0 and statistics.median(b) > 0:
                        per_round_mean.append(statistics.fmean(a) / statistics.fmean(b))
                        per_round_p50.append(statistics.median(a) / statistics.median(b))
                mine, base = entry[t.label], entry[ref]
                entry[f"{t.label}/{ref}"] = {
                    "pooled": {q: mine[q] / base[q] if base[q] else float("nan") for q in ("p50", "mean", "p99")},
                    "per_round_mean": per_round_mean,
                    "per_round_p50": per_round_p50,
                    "median_of_round_means": statistics.median(per_round_mean) if per_round_mean else float("nan"),
                    "median_of_round_p50s": statistics.median(per_round_p50) if per_round_p50 else float("nan"),
                }
            out[f"{kind}/{fig}"] = entry
    return out


def report(result: dict[str, Any]) -> str:
    """The result as markdown: the command, trees, machine and load, then one table per figure."""
    m, trees = result["machine"], result["trees"]
    ref = trees[0]["label"]
    loads = [r[0] for r in result["round_loads"]]
    lines = [
        f"# Paired `{result['bench']}`: {' vs '.join(t['label'] for t in trees)}",
        "",
        f"`{result['command']}`",
        "",
        f"{m['date']}; {m['cpus']} CPUs {m['cpu_model']}, {m['platform']}; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f} over the rounds (median {statistics.median(loads):.1f}); "
        f"{result['rounds']} rounds x {result['steps']} steps per tree, tree order rotating each round. Trees: "
        + ", ".join(f"`{t['label']}` = {t['commit']} ({t['path']})" for t in trees)
        + f". Options: `{json.dumps(result['options'])}`.",
        "",
        "| figure (ms) | tree | n | p50 | mean | p99 | max | p50 / ref | mean / ref | p99 / ref "
        "| median of round means / ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in result["summary"].items():
        for t in trees:
            d = entry[t["label"]]
            ratio = entry.get(f"{t['label']}/{ref}")
            cells = (
                f"{ratio['pooled']['p50']:.3f} | {ratio['pooled']['mean']:.3f} | {ratio['pooled']['p99']:.3f} | "
                f"{ratio['median_of_round_means']:.3f}"
                if ratio
                else "ref | | |"
            )
            lines.append(
                f"| {key} | {t['label']} | {d['n']} | {d['p50']:.2f} | {d['mean']:.2f} | {d['p99']:.2f} | "
                f"{d['max']:.2f} | {cells} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":  # pair.py --worker BENCH --opts JSON
        worker(sys.argv[2], json.loads(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", choices=sorted(WORKERS))
    ap.add_argument("--tree", action="append", default=[], help="a commit, LABEL=DIR or 'this' (repeatable)")
    ap.add_argument("--no-this", action="store_true", help="do not add this checkout")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps per tree and round")
    ap.add_argument("--mini-batches", type=int, default=4, help="trainer: measured mini-batches per step")
    ap.add_argument("--variant", default=None, help="trainer: run.py variant (iter/dedup); baselines: runner variant")
    ap.add_argument("--kind", default="multimodal", help="baselines: workload kind")
    ap.add_argument("--warm", type=int, default=8, help="cold: warm mini-batches per run")
    ap.add_argument("--trees-dir", type=Path, default=Path(tempfile.gettempdir()) / "knittrans-trees")
    ap.add_argument("--tag", default=None, help="result file name part (default: the trees' labels)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    specs = list(args.tree)
    if not args.no_this and "this" not in specs:
        specs.append("this")
    trees = [resolve_tree(s, args.trees_dir) for s in specs]
    if len(trees) < 2 or len({t.label for t in trees}) != len(trees):
        ap.error("need at least two trees with distinct labels")
    opts: dict[str, Any] = {
        "trainer": {"variant": args.variant or "iter/dedup", "mini_batches": args.mini_batches},
        "baselines": {"variant": args.variant or "flight", "kind": args.kind, "warmup": 1},
        "cold": {"warm": args.warm},
    }[args.bench]
    compile_trees(trees)
    result: dict[str, Any] = {
        "bench": args.bench,
        "command": " ".join([Path(sys.executable).name, *[str(a) for a in sys.argv]]),
        "machine": machine(),
        "trees": [{"label": t.label, "commit": t.commit, "path": str(t.path)} for t in trees],
        "options": opts,
        "rounds": args.rounds,
        "steps": args.steps,
        "round_loads": [],
        "steps_raw": [],
    }
    try:
        for t in trees:  # one at a time: start-ups are CPU-heavy
            t.start(args.bench, opts)
            t.ready()
        i = 0
        for rnd in range(args.rounds):
            result["round_loads"].append(list(os.getloadavg()))
            order = trees[rnd % len(trees) :] + trees[: rnd % len(trees)]
            for t in order:
                for _ in range(args.steps):
                    answer = t.step(i)
                    result["steps_raw"].append({"round": rnd, "tree": t.label, "step": i, **answer})
                    i += 1
            print(f"  round {rnd + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    finally:
        for t in trees:
            t.stop()
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["summary"] = summarise(args.bench, trees, result["steps_raw"])
    tag = args.tag or "_".join(t.label for t in trees)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pair_{args.bench}_{tag}.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (args.out / f"pair_{args.bench}_{tag}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
