"""Vision-tower cost per mini-batch on the real tiny VLM: per-row encoding vs DedupEncoder (keep_graph, recompute).

Workload per mini-batch: ``--groups`` prompts (GRPO groups) of ``G`` rows each; every prompt carries
``I`` images that its ``G`` rows share; micro-batches of ``--micro-batch`` rows, whole groups
cut in row order (so a group's rows may span micro-batches). The encoder is the policy's own
vision tower (:class:`knittrans.rollout.vlm.VisionTower`: vision transformer + connector of
``build_tiny_vlm``); images are preprocessed once beforehand (the same for every variant). The
vision tower is the tiny VLM's architecture at a size where its compute, not Python call
overhead, dominates (defaults: width 128, 4 layers, 224 px images = 256 patches, 64 tokens). The
backbone is replaced by a fixed random projection of the features (a stand-in whose cost is
negligible), so the measured time is the vision tower's forward + backward and the bookkeeping
around it:

* ``per_row``: every micro-batch encodes each of its rows' images and backpropagates through them.
* ``keep_graph``: :class:`~knittrans.trainer.dedup.DedupEncoder` encodes each unique image once
  (lazily, at first use), keeps the graph, one encoder backward in ``finish()``.
* ``recompute``: encodes under ``no_grad``, re-runs each chunk under grad in ``finish()`` and
  backpropagates chunk by chunk.

Time is the median over ``--repeats`` runs (after one warm-up) of the whole mini-batch; the three
modes run back to back within each repeat and the ratio to ``per_row`` is the median of the
per-repeat ratios, so load that drifts on a shared machine affects numerator and denominator alike. Memory is
the peak of the bytes the autograd graph holds for backward (saved tensors, counted with
``torch.autograd.graph.saved_tensors_hooks``) plus the feature leaves: deterministic on CPU,
where allocator statistics are not available. The target is
``time saved >= 0.8 * (1 - 1/G)`` of the per-row time.

    python benchmarks/trainer/vlm_dedup.py [--repeats 5] [--groups 4] [--out benchmarks/trainer/results]

Writes ``vlm_dedup.json``, ``vlm_dedup.md`` and ``vlm_dedup.png`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from knittrans.rollout.vlm import TinyVLMSpec, VisionTower, build_tiny_vlm, load_image_processor, pixel_values
from knittrans.trainer.dedup import DedupEncoder

MODES = ("per_row", "keep_graph", "recompute")


class _Held:
    """Bytes of one saved tensor, counted while the autograd graph keeps it."""

    def __init__(self, meter: _Meter, tensor: torch.Tensor) -> None:
        self.meter = meter
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.add(self.nbytes)

    def __del__(self) -> None:
        self.meter.add(-self.nbytes)


class _Meter:
    """Live and peak bytes held by autograd graphs (and anything else ``add`` is told about)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    @contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(self, t), lambda h: h.tensor):
            yield


def _workload(groups: int, group_size: int, images: int, pixels: torch.Tensor) -> list[list[str]]:
    """Hashes each row uses, row by row (group-major)."""
    rows = []
    for g in range(groups):
        hashes = [f"g{g}i{i}" for i in range(images)]
        rows += [hashes] * group_size
    assert len({h for r in rows for h in r}) <= pixels.shape[0]
    return rows


