"""Rank plans: the compact layout stored per mini-batch, and its rendering into rows and Flight tickets.

At admission the assignment (:func:`knittrans.sched.assign.assign_mini_batch`) is reduced to a
*layout* — rank → micro-batch → ``[group_id, row]`` pairs in read order — which is what is persisted.
The JSON plan a rank receives (rows, one rows ticket per node, one media ticket per unique hash) is
rendered from the layout when the rank asks, with the nodes' current endpoints; rendering is
deterministic, so asking again returns the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.sched.types import RankPlan
from knittrans.tickets import Ticket, UnitRead

__all__ = ["Layout", "format_plan_id", "layout_of", "parse_plan_id", "render_rank_plan", "unit_json"]

Layout = list[list[list[list[Any]]]]
"""rank -> micro-batch -> ``[group_id, row]`` pairs, in the order the rank's reads return rows."""


def unit_json(u: UnitDescriptor) -> dict[str, Any]:
    """``u.to_dict()`` without :func:`dataclasses.asdict` (several times faster on the registration path).

    Token counts and media hashes stay tuples: JSON encodes them as arrays.
    """
    return {
        "unit_id": u.unit_id,
        "job": u.job,
        "node_id": u.node_id,
        "endpoint": u.endpoint,
        "num_rows": u.num_rows,
        "num_bytes": u.num_bytes,
        "schema_version": u.schema_version,
        "groups": [
            {
                "group_id": g.group_id,
                "source": g.source,
                "row_start": g.row_start,
                "num_trajectories": g.num_trajectories,
                "trajectory_tokens": g.trajectory_tokens,
                "version_start": g.version_start,
                "version_end": g.version_end,
                "version_weighted": g.version_weighted,
                "finished_at": g.finished_at,
                "media_hashes": g.media_hashes,
            }
            for g in u.groups
        ],
    }


def format_plan_id(n: int, attempt: int, rank: int) -> str:
    """Plan id of rank ``rank`` in attempt ``attempt`` of mini-batch ``n``."""
    return f"n{n}.a{attempt}.r{rank}"


def parse_plan_id(plan_id: str) -> tuple[int, int, int] | None:
    """``(n, attempt, rank)`` of a plan id, or None when it is not one of ours."""
    parts = plan_id.split(".")
    if len(parts) != 3 or [p[:1] for p in parts] != ["n", "a", "r"]:
        return None
    try:
        n, attempt, rank = (int(p[1:]) for p in parts)
    except ValueError:
        return None
    if min(n, attempt, rank) < 0:
        return None
    return n, attempt, rank


def layout_of(plans: Sequence[RankPlan]) -> Layout:
    """The compact layout of an assignment (ranks in order)."""
    return [
        [[[t.group_id, t.row] for t in m.trajectories] for m in p.micro_batches]
        for p in sorted(plans, key=lambda p: p.rank)
    ]


