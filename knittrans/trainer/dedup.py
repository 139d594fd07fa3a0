"""Gradient-preserving encoding dedup: encode each unique media once per mini-batch (docs/explanation/dedup.md)."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from knittrans.errors import Conflict, DedupStateError, InvalidRequest, NotFound

__all__ = [
    "DedupEncoder",
    "DedupStateError",
    "DedupStats",
    "all_reduce_gradients",
]

logger = logging.getLogger(__name__)

Mode = Literal["keep_graph", "recompute"]


@dataclass(frozen=True, kw_only=True)
class DedupStats:
    """What one mini-batch of a :class:`DedupEncoder` did."""

    uses: int
    """Media rows handed to micro-batches (what a duplicated run would have encoded)."""
    unique_media: int
    """Distinct media encoded."""
    encoder_calls: int
    """Encoder forward calls during the mini-batch (not counting ``recompute`` re-runs)."""
    recompute_calls: int
    """Encoder forward calls re-run under grad in ``finish()`` (``recompute`` mode only)."""
    backward_rows: int
    """Media rows whose summed gradient went through the encoder backward in ``finish()``."""


@dataclass(frozen=True)
class _Fingerprint:
    """What was encoded for one hash: the input's shape and dtype, and its content digest when verifying."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: int | None


@dataclass
class _Chunk:
    """One encoder call: its inputs (recompute), output (keep_graph) and the detached leaf."""

    inputs: torch.Tensor | None
    encoded: torch.Tensor | None
    leaf: torch.Tensor
    rng_state: tuple[torch.Tensor, torch.Tensor | None] | None
    """``recompute``: the CPU RNG state before the forward, and that of the inputs' CUDA device (None off CUDA)."""
    input_version: int = 0


