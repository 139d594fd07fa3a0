"""Signed ticket grants: what the control plane lets the trainer read from one store node (docs/reference/wire.md)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knittrans.errors import Unauthenticated
from knittrans.tickets import Ticket

__all__ = ["MAX_GRANTS", "Grant", "check_listing", "check_ticket", "sign_grant"]

MAX_GRANTS = 64
"""Most grants one ticket may carry."""


@dataclass(frozen=True)
class Grant:
    """A verified grant."""

    job: str
    expires_at: float
    reads: dict[str, list[tuple[int, int]]]
    columns: frozenset[str] | None
    media: dict[str, str]


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def sign_grant(
    key: bytes,
    *,
    job: str,
    expires_at: float,
    reads: Mapping[str, Sequence[tuple[int, int]]],
    columns: Sequence[str] | None,
    media: Mapping[str, str],
) -> str:
    """``<base64url payload>.<hex HMAC-SHA256>`` granting ``reads`` (unit -> row ranges) × ``columns``
    and ``media`` (hash -> unit) of ``job`` until ``expires_at`` (Unix seconds)."""
    body = {
        "job": job,
        "exp": expires_at,
        "reads": {u: [list(r) for r in _merge(rs)] for u, rs in sorted(reads.items())},
        "columns": sorted(columns) if columns is not None else None,
        "media": dict(sorted(media.items())),
    }
    payload = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode().rstrip("=")
    return f"{payload}.{_mac(key, payload.encode())}"


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(tuple(r) for r in ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _open(key: bytes, grant: str, now: float) -> Grant:
    """The grant, verified and unexpired at ``now``."""
    payload, _, mac = grant.partition(".")
    if not mac or not hmac.compare_digest(mac, _mac(key, payload.encode())):
        raise Unauthenticated("ticket grant signature does not verify (not issued by this job's control plane)")
    try:
        body: dict[str, Any] = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        opened = Grant(
            job=body["job"],
            expires_at=float(body["exp"]),
            reads={u: [(int(a), int(b)) for a, b in rs] for u, rs in body["reads"].items()},
            columns=frozenset(body["columns"]) if body["columns"] is not None else None,
            media=dict(body["media"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise Unauthenticated(f"ticket grant is malformed: {exc}") from None
    if opened.expires_at < now:
        raise Unauthenticated(f"ticket grant of job {opened.job!r} expired {now - opened.expires_at:.0f}s ago")
    return opened


def _covered(ranges: list[tuple[int, int]], start: int, stop: int) -> bool:
    return any(a <= start and stop <= b for a, b in ranges)


def check_ticket(key: bytes, ticket: Ticket, *, now: float) -> None:
    """Raise :class:`Unauthenticated` unless valid grants of ``ticket.job`` cover all it reads."""
    if not ticket.grants:
        raise Unauthenticated("this store only serves tickets signed by the control plane (no grant)")
    if len(ticket.grants) > MAX_GRANTS:
        raise Unauthenticated(f"ticket carries {len(ticket.grants)} grants, more than {MAX_GRANTS}")
    grants = [_open(key, g, now) for g in dict.fromkeys(ticket.grants)]
    for g in grants:
        if g.job != ticket.job:
            raise Unauthenticated(f"ticket grant is for job {g.job!r}, not {ticket.job!r}")
    if ticket.kind == "media":
        for h in ticket.media_hashes:
            if not any(h in g.media for g in grants):
                raise Unauthenticated(f"media hash {h[:16]}… is not granted by the ticket's grants")
        units = {u for g in grants for u in g.media.values()}
        for r in ticket.reads:
            if r.unit_id not in units:
                raise Unauthenticated(f"unit {r.unit_id!r} is not granted for media reads")
        return
    want_cols = frozenset(ticket.columns) if ticket.columns is not None else None
    for r in ticket.reads:
        for g in grants:
            if g.columns is not None and (want_cols is None or not want_cols <= g.columns):
                continue
            ranges = g.reads.get(r.unit_id)
            if ranges is not None and r.row_ranges and all(_covered(ranges, a, b) for a, b in r.row_ranges):
                break
        else:  # no grant covers the read
            raise Unauthenticated(
                f"rows {list(r.row_ranges) or 'all'} of unit {r.unit_id!r} (columns "
                f"{sorted(want_cols) if want_cols is not None else 'all'}) are not granted"
            )


def check_listing(key: bytes, grant: str, *, job: str | None, now: float) -> str:
    """The job a valid, unexpired ``grant`` lets its holder list (``ListFlights``/``GetFlightInfo``).

    Any grant the control plane issued for a job (one that came with a mini-batch manifest) is that job's
    credential; it lists only that job's units. ``job``: the job the caller asked for, or None.
    """
    if not grant:
        raise Unauthenticated(
            "this store lists units only with a grant of their job (criteria: <job>, a newline, <grant>)"
        )
    opened = _open(key, grant, now)
    if job is not None and job != opened.job:
        raise Unauthenticated(f"the grant is for job {opened.job!r}; it cannot list job {job!r}")
    return opened.job