def _micro_batch(
    job: str,
    index: int,
    pairs: Sequence[Sequence[Any]],
    where: Callable[[str], tuple[GroupRecord, str, str]],
    endpoint: Callable[[str], str],
    columns: Sequence[str] | None,
) -> dict[str, Any]:
    rows = []
    per_node: dict[str, list[UnitRead]] = {}
    media: dict[str, tuple[str, str]] = {}
    current: tuple[str, str] | None = None
    ranges: list[tuple[int, int]] = []

    def close() -> None:
        if current is not None:
            per_node.setdefault(current[0], []).append(UnitRead(unit_id=current[1], row_ranges=tuple(ranges)))

    tokens = 0
    for group_id, row in pairs:
        record, unit_id, node_id = where(group_id)
        num_tokens = record.trajectory_tokens[row - record.row_start]
        tokens += num_tokens
        rows.append(
            {"group_id": group_id, "unit_id": unit_id, "node_id": node_id, "row": row, "num_tokens": num_tokens}
        )
        for h in record.media_hashes:
            media.setdefault(h, (node_id, unit_id))
        if current == (node_id, unit_id) and ranges[-1][1] == row:
            ranges[-1] = (ranges[-1][0], row + 1)
        elif current == (node_id, unit_id):
            ranges.append((row, row + 1))
        else:
            close()
            if current is not None and current[0] != node_id and node_id in per_node:
                raise RuntimeError(f"micro-batch {index}: rows of node {node_id!r} are not contiguous")
            current, ranges = (node_id, unit_id), [(row, row + 1)]
    close()
    cols = tuple(columns) if columns else None
    return {
        "index": index,
        "num_tokens": tokens,
        "rows": rows,
        "fetches": [
            {
                "node_id": node_id,
                "endpoint": endpoint(node_id),
                "ticket": Ticket(job=job, reads=tuple(reads), columns=cols).encode().decode(),
            }
            for node_id, reads in per_node.items()
        ],
        "media": [
            {
                "hash": h,
                "node_id": node_id,
                "endpoint": endpoint(node_id),
                "ticket": Ticket(job=job, kind="media", reads=(UnitRead(unit_id=unit_id),), media_hashes=(h,))
                .encode()
                .decode(),
            }
            for h, (node_id, unit_id) in media.items()
        ],
    }


Signer = Callable[[dict[str, list[tuple[int, int]]], dict[str, str]], str]
"""Makes the signed grant of one node's reads and media (``knittrans.grants.sign_grant`` bound to a plan)."""


def _sign(docs: list[dict[str, Any]], sign: Signer) -> None:
    reads: dict[str, dict[str, list[tuple[int, int]]]] = {}
    media: dict[str, dict[str, str]] = {}
    for d in docs:
        for f in d["fetches"]:
            for r in Ticket.decode(f["ticket"].encode()).reads:
                reads.setdefault(f["node_id"], {}).setdefault(r.unit_id, []).extend(r.row_ranges)
        for m in d["media"]:
            t = Ticket.decode(m["ticket"].encode())
            media.setdefault(m["node_id"], {}).update({h: t.reads[0].unit_id for h in t.media_hashes})
    grants = {node: sign(reads.get(node, {}), media.get(node, {})) for node in {*reads, *media}}
    for d in docs:
        for entry in (*d["fetches"], *d["media"]):
            t = Ticket.decode(entry["ticket"].encode())
            entry["ticket"] = replace(t, grants=(grants[entry["node_id"]],)).encode().decode()


def render_rank_plan(
    job: str,
    micro_batches: Sequence[Sequence[Sequence[Any]]],
    *,
    rank: int,
    n: int,
    attempt: int,
    step: int,
    k: int,
    where: Callable[[str], tuple[GroupRecord, str, str]],
    endpoint: Callable[[str], str],
    columns: Sequence[str] | None,
    sign: Signer | None = None,
) -> dict[str, Any]:
    """JSON plan of one rank for mini-batch ``n`` (trained at policy version ``n``).

    Args:
        job: job name written into the tickets.
        micro_batches: the rank's part of the layout.
        rank, n, attempt, step, k: identify the plan.
        where: group id -> (its record, unit id, node id).
        endpoint: node id -> Flight location of the node now.
        columns: columns to project, None for all.
        sign: ``sign(reads, media) -> grant`` (see :mod:`knittrans.grants`), called once per node with
            that node's ``{unit: [(start, stop), ...]}`` and ``{hash: unit}``; every ticket to the
            node then carries the grant. None leaves tickets unsigned.
    """
    docs = [_micro_batch(job, i, pairs, where, endpoint, columns) for i, pairs in enumerate(micro_batches)]
    if sign is not None:
        _sign(docs, sign)
    return {
        "plan_id": format_plan_id(n, attempt, rank),
        "job": job,
        "rank": rank,
        "step": step,
        "mini_batch_index": k,
        "global_index": n,
        "policy_version": n,
        "num_tokens": sum(d["num_tokens"] for d in docs),
        "micro_batches": docs,
    }
