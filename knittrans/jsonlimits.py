"""JSON refused by nesting depth before it is parsed (HTTP bodies, Flight tickets and action bodies)."""

from __future__ import annotations

import numpy as np

__all__ = ["nesting_over"]

_CHUNK = 1 << 20
"""Quotes and brackets counted per vectorised step (bounds the temporary arrays to a few MiB)."""
_QUOTE = 2
_KINDS = bytes(1 if b in b"[{" else 255 if b in b"]}" else _QUOTE if b == ord('"') else 0 for b in range(256))
"""Per byte value, as int8: +1 opens a level, -1 closes one, 2 is a quote."""
_OTHERS = bytes(b for b in range(256) if b not in b'"[]{}')


def nesting_over(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects more than ``limit`` levels deep.

    Brackets inside strings do not count. Text that is not JSON (unbalanced brackets, an unterminated
    string) may answer either way: the parser that runs after this check refuses it. Listeners ask it
    before ``json.loads``, which recurses once per level; it builds no value: one C pass
    (``bytes.translate``) keeps only the quotes and brackets, then vectorised numpy passes count the levels.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot nest deeper than it has openings
        return False
    if b"\\" in raw:  # escapes out first: a run of backslashes pairs up from its left, then \" is no quote
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    kinds = np.frombuffer(raw.translate(_KINDS, _OTHERS), dtype=np.int8)
    depth, quotes = 0, 0
    for start in range(0, len(kinds), _CHUNK):
        chunk = kinds[start : start + _CHUNK]
        is_quote = chunk == _QUOTE
        outside = ((np.cumsum(is_quote, dtype=np.int32) + quotes) & 1) == 0  # an opening quote is inside
        levels = np.cumsum(np.where(outside & ~is_quote, chunk, 0), dtype=np.int32) + depth
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
        quotes += int(np.count_nonzero(is_quote))
    return False
