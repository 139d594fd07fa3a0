"""DedupEncoder: encoding each unique media once per mini-batch gives the duplicated run's gradients."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from knittrans.errors import Conflict, InvalidRequest, NotFound
from knittrans.trainer.dedup import DedupEncoder, DedupStateError, all_reduce_gradients

DIM = 8
VOCAB = 11


class TinyEncoder(nn.Module):
    """Conv patchifier + pooling to 4 tokens per image (any H, W), then a projection."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, DIM, kernel_size=2, stride=2)
        self.pool = nn.AdaptiveAvgPool2d((2, 2))
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.proj.weight.dtype) / 255.0
        x = self.pool(torch.tanh(self.conv(x))).flatten(2).transpose(1, 2)  # [n, 4, DIM]
        return self.proj(self.drop(x))


class TinyLM(nn.Module):
    """One causal attention block over [image tokens; text tokens]; returns the summed next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, image_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        prefix = image_tokens.shape[0]
        x = torch.cat([image_tokens.to(self.head.weight.dtype), self.embed(tokens)])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h[prefix:-1]), tokens[1:], reduction="sum")


@dataclass(frozen=True)
class Traj:
    hashes: tuple[str, ...]
    tokens: torch.Tensor


def make_images(shapes: Mapping[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {h: torch.randint(0, 256, (3, *hw), generator=gen, dtype=torch.uint8) for h, hw in shapes.items()}


def make_micro_batches(spec: Sequence[Sequence[tuple[str, ...]]]) -> list[list[Traj]]:
    gen = torch.Generator().manual_seed(11)
    return [
        [Traj(hashes, torch.randint(0, VOCAB, (3 + i % 3,), generator=gen)) for i, hashes in enumerate(mb)]
        for mb in spec
    ]


# A shared across micro-batches and twice inside mb0 (t0, t1, t2); B in mb0 and mb1; t4 and mb2 use no media.
SPEC = [[("A",), ("A",), ("B", "A")], [("B",), (), ("C",)], [()]]


def normaliser(micro_batches: list[list[Traj]]) -> float:
    return float(sum(t.tokens.numel() - 1 for mb in micro_batches for t in mb))


def models(dropout: float = 0.0) -> tuple[TinyEncoder, TinyLM]:
    torch.manual_seed(0)
    return TinyEncoder(dropout).double(), TinyLM().double()


def micro_batch_loss(lm: TinyLM, feats: torch.Tensor, mb: list[Traj]) -> torch.Tensor:
    loss = torch.zeros((), dtype=torch.float64)
    offset = 0
    for t in mb:
        k = len(t.hashes)
        loss = loss + lm(feats[offset : offset + k].reshape(-1, DIM), t.tokens)
        offset += k
    return loss


def run_duplicated(enc: TinyEncoder, lm: TinyLM, images: Mapping[str, torch.Tensor], mbs: list[list[Traj]]) -> None:
    """Baseline: every trajectory encodes its own copy of each image."""
    norm = normaliser(mbs)
    for mb in mbs:
        parts = [enc(images[h].clone()[None]) for t in mb for h in t.hashes]
        feats = torch.cat(parts) if parts else torch.empty((0, 4, DIM), dtype=torch.float64)
        (micro_batch_loss(lm, feats, mb) / norm).backward()


def run_dedup(
    dedup: DedupEncoder,
    lm: TinyLM,
    images: Mapping[str, torch.Tensor],
    mbs: list[list[Traj]],
    *,
    lazy: bool = False,
) -> None:
    norm = normaliser(mbs)
    used = {h for mb in mbs for t in mb for h in t.hashes}
    dedup.begin_mini_batch(None if lazy else {h: images[h] for h in sorted(used)})
    for mb in mbs:
        hashes = [h for t in mb for h in t.hashes]
        feats = dedup.features(hashes, media={h: images[h] for h in hashes} if lazy else None)
        (micro_batch_loss(lm, feats, mb) / norm).backward()


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        out[name] = p.grad.clone()
    return out


class RowCounter:
    """Forward hook counting encoder calls and media rows encoded."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.rows = 0
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.calls += 1
        self.rows += int(args[0].shape[0])


