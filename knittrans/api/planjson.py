"""A rank's plan rendered straight to the JSON bytes ``next`` answers, without the plan dataclasses.

:func:`knittrans.api.plans.render_rank_plan` builds a :class:`~knittrans.plans.RankPlan` (rows,
fetches, media, :class:`~knittrans.tickets.Ticket` objects, each checked as it is made) that the
control plane then turns into a dict and JSON. At 1,024 ranks that is done 1,024 times per
mini-batch on the state thread, on the path from admission to the ranks' plans. Here the same
JSON value is built from the layout as plain dicts and lists and encoded once, byte for byte what
``json.dumps(render_rank_plan(...).to_json(), ensure_ascii=False, allow_nan=False,
separators=(",", ":"))`` gives (a test compares the two on plans with media, columns and signed
tickets). What the dataclasses would refuse (a row read twice or out of order in one ticket, a
node's rows not contiguous) cannot come out of the scheduler; should a layout hold it anyway, the
plan is rendered by the dataclass path, which raises as it always did.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from knittrans.api.plans import Signer, render_rank_plan
from knittrans.descriptors import GroupRecord
from knittrans.plans import PlanId
from knittrans.tickets import TICKET_VERSION

__all__ = ["PLAN_ENCODER", "render_rank_plan_json"]

PLAN_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""The encoder of a plan body (what ``json.dumps`` with these arguments makes anew on every call)."""
_TICKET = json.JSONEncoder(separators=(",", ":")).encode  # Ticket.encode's json.dumps


class _Unusual(Exception):
    """The layout holds something only the dataclass path reports properly (see the module docstring)."""


def render_rank_plan_json(
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
    mini_batch_trajectories: int | None = None,
    admitted_at: float | None = None,
) -> bytes:
    """``render_rank_plan(...)`` (same arguments) as the JSON bytes of its ``to_json()``."""
    try:
        body = _body(job, micro_batches, rank, n, attempt, step, k, where, endpoint, columns, sign)
    except _Unusual:
        plan = render_rank_plan(
            job,
            micro_batches,
            rank=rank,
            n=n,
            attempt=attempt,
            step=step,
            k=k,
            where=where,
            endpoint=endpoint,
            columns=columns,
            sign=sign,
            mini_batch_trajectories=mini_batch_trajectories,
            admitted_at=admitted_at,
        )
        return PLAN_ENCODER.encode(plan.to_json()).encode()
    body["mini_batch_trajectories"] = mini_batch_trajectories
    body["admitted_at"] = admitted_at
    return PLAN_ENCODER.encode(body).encode()


# one micro-batch before its tickets are encoded: rows (JSON), tokens, per node [(unit, ranges)], media
_Micro = tuple[list[dict[str, Any]], int, dict[str, list[tuple[str, list[list[int]]]]], dict[str, tuple[str, str]]]


def _body(
    job: str,
    micro_batches: Sequence[Sequence[Sequence[Any]]],
    rank: int,
    n: int,
    attempt: int,
    step: int,
    k: int,
    where: Callable[[str], tuple[GroupRecord, str, str]],
    endpoint: Callable[[str], str],
    columns: Sequence[str] | None,
    sign: Signer | None,
) -> dict[str, Any]:
    micros = [_micro(pairs, where) for pairs in micro_batches]
    grants: dict[str, list[str]] = {}
    if sign is not None:  # one grant per node, for all of the rank's reads and media there (plans._sign)
        reads: dict[str, dict[str, list[tuple[int, int]]]] = {}
        media: dict[str, dict[str, str]] = {}
        for _, _, per_node, hashes in micros:
            for node_id, runs in per_node.items():
                node = reads.setdefault(node_id, {})
                for unit_id, ranges in runs:
                    node.setdefault(unit_id, []).extend((start, stop) for start, stop in ranges)
            for h, (node_id, unit_id) in hashes.items():
                media.setdefault(node_id, {})[h] = unit_id
        grants = {node: [sign(reads.get(node, {}), media.get(node, {}))] for node in {*reads, *media}}
    endpoints: dict[str, str] = {}

    def at(node_id: str) -> str:
        found = endpoints.get(node_id)
        if found is None:
            found = endpoints[node_id] = endpoint(node_id)
        return found

    cols = list(columns) if columns else None
    out = []
    total = 0
    for index, (rows, tokens, per_node, hashes) in enumerate(micros):
        total += tokens
        fetches = []
        for node_id, runs in per_node.items():
            ticket: dict[str, Any] = {
                "v": TICKET_VERSION,
                "kind": "rows",
                "job": job,
                "reads": [{"unit": unit_id, "rows": ranges} for unit_id, ranges in runs],
            }
            if cols is not None:
                ticket["columns"] = cols
            if node_id in grants:
                ticket["grants"] = grants[node_id]
            fetches.append({"node_id": node_id, "endpoint": at(node_id), "ticket": _TICKET(ticket)})
        media_out = []
        for h, (node_id, unit_id) in hashes.items():
            ticket = {"v": TICKET_VERSION, "kind": "media", "job": job, "reads": [{"unit": unit_id, "rows": []}]}
            ticket["media"] = [h]
            if node_id in grants:
                ticket["grants"] = grants[node_id]
            media_out.append({"hash": h, "node_id": node_id, "endpoint": at(node_id), "ticket": _TICKET(ticket)})
        out.append({"index": index, "num_tokens": tokens, "rows": rows, "fetches": fetches, "media": media_out})
    return {
        "plan_id": str(PlanId(n=n, attempt=attempt, rank=rank)),
        "job": job,
        "rank": rank,
        "step": step,
        "mini_batch_index": k,
        "global_index": n,
        "policy_version": n,
        "num_tokens": total,
        "micro_batches": out,
    }


def _micro(pairs: Sequence[Sequence[Any]], where: Callable[[str], tuple[GroupRecord, str, str]]) -> _Micro:
    """One micro-batch's rows, tokens, reads per node (``tickets.node_reads``) and media (first use wins)."""
    rows: list[dict[str, Any]] = []
    per_node: dict[str, list[tuple[str, list[list[int]]]]] = {}
    media: dict[str, tuple[str, str]] = {}
    tokens = 0
    last_node: str | None = None
    last_unit: str | None = None
    ranges: list[list[int]] = []
    seen: set[tuple[str, int]] = set()
    for group_id, row in pairs:
        record, unit_id, node_id = where(group_id)
        num_tokens = record.trajectory_tokens[row - record.row_start]
        tokens += num_tokens
        rows.append(
            {"group_id": group_id, "unit_id": unit_id, "node_id": node_id, "row": row, "num_tokens": num_tokens}
        )
        for h in record.media_hashes:
            media.setdefault(h, (node_id, unit_id))
        if (unit_id, row) in seen:
            raise _Unusual  # a row twice in one ticket
        seen.add((unit_id, row))
        if node_id == last_node and unit_id == last_unit:  # the run of this unit goes on
            stop = ranges[-1][1]
            if row == stop:
                ranges[-1][1] = row + 1
            elif row > stop:
                ranges.append([row, row + 1])
            else:
                raise _Unusual  # out of order inside a run
            continue
        if node_id != last_node and node_id in per_node:
            raise _Unusual  # the node's rows are not contiguous
        ranges = [[row, row + 1]]
        per_node.setdefault(node_id, []).append((unit_id, ranges))
        last_node, last_unit = node_id, unit_id
    return rows, tokens, per_node, media
