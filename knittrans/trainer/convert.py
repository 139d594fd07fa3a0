"""Arrow trajectory rows -> torch tensors: zero-copy on CPU, packed and padded layouts, device copy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.utils.dlpack

from knittrans.errors import InvalidRequest
from knittrans.schema import TRAJECTORY_COLUMNS, TrajectoryGroup, build_unit_tables
from knittrans.userfields import user_column_to_torch

__all__ = ["MicroBatch", "PackedSequence", "pad_sequences", "to_device", "to_micro_batch", "warm_up"]

_LIST_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask")
_SCALAR_COLUMNS = {
    "reward": "rewards",
    "advantage": "advantages",
    "version_start": "version_start",
    "version_end": "version_end",
    "version_weighted": "version_weighted",
}


@dataclass(frozen=True, kw_only=True)
class PackedSequence:
    """Prompt + response of every row, packed back to back (variable-length attention layout)."""

    input_ids: torch.Tensor
    """Flat token ids, int32, row after row."""
    cu_seqlens: torch.Tensor
    """int32 ``[rows + 1]`` boundaries of the rows in :attr:`input_ids`."""
    response_index: torch.Tensor
    """int64 position in :attr:`input_ids` of every response token (aligned with ``response_ids``)."""


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Tensors of one micro-batch; a column that was not fetched is None."""

    num_rows: int
    """Trajectories in the micro-batch."""
    prompt_ids: torch.Tensor | None = None
    """Flat prompt tokens (int32)."""
    prompt_cu_seqlens: torch.Tensor | None = None
    """int32 ``[rows + 1]`` prompt boundaries."""
    response_ids: torch.Tensor | None = None
    """Flat response tokens (int32)."""
    response_cu_seqlens: torch.Tensor | None = None
    """int32 ``[rows + 1]`` response boundaries (also those of logprobs and loss mask)."""
    response_logprobs: torch.Tensor | None = None
    """Flat sampling logprobs (float32), aligned with ``response_ids``."""
    loss_mask: torch.Tensor | None = None
    """Flat uint8 mask over response tokens."""
    rewards: torch.Tensor | None = None
    """float32 ``[rows]``."""
    advantages: torch.Tensor | None = None
    """float32 ``[rows]`` advantages (GRPO group-normalised rewards unless the writer gave others)."""
    version_start: torch.Tensor | None = None
    """int32 ``[rows]`` policy version at each trajectory's start."""
    version_end: torch.Tensor | None = None
    """int32 ``[rows]`` policy version of each trajectory's last token."""
    version_weighted: torch.Tensor | None = None
    """float32 ``[rows]`` token-weighted policy version."""
    media_hashes: torch.Tensor | None = None
    """uint8 ``[media refs, 32]`` content hashes, row after row."""
    media_cu_seqlens: torch.Tensor | None = None
    """int32 ``[rows + 1]`` boundaries of each row's media references."""
    table: pa.Table | None = None
    """The Arrow rows themselves (ids, group ids, sources stay here)."""
    user: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-job user fields fetched, converted by :func:`knittrans.userfields.user_column_to_torch`
    (a tensor, a ``(values, cu_seqlens)`` pair, or a list of Python values)."""

    def media_hex(self) -> list[list[str]]:
        """Hex media hashes per row (a loop over media references, not tokens)."""
        if self.media_hashes is None or self.media_cu_seqlens is None:
            return []
        flat = [bytes(h).hex() for h in self.media_hashes.cpu().numpy()]
        cu = self.media_cu_seqlens.tolist()
        return [flat[cu[i] : cu[i + 1]] for i in range(self.num_rows)]

    def pack(self) -> PackedSequence:
        """Prompt + response per row in one tensor (two vectorised scatters)."""
        if self.prompt_ids is None or self.response_ids is None:
            raise InvalidRequest("pack() needs both prompt_ids and response_ids columns")
        assert self.prompt_cu_seqlens is not None and self.response_cu_seqlens is not None
        if self.prompt_ids.device.type == "cpu":
            return _pack_cpu(self.prompt_ids, self.prompt_cu_seqlens, self.response_ids, self.response_cu_seqlens)
        p_cu, r_cu = self.prompt_cu_seqlens.long(), self.response_cu_seqlens.long()
        plen, rlen = p_cu.diff(), r_cu.diff()
        cu = torch.zeros(self.num_rows + 1, dtype=torch.long, device=p_cu.device)
        torch.cumsum(plen + rlen, 0, out=cu[1:])
        n_p, n_r = self.prompt_ids.numel(), self.response_ids.numel()
        out = torch.empty(n_p + n_r, dtype=self.prompt_ids.dtype, device=self.prompt_ids.device)
        p_pos = torch.arange(n_p, device=p_cu.device) + _per_token(cu[:-1] - p_cu[:-1], p_cu, n_p)
        r_pos = torch.arange(n_r, device=r_cu.device) + _per_token(cu[:-1] + plen - r_cu[:-1], r_cu, n_r)
        out[p_pos] = self.prompt_ids
        out[r_pos] = self.response_ids
        return PackedSequence(input_ids=out, cu_seqlens=cu.int(), response_index=r_pos)


def _pack_cpu(
    prompt: torch.Tensor, p_cu_t: torch.Tensor, response: torch.Tensor, r_cu_t: torch.Tensor
) -> PackedSequence:
    """:meth:`MicroBatch.pack` on CPU with numpy: the same scatters, without torch's intra-op thread
    pool, whose wake-ups are slow on a busy host."""
    p_cu, r_cu = p_cu_t.numpy().astype(np.int64), r_cu_t.numpy().astype(np.int64)
    plen, rlen = np.diff(p_cu), np.diff(r_cu)
    cu = np.zeros(len(p_cu), dtype=np.int64)
    np.cumsum(plen + rlen, out=cu[1:])
    p_pos = np.arange(p_cu[-1] - p_cu[0]) + np.repeat(cu[:-1] - p_cu[:-1] + p_cu[0], plen)
    r_pos = np.arange(r_cu[-1] - r_cu[0]) + np.repeat(cu[:-1] + plen - r_cu[:-1] + r_cu[0], rlen)
    p_np, r_np = prompt.numpy(), response.numpy()
    out = np.empty(len(p_pos) + len(r_pos), dtype=p_np.dtype)
    out[p_pos] = p_np
    out[r_pos] = r_np
    return PackedSequence(
        input_ids=torch.from_numpy(out),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        response_index=torch.from_numpy(r_pos),
    )


def _per_token(row_values: torch.Tensor, cu: torch.Tensor, n: int) -> torch.Tensor:
    """``row_values[i]`` repeated over row ``i``'s tokens: a scatter of steps and a cumsum.

    Equivalent to ``repeat_interleave(row_values, lengths)``, without its per-row overhead on CPU.
    """
    steps = torch.zeros(n + 1, dtype=row_values.dtype, device=row_values.device)
    steps.index_add_(0, cu[:-1], torch.diff(row_values, prepend=row_values.new_zeros(1)))
    return torch.cumsum(steps[:n], 0)


def _tensor(arr: pa.Array) -> torch.Tensor:
    """Zero-copy torch view of a primitive, null-free Arrow array (DLPack)."""
    if len(arr) == 0:
        return torch.from_numpy(np.zeros(0, dtype=arr.type.to_pandas_dtype()))
    return torch.utils.dlpack.from_dlpack(arr)


def _single(col: pa.ChunkedArray) -> pa.Array:
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _list_column(col: pa.ChunkedArray) -> tuple[pa.Array, torch.Tensor]:
    """(flat values, cu_seqlens rebased to 0) of a list column."""
    arr = _single(col)
    if arr.null_count:
        raise InvalidRequest(f"list column has {arr.null_count} null rows; cannot convert")
    offsets = arr.offsets
    start = offsets[0].as_py() if len(offsets) else 0
    end = offsets[-1].as_py() if len(offsets) else 0
    values = arr.values.slice(start, end - start)
    cu = _tensor(offsets) if start == 0 else torch.from_numpy(offsets.to_numpy() - np.int32(start))
    return values, cu


def to_micro_batch(table: pa.Table) -> MicroBatch:
    """Convert trajectory rows (any projection of the schema) to a :class:`MicroBatch`."""
    fields: dict[str, Any] = {"num_rows": table.num_rows, "table": table}
    names = set(table.column_names)
    for name in _LIST_COLUMNS:
        if name in names:
            values, cu = _list_column(table.column(name))
            fields[name] = _tensor(values)
            if name in ("prompt_ids", "response_ids"):
                fields[name.replace("_ids", "_cu_seqlens")] = cu
    for name, attr in _SCALAR_COLUMNS.items():
        if name in names:
            fields[attr] = _tensor(_single(table.column(name)))
    if "media" in names:
        hashes, fields["media_cu_seqlens"] = _list_column(table.column("media"))  # fixed_size_binary(32)
        raw = np.frombuffer(hashes.buffers()[1], dtype=np.uint8) if len(hashes) else np.zeros(0, np.uint8)
        start = hashes.offset * 32
        fields["media_hashes"] = torch.from_numpy(raw[start : start + len(hashes) * 32].reshape(-1, 32).copy())
    fixed = set(TRAJECTORY_COLUMNS)
    fields["user"] = {n: user_column_to_torch(table.column(n)) for n in table.column_names if n not in fixed}
    return MicroBatch(**fields)


def warm_up() -> None:
    """Receive and convert a one-row trajectory table once, as a micro-batch is (Arrow IPC stream in, then
    :func:`to_micro_batch`).

    A process's first IPC read, ``torch.from_numpy`` and DLPack import each pay a one-time set-up (lazy
    imports and bridges) that, summed, costs several times the conversion of a whole small micro-batch.
    :class:`~knittrans.trainer.client.TrainerClient` calls this while it waits for its first manifest, so
    the first micro-batch of a job does not pay it.
    """
    group = TrajectoryGroup(
        group_id="warm-up",
        source="warm-up",
        prompt_ids=np.zeros(1, np.int32),
        response_ids=[np.zeros(1, np.int32)],
        response_logprobs=[np.zeros(1, np.float32)],
        rewards=np.zeros(1, np.float32),
    )
    table = build_unit_tables([group]).traj
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    to_micro_batch(pa.ipc.open_stream(sink.getvalue()).read_all())


def pad_sequences(
    flat: torch.Tensor, cu_seqlens: torch.Tensor, *, pad_value: float = 0, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[rows, max_len]`` tensor and bool mask from flat values + cu_seqlens.

    Rows longer than ``max_len`` are truncated; no per-token Python.
    """
    cu = cu_seqlens.long()
    lens = cu.diff()
    rows = lens.numel()
    width = int(lens.max()) if max_len is None and rows else (max_len or 0)
    row = _per_token(torch.arange(rows, device=flat.device), cu, flat.numel())
    col = torch.arange(flat.numel(), device=flat.device) - _per_token(cu[:-1], cu, flat.numel())
    keep = col < width
    out = torch.full((rows, width), pad_value, dtype=flat.dtype, device=flat.device)
    mask = torch.zeros((rows, width), dtype=torch.bool, device=flat.device)
    if bool(keep.all()):
        out[row, col] = flat
        mask[row, col] = True
    else:
        out[row[keep], col[keep]] = flat[keep]
        mask[row[keep], col[keep]] = True
    return out, mask


def to_device(batch: MicroBatch, device: str | torch.device, *, non_blocking: bool = True) -> MicroBatch:
    """Copy every tensor to ``device``: CUDA through pinned staging + non-blocking copies.

    On a CPU device the batch is returned unchanged (its tensors already live there).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return batch
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = _staged(value, device, non_blocking)
    if batch.user:
        changes["user"] = {
            k: _staged(v, device, non_blocking)
            if isinstance(v, torch.Tensor)
            else tuple(_staged(x, device, non_blocking) for x in v)
            if isinstance(v, tuple)
            else v
            for k, v in batch.user.items()
        }
    return dataclasses.replace(batch, **changes)


def _staged(value: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    staged = value if value.is_pinned() else value.pin_memory()
    return staged.to(device, non_blocking=non_blocking)