def check_against_baseline(
    shapes: Mapping[str, tuple[int, int]], spec: list[list[tuple[str, ...]]], mode: str, **kwargs: object
) -> tuple[RowCounter, object]:
    images = make_images(shapes)
    mbs = make_micro_batches(spec)
    enc, lm = models()
    enc_d, lm_d = copy.deepcopy(enc), copy.deepcopy(lm)
    run_duplicated(enc, lm, images, mbs)
    counter = RowCounter(enc_d)
    batch = kwargs.pop("encode_batch_size", None)
    dedup = DedupEncoder(enc_d, mode=mode, encode_batch_size=batch)  # type: ignore[arg-type]
    run_dedup(dedup, lm_d, images, mbs, **kwargs)  # type: ignore[arg-type]
    stats = dedup.finish()
    assert_close(grads(enc_d), grads(enc))
    assert_close(grads(lm_d), grads(lm))
    return counter, stats


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_grads_match_duplicated_baseline(mode: str) -> None:
    """Media shared within and across micro-batches, accumulation, global normaliser: exact grads, 3 rows."""
    counter, stats = check_against_baseline({"A": (6, 6), "B": (6, 6), "C": (6, 6)}, SPEC, mode)
    assert counter.rows == 3 * (2 if mode == "recompute" else 1)  # A, B, C once each (dup encodes 6)
    assert counter.calls == (1 if mode == "keep_graph" else 2)  # recompute re-runs once in finish()
    assert stats.uses == 6 and stats.unique_media == 3 and stats.backward_rows == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_different_shapes_are_bucketed(mode: str) -> None:
    """Media of different shapes are encoded per shape bucket; a micro-batch mixing buckets stays exact."""
    counter, stats = check_against_baseline({"A": (6, 6), "B": (8, 4), "C": (6, 6)}, SPEC, mode)
    assert stats.encoder_calls == 2 and stats.uses == 6  # type: ignore[attr-defined]
    assert counter.rows == 3 + (3 if mode == "recompute" else 0)


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_lazy_media_per_micro_batch(mode: str) -> None:
    """Media handed in per micro-batch are encoded the first time only; gradients stay exact."""
    counter, stats = check_against_baseline({"A": (6, 6), "B": (6, 6), "C": (6, 6)}, SPEC, mode, lazy=True)
    assert stats.unique_media == 3 and stats.encoder_calls == 2  # type: ignore[attr-defined]  # mb0: A,B; mb1: C
    assert counter.rows == 3 * (2 if mode == "recompute" else 1)


def test_encode_batch_size_one_calls_encoder_once_per_unique_media() -> None:
    """With encode_batch_size=1 the number of encoder calls equals the unique media of the mini-batch."""
    counter, _ = check_against_baseline(
        {"A": (6, 6), "B": (6, 6), "C": (6, 6)}, SPEC, "keep_graph", encode_batch_size=1
    )
    assert counter.calls == 3


def test_two_mini_batches_in_a_row() -> None:
    """The cache is per mini-batch: the second mini-batch re-encodes and its gradients are exact too."""
    images = make_images({"A": (6, 6), "B": (6, 6), "C": (6, 6)})
    mbs = make_micro_batches(SPEC)
    enc, lm = models()
    enc_d, lm_d = copy.deepcopy(enc), copy.deepcopy(lm)
    counter = RowCounter(enc_d)
    dedup = DedupEncoder(enc_d)
    for _ in range(2):
        run_duplicated(enc, lm, images, mbs)
        run_dedup(dedup, lm_d, images, mbs)
        dedup.finish()
        assert_close(grads(enc_d), grads(enc))
        assert_close(grads(lm_d), grads(lm))
        for m in (enc, lm, enc_d, lm_d):
            m.zero_grad(set_to_none=True)
    assert counter.rows == 6


def test_cache_and_graph_dropped_after_finish() -> None:
    """finish() frees the encoded features and their graph; features() afterwards raises."""
    images = make_images({"A": (6, 6)})
    enc, lm = models()
    outputs: list[weakref.ref[torch.Tensor]] = []
    enc.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    dedup = DedupEncoder(enc)
    dedup.begin_mini_batch(images)
    feats = dedup.features(["A", "A"])
    lm(feats.reshape(-1, DIM), torch.tensor([1, 2, 3])).backward()
    del feats
    assert dedup.active and dedup.cached_media == 1 and "A" in dedup and "B" not in dedup
    dedup.finish()
    gc.collect()
    assert not dedup.active and dedup.cached_media == 0 and "A" not in dedup
    assert outputs and all(ref() is None for ref in outputs)
    with pytest.raises(DedupStateError, match="begin_mini_batch"):
        dedup.features(["A"])