def _run(
    mode: str, tower: VisionTower, rows: list[list[str]], media: dict[str, torch.Tensor], micro: int, proj: torch.Tensor
) -> tuple[float, int, int]:
    """One mini-batch; returns (seconds, peak bytes, images run through the tower's forward)."""
    for p in tower.parameters():
        p.grad = None
    meter = _Meter()
    forwards = 0

    def count(_m: Any, args: tuple[Any, ...], _out: Any) -> None:
        nonlocal forwards
        forwards += int(args[0].shape[0])

    hook = tower.register_forward_hook(count)
    t0 = time.perf_counter()
    with meter.counting():
        dedup = DedupEncoder(tower, mode=mode) if mode != "per_row" else None  # type: ignore[arg-type]
        if dedup is not None:
            dedup.begin_mini_batch()
        for start in range(0, len(rows), micro):
            flat = [h for r in rows[start : start + micro] for h in r]
            if dedup is not None:
                fresh = {h: media[h] for h in flat if h not in dedup}
                before = sum(c.leaf.numel() * c.leaf.element_size() for c in dedup._chunks)
                feats = dedup.features(flat, media=fresh or None)
                after = sum(c.leaf.numel() * c.leaf.element_size() for c in dedup._chunks)
                meter.add(after - before)  # the leaves live until finish()
            else:
                feats = tower(torch.stack([media[h] for h in flat]))
            loss = (feats @ proj).tanh().sum()
            loss.backward()  # type: ignore[no-untyped-call]
        if dedup is not None:
            dedup.finish()
    seconds = time.perf_counter() - t0
    hook.remove()
    return seconds, meter.peak, forwards


