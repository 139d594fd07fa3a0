"""A rank's plan rendered straight to the JSON bytes ``next`` answers, without the plan dataclasses.

:func:`knittrans.api.plans.render_rank_plan` builds a :class:`~knittrans.plans.RankPlan` (rows,
fetches, media, :class:`~knittrans.tickets.Ticket` objects, each checked as it is made) that the
control plane then turns into a dict and JSON. At 1,024 ranks that is done 1,024 times per
mini-batch on the state thread, on the path from admission to the ranks' plans. Here the same
JSON text is written straight from the layout, strings through the ``json`` encoder's own (C)
escaping functions: byte for byte what ``json.dumps(render_rank_plan(...).to_json(),
ensure_ascii=False, allow_nan=False, separators=(",", ":"))`` gives (a test compares the two on
plans with media, a projection and signed tickets). What the dataclasses would refuse (a row read
twice or out of order in one ticket, a node's rows not contiguous) cannot come out of the scheduler;
should a layout hold it anyway, the plan is rendered by the dataclass path, which raises as it
always did.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

from knittrans.api.plans import Signer, render_rank_plan
from knittrans.descriptors import GroupRecord
from knittrans.tickets import TICKET_VERSION

__all__ = ["PLAN_ENCODER", "render_rank_plan_json"]

PLAN_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""The encoder of a plan body (what ``json.dumps`` with these arguments makes anew on every call)."""
_encode = PLAN_ENCODER.encode
_esc = encode_basestring  # a string as PLAN_ENCODER writes it (ensure_ascii=False)
_esc_ascii = encode_basestring_ascii  # a string as Ticket.encode's json.dumps writes it


def _value(x: Any) -> str:
    """A number or null as the plan's encoder writes it (NaN refused), without the encoder's per-call setup
    for the plain cases (once per rank and mini-batch: ints and finite floats are their ``repr``)."""
    if type(x) is int:
        return int.__repr__(x)
    if type(x) is float and math.isfinite(x):
        return float.__repr__(x)
    return _encode(x)


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
    # The plan's JSON text, piece by piece: what ``json.dumps`` writes for ``to_json()`` (strings through
    # the encoder's own escaping functions).
    job_text = _esc(job)
    try:
        micros = [_micro(pairs, where, job_text) for pairs in micro_batches]
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
        return _encode(plan.to_json()).encode()
    grants: dict[str, str] = {}
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
        grants = {
            node: ',"grants":[' + _esc_ascii(sign(reads.get(node, {}), media.get(node, {}))) + "]"
            for node in {*reads, *media}
        }
    endpoints: dict[str, str] = {}

    def at(node_id: str) -> str:  # '"node_id":...,"endpoint":...' of a node
        found = endpoints.get(node_id)
        if found is None:
            found = endpoints[node_id] = f'"node_id":{_esc(node_id)},"endpoint":{_esc(endpoint(node_id))}'
        return found

    job_ascii = _esc_ascii(job)
    cols = "" if not columns else ',"columns":[' + ",".join(map(_esc_ascii, columns)) + "]"
    parts = []
    total = 0
    for index, (rows, tokens, per_node, hashes) in enumerate(micros):
        total += tokens
        fetches = []
        for node_id, runs in per_node.items():
            reads_text = ",".join(
                '{"unit":' + _esc_ascii(unit_id) + ',"rows":[' + ",".join(f"[{a},{b}]" for a, b in ranges) + "]}"
                for unit_id, ranges in runs
            )
            ticket = f'{{"v":{TICKET_VERSION},"kind":"rows","job":{job_ascii},"reads":[{reads_text}]{cols}'
            ticket += grants.get(node_id, "") + "}"
            fetches.append(f'{{{at(node_id)},"ticket":{_esc(ticket)}}}')
        media_out = []
        for h, (node_id, unit_id) in hashes.items():
            ticket = (
                f'{{"v":{TICKET_VERSION},"kind":"media","job":{job_ascii},"reads":[{{"unit":{_esc_ascii(unit_id)},'
                f'"rows":[]}}],"media":[{_esc_ascii(h)}]{grants.get(node_id, "")}}}'
            )
            media_out.append(f'{{"hash":{_esc(h)},{at(node_id)},"ticket":{_esc(ticket)}}}')
        parts.append(
            f'{{"index":{index},"num_tokens":{tokens},"rows":[{",".join(rows)}],"fetches":[{",".join(fetches)}],'
            f'"media":[{",".join(media_out)}]}}'
        )
    plan_id = f'"n{n}.a{attempt}.r{rank}"'  # _esc(str(PlanId(...))) of the scheduler's ints: nothing to escape
    body = (
        f'{{"plan_id":{plan_id},"job":{job_text},"rank":{rank},"step":{step},"mini_batch_index":{k},'
        f'"global_index":{n},"policy_version":{n},"num_tokens":{total},"micro_batches":[{",".join(parts)}]'
    )
    tail = f',"mini_batch_trajectories":{_value(mini_batch_trajectories)},"admitted_at":{_value(admitted_at)}}}'
    return (body + tail).encode()


# one micro-batch before its tickets are written: rows (JSON text each), tokens, per node [(unit, ranges)], media
_Micro = tuple[list[str], int, dict[str, list[tuple[str, list[list[int]]]]], dict[str, tuple[str, str]]]


def _micro(
    pairs: Sequence[Sequence[Any]], where: Callable[[str], tuple[GroupRecord, str, str]], job_text: str
) -> _Micro:
    """One micro-batch's rows, tokens, reads per node (``tickets.node_reads``) and media (first use wins)."""
    rows: list[str] = []
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
        if type(row) is not int or type(num_tokens) is not int:
            raise _Unusual  # written as JSON numbers below only when they are plain ints
        tokens += num_tokens
        rows.append(
            f'{{"group_id":{_esc(group_id)},"unit_id":{_esc(unit_id)},"node_id":{_esc(node_id)},'
            f'"row":{row},"num_tokens":{num_tokens}}}'
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