def test_usage_errors_are_clear() -> None:
    """features()/add_media()/feature_list() before begin, an unknown hash, a second begin and a bad encoder output
    raise named errors."""
    enc, _ = models()
    dedup = DedupEncoder(enc)
    with pytest.raises(DedupStateError, match=r"features\(\) called outside a mini-batch"):
        dedup.features(["A"])
    with pytest.raises(DedupStateError):
        dedup.finish()
    with pytest.raises(DedupStateError, match=r"add_media\(\) called outside"):
        dedup.add_media(make_images({"A": (6, 6)}))
    with pytest.raises(DedupStateError, match=r"feature_list\(\) called outside"):
        dedup.feature_list(["A"])
    dedup.begin_mini_batch(make_images({"A": (6, 6)}))
    with pytest.raises(NotFound, match="'Z'"):
        dedup.features(["A", "Z"])
    with pytest.raises(DedupStateError, match="again"):
        dedup.begin_mini_batch()
    with pytest.raises(InvalidRequest, match=r"torch\.Tensor"):
        dedup.add_media({"B": [1, 2, 3]})  # type: ignore[dict-item]
    dedup.drop()
    bad = DedupEncoder(nn.Flatten(0))
    bad.begin_mini_batch()
    with pytest.raises(InvalidRequest, match="encoder must return a tensor"):
        bad.add_media({"A": torch.zeros(3, 2, 2), "B": torch.ones(3, 2, 2)})
    with pytest.raises(ValueError, match="mode"):
        DedupEncoder(enc, mode="lazy")  # type: ignore[arg-type]


def test_finish_without_gradient_is_a_noop() -> None:
    """A mini-batch whose features got no gradient runs no encoder backward and leaves grads unset."""
    enc, _ = models()
    dedup = DedupEncoder(enc, mode="recompute")
    counter = RowCounter(enc)
    dedup.begin_mini_batch(make_images({"A": (6, 6)}))
    empty = dedup.features([])
    assert empty.shape == (0, 4, DIM)
    stats = dedup.finish()
    assert stats.backward_rows == 0 and stats.recompute_calls == 0 and counter.calls == 1
    assert all(p.grad is None for p in enc.parameters())
    dedup.begin_mini_batch()
    assert dedup.features([]).shape == (0,)
    dedup.finish()


def test_recompute_replays_dropout() -> None:
    """recompute mode replays the no-grad forward's dropout masks, so it matches keep_graph exactly."""
    images = make_images({"A": (6, 6), "B": (6, 6), "C": (6, 6)})
    mbs = make_micro_batches(SPEC)
    results = []
    for mode in ("keep_graph", "recompute"):
        enc, lm = models(dropout=0.5)
        torch.manual_seed(123)
        dedup = DedupEncoder(enc, mode=mode)  # type: ignore[arg-type]
        run_dedup(dedup, lm, images, mbs)
        dedup.finish()
        after = torch.rand(4)  # replaying must not disturb the caller's RNG stream
        results.append((grads(enc), grads(lm), after))
    (enc_k, lm_k, after_k), (enc_r, lm_r, after_r) = results
    assert_close(enc_r, enc_k)
    assert_close(lm_r, lm_k)
    assert_close(after_r, after_k)


def test_bf16_encoder_gets_fp32_leaf() -> None:
    """A bf16 encoder output is handed out as an fp32 leaf; its backward reaches the bf16 parameters."""
    enc = TinyEncoder().to(torch.bfloat16)
    dedup = DedupEncoder(enc)
    dedup.begin_mini_batch(make_images({"A": (6, 6)}))
    feats = dedup.features(["A", "A"])
    assert feats.dtype == torch.float32
    feats.sum().backward()
    dedup.finish()
    assert enc.proj.weight.grad is not None and enc.proj.weight.grad.dtype == torch.bfloat16
    # d(sum of both uses)/d(proj.bias) = 2 uses x 4 tokens per image
    assert_close(enc.proj.bias.grad, torch.full((DIM,), 8.0, dtype=torch.bfloat16))


def test_frozen_encoder_backbone_still_exact() -> None:
    """With a frozen encoder finish() skips the backward and the backbone gradient is unchanged."""
    images = make_images({"A": (6, 6), "B": (6, 6), "C": (6, 6)})
    mbs = make_micro_batches(SPEC)
    enc, lm = models()
    enc.requires_grad_(False)
    enc_d, lm_d = copy.deepcopy(enc), copy.deepcopy(lm)
    run_duplicated(enc, lm, images, mbs)
    dedup = DedupEncoder(enc_d)
    run_dedup(dedup, lm_d, images, mbs)
    assert dedup.finish().backward_rows == 0
    assert_close(grads(lm_d), grads(lm))


