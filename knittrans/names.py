"""Validation of identifiers (jobs, units, nodes, sources) that may end up in paths or URLs."""

from __future__ import annotations

import re

from knittrans.errors import InvalidName, InvalidRequest

__all__ = ["CONTENT_HASH_PATTERN", "NAME_RE", "check_name", "is_content_hash"]

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A safe identifier: letters, digits, ``.``, ``_``, ``-``; starts alphanumeric; at most 128 chars.

Always matched whole (``fullmatch``): ``$`` would let a trailing newline through."""


def check_name(value: object, what: str, *, error: type[InvalidRequest] = InvalidName) -> str:
    """Return ``value`` if it is a safe identifier, else raise ``error`` naming ``what``.

    Rejects path separators, ``..``, empty strings and anything outside :data:`NAME_RE`,
    so a name can never escape the directory it is joined to.
    """
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or ".." in value:
        raise error(
            f"{what} {value!r} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return value


CONTENT_HASH_PATTERN = r"^[0-9a-f]{64}$"
"""A media content hash (SHA-256): 64 lower-case hex characters; :func:`is_content_hash` checks it
(the API's schema publishes it as this pattern)."""

_HEX = frozenset("0123456789abcdef")


def is_content_hash(value: object) -> bool:
    """Whether ``value`` matches :data:`CONTENT_HASH_PATTERN` (a set test: faster than the regex)."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX
