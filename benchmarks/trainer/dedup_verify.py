"""Cost of DedupEncoder's content check (``verify_content``) on the tiny VLM's vision tower.

Workload per mini-batch (as ``vlm_dedup.py``): ``--groups`` prompts of ``G`` rows, each prompt with
``I`` images its rows share, micro-batches of ``--micro-batch`` rows; the encoder is the policy's
vision tower (:class:`knittrans.rollout.vlm.VisionTower`), the backbone a fixed projection. One
mini-batch in ``keep_graph`` mode runs with ``verify_content=False`` (baseline) and ``True``, in
two call patterns:

* ``fresh``: only hashes not encoded yet are handed in (what ``knittrans train`` does): one digest
  per unique image;
* ``every_micro_batch``: each micro-batch hands in every image it uses: one digest per image and
  micro-batch that uses it (with micro-batches of 4 rows, each group's images twice).

The two settings alternate within each repeat; the ratio is the median of per-repeat ratios, so
load drifting on a shared machine hits both alike. Also reported: the digest alone per image
(CRC-32 of the preprocessed pixels) next to the tower's forward per image.

    python benchmarks/trainer/dedup_verify.py [--repeats 9] [--out benchmarks/trainer/results]

Writes ``dedup_verify.json`` and ``dedup_verify.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from vlm_dedup import add_tower_args, load_tower

from knittrans.rollout.vlm import VisionTower, pixel_values
from knittrans.trainer.dedup import DedupEncoder, _content_digest

PATTERNS = ("fresh", "every_micro_batch")


def _run(
    tower: VisionTower,
    rows: list[list[str]],
    media: dict[str, torch.Tensor],
    *,
    micro: int,
    proj: torch.Tensor,
    verify: bool,
    pattern: str,
) -> float:
    """One mini-batch (keep_graph); returns its seconds."""
    for p in tower.parameters():
        p.grad = None
    t0 = time.perf_counter()
    dedup = DedupEncoder(tower, verify_content=verify)
    dedup.begin_mini_batch()
    for start in range(0, len(rows), micro):
        flat = [h for r in rows[start : start + micro] for h in r]
        if pattern == "fresh":
            handed = {h: media[h] for h in flat if h not in dedup}
        else:
            handed = {h: media[h] for h in flat}
        loss = (dedup.features(flat, media=handed or None) @ proj).tanh().sum()
        loss.backward()  # type: ignore[no-untyped-call]
    dedup.finish()
    return time.perf_counter() - t0


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    """Measure every (G, I, pattern) cell with the check off and on; write JSON and markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--groups", type=int, default=4, help="prompts (groups) per mini-batch")
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--group-sizes", default="8")
    ap.add_argument("--images", default="1,2", help="images per prompt")
    add_tower_args(ap)
    args = ap.parse_args(argv)
    tower, processor, spec = load_tower(args)
    rng = np.random.default_rng(0)
    most = args.groups * max(int(x) for x in args.images.split(","))
    raw = [rng.integers(0, 256, (3, 128, 128), dtype=np.uint8) for _ in range(most)]
    pixels = pixel_values(processor, raw)
    proj = torch.from_numpy(rng.standard_normal(spec.hidden).astype(np.float32))

    digest_s = []
    forward_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i in range(pixels.shape[0]):
            _content_digest(pixels[i])
        digest_s.append((time.perf_counter() - t0) / pixels.shape[0])
        with torch.no_grad():
            t0 = time.perf_counter()
            tower(pixels[:4])
            forward_s.append((time.perf_counter() - t0) / 4)
    per_image = {
        "pixel_bytes": int(pixels[0].numel() * pixels[0].element_size()),
        "digest_us_median": statistics.median(digest_s) * 1e6,
        "forward_ms_median": statistics.median(forward_s) * 1e3,
    }
    per_image["digest_vs_forward"] = per_image["digest_us_median"] / 1e3 / per_image["forward_ms_median"]

    cells: list[dict[str, Any]] = []
    for g in (int(x) for x in args.group_sizes.split(",")):
        for images in (int(x) for x in args.images.split(",")):
            rows = [[f"g{p}i{i}" for i in range(images)] for p in range(args.groups) for _ in range(g)]
            media = {f"g{p}i{i}": pixels[p * images + i] for p in range(args.groups) for i in range(images)}
            for pattern in PATTERNS:
                run = {"micro": args.micro_batch, "proj": proj, "pattern": pattern}
                _run(tower, rows, media, verify=False, **run)  # type: ignore[arg-type]  # warm-up
                off: list[float] = []
                on: list[float] = []
                for r in range(args.repeats):  # alternate which goes first
                    for verify in (False, True) if r % 2 == 0 else (True, False):
                        (on if verify else off).append(_run(tower, rows, media, verify=verify, **run))  # type: ignore[arg-type]
                ratios = [b / a for a, b in zip(off, on, strict=True)]
                cell = {
                    "group_size": g,
                    "images_per_prompt": images,
                    "pattern": pattern,
                    "digests": len({h for r in rows for h in r})
                    if pattern == "fresh"
                    else sum(
                        len(set(h for r in rows[s : s + args.micro_batch] for h in r))
                        for s in range(0, len(rows), args.micro_batch)
                    ),
                    "off_ms": {
                        "median": statistics.median(off) * 1e3,
                        "mean": statistics.fmean(off) * 1e3,
                        "p99": _p99(off) * 1e3,
                    },
                    "on_ms": {
                        "median": statistics.median(on) * 1e3,
                        "mean": statistics.fmean(on) * 1e3,
                        "p99": _p99(on) * 1e3,
                    },
                    "ratio_on_off_median": statistics.median(ratios),
                }
                cells.append(cell)
                print(
                    f"G={g} I={images} {pattern}: off {cell['off_ms']['median']:.1f} ms, "
                    f"on {cell['on_ms']['median']:.1f} ms (x{cell['ratio_on_off_median']:.3f})",
                    file=sys.stderr,
                    flush=True,
                )
    load = os.getloadavg()
    result = {
        "config": {**vars(args), "out": str(args.out), "spec": spec.__dict__, "torch": torch.__version__},
        "load_avg_at_end": load,
        "per_image": per_image,
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dedup_verify.json").write_text(json.dumps(result, indent=2))
    table = _markdown(cells, per_image, args, load)
    (args.out / "dedup_verify.md").write_text(table)
    print(table)
    return 0


def _markdown(cells: list[dict[str, Any]], per_image: dict[str, Any], args: argparse.Namespace, load: Any) -> str:
    head = (
        f"DedupEncoder verify_content on the VLM vision tower ({args.groups} prompts x G rows, micro-batches of "
        f"{args.micro_batch}, keep_graph, {args.repeats} alternated repeats, {args.threads} thread(s), load "
        f"{load[0]:.1f})\n\n"
        f"Per image: {per_image['pixel_bytes'] / 1024:.0f} KiB of pixels, "
        f"digest {per_image['digest_us_median']:.0f} us, "
        f"tower forward {per_image['forward_ms_median']:.2f} ms ({per_image['digest_vs_forward']:.2%})\n\n"
        "| G | images/prompt | pattern | digests | off median / mean / p99 ms | on median / mean / p99 ms | "
        "on / off (median of ratios) |\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for c in cells:
        off, on = c["off_ms"], c["on_ms"]
        lines.append(
            f"| {c['group_size']} | {c['images_per_prompt']} | {c['pattern']} | {c['digests']} | "
            f"{off['median']:.1f} / {off['mean']:.1f} / {off['p99']:.1f} | {on['median']:.1f} / {on['mean']:.1f} / "
            f"{on['p99']:.1f} | {c['ratio_on_off_median']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