def _images(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"m{i}": torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8) for i in range(count)}


class _CountingEncoder(TinyEncoder):
    """TinyEncoder that counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(images)


def test_frozen_encoder_is_not_rerun_in_recompute_mode() -> None:
    """recompute + frozen encoder: finish() only drops the cache, it does not run the encoder again."""
    enc = _CountingEncoder().requires_grad_(False)
    dedup = DedupEncoder(enc, mode="recompute")
    dedup.begin_mini_batch(_images(3))
    dedup.features(["m0", "m1", "m2", "m0"]).sum().backward()
    assert enc.calls == 1
    stats = dedup.finish()
    assert enc.calls == 1 and stats.recompute_calls == 0 and stats.backward_rows == 0


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_no_grad_encodes_without_a_graph(mode: str) -> None:
    """Under torch.no_grad() nothing records or keeps an encoder graph; finish() has nothing to do."""
    enc = _CountingEncoder()
    dedup = DedupEncoder(enc, mode=mode)  # type: ignore[arg-type]
    with torch.no_grad():
        dedup.begin_mini_batch(_images(2))
        feats = dedup.features(["m0", "m1", "m0"])
    assert not feats.requires_grad
    assert all(c.encoded is None and c.inputs is None for c in dedup._chunks)
    stats = dedup.finish()
    assert stats.backward_rows == 0 and stats.recompute_calls == 0 and enc.calls == 1
    assert all(p.grad is None for p in enc.parameters())


class _Meter:
    """Live and peak bytes of the tensors autograd graphs save for backward."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        meter = self

        class Held:
            def __init__(self) -> None:
                self.t = t
                self.n = t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                meter.live -= self.n

        return Held()


def test_recompute_backward_runs_chunk_by_chunk() -> None:
    """recompute with 4 chunks: finish() never holds more than one chunk's graph (gradients still exact)."""
    torch.manual_seed(0)
    enc = TinyEncoder()
    ref = copy.deepcopy(enc)
    media = _images(4)
    one = _Meter()
    with torch.autograd.graph.saved_tensors_hooks(one.pack, lambda h: h.t):
        ref(media["m0"][None]).sum().backward()
    meter = _Meter()
    dedup = DedupEncoder(enc, mode="recompute", encode_batch_size=1)
    dedup.begin_mini_batch(media)
    dedup.features(list(media)).sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda h: h.t):
        stats = dedup.finish()
    assert stats.recompute_calls == 4
    assert 0 < meter.peak <= one.peak  # one chunk of one image at a time
    ref.zero_grad()
    ref(torch.stack(list(media.values()))).sum().backward()
    for p, q in zip(enc.parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, q.grad)


class _InPlaceEncoder(TinyEncoder):
    """Scales its input in place: recompute would re-run it on changed data."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        images.div_(2) if images.is_floating_point() else images.bitwise_right_shift_(1)
        return super().forward(x)


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_encoder_changing_its_input_in_place_is_refused(mode: str) -> None:
    """An encoder that modifies its input in place raises InvalidRequest instead of giving wrong gradients."""
    dedup = DedupEncoder(_InPlaceEncoder(), mode=mode)  # type: ignore[arg-type]
    dedup.begin_mini_batch()
    with pytest.raises(InvalidRequest, match="in place"):
        dedup.add_media(_images(2))
    dedup.drop()


@pytest.mark.parametrize("mode", ["keep_graph", "recompute"])
def test_same_hash_with_other_pixels_is_refused(mode: str) -> None:
    """A hash handed in again with an augmented copy of its image raises Conflict (no silently wrong grads)."""
    images = make_images({"A": (6, 6)})
    augmented = images["A"].flip(-1).contiguous()  # per-row augmentation under the same hash
    enc, lm = models()
    dedup = DedupEncoder(enc, mode=mode)  # type: ignore[arg-type]
    assert dedup.verify_content  # on by default while Python runs without -O (tests do)
    mbs = make_micro_batches([[("A",)], [("A",)]])
    dedup.begin_mini_batch()
    feats = dedup.features(["A"], media={"A": images["A"]})
    micro_batch_loss(lm, feats, mbs[0]).backward()
    dedup.features(["A"], media={"A": images["A"].clone()})  # the same pixels again: fine
    with pytest.raises(Conflict, match=r"'A' is given with other content.*function of the hash"):
        dedup.features(["A"], media={"A": augmented})
    dedup.drop()
    dedup.begin_mini_batch({"A": augmented})  # a new mini-batch starts from nothing
    dedup.drop()


def test_same_hash_with_other_shape_or_dtype_is_refused_without_content_check() -> None:
    """Shape and dtype are always checked; verify_content=False only skips the digest of the bytes."""
    images = make_images({"A": (6, 6)})
    enc, _ = models()
    dedup = DedupEncoder(enc, verify_content=False)
    dedup.begin_mini_batch(images)
    with pytest.raises(Conflict, match=r"torch\.uint8 tensor of shape \[3, 6, 6\].*torch\.float64 of shape"):
        dedup.add_media({"A": images["A"].double()})
    with pytest.raises(Conflict, match=r"shape \[3, 8, 4\]"):
        dedup.add_media({"A": make_images({"A": (8, 4)})["A"]})
    dedup.add_media({"A": 255 - images["A"]})  # same shape and dtype, other bytes: not digested
    assert dedup.cached_media == 1
    dedup.drop()


class _Scale(nn.Module):
    """Features of an input's own shape (``w * x``): media of different lengths have different feature shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * self.w


