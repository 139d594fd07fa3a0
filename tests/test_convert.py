"""Arrow -> torch conversion: zero-copy views, cu_seqlens, packing, padding, device copy."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from data_support import make_groups

from knittrans.errors import InvalidRequest
from knittrans.schema import build_unit_tables
from knittrans.trainer.convert import pad_sequences, to_device, to_micro_batch, warm_up


def _traj(n: int = 3) -> pa.Table:
    return build_unit_tables(make_groups(n, 4, max_len=30)).traj


def test_columns_become_zero_copy_tensors_with_cu_seqlens() -> None:
    """Flat tensors share memory with the Arrow buffers and cu_seqlens equal the list offsets."""
    traj = _traj()
    mb = to_micro_batch(traj)
    resp = traj.column("response_ids").chunk(0)
    assert mb.response_ids is not None and mb.response_cu_seqlens is not None
    assert mb.response_ids.data_ptr() == resp.values.buffers()[1].address
    assert mb.response_cu_seqlens.dtype == torch.int32
    assert mb.response_cu_seqlens.data_ptr() == resp.offsets.buffers()[1].address  # the offsets themselves
    assert mb.response_cu_seqlens.tolist() == resp.offsets.to_pylist()
    rows = traj.to_pylist()
    cu = mb.response_cu_seqlens.tolist()
    for i, row in enumerate(rows):
        assert mb.response_ids[cu[i] : cu[i + 1]].tolist() == row["response_ids"]
        assert mb.response_logprobs[cu[i] : cu[i + 1]].tolist() == row["response_logprobs"]  # type: ignore[index]
        assert mb.loss_mask[cu[i] : cu[i + 1]].tolist() == row["loss_mask"]  # type: ignore[index]
    assert mb.rewards.tolist() == [r["reward"] for r in rows]  # type: ignore[union-attr]
    assert mb.version_end.tolist() == [r["version_end"] for r in rows]  # type: ignore[union-attr]
    assert mb.media_hex() == [[h.hex() for h in r["media"]] for r in rows]


def test_sliced_and_multi_chunk_tables_are_rebased() -> None:
    """A row slice gets cu_seqlens starting at 0; several chunks convert like their concatenation."""
    traj = _traj()
    part = traj.slice(5, 4)
    mb = to_micro_batch(part)
    assert mb.prompt_cu_seqlens is not None and mb.prompt_cu_seqlens[0] == 0
    assert mb.prompt_ids is not None
    assert mb.prompt_ids.tolist() == [t for r in part.column("prompt_ids").to_pylist() for t in r]
    two = pa.concat_tables([traj.slice(0, 3), traj.slice(8, 2)])
    one = pa.Table.from_batches(two.combine_chunks().to_batches())
    a, b = to_micro_batch(two), to_micro_batch(one)
    for name in ("response_ids", "response_cu_seqlens", "prompt_ids", "rewards", "media_hashes", "media_cu_seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_pack_equals_per_row_concatenation() -> None:
    """pack() gives prompt+response per row and response_index points at the response tokens."""
    traj = _traj()
    mb = to_micro_batch(traj)
    packed = mb.pack()
    rows = traj.to_pylist()
    want = [t for r in rows for t in r["prompt_ids"] + r["response_ids"]]
    assert packed.input_ids.tolist() == want
    lens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    assert packed.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert torch.equal(packed.input_ids[packed.response_index], mb.response_ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="needs both"):
        to_micro_batch(traj.select(["response_ids"])).pack()


def test_pad_sequences_matches_python_padding() -> None:
    """The padded helper equals naive list padding, with mask, and truncates to max_len."""
    traj = _traj()
    mb = to_micro_batch(traj)
    assert mb.response_ids is not None and mb.response_cu_seqlens is not None
    padded, mask = pad_sequences(mb.response_ids, mb.response_cu_seqlens, pad_value=-1)
    rows = traj.column("response_ids").to_pylist()
    width = max(len(r) for r in rows)
    assert padded.tolist() == [r + [-1] * (width - len(r)) for r in rows]
    assert mask.sum(1).tolist() == [len(r) for r in rows]
    short, smask = pad_sequences(mb.response_ids, mb.response_cu_seqlens, max_len=3)
    assert short.tolist() == [(r + [0] * 3)[:3] for r in rows] and smask.shape == (len(rows), 3)


def test_to_device_copies_values() -> None:
    """to_device keeps every value (CPU here; CUDA through pinned staging when available)."""
    mb = to_micro_batch(_traj())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = to_device(mb, device)
    assert moved.response_ids is not None and mb.response_ids is not None
    assert moved.response_ids.device.type == device
    torch.testing.assert_close(moved.response_logprobs.cpu(), mb.response_logprobs)  # type: ignore[union-attr]
    assert torch.equal(moved.response_cu_seqlens.cpu(), mb.response_cu_seqlens)  # type: ignore[union-attr,arg-type]


def test_projection_without_list_columns() -> None:
    """A projection of scalar columns converts; absent columns are None."""
    mb = to_micro_batch(_traj().select(["reward", "version_start"]))
    assert mb.response_ids is None and mb.rewards is not None and mb.num_rows == 12 and mb.media_hex() == []


def test_empty_tables_convert_and_null_lists_are_refused() -> None:
    """No rows (an empty slice, or no chunks at all) gives empty tensors with cu_seqlens [0] that pack and pad;
    a list column with a null row cannot be a flat tensor and is refused."""
    traj = _traj()
    for empty in (traj.slice(4, 0), pa.Table.from_batches([], schema=traj.schema)):
        mb = to_micro_batch(empty)
        assert mb.num_rows == 0 and mb.media_hex() == [] and mb.rewards is not None and mb.rewards.numel() == 0
        assert mb.response_ids is not None and mb.response_cu_seqlens is not None
        assert mb.response_ids.numel() == 0 and mb.response_cu_seqlens.tolist() == [0]
        assert mb.pack().input_ids.numel() == 0
        assert pad_sequences(mb.response_ids, mb.response_cu_seqlens)[0].shape == (0, 0)
    nulls = pa.table({"response_ids": pa.array([[1, 2], None], pa.list_(pa.int32()))})
    with pytest.raises(InvalidRequest, match="1 null rows"):
        to_micro_batch(nulls)


def test_pack_of_a_sliced_table_matches_its_copy() -> None:
    """pack() of rows sliced out of the middle of a table (non-zero offsets) equals pack() of a fresh copy."""
    traj = _traj()
    part = traj.slice(3, 4)
    fresh = pa.Table.from_pylist(part.to_pylist(), schema=traj.schema)
    a, b = to_micro_batch(part).pack(), to_micro_batch(fresh).pack()
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert torch.equal(a.response_index, b.response_index)


def test_warm_up_converts_a_table_of_the_current_schema() -> None:
    """``warm_up`` (the client's start runs it before its first manifest) builds, sends through an IPC stream and
    converts a trajectory table of today's schema without error, and changes nothing a later conversion sees."""
    table = build_unit_tables(make_groups(2)).traj
    before = to_micro_batch(table)
    warm_up()
    after = to_micro_batch(table)
    assert torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(before.response_cu_seqlens, after.response_cu_seqlens)
