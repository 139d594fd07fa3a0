"""The control plane at cluster scale, driven by the trainer client's own delivery and progress code.

Run: ``python benchmarks/control_plane/scale.py [--smoke] [--ranks 256 1024] [--step-ms 120 2000]
[--groups per-rank|shared] [--rows-per-rank 1] [--seconds 30] [--runs 3] [--out PATH]``.

One real ``knittrans control-plane`` process (SQLite WAL in a temp dir) per run. Around it, in this
process: ``--nodes`` store nodes heartbeating as often as the server asks (``heartbeat_s`` of its node
answers, as ``knittrans store`` does; ``--heartbeat-s`` overrides), a rollout writer registering one-group units
as fast as the off-policy window lets it (long-polling ``GET /headroom``), and the trainer's ranks,
each running what :class:`~knittrans.trainer.client.TrainerClient` runs between the manifest and the
optimizer step: a :class:`~knittrans.trainer.feed.ManifestFeed` (long-polls ``GET
.../minibatches/{n}`` and takes the rank's share) and a :class:`~knittrans.trainer.feed.Progress`
(``fetched`` before the step, ``ack`` with the new version and the ranks' transfer figures after it);
the training step is a sleep of ``--step-ms``. Rows are not fetched: the stores are not part of this
measurement (``benchmarks/trainer`` measures the data path).

``--groups shared`` (the client's default under ``torch.distributed``): rank 0 reads each manifest
and broadcasts it over the trainer's gloo group, every rank cuts its own share, and ``fetched`` /
``ack`` are gathered into one request each. Only rank 0 runs here, as a member of a
:class:`threadgroup.VirtualGroup` of ``--ranks`` ranks: the control plane sees exactly what a trainer
of that size sends. The rest of "every rank holds its share" is measured on its own: the gloo
broadcast among real processes (``gloo_broadcast.py``) and, here, each rank's cut of its share from
the last manifest (timed for every rank after the window). ``--groups per-rank``
(``TrainerConfig(group="none")``): every rank is a thread with its own client that asks and reports
for itself.

Reported per configuration (median over ``--runs``, each run also listed): the server's CPU per
consumed mini-batch (everything it did in the timed window: manifests, acks, registrations,
heartbeats, admission), the background (CPU per second over ``--idle-seconds`` before the trainer
starts, once rollout has filled the window: the nodes' heartbeats and the idle server), the CPU per
mini-batch above that background, and the server's share of one core; the time from admission (the manifest's
``admitted_at``, the server's clock, same host) to the asking rank(s) holding the manifest (p50,
mean, p99, max); the share cut (p99 over ranks); mini-batches consumed per second; the server's RSS. JSON to
``--out`` (default ``benchmarks/control_plane/results/scale.json``) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import GROUP_SIZE, TOKEN_A, TOKEN_W, Server, create_job, register_nodes, unit, write_results
from threadgroup import VirtualGroup

from knittrans.controlclient import ControlClient
from knittrans.retry import RetryPolicy
from knittrans.trainer.feed import ManifestFeed, Progress

HERE = Path(__file__).resolve().parent
JOB = "scale"
SOURCES = {"math": 2, "code": 1, "chat": 1}  # quota shares (scaled to the mini-batch size)
RETRY = RetryPolicy(budget_s=60.0, first_backoff_s=0.1, max_backoff_s=2.0)


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50": pct(values, 0.5),
        "mean": statistics.fmean(values) if values else None,
        "p99": pct(values, 0.99),
        "max": max(values) if values else None,
    }


class Rank(threading.Thread):
    """One rank: the client's feed and progress, a sleep for the training step (in a shared group: rank 0 of a
    :class:`VirtualGroup`)."""

    def __init__(
        self, rank: int, world: int, control: ControlClient, group: VirtualGroup | None, step_ms: int, stop: Any
    ) -> None:
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.rank, self.world, self.step_s, self.group = rank, world, step_ms / 1e3, group
        self.feed = ManifestFeed(control, JOB, rank, world, collective=group, poll_s=2.0)
        self.progress = Progress(control, JOB, rank, VirtualGroup(world) if group is not None else None)
        self.stop = stop
        self.latencies: list[float] = []
        self.done = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            n = self.feed.start()
            while not self.stop.is_set():
                t0 = time.perf_counter()
                shared = self.feed.share(n)
                if shared is None:
                    return
                t1 = time.perf_counter()
                plan, _ = shared
                self.latencies.append(self.feed.arrived[n] - plan.manifest.admitted_at)
                self.progress.fetched(n, plan.manifest.attempt)
                t2 = time.perf_counter()
                time.sleep(self.step_s)  # the training step
                # measured seconds, as a real rank's are (full-precision floats: their JSON is what the server parses)
                figures = {"exposed_s": t1 - t0, "fetch_s": t2 - t1, "row_bytes": 4096}
                self.progress.ack(n, plan.manifest.attempt, version=n + 1, transfer=figures)
                self.feed.release_below(n + 1)
                self.done += 1
                n += 1
        except BaseException as exc:  # reported, not raised: the run's table says which ranks failed
            if not self.stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"


def _rollout_and_nodes(url: str, nodes: int, heartbeat_s: float, stop: Any, registered: Any) -> None:
    """Rollout as ``knittrans rollout`` paces it (long-poll ``GET /headroom`` until the off-policy window has
    room, then register that many finished groups, by source, in one request: generation takes no time, so
    rollout is never what the trainer waits for) and ``nodes`` store nodes heartbeating every ``heartbeat_s``."""
    done = threading.Event()

    def heartbeats() -> None:
        control = ControlClient(url, token=TOKEN_W, retry=RETRY)
        i = 0
        while not done.is_set():
            t0 = time.monotonic()
            for n in range(i % 4, nodes, 4):  # a quarter of the nodes every quarter interval
                control._request("POST", f"/v1/nodes/n{n}/heartbeat")
            i += 1
            time.sleep(max(0.0, heartbeat_s / 4 - (time.monotonic() - t0)))
        control.close()

    beats = threading.Thread(target=heartbeats, daemon=True)
    beats.start()
    control = ControlClient(url, token=TOKEN_W, retry=RETRY)
    i = 0
    while not stop.is_set():
        try:
            room = control.headroom(JOB, wait_s=1.0)["headroom"]
            batch = []
            for source, count in room.items():
                for _ in range(min(count, 500 - len(batch))):
                    batch.append(unit(JOB, i, source, time.time(), nodes=nodes))
                    i += 1
            if batch:
                control.register_units(JOB, batch)
                registered.value += len(batch)
        except Exception:  # the server stopping under the last call
            time.sleep(0.1)
    done.set()
    beats.join(5)
    control.close()


def run_once(args: Any, ranks: int, step_ms: int, groups: str) -> dict[str, Any]:
    """One server, one job, ``args.seconds`` of steady state; the figures of that window."""
    with tempfile.TemporaryDirectory(prefix="kt-scale-") as tmp:
        server = Server(Path(tmp), node_timeout_s=30)
        try:
            return _drive(server, args, ranks, step_ms, groups)
        finally:
            server.stop()


def _drive(server: Server, args: Any, ranks: int, step_ms: int, groups: str) -> dict[str, Any]:
    per_mb = max(len(SOURCES), ranks * args.rows_per_rank // GROUP_SIZE)  # groups per mini-batch
    k = 2
    total = sum(SOURCES.values())
    quotas = {s: per_mb * k * q // total for s, q in SOURCES.items()}
    quotas["math"] += per_mb * k - sum(quotas.values())
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN_A}"}, timeout=60)
    create_job(admin, JOB, quotas=quotas, k=k, w=ranks, micro_batch_size=args.rows_per_rank, lookahead=1)
    asked = register_nodes(admin, args.nodes)
    heartbeat_s = args.heartbeat_s or asked
    stop = threading.Event()
    # rollout and the store nodes in a process of their own: their requests are the server's load, their
    # Python is not the ranks' (one GIL would put the heartbeats' work inside the measured delivery)
    ctx = multiprocessing.get_context("spawn")
    noise_stop, registered = ctx.Event(), ctx.Value("q", 0)
    noise = ctx.Process(
        target=_rollout_and_nodes, args=(server.url, args.nodes, heartbeat_s, noise_stop, registered), daemon=True
    )
    noise.start()
    # the background: the nodes' heartbeats and an idle server, once rollout has filled the off-policy window
    # (what a mini-batch costs above it is what the trainer's size changes)
    deadline, last = time.monotonic() + 60, -1
    while registered.value != last and time.monotonic() < deadline:
        last = registered.value
        time.sleep(1.0)
    idle0, idle_wall0 = server.cpu_s(), time.monotonic()
    time.sleep(args.idle_seconds)
    background = (server.cpu_s() - idle0) / (time.monotonic() - idle_wall0)  # CPU seconds per second
    shared = groups == "shared"
    # shared: rank 0 of the trainer runs (the others' requests are its); per-rank: every rank, its own client
    running = 1 if shared else ranks
    clients = [ControlClient(server.url, token=TOKEN_W, retry=RETRY) for _ in range(running)]
    group = VirtualGroup(ranks) if shared else None
    rank_threads = [Rank(r, ranks, clients[r], group, step_ms, stop) for r in range(running)]
    for t in rank_threads:
        t.start()
    # warm-up: until the first few mini-batches are consumed
    deadline = time.monotonic() + 120
    while min(t.done for t in rank_threads) < 2 and time.monotonic() < deadline:
        if any(t.error for t in rank_threads):
            break
        time.sleep(0.05)
    done0 = [t.done for t in rank_threads]
    lat0 = [len(t.latencies) for t in rank_threads]
    # what else runs in this process and beside it (earlier runs' threads or processes would be load here)
    others = {"threads": threading.active_count(), "processes": len(psutil.Process().children(recursive=True))}
    cpu0, wall0 = server.cpu_s(), time.monotonic()
    time.sleep(args.seconds)
    cpu1, wall1 = server.cpu_s(), time.monotonic()
    consumed = min(t.done - d for t, d in zip(rank_threads, done0, strict=True))
    latencies = [x * 1e3 for t, n in zip(rank_threads, lat0, strict=True) for x in t.latencies[n:]]
    rss = server.rss_mib()
    stop.set()
    cuts: list[float] = []  # what each rank does with the broadcast manifest, on its own CPU: cut its share
    last = group.last if group is not None else None  # leader_call's (ok, value); value: (manifest, etag)
    if last is not None and last[0] and isinstance(last[1], tuple):
        manifest = last[1][0]
        for r in range(ranks):
            c0 = time.perf_counter()
            manifest.share(r)
            cuts.append((time.perf_counter() - c0) * 1e3)
    status = admin.get(f"/v1/jobs/{JOB}/status").json()
    noise_stop.set()
    noise.join(10)
    errors = [f"rank {t.rank}: {t.error}" for t in rank_threads if t.error][:5]
    server.stop()  # ends the feeds' long-polls; the threads are daemons
    for c in clients:
        c.close()
    admin.close()
    cpu = cpu1 - cpu0
    return {
        "ranks": ranks,
        "step_ms": step_ms,
        "groups": groups,
        "rows_per_rank": args.rows_per_rank,
        "groups_per_mini_batch": per_mb,
        "groups_registered": registered.value,
        "window_s": wall1 - wall0,
        "consumed_mini_batches": consumed,
        "heartbeat_s": heartbeat_s,
        "server_cpu_s": cpu,
        "server_cpu_ms_per_mini_batch": cpu * 1e3 / consumed if consumed else None,
        "background_cpu_s_per_s": background,
        "server_cpu_ms_per_mini_batch_above_background": (
            (cpu - background * (wall1 - wall0)) * 1e3 / consumed if consumed else None
        ),
        "server_core_share": cpu / (wall1 - wall0),
        "delivery_ms": summary(latencies),
        "share_cut_ms": summary(cuts),
        "server_rss_mib": rss,
        "consumed_total": status["counts"]["consumed_mini_batches"],
        "at_window_start": others,
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--step-ms", type=int, nargs="+", default=[120, 2000])
    parser.add_argument("--groups", nargs="+", choices=("shared", "per-rank"), default=["shared"])
    parser.add_argument("--rows-per-rank", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument(
        "--heartbeat-s", type=float, default=None, help="node heartbeat interval (default: what the server asks)"
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--idle-seconds", type=float, default=8.0, help="background CPU window before the trainer starts (default 8)"
    )
    parser.add_argument("--smoke", action="store_true", help="one short run of 16 ranks (a check, not a figure)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scale.json")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.step_ms, args.seconds, args.runs, args.nodes, args.idle_seconds = [16], [120], 3.0, 1, 4, 1.0
    configs = [(r, s, g) for r in args.ranks for s in args.step_ms for g in args.groups]
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):  # configurations interleaved: run 1 of each, then run 2 of each, ...
        for ranks, step, groups in configs:
            log(f"run {i + 1}/{args.runs}: {ranks} ranks, {step} ms step, {groups}")
            result = run_once(args, ranks, step, groups)
            result["run"] = i + 1
            runs.append(result)
            d = result["delivery_ms"]
            cpu = result["server_cpu_ms_per_mini_batch"] or 0
            above = result["server_cpu_ms_per_mini_batch_above_background"] or 0
            log(
                f"  {result['consumed_mini_batches']} mini-batches, server {cpu:.1f}"
                f" ms CPU each ({above:.1f} above the background; {result['server_core_share']:.0%} of a core);"
                f" share held p50 {d['p50'] or 0:.1f} /"
                f" p99 {d['p99'] or 0:.1f} ms{'; errors: ' + str(result['errors']) if result['errors'] else ''}"
            )
    table = []
    for ranks, step, groups in configs:
        mine = [r for r in runs if (r["ranks"], r["step_ms"], r["groups"]) == (ranks, step, groups)]

        def med(get: Any, rows: list[dict[str, Any]] = mine) -> float | None:
            values = [v for v in (get(r) for r in rows) if v is not None]
            return statistics.median(values) if values else None

        table.append(
            {
                "ranks": ranks,
                "step_ms": step,
                "groups": groups,
                "runs": len(mine),
                "server_cpu_ms_per_mini_batch": med(lambda r: r["server_cpu_ms_per_mini_batch"]),
                "background_cpu_ms_per_s": med(lambda r: r["background_cpu_s_per_s"] * 1e3),
                "server_cpu_ms_per_mini_batch_above_background": med(
                    lambda r: r["server_cpu_ms_per_mini_batch_above_background"]
                ),
                "server_core_share": med(lambda r: r["server_core_share"]),
                "delivery_p50_ms": med(lambda r: r["delivery_ms"]["p50"]),
                "delivery_mean_ms": med(lambda r: r["delivery_ms"]["mean"]),
                "delivery_p99_ms": med(lambda r: r["delivery_ms"]["p99"]),
                "delivery_max_ms": med(lambda r: r["delivery_ms"]["max"]),
                "share_cut_p99_ms": med(lambda r: r["share_cut_ms"]["p99"]),
                "mini_batches_per_s": med(lambda r: r["consumed_mini_batches"] / r["window_s"]),
                "server_rss_mib": med(lambda r: r["server_rss_mib"]),
            }
        )
    md = [
        "| ranks | step | groups | server CPU / mini-batch (above the background) | background CPU / s | core share "
        "| manifest held by the asking rank(s): p50 / mean / p99 / max (ms) | share cut, p99 over ranks (ms) "
        "| mini-batches/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        md.append(
            f"| {t['ranks']} | {t['step_ms']} ms | {t['groups']} | {t['server_cpu_ms_per_mini_batch'] or 0:.1f} ms "
            f"({t['server_cpu_ms_per_mini_batch_above_background'] or 0:.1f} ms) | "
            f"{t['background_cpu_ms_per_s'] or 0:.1f} ms | {t['server_core_share'] or 0:.0%} | "
            f"{t['delivery_p50_ms'] or 0:.1f} / {t['delivery_mean_ms'] or 0:.1f} / "
            f"{t['delivery_p99_ms'] or 0:.1f} / {t['delivery_max_ms'] or 0:.1f} | "
            f"{t['share_cut_p99_ms'] if t['share_cut_p99_ms'] is not None else float('nan'):.3f} | "
            f"{t['mini_batches_per_s'] or 0:.2f} |"
        )
    write_results(
        args.out, {"args": {k: v for k, v in vars(args).items() if k != "out"}, "table": table, "runs": runs}, md
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