def test_media_of_different_feature_shapes_come_as_a_list() -> None:
    """features() of a micro-batch whose media have different feature shapes refuses, naming feature_list(), and
    counts no use; feature_list() then gives per-hash views whose summed gradient reaches the encoder once."""
    enc = _Scale()
    dedup = DedupEncoder(enc, device="cpu")
    dedup.begin_mini_batch({"a": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(InvalidRequest, match=r"different feature shapes \[\(2,\), \(3,\)\]; use feature_list"):
        dedup.features(["a", "b"])
    parts = dedup.feature_list(["a", "b", "a"])
    assert [tuple(p.shape) for p in parts] == [(2,), (3,), (2,)]
    sum(p.sum() for p in parts).backward()  # type: ignore[union-attr]
    stats = dedup.finish()
    assert stats.uses == 3 and stats.unique_media == 2 and stats.encoder_calls == 2
    assert enc.w.grad is not None and enc.w.grad.item() == 7.0  # a twice (2 + 2), b once (3)


def test_recompute_encoder_whose_output_needs_no_gradient() -> None:
    """recompute + an encoder whose trainable parameters are off its output's path: finish() re-runs it once and
    runs no backward (there is nothing to propagate)."""
    enc = _Scale()
    enc.w.requires_grad_(False)
    enc.spare = nn.Parameter(torch.tensor(1.0))  # trainable, unused by forward()
    dedup = DedupEncoder(enc, mode="recompute")
    dedup.begin_mini_batch({"a": torch.ones(2)})
    dedup.features(["a"]).sum().backward()
    stats = dedup.finish()
    assert stats.recompute_calls == 1 and stats.backward_rows == 0 and enc.spare.grad is None


def test_device_moves_the_stacked_inputs_before_the_encoder() -> None:
    """device= moves each stacked input batch there before the encoder runs (``meta`` stands for an accelerator)."""
    seen: list[torch.device] = []
    enc = _Scale().to("meta")
    enc.register_forward_pre_hook(lambda m, args: seen.append(args[0].device))
    dedup = DedupEncoder(enc, device="meta")
    dedup.begin_mini_batch({"a": torch.ones(2)})
    feats = dedup.features(["a", "a"])
    assert seen == [torch.device("meta")] and feats.device.type == "meta" and feats.shape == (2, 2)
    dedup.drop()


def test_bad_arguments_and_a_chunk_changed_after_encoding_are_refused() -> None:
    """encode_batch_size < 1, an empty hash, all_reduce_gradients without torch.distributed, and (recompute) an
    encoded chunk's input changed in place before finish() raise named errors instead of wrong gradients."""
    with pytest.raises(ValueError, match="encode_batch_size must be >= 1"):
        DedupEncoder(_Scale(), encode_batch_size=0)
    seen: list[torch.Tensor] = []
    enc = _Scale()
    enc.register_forward_pre_hook(lambda m, args: seen.append(args[0]))  # an encoder keeping its input
    dedup = DedupEncoder(enc, mode="recompute")
    dedup.begin_mini_batch()
    with pytest.raises(InvalidRequest, match="non-empty str"):
        dedup.add_media({"": torch.ones(2)})
    dedup.features(["a"], media={"a": torch.ones(2)}).sum().backward()
    seen[0].add_(1)
    with pytest.raises(InvalidRequest, match="modified in place after encoding"):
        dedup.finish()
    assert not dedup.active
    with pytest.raises(DedupStateError, match=r"needs an initialised torch\.distributed"):
        all_reduce_gradients(enc.parameters())
