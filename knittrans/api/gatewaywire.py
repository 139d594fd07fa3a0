"""Frames between the control plane and its plan gateway process (:mod:`knittrans.api.gateway`).

One stream socket (a socket pair made by the control plane) carries frames both ways: an 8-byte
header (two big-endian u32: the JSON head's length, the blob's length), the head (a JSON object whose
``"t"`` names the message) and an optional blob of bytes (rendered plans, concatenated). Messages:

* gateway → control plane: ``ready`` (``port``), ``open`` (``id``, ``method``, ``path``, ``query``,
  ``auth``: a stream to set up), ``acks`` (``id``, ``acks``: ``[[job, rank, plan_id], ...]``, one
  frame per batch of ack lines);
* control plane → gateway: ``answers`` (``job``, ``state``: the job's state, ``n`` ranks; the blob is
  the index, :func:`pack_index`, then the plans in its order; ``forget``: the job is gone), ``opened``
  (``id``, ``status``, ``keepalive_s``, ``max_s`` or the error ``body``), ``acked`` (``id``,
  ``errors``: ``[[index, kind, detail], ...]`` for the refused acks only), ``close``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

__all__ = ["MAX_ACK_LINE", "MAX_FRAME", "FrameReader", "ack_of_line", "frame", "pack_index", "unpack_index"]

MAX_FRAME = 256 << 20
"""Largest head or blob accepted (a bigger length means the peer is not speaking this protocol)."""

_HEADER = struct.Struct(">II")

MAX_ACK_LINE = 1024
"""Longest ack line of a plan stream's body (one is ~40 bytes); a longer one is refused, the rest skipped."""


def ack_of_line(line: bytes) -> str | dict[str, Any]:
    """The plan id of a plan stream's ack line (``{"ack": "<plan id>"}``), or the ``ack_error`` line's
    object that refuses it (the server's stream and the gateway answer a bad line the same way)."""
    plan_id: Any = None
    try:
        plan_id = json.loads(line)["ack"] if len(line) <= MAX_ACK_LINE else None
    except (ValueError, TypeError, KeyError):
        plan_id = None
    if isinstance(plan_id, str) and 0 < len(plan_id) <= 64:
        return plan_id
    detail = f'an ack line is {{"ack": "<plan id>"}} (at most 64 characters), got {line[:80]!r}'
    return {"ack_error": plan_id if isinstance(plan_id, str) else None, "error": "invalid_request", "detail": detail}


def pack_index(index: list[int]) -> bytes:
    """An ``answers`` frame's index, ``(rank, plan length or -1, done)`` per rank flattened, as big-endian i32s."""
    return struct.pack(f">{len(index)}i", *index)


def unpack_index(blob: bytes, n: int) -> tuple[tuple[int, ...], bytes]:
    """``(flat index, plans)`` of an ``answers`` blob with ``n`` ranks (:func:`pack_index`)."""
    size = 12 * n
    if len(blob) < size:
        raise ValueError(f"answers frame of {len(blob)} bytes cannot hold the index of {n} ranks")
    return struct.unpack_from(f">{3 * n}i", blob), blob[size:]


def frame(head: dict[str, Any], blob: bytes = b"") -> bytes:
    """One frame: ``head`` as compact JSON, then ``blob``."""
    text = json.dumps(head, separators=(",", ":")).encode()
    return _HEADER.pack(len(text), len(blob)) + text + blob


class FrameReader:
    """Splits the bytes read from the socket into ``(head, blob)`` frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        """The frames completed by ``data``. Raises ValueError on a frame that is not one of ours."""
        buffer = self._buffer
        buffer += data
        out: list[tuple[dict[str, Any], bytes]] = []
        start = 0
        while len(buffer) - start >= _HEADER.size:
            head_len, blob_len = _HEADER.unpack_from(buffer, start)
            if head_len > MAX_FRAME or blob_len > MAX_FRAME:
                raise ValueError(f"gateway frame of {head_len} + {blob_len} bytes: not a gateway peer")
            end = start + _HEADER.size + head_len + blob_len
            if len(buffer) < end:
                break
            head_end = start + _HEADER.size + head_len
            head = json.loads(bytes(buffer[start + _HEADER.size : head_end]))
            if not isinstance(head, dict) or not isinstance(head.get("t"), str):
                raise ValueError(f"gateway frame head {head!r} is not a message")
            out.append((head, bytes(buffer[head_end:end])))
            start = end
        del buffer[:start]
        return out