class DedupEncoder:
    """Wraps an encoder so each unique media is encoded once per mini-batch, with exact gradients.

    Args:
        encoder: module mapping a stacked batch ``[n, *media_shape]`` to ``[n, *feature_shape]``.
            It receives the media tensors as decoded (e.g. uint8); convert inside the module.
        mode: ``keep_graph`` keeps the encoder graph from the forward until ``finish()``;
            ``recompute`` encodes under ``no_grad`` and re-runs the encoder under grad in
            ``finish()`` (less memory, one more encoder forward per chunk with a gradient).
        encode_batch_size: most media per encoder call; ``None`` encodes each (shape, dtype)
            group of a ``begin_mini_batch``/``add_media`` call in one call.
        device: where stacked inputs go before the encoder (``None``: leave them where they are).
        verify_content: keep a CRC-32 digest of each media tensor's bytes and refuse a hash handed in
            again with other content (:class:`~knittrans.errors.Conflict`). ``None`` (default): on
            unless Python runs with ``-O`` (``__debug__``), the switch that also turns ``assert`` off.
            Shape and dtype are checked either way. A tensor off the CPU is copied to the host to be
            digested (a device sync), so turn it off for device-resident inputs in production.
    """

    def __init__(
        self,
        encoder: nn.Module,
        *,
        mode: Mode = "keep_graph",
        encode_batch_size: int | None = None,
        device: torch.device | str | None = None,
        verify_content: bool | None = None,
    ) -> None:
        if mode not in ("keep_graph", "recompute"):
            raise ValueError(f"mode must be 'keep_graph' or 'recompute', got {mode!r}")
        if encode_batch_size is not None and encode_batch_size < 1:
            raise ValueError(f"encode_batch_size must be >= 1 or None, got {encode_batch_size}")
        self.encoder = encoder
        self.mode: Mode = mode
        self.encode_batch_size = encode_batch_size
        self.device = torch.device(device) if device is not None else None
        self.verify_content: bool = __debug__ if verify_content is None else verify_content
        self._active = False
        self.drop()

    # ------------------------------------------------------------------ lifecycle
    @property
    def active(self) -> bool:
        """True between ``begin_mini_batch()`` and ``finish()``/``drop()``."""
        return self._active

    @property
    def cached_media(self) -> int:
        """Unique media encoded and held for the current mini-batch (0 once dropped)."""
        return len(self._index)

    def __contains__(self, media_hash: object) -> bool:
        """True when ``media_hash`` was encoded in the current mini-batch."""
        return media_hash in self._index

    def begin_mini_batch(self, media: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start a mini-batch, encoding ``media`` (hash -> decoded tensor) now if given.

        Raises:
            DedupStateError: the previous mini-batch was not finished or dropped.
        """
        if self._active:
            raise DedupStateError("begin_mini_batch() called again before finish() or drop()")
        self._active = True
        if media:
            self.add_media(media)

    def add_media(self, media: Mapping[str, torch.Tensor]) -> None:
        """Encode the media of ``media`` not encoded yet in this mini-batch (lazy, per micro-batch).

        A hash encoded before in this mini-batch is not encoded again; its tensor is checked
        against the one encoded (shape and dtype, and content with ``verify_content``).

        Raises:
            DedupStateError: no mini-batch is active.
            InvalidRequest: a hash that is not a non-empty str, or a value that is not a tensor.
            Conflict: a hash encoded before with a tensor of another shape, dtype or content.
        """
        self._require_active("add_media")
        new: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[str, torch.Tensor, _Fingerprint]]] = {}
        for media_hash, tensor in media.items():
            if not isinstance(media_hash, str) or not media_hash:
                raise InvalidRequest(f"media hash must be a non-empty str, got {media_hash!r}")
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequest(f"media {media_hash}: expected a torch.Tensor, got {type(tensor).__name__}")
            fingerprint = _Fingerprint(
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                digest=_content_digest(tensor) if self.verify_content else None,
            )
            encoded = self._index.get(media_hash)
            if encoded is not None:
                _check_same_input(media_hash, encoded[2], fingerprint)
                continue
            new.setdefault((fingerprint.shape, fingerprint.dtype), []).append((media_hash, tensor, fingerprint))
        for group in new.values():
            step = self.encode_batch_size or len(group)
            for start in range(0, len(group), step):
                self._encode(group[start : start + step])

    def features(self, hashes: Sequence[str], media: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Stacked features ``[len(hashes), *feature_shape]`` for one micro-batch, in ``hashes`` order.

        Rows come from the detached leaf, so the micro-batch's backward accumulates into
        ``leaf.grad``. ``media`` (optional) is passed to :meth:`add_media` first. An empty
        ``hashes`` gives a ``[0, *feature_shape]`` tensor (``[0]`` before anything was encoded).

        Raises:
            DedupStateError: no mini-batch is active.
            NotFound: a hash was never given to ``begin_mini_batch``/``add_media``.
            InvalidRequest: the requested media have different feature shapes.
        """
        self._require_active("features")
        if media:
            self.add_media(media)
        if len(hashes) == 0:
            shapes = {tuple(c.leaf.shape[1:]) for c in self._chunks}
            shape = shapes.pop() if len(shapes) == 1 else ()
            if not self._chunks:
                return torch.empty((0,), dtype=torch.float32, device=self.device)
            first = self._chunks[0].leaf
            return torch.empty((0, *shape), dtype=first.dtype, device=first.device)
        places = [self._place(h) for h in hashes]
        if len({c for c, _ in places}) == 1:
            leaf = self._chunks[places[0][0]].leaf
            rows = torch.tensor([r for _, r in places], dtype=torch.long, device=leaf.device)
            self._uses += len(hashes)
            return leaf.index_select(0, rows)
        parts = [self._chunks[c].leaf[r] for c, r in places]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:  # nothing handed out: no use counted
            raise InvalidRequest(
                f"media of one micro-batch have different feature shapes {sorted(shapes)}; use feature_list()"
            )
        self._uses += len(hashes)
        return torch.stack(parts)

    def feature_list(self, hashes: Sequence[str]) -> list[torch.Tensor]:
        """Per-hash feature views (for media whose feature shapes differ)."""
        self._require_active("feature_list")
        places = [self._place(h) for h in hashes]
        self._uses += len(hashes)
        return [self._chunks[c].leaf[r] for c, r in places]

    def finish(self) -> DedupStats:
        """Run one encoder backward with the gradient summed over all micro-batches, then drop the cache.

        Call after the last micro-batch's backward and before the optimizer step. Chunks whose
        leaf received no gradient are skipped; with no gradient at all this is a no-op apart
        from dropping the cache.

        Raises:
            DedupStateError: no mini-batch is active.
        """
        self._require_active("finish")
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        backward_rows = 0
        recompute_calls = 0
        trainable = any(p.requires_grad for p in self.encoder.parameters())
        try:
            for chunk in self._chunks:
                grad = chunk.leaf.grad
                if grad is None:
                    continue
                if chunk.encoded is None:  # recompute mode
                    if not trainable:  # frozen encoder: nothing to propagate, do not re-run it
                        continue
                    assert chunk.inputs is not None and chunk.rng_state is not None
                    if chunk.inputs._version != chunk.input_version:
                        raise InvalidRequest(
                            "the input of an encoded chunk was modified in place after encoding; "
                            "recompute mode would re-run the encoder on changed data"
                        )
                    with torch.enable_grad(), _rng_restored(chunk.rng_state, chunk.inputs.device):
                        encoded = self.encoder(chunk.inputs)
                    recompute_calls += 1
                    if encoded.requires_grad:  # backward now: one chunk's graph alive at a time
                        torch.autograd.backward([encoded], grad_tensors=[grad.to(encoded.dtype)])
                        backward_rows += int(grad.shape[0])
                    continue
                encoded = chunk.encoded
                if not encoded.requires_grad:  # frozen encoder: nothing to propagate
                    continue
                outputs.append(encoded)
                grads.append(grad.to(encoded.dtype))
                backward_rows += int(grad.shape[0])
            if outputs:
                torch.autograd.backward(outputs, grad_tensors=grads)
            stats = DedupStats(
                uses=self._uses,
                unique_media=len(self._index),
                encoder_calls=self._encoder_calls,
                recompute_calls=recompute_calls,
                backward_rows=backward_rows,
            )
        finally:
            self.drop()
        logger.debug("dedup mini-batch done: %s", stats)
        return stats

    def drop(self) -> None:
        """Forget the current mini-batch without a backward (e.g. on an exception); idempotent."""
        self._chunks: list[_Chunk] = []
        self._index: dict[str, tuple[int, int, _Fingerprint]] = {}  # hash -> chunk, row, what was encoded
        self._uses = 0
        self._encoder_calls = 0
        self._active = False

    # ------------------------------------------------------------------ internals
    def _require_active(self, what: str) -> None:
        if not self._active:
            raise DedupStateError(f"{what}() called outside a mini-batch; call begin_mini_batch() first")

    def _place(self, media_hash: str) -> tuple[int, int]:
        try:
            return self._index[media_hash][:2]
        except KeyError:
            raise NotFound(
                f"media {media_hash!r} was not given to begin_mini_batch()/add_media() in this mini-batch"
            ) from None

    def _encode(self, items: list[tuple[str, torch.Tensor, _Fingerprint]]) -> None:
        inputs = torch.stack([t for _, t, _ in items])
        if self.device is not None:
            inputs = inputs.to(self.device, non_blocking=True)
        rng_state = None
        grad_mode = torch.is_grad_enabled()  # the caller's: no graph is recorded under no_grad()
        version = inputs._version
        if self.mode == "keep_graph":
            encoded = self.encoder(inputs)
        else:
            rng_state = _capture_rng(inputs.device)
            with torch.no_grad():
                encoded = self.encoder(inputs)
        if inputs._version != version:
            raise InvalidRequest(
                "the encoder modified its input in place; DedupEncoder needs an encoder that leaves it unchanged"
            )
        self._encoder_calls += 1
        if not isinstance(encoded, torch.Tensor) or encoded.dim() < 1 or encoded.shape[0] != len(items):
            got = tuple(encoded.shape) if isinstance(encoded, torch.Tensor) else type(encoded).__name__
            raise InvalidRequest(f"encoder must return a tensor [{len(items)}, ...] for {len(items)} media, got {got}")
        leaf_dtype = torch.float64 if encoded.dtype == torch.float64 else torch.float32
        leaf = encoded.detach().to(leaf_dtype).requires_grad_(grad_mode)
        chunk_id = len(self._chunks)
        self._chunks.append(
            _Chunk(
                inputs=inputs if self.mode == "recompute" and grad_mode else None,
                encoded=encoded if self.mode == "keep_graph" and grad_mode else None,
                leaf=leaf,
                rng_state=rng_state,
                input_version=inputs._version,
            )
        )
        for row, (media_hash, _, fingerprint) in enumerate(items):
            self._index[media_hash] = (chunk_id, row, fingerprint)


def _content_digest(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes in row-major order (a copy to the host first for a device tensor)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def _check_same_input(media_hash: str, encoded: _Fingerprint, given: _Fingerprint) -> None:
    """Refuse a tensor for ``media_hash`` that is not the one encoded for it in this mini-batch."""
    remedy = (
        "the tensor for a media hash must be a function of the hash (per-row augmentation or a "
        "per-source processor needs a hash of its own)"
    )
    if (given.shape, given.dtype) != (encoded.shape, encoded.dtype):
        raise Conflict(
            f"media {media_hash!r} was encoded from a {encoded.dtype} tensor of shape {list(encoded.shape)} in "
            f"this mini-batch and is now given as {given.dtype} of shape {list(given.shape)}; {remedy}"
        )
    if given.digest is not None and encoded.digest is not None and given.digest != encoded.digest:
        raise Conflict(
            f"media {media_hash!r} is given with other content than the tensor encoded for it in this mini-batch "
            f"(CRC-32 {given.digest:08x} vs {encoded.digest:08x}); {remedy}"
        )


def _capture_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RNG state before a no-grad forward, so ``finish()`` can replay the same dropout masks."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Iterator[None]:
    """Replay the RNG state of the no-grad forward on ``device`` without disturbing the caller's RNG."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def all_reduce_gradients(
    params: Iterable[nn.Parameter],
    *,
    group: torch.distributed.ProcessGroup | None = None,
    average: bool = True,
) -> None:
    """All-reduce ``.grad`` of ``params`` across ``group`` (mean like DDP, or sum), one flat buffer per dtype.

    A parameter without a gradient takes part as zeros (and gets the reduced gradient), so every
    rank issues the same collectives whether or not it used the parameter. Call it on every rank,
    after :meth:`DedupEncoder.finish`, once per mini-batch.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise DedupStateError("all_reduce_gradients() needs an initialised torch.distributed process group")
    world = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(world)
        for g, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
            g.copy_(reduced.view_as(g))
