"""How long the trainer's own gloo group takes to hand a manifest from rank 0 to every rank.

Run: ``python benchmarks/control_plane/gloo_broadcast.py [--procs 2 4 8] [--manifest-ranks 1024]
[--rows-per-rank 1 8] [--repeats 30] [--out PATH]``.

With the client's default under ``torch.distributed`` rank 0 reads each manifest and broadcasts it
over a gloo group of the client's own (:class:`~knittrans.trainer.feed.TorchCollective`), and every
rank cuts its share. ``scale.py`` measures the control plane and rank 0; this measures the rest with
real processes on this host: ``--procs`` ranks (one process each) broadcast a manifest laid out for
``--manifest-ranks`` ranks (the size a 1,024-rank trainer gets) ``--repeats`` times; each rank stamps
the wall clock when it holds the manifest and when it has cut its share. Before each broadcast rank 0
decodes the manifest from its JSON bytes, as the leader does with the control plane's answer. Reported
per configuration: the time from rank 0's call to the last rank holding the manifest and to the last
rank holding its share, rank 0's decode (p50, mean, p99, max over repeats), and the manifest's pickled
size. Every rank has torch imported, as a trainer has (a full collection of that heap takes about
100 ms). Processes on one host share its two cores here, so this is an upper bound for ranks with cores
of their own; across hosts the fabric decides.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import write_results

from knittrans.manifest import Manifest, ManifestGroup, ManifestNode
from knittrans.procs import free_port

HERE = Path(__file__).resolve().parent


def manifest_for(ranks: int, rows_per_rank: int, nodes: int = 128) -> Manifest:
    """A manifest shaped like ``scale.py``'s: groups of 8 rows, one unit per group, units over ``nodes`` nodes."""
    groups = ranks * rows_per_rank // 8
    return Manifest(
        job="bench",
        global_index=7,
        attempt=0,
        step=3,
        mini_batch_index=1,
        policy_version=7,
        admitted_at=time.time(),
        columns=None,
        nodes=tuple(ManifestNode(f"n{i}", f"grpc://10.0.{i // 250}.{i % 250}:8815", "g" * 180) for i in range(nodes)),
        units=tuple((f"u{g}", g % nodes) for g in range(groups)),
        groups=tuple(ManifestGroup(f"g{g}", g, ()) for g in range(groups)),
        media=(),
        ranks=tuple(
            (tuple(((r * rows_per_rank + j) // 8, (r * rows_per_rank + j) % 8, 300) for j in range(rows_per_rank)),)
            for r in range(ranks)
        ),
    )


def _rank(rank: int, world: int, port: int, ranks: int, rows: int, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    from knittrans.trainer.feed import TorchCollective

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(60)
    )
    coll = TorchCollective()
    manifest = manifest_for(ranks, rows) if rank == 0 else None
    raw = manifest_for(ranks, rows).encode()
    stamps, decodes = [], []
    for _ in range(repeats + 3):
        if rank == 0:
            t = time.perf_counter()
            manifest = Manifest.decode(raw)
            decodes.append(time.perf_counter() - t)
        dist.barrier()
        started = coll.broadcast(time.time() if rank == 0 else None)  # rank 0's clock, same host
        time.sleep(0.02)
        t0 = time.time() if rank == 0 else 0.0
        got = coll.broadcast(manifest)
        held = time.time()
        got.share(rank * (ranks // world))
        cut = time.time()
        del started
        stamps.append((coll.broadcast(t0), held, cut))
    out.put((rank, stamps[3:], decodes[3:]))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, ranks: int, rows: int, repeats: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, ranks, rows, repeats, out)) for r in range(world)]
    for p in procs:
        p.start()
    got, decodes = {}, []
    for _ in procs:
        rank, stamps, decoded = out.get(timeout=300)
        got[rank] = stamps
        decodes += decoded
    for p in procs:
        p.join(60)
    held, cut = [], []
    for i in range(repeats):
        t0 = got[0][i][0]
        held.append(max(got[r][i][1] for r in got) - t0)
        cut.append(max(got[r][i][2] for r in got) - t0)
    size = len(pickle.dumps(manifest_for(ranks, rows)))
    return {
        "procs": world,
        "manifest_ranks": ranks,
        "rows_per_rank": rows,
        "pickled_bytes": size,
        "all_hold_manifest_ms": _summary(held),
        "all_hold_share_ms": _summary(cut),
        "leader_decode_ms": _summary(decodes),
    }


def _summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {
        "p50": ms[len(ms) // 2],
        "mean": statistics.fmean(ms),
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max": ms[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--manifest-ranks", type=int, default=1024)
    parser.add_argument("--rows-per-rank", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gloo_broadcast.json")
    args = parser.parse_args()
    results = []
    for rows in args.rows_per_rank:
        for world in args.procs:
            print(f"[gloo] {world} processes, manifest of {args.manifest_ranks} ranks x {rows} rows", file=sys.stderr)
            results.append(run(world, args.manifest_ranks, rows, args.repeats))
    lines = [
        "| processes | manifest | pickled | every rank holds the manifest p50 / p99 (ms) "
        "| ... and its share p50 / p99 | rank 0 decodes the JSON p50 / p99 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        h, c, d = r["all_hold_manifest_ms"], r["all_hold_share_ms"], r["leader_decode_ms"]
        lines.append(
            f"| {r['procs']} | {r['manifest_ranks']} ranks x {r['rows_per_rank']} rows "
            f"| {r['pickled_bytes'] / 1024:.0f} KiB | {h['p50']:.2f} / {h['p99']:.2f} "
            f"| {c['p50']:.2f} / {c['p99']:.2f} | {d['p50']:.2f} / {d['p99']:.2f} |"
        )
    write_results(args.out, {"results": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
