"""Micro benchmark: duplicated vs deduplicated multimodal encoding on one mini-batch, 4 ranks in sequence.

Workload: 512 trajectories in groups of 8, each group sharing one 256 KiB image (uint8 4x256x256),
4 data-parallel ranks simulated one after another (whole groups per rank), micro-batches of 16.

* dup: sample-level media — every trajectory fetches (copies) its own image and encodes it.
* dedup: MediaCache fetches each unique hash once per rank and mini-batch; DedupEncoder encodes it
  once and runs one encoder backward with the summed gradient.

Both runs start from the same weights; the encoder and backbone gradients, summed over the ranks
(what an all-reduce would give), are compared with ``torch.testing.assert_close``.

    python benchmarks/trainer/dedup_only.py [--repeats 5] [--out benchmarks/trainer/results]

Prints a table and writes ``dedup_only.json`` and ``dedup_only.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from knittrans.trainer.dedup import DedupEncoder
from knittrans.trainer.media import MediaCache, MediaRecord, decode_media


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Shape of the benchmark mini-batch."""

    trajectories: int = 512
    """Trajectories per mini-batch (all ranks)."""
    group_size: int = 8
    """Trajectories per group; a group shares one image."""
    ranks: int = 4
    """Data-parallel ranks, simulated sequentially."""
    micro_batch: int = 16
    """Trajectories per micro-batch."""
    image_shape: tuple[int, int, int] = (4, 256, 256)
    """uint8 image shape (4x256x256 = 256 KiB)."""
    response_tokens: int = 24
    """Text tokens per trajectory."""

    def __post_init__(self) -> None:
        if self.trajectories % (self.group_size * self.ranks):
            raise ValueError("trajectories must split into whole groups per rank")
        if (self.trajectories // self.ranks) % self.micro_batch:
            raise ValueError("a rank's share must split into whole micro-batches")


DIM = 32
VOCAB = 64


class VisionEncoder(nn.Module):
    """Patchify 16x16, one transformer layer over the 256 patches, pool to 16 tokens."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.patch = nn.Conv2d(channels, DIM, kernel_size=16, stride=16)
        self.layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images.float() / 255.0)  # [n, DIM, 16, 16]
        x = F.adaptive_avg_pool2d(self.layer(x.flatten(2).transpose(1, 2)).transpose(1, 2).unflatten(2, (16, 16)), 4)
        return self.out(x.flatten(2).transpose(1, 2))  # [n, 16, DIM]


class TinyLM(nn.Module):
    """One causal attention block over [image tokens; text]; summed next-token loss of a micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([feats, self.embed(tokens)], dim=1)  # [b, P + T, DIM]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.mlp(h)
        logits = self.head(h[:, feats.shape[1] : -1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")


class MediaStore:
    """The unit's media (one record per unique hash); fetches copy bytes, like a transfer would."""

    def __init__(self, images: Sequence[np.ndarray]) -> None:
        self.records: dict[str, MediaRecord] = {}
        for img in images:
            payload = img.tobytes()
            key = hashlib.sha256(f"image|uint8|{list(img.shape)}\n".encode() + payload).hexdigest()
            self.records[key] = MediaRecord("image", list(img.shape), "uint8", payload)
        self.bytes_moved = 0

    def fetch(self, hashes: Sequence[str]) -> dict[str, MediaRecord]:
        out = {}
        for h in hashes:
            rec = self.records[h]
            out[h] = rec._replace(data=bytearray(rec.data))
            self.bytes_moved += len(rec.data)
        return out


def build(work: Workload, seed: int = 0) -> tuple[MediaStore, list[str], torch.Tensor]:
    rng = np.random.default_rng(seed)
    groups = work.trajectories // work.group_size
    images = [rng.integers(0, 256, work.image_shape, dtype=np.uint8) for _ in range(groups)]
    store = MediaStore(images)
    keys = list(store.records)
    traj_media = [keys[i // work.group_size] for i in range(work.trajectories)]
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (work.trajectories, work.response_tokens)))
    return store, traj_media, tokens


def rank_slices(work: Workload) -> list[list[slice]]:
    share = work.trajectories // work.ranks
    return [
        [slice(r * share + s, r * share + s + work.micro_batch) for s in range(0, share, work.micro_batch)]
        for r in range(work.ranks)
    ]


def run_dup(
    work: Workload, enc: nn.Module, lm: nn.Module, store: MediaStore, media: list[str], tokens: torch.Tensor
) -> None:
    norm = float(tokens[:, 1:].numel())
    for micro_batches in rank_slices(work):
        for sl in micro_batches:
            hashes = media[sl]
            images = [decode_media(h, store.fetch([h])[h]) for h in hashes]  # one copy per trajectory
            feats = enc(torch.stack(images))
            (lm(feats, tokens[sl]) / norm).backward()


def run_dedup(
    work: Workload, enc: nn.Module, lm: nn.Module, store: MediaStore, media: list[str], tokens: torch.Tensor
) -> None:
    norm = float(tokens[:, 1:].numel())
    for micro_batches in rank_slices(work):
        cache = MediaCache(store.fetch)
        dedup = DedupEncoder(enc, mode="keep_graph")
        dedup.begin_mini_batch()
        for sl in micro_batches:
            hashes = media[sl]
            feats = dedup.features(hashes, media=cache.get(hashes))
            (lm(feats, tokens[sl]) / norm).backward()
        dedup.finish()
        cache.clear()


def _grads(*modules: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters() if p.grad is not None
    }


def run_benchmark(work: Workload, repeats: int = 5) -> dict[str, Any]:
    """Time dup and dedup ``repeats`` times each (alternating), count encoder rows and bytes, compare grads."""
    store, media, tokens = build(work)
    torch.manual_seed(0)
    base_enc, base_lm = VisionEncoder(work.image_shape[0]), TinyLM()
    results: dict[str, dict[str, Any]] = {}
    for name in ("dup", "dedup"):
        results[name] = {"seconds": [], "encoder_rows": 0, "media_bytes": 0}
    for rep in range(repeats):
        for name, fn in (("dup", run_dup), ("dedup", run_dedup)):
            enc, lm = copy.deepcopy(base_enc), copy.deepcopy(base_lm)
            rows = [0]
            enc.register_forward_hook(lambda m, a, o, rows=rows: rows.__setitem__(0, rows[0] + a[0].shape[0]))
            store.bytes_moved = 0
            start = time.perf_counter()
            fn(work, enc, lm, store, media, tokens)
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["encoder_rows"] = rows[0]
            results[name]["media_bytes"] = store.bytes_moved
            results[name]["grads"] = _grads(enc, lm)
            print(f"  repeat {rep + 1}/{repeats} {name}: {results[name]['seconds'][-1]:.3f} s", file=sys.stderr)
    diff = max((results["dup"]["grads"][k] - v).abs().max().item() for k, v in results["dedup"]["grads"].items())
    torch.testing.assert_close(results["dedup"]["grads"], results["dup"]["grads"], rtol=1e-4, atol=1e-6)
    out: dict[str, Any] = {"workload": asdict(work), "repeats": repeats, "max_grad_abs_diff": diff, "grads_equal": True}
    for name in ("dup", "dedup"):
        r = results[name]
        out[name] = {
            "median_s": statistics.median(r["seconds"]),
            "seconds": r["seconds"],
            "encoder_rows": r["encoder_rows"],
            "media_bytes": r["media_bytes"],
        }
    out["ratio"] = {
        "time": out["dup"]["median_s"] / out["dedup"]["median_s"],
        "encoder_rows": out["dup"]["encoder_rows"] / out["dedup"]["encoder_rows"],
        "media_bytes": out["dup"]["media_bytes"] / out["dedup"]["media_bytes"],
    }
    return out


def _plot(result: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, key, label in zip(
        axes,
        ("median_s", "encoder_rows", "media_bytes"),
        ("median time (s)", "images encoded", "media bytes moved"),
        strict=True,
    ):
        ax.bar(["dup", "dedup"], [result["dup"][key], result["dedup"][key]], color=["#b55", "#5a5"])
        ax.set_title(label)
    fig.suptitle("duplicated vs deduplicated encoding (512 traj, groups of 8, 4 ranks, micro-batch 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_benchmark(Workload(), repeats=args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dedup_only.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "dedup_only.png")
    print(f"{'':8}{'median s':>10}{'images encoded':>16}{'media MiB':>12}")
    for name in ("dup", "dedup"):
        r = result[name]
        print(f"{name:8}{r['median_s']:>10.3f}{r['encoder_rows']:>16}{r['media_bytes'] / 2**20:>12.1f}")
    ratio = result["ratio"]
    print(f"{'ratio':8}{ratio['time']:>10.2f}{ratio['encoder_rows']:>16.1f}{ratio['media_bytes']:>12.1f}")
    print(f"gradients equal (assert_close rtol=1e-4): max abs diff {result['max_grad_abs_diff']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