def add_tower_args(ap: argparse.ArgumentParser) -> None:
    """The tiny VLM's vision-tower options and ``--out`` (shared with ``dedup_verify.py``)."""
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--vision-hidden", type=int, default=128, help="vision transformer width")
    ap.add_argument("--vision-layers", type=int, default=4, help="vision transformer layers")
    ap.add_argument("--image-size", type=int, default=224, help="image side (a multiple of 28; 224: 64 tokens)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))


def load_tower(args: argparse.Namespace) -> tuple[VisionTower, Any, TinyVLMSpec]:
    """The tiny VLM of :func:`add_tower_args`' options: its vision tower (train mode), image processor, spec."""
    torch.set_num_threads(args.threads)
    from transformers import Idefics3ForConditionalGeneration

    spec = TinyVLMSpec(
        vision_hidden=args.vision_hidden,
        vision_layers=args.vision_layers,
        vision_heads=max(1, args.vision_hidden // 64),
        image_size=args.image_size,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_vlm(Path(tmp) / "vlm", spec, seed=0)
        model = Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        processor = load_image_processor(model_dir)
    return VisionTower(model).train(), processor, spec


def main(argv: list[str] | None = None) -> int:
    """Run every (G, I, mode) cell and write JSON, markdown and PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--groups", type=int, default=4, help="prompts (groups) per mini-batch")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--group-sizes", default="4,8,16")
    ap.add_argument("--images", default="1,2", help="images per prompt")
    add_tower_args(ap)
    args = ap.parse_args(argv)
    tower, processor, spec = load_tower(args)
    group_sizes = [int(x) for x in args.group_sizes.split(",")]
    image_counts = [int(x) for x in args.images.split(",")]
    rng = np.random.default_rng(0)
    most = args.groups * max(image_counts)
    raw = [
        rng.integers(0, 256, (3, int(rng.integers(96, 161)), int(rng.integers(96, 161))), dtype=np.uint8)
        for _ in range(most)
    ]
    pixels = pixel_values(processor, raw)
    media = {
        f"g{g}i{i}": pixels[g * max(image_counts) + i] for g in range(args.groups) for i in range(max(image_counts))
    }
    proj = torch.from_numpy(rng.standard_normal(spec.hidden).astype(np.float32))
    cells: list[dict[str, Any]] = []
    total = len(group_sizes) * len(image_counts) * len(MODES)
    done = 0
    for g in group_sizes:
        for images in image_counts:
            rows = _workload(args.groups, g, images, pixels)
            for mode in MODES:  # warm-up
                _run(mode, tower, rows, media, args.micro_batch, proj)
            # modes interleaved within each repeat, so load drift on a shared machine hits all alike
            runs: dict[str, list[tuple[float, int, int]]] = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for mode in MODES:
                    runs[mode].append(_run(mode, tower, rows, media, args.micro_batch, proj))
            for mode in MODES:
                ratios = [r[0] / b[0] for r, b in zip(runs[mode], runs["per_row"], strict=True)]
                cells.append(
                    {
                        "group_size": g,
                        "images_per_prompt": images,
                        "mode": mode,
                        "median_s": statistics.median(r[0] for r in runs[mode]),
                        "runs_s": [r[0] for r in runs[mode]],
                        "time_ratio_vs_per_row": statistics.median(ratios),
                        "peak_graph_mib": runs[mode][-1][1] / 2**20,
                        "encoded_images": runs[mode][-1][2],
                        "image_uses": len(rows) * images,
                    }
                )
                done += 1
                print(
                    f"[{done}/{total}] G={g} I={images} {mode}: {cells[-1]['median_s'] * 1e3:.1f} ms "
                    f"(x{cells[-1]['time_ratio_vs_per_row']:.3f} of per_row)",
                    file=sys.stderr,
                    flush=True,
                )
    for c in cells:
        base = next(
            b
            for b in cells
            if b["mode"] == "per_row"
            and b["group_size"] == c["group_size"]
            and b["images_per_prompt"] == c["images_per_prompt"]
        )
        c["time_saved"] = 1 - c["time_ratio_vs_per_row"]
        c["target_saved"] = 0.8 * (1 - 1 / c["group_size"]) if c["mode"] != "per_row" else None
        c["meets_target"] = None if c["target_saved"] is None else c["time_saved"] >= c["target_saved"]
        c["memory_ratio_vs_per_row"] = c["peak_graph_mib"] / base["peak_graph_mib"]
    result = {
        "config": {**vars(args), "out": str(args.out), "spec": spec.__dict__, "torch": torch.__version__},
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vlm_dedup.json").write_text(json.dumps(result, indent=2))
    table = _markdown(cells, args)
    (args.out / "vlm_dedup.md").write_text(table)
    _plot(cells, args.out / "vlm_dedup.png")
    print(table)
    return 0 if all(c["meets_target"] is not False for c in cells) else 1


def _markdown(cells: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"Vision tower per mini-batch ({args.groups} prompts x G rows, micro-batches of {args.micro_batch}, "
        f"median of {args.repeats}, {args.threads} thread(s))\n\n"
        "| G | images/prompt | mode | encoded/uses | median ms | x per_row (median of ratios) | saved | target | "
        "peak graph MiB | x per_row |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {c['group_size']} | {c['images_per_prompt']} | {c['mode']} | {c['encoded_images']}/{c['image_uses']} | "
        f"{c['median_s'] * 1e3:.1f} | {c['time_ratio_vs_per_row']:.3f} | {c['time_saved']:.1%} | "
        f"{'-' if c['target_saved'] is None else format(c['target_saved'], '.0%')} | "
        f"{c['peak_graph_mib']:.1f} | {c['memory_ratio_vs_per_row']:.3f} |"
        for c in cells
    ]
    return head + "\n".join(lines) + "\n"


def _plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for images, style in ((1, "-"), (2, "--")):
        for mode in ("keep_graph", "recompute"):
            pts = sorted((c["group_size"], c) for c in cells if c["mode"] == mode and c["images_per_prompt"] == images)
            gs = [g for g, _ in pts]
            axes[0].plot(gs, [c["time_saved"] for _, c in pts], style, marker="o", label=f"{mode}, {images} img")
            axes[1].plot(
                gs, [c["memory_ratio_vs_per_row"] for _, c in pts], style, marker="o", label=f"{mode}, {images} img"
            )
    gs = sorted({c["group_size"] for c in cells})
    axes[0].plot(gs, [0.8 * (1 - 1 / g) for g in gs], "k:", label="target 0.8(1-1/G)")
    axes[0].set_title("vision time saved vs per-row encoding")
    axes[1].set_title("peak autograd memory / per-row")
    for ax in axes:
        ax.set_xlabel("group size G")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
