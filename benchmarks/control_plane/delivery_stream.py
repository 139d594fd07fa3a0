"""Plan delivery at scale: the rank's long-poll (``next?ack=``) against the plan stream (``.../plans``), interleaved.

Run: ``python benchmarks/control_plane/delivery_stream.py [--runs 3] [--seconds 20] [--ranks 1024]
[--modes next stream stream-post] [--think-ms 0 120] [--baseline-source DIR]
[--stream-client socket|asyncio]``. Each run is one ``scale.py --phases delivery`` (its own server
process); the configurations (mode x think time x server) take turns (next, stream, stream-post, next,
...), so load on the shared machine hits them alike. ``--baseline-source``: a directory holding another
checkout's ``knittrans`` package (e.g. main's, ``git archive main knittrans | tar -x -C DIR``) that runs
as a second server for each configuration. Reported per configuration: the median over runs of the
plan's arrival at the rank's socket p50/p99 (the kernel's receive time; stream modes with
``--stream-client socket``), plan delivery after parsing p50/p99/mean (ms after admission), server CPU
per mini-batch, mini-batches consumed, the load average around each run, and the ratio to the baseline
server (else to the first configuration). Results: ``results/delivery_stream.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def one(
    spec: str, think_ms: float, source: Path | None, args: argparse.Namespace, work: Path, i: int
) -> dict[str, Any]:
    """One ``scale.py`` run of ``spec`` (an ack mode, optionally ``@<parser>``: the server's ``--http``) with
    the ranks' think time, the server from ``source`` (None: this checkout)."""
    mode, _, http = spec.partition("@")
    out = work / f"{mode}_{http or 'default'}_{think_ms:g}_{'base' if source else 'wt'}_{i}"
    cmd = [
        sys.executable,
        str(HERE / "scale.py"),
        "--phases",
        "delivery",
        "--ack-mode",
        mode,
        "--seconds",
        str(args.seconds),
        "--ranks",
        str(args.ranks),
        "--nodes",
        str(args.nodes),
        "--rate",
        str(args.rate),
        "--rows-per-rank",
        str(args.rows_per_rank),
        "--think-ms",
        str(think_ms),
        "--out",
        str(out),
        "--stream-client",
        args.stream_client,
        *(["--server-http", http] if http else []),
        *(["--server-source", str(source)] if source else []),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.with_suffix(".json").read_text())
    return result


def med(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def result_header(benchmark: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every control-plane result file starts with: benchmark, machine, commit, arguments."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "benchmark": benchmark,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "commit": commit.stdout.strip(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--rows-per-rank", type=int, default=1, help="scale.py --rows-per-rank (1 or 8)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["next", "stream", "stream-post"],
        help="ack modes of scale.py, each optionally MODE@PARSER (the server's --http: h11, httptools)",
    )
    parser.add_argument(
        "--think-ms", type=float, nargs="+", default=[0.0], help="the ranks' think times to run (scale.py --think-ms)"
    )
    parser.add_argument(
        "--baseline-source",
        type=Path,
        default=None,
        help="directory holding another checkout's knittrans package: each configuration also runs on that server",
    )
    parser.add_argument("--baseline-label", default="base", help="what --baseline-source is (e.g. main@<commit>)")
    parser.add_argument(
        "--baseline-instead",
        nargs="*",
        default=["gateway=stream"],
        help="MODE=OTHER: MODE is new (the baseline server lacks it); compare it with OTHER on the baseline server",
    )
    parser.add_argument(
        "--stream-client",
        choices=["socket", "asyncio"],
        default="socket",
        help="scale.py --stream-client: the simulated ranks of the stream modes on raw sockets with the kernel's "
        "receive time (default) or on asyncio streams (the client before 2026-12-03)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "delivery_stream")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="knittrans-delivery-stream-"))
    servers: list[Path | None] = [None] + ([args.baseline_source.resolve()] if args.baseline_source else [])
    instead = dict(pair.split("=", 1) for pair in args.baseline_instead)
    configs = [
        (f"{mode} think {think:g}" + (f" {args.baseline_label}" if source else ""), mode, think, source)
        for think in args.think_ms
        for mode in args.modes
        for source in servers
        if source is None or mode not in instead
    ]
    for think in args.think_ms:  # a new mode's counterpart on the baseline server, run once per think time
        for other in {instead[m] for m in args.modes if m in instead and args.baseline_source} - set(args.modes):
            configs.append((f"{other} think {think:g} {args.baseline_label}", other, think, servers[-1]))
    names = {c[0] for c in configs}
    compare_to = {}
    for name, mode, think, source in configs:
        base = f"{instead.get(mode, mode)} think {think:g} {args.baseline_label}"
        if source is None and base in names:
            compare_to[name] = base
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for i in range(args.runs):
        for name, mode, think, source in configs:
            r = one(mode, think, source, args, work, i)
            d = r["delivery"]
            arrival = d.get("plan_arrival_ms") or {}
            arrival_user = d.get("plan_arrival_user_ms") or {}
            row = {
                "run": i,
                "stream_client": d.get("stream_client", "asyncio"),
                "arrival_p50_ms": arrival.get("p50"),
                "arrival_p99_ms": arrival.get("p99"),
                "arrival_user_p99_ms": arrival_user.get("p99"),
                "clients_cpu_share": d.get("clients_cpu_share"),
                "load_avg_1m_start": r["load_avg_1m_start"],
                "load_avg_1m_end": r["load_avg_1m_end"],
                "p50_ms": d["plan_delivery_ms"]["p50"],
                "p99_ms": d["plan_delivery_ms"]["p99"],
                "mean_ms": d["plan_delivery_ms"]["mean"],
                "max_ms": d["plan_delivery_ms"]["max"],
                "mini_batches_consumed": d["mini_batches_consumed"],
                "server_cpu_ms_per_mini_batch": d["server_cpu_ms_per_mini_batch"],
                "server_cpu_share": d["server_cpu_share"],
                "state_process_cpu_share": d.get("server_state_process_cpu_share"),
                "gateway_cpu_share": d.get("gateway_cpu_share"),
                "state_process_cpu_ms_per_mini_batch": (
                    d["server_state_process_cpu_share"] * d["seconds"] / d["mini_batches_consumed"] * 1e3
                    if d.get("server_state_process_cpu_share") is not None and d["mini_batches_consumed"]
                    else None
                ),
                "registration_p99_ms": d["registration_request_ms"]["p99"],
                "plans_delivered": d["plans_delivered"],
            }
            runs[name].append(row)
            print(f"[delivery_stream] run {i} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    keys = [
        "arrival_p50_ms",
        "arrival_p99_ms",
        "arrival_user_p99_ms",
        "clients_cpu_share",
        "p50_ms",
        "p99_ms",
        "mean_ms",
        "server_cpu_ms_per_mini_batch",
        "mini_batches_consumed",
        "server_cpu_share",
        "state_process_cpu_ms_per_mini_batch",
        "state_process_cpu_share",
        "gateway_cpu_share",
        "load_avg_1m_start",
    ]
    medians = {m: {k: med([row.get(k) for row in rows]) for k in keys} for m, rows in runs.items()}
    result = {
        **result_header("control_plane_delivery_stream", args),
        "runs": runs,
        "medians": medians,
        "baselines": {c[0]: (f"{c[1]} think {c[2]:g}" if c[3] else None) for c in configs},
        "compare_to": compare_to,
        "target_p99_ms": 50.0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_md(result, args.out.with_suffix(".md"))
    return 0


def write_md(result: dict[str, Any], path: Path) -> None:
    """The table of ``result`` (medians per mode, ratios to ``next``) as Markdown at ``path``."""
    args = argparse.Namespace(**result["args"])
    runs, medians = result["runs"], result["medians"]
    first = "next" if "next" in medians else next(iter(medians))
    baselines: dict[str, str | None] = result.get("baselines") or {}
    # with a baseline server: each configuration's ratio of this checkout's server to the baseline's
    base_of = {b: name for name, b in baselines.items() if b}
    if "compare_to" in result:  # which baseline configuration each of this checkout's is compared with
        base_of = result["compare_to"]
    base_name = "baseline server" if base_of else first

    def f(v: float | None, fmt: str = ".1f") -> str:
        return "–" if v is None else format(v, fmt)

    def pct(v: float | None) -> float | None:
        return None if v is None else v * 100

    def ratio(name: str, key: str) -> float | None:
        m = medians[name]
        if base_of and name not in base_of:
            return None  # a baseline configuration itself (or one without a counterpart there)
        base = medians.get(base_of[name]) if base_of else medians.get(first)
        mine, theirs = m.get(key), base.get(key) if base else None
        return mine / theirs if theirs and mine is not None else None

    lines = [
        f"# Plan delivery: long-poll vs plan stream ({args.ranks} ranks, {args.nodes} nodes, {args.rate} groups/s, "
        f"{getattr(args, 'rows_per_rank', 1)} rows per rank)\n",
        f"{result['machine']}, {result['cpus']} CPUs, commit {result['commit']}; {args.runs} runs of "
        f"{args.seconds} s per mode, interleaved; medians over runs.\n",
        f"| configuration | arrival at the rank's socket p50 / p99 (ms) | arrival p99 vs {base_name} | "
        "read callback p99 (ms) | "
        f"parsed: delivery p50 (ms) | delivery p99 (ms) | mean (ms) | p99 vs {base_name} | "
        f"server CPU / mini-batch (ms) | CPU vs {base_name} | mini-batches | server CPU share | "
        "state process CPU / mini-batch (ms) | state process, gateway CPU share | simulated clients' CPU share | "
        "load 1m (start of each run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in medians.items():
        loads = ", ".join(f"{row['load_avg_1m_start']:.1f}" for row in runs[mode])
        lines.append(
            f"| {mode} | {f(m.get('arrival_p50_ms'))} / {f(m.get('arrival_p99_ms'))} | "
            f"{f(ratio(mode, 'arrival_p99_ms'), '.2f')} | {f(m.get('arrival_user_p99_ms'))} | "
            f"{f(m['p50_ms'])} | {f(m['p99_ms'])} | {f(m.get('mean_ms'))} | "
            f"{f(ratio(mode, 'p99_ms'), '.2f')} | "
            f"{f(m['server_cpu_ms_per_mini_batch'])} | {f(ratio(mode, 'server_cpu_ms_per_mini_batch'), '.2f')} | "
            f"{f(m['mini_batches_consumed'], '.0f')} | {f((m['server_cpu_share'] or 0) * 100, '.0f')} % | "
            f"{f(m.get('state_process_cpu_ms_per_mini_batch'))} | "
            f"{f(pct(m.get('state_process_cpu_share')), '.0f')} %, {f(pct(m.get('gateway_cpu_share')), '.0f')} % | "
            f"{f(pct(m.get('clients_cpu_share')), '.0f')} % | "
            f"{loads} |"
        )
    lines += [
        "",
        "modes: `next` = `GET .../next?ack=<plan_id>`, one request per rank per mini-batch; `stream` = one "
        "`POST .../plans` per rank for the run, plans as lines of its response, acks as lines of its chunked "
        "request body; `stream-post` = `GET .../plans`, acks by `POST .../ack` (the trainer client with "
        "`plan_stream=True`); `post` = `POST .../ack` then `GET .../next` (the trainer client's default). Delivery is "
        "measured from admission, or from when the rank was ready if later: for `next` and the stream modes "
        "from sending the ack, for `post` from the `next` request after the ack returned (its ack round trip "
        "is not in the figure). Server CPU per mini-batch compares across modes; the latencies depend on how "
        "far each mode saturates the server. `MODE@PARSER`: the server ran with `--http PARSER` (uvicorn's "
        "HTTP/1.1 implementation). `think T`: each rank computes T ms on a plan before it acks and asks "
        "for the next (scale.py --think-ms). `gateway` = as `stream`, on the plan gateway's port (the server runs "
        "with `--plan-gateway-port 0`; its CPU includes the gateway process; compared with `stream` on the baseline "
        "server, which has no gateway). Server CPU share: of one core (state process + gateway). "
        "Arrival at the rank's socket: the kernel's receive time of the plan's bytes (SO_TIMESTAMPNS; "
        "`--stream-client socket`, the stream modes only), from admission or from the rank's ack of the previous "
        "plan if later; read callback: `time.time()` when the rank's read callback ran, before parsing; parsed: "
        "after `json.loads` of the line (with `--stream-client asyncio`, after asyncio streams' readline and "
        "readexactly). The 1,024 simulated ranks share one Python process, so the callback and parsed times "
        "include each rank's wait for the ranks the event loop served before it; the kernel time does not. "
        "Target: p99 <= 50 ms, judged on the arrival at the rank's socket.",
    ]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main_md(json_path: Path) -> int:
    """Rewrite the Markdown of an earlier run from its JSON."""
    write_md(json.loads(json_path.read_text()), json_path.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--md-only":
        sys.exit(main_md(Path(sys.argv[2])))
    sys.exit(main())
