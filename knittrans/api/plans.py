"""Rank plans: the compact layout stored per mini-batch, and its rendering into rows and Flight tickets.

At admission the assignment is made as a *layout* (:meth:`knittrans.sched.assign.Assignment.layout`:
rank → micro-batch → ``[group_id, row]`` pairs in read order, the assignment of
:func:`~knittrans.sched.assign.assign_mini_batch` without its plan objects), which is what is persisted.
The plan a rank receives (:class:`knittrans.plans.RankPlan`: rows, one rows ticket per node, one
media ticket per unique hash) is rendered from the layout when the rank asks, with the nodes'
current endpoints; rendering is deterministic, so asking again returns the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from knittrans.descriptors import GroupRecord, UnitDescriptor, group_fields, unit_fields
from knittrans.errors import InvalidTicket
from knittrans.plans import MediaFetch, MicroBatchReads, PlanId, PlanRow, RankPlan, RowFetch
from knittrans.tickets import Ticket, UnitRead, node_reads

__all__ = ["Layout", "render_rank_plan", "unit_json"]

Layout = list[list[list[list[Any]]]]
"""rank -> micro-batch -> ``[group_id, row]`` pairs, in the order the rank's reads return rows."""


def unit_json(u: UnitDescriptor) -> dict[str, Any]:
    """``u.to_dict()`` without :func:`dataclasses.asdict`: the JSON value of a unit in a ``units`` record.

    Token counts and media hashes stay tuples: JSON encodes them as arrays. (Registration encodes its
    record straight from the descriptors with pydantic-core, ``knittrans.api.supply._UNITS_JSON``; a test
    pins that both give the same JSON value.)
    """
    body = unit_fields(u)
    body["groups"] = [group_fields(g) for g in u.groups]
    return body


def _micro_batch(
    job: str,
    index: int,
    pairs: Sequence[Sequence[Any]],
    where: Callable[[str], tuple[GroupRecord, str, str]],
    endpoint: Callable[[str], str],
    columns: Sequence[str] | None,
) -> MicroBatchReads:
    rows = []
    media: dict[str, tuple[str, str]] = {}
    tokens = 0
    for group_id, row in pairs:
        record, unit_id, node_id = where(group_id)
        num_tokens = record.trajectory_tokens[row - record.row_start]
        tokens += num_tokens
        rows.append(PlanRow(group_id=group_id, unit_id=unit_id, node_id=node_id, row=row, num_tokens=num_tokens))
        for h in record.media_hashes:
            media.setdefault(h, (node_id, unit_id))
    try:
        per_node = node_reads((r.node_id, r.unit_id, r.row) for r in rows)
    except InvalidTicket as exc:
        raise RuntimeError(f"micro-batch {index}: {exc}") from None
    cols = tuple(columns) if columns else None
    return MicroBatchReads(
        index=index,
        num_tokens=tokens,
        rows=tuple(rows),
        fetches=tuple(
            RowFetch(node_id=node_id, endpoint=endpoint(node_id), ticket=Ticket(job=job, reads=reads, columns=cols))
            for node_id, reads in per_node.items()
        ),
        media=tuple(
            MediaFetch(
                hash=h,
                node_id=node_id,
                endpoint=endpoint(node_id),
                ticket=Ticket(job=job, kind="media", reads=(UnitRead(unit_id=unit_id),), media_hashes=(h,)),
            )
            for h, (node_id, unit_id) in media.items()
        ),
    )


Signer = Callable[[dict[str, list[tuple[int, int]]], dict[str, str]], str]
"""Makes the signed grant of one node's reads and media (``knittrans.grants.sign_grant`` bound to a plan)."""


def _sign(micro_batches: list[MicroBatchReads], sign: Signer) -> list[MicroBatchReads]:
    """The micro-batches with every ticket carrying the grant of its node (all of the rank's reads there)."""
    reads: dict[str, dict[str, list[tuple[int, int]]]] = {}
    media: dict[str, dict[str, str]] = {}
    for m in micro_batches:
        for f in m.fetches:
            for r in f.ticket.reads:
                reads.setdefault(f.node_id, {}).setdefault(r.unit_id, []).extend(r.row_ranges)
        for e in m.media:
            media.setdefault(e.node_id, {}).update({h: e.ticket.reads[0].unit_id for h in e.ticket.media_hashes})
    grants = {node: sign(reads.get(node, {}), media.get(node, {})) for node in {*reads, *media}}
    return [
        replace(
            m,
            fetches=tuple(replace(f, ticket=replace(f.ticket, grants=(grants[f.node_id],))) for f in m.fetches),
            media=tuple(replace(e, ticket=replace(e.ticket, grants=(grants[e.node_id],))) for e in m.media),
        )
        for m in micro_batches
    ]


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
    mini_batch_trajectories: int | None = None,
    admitted_at: float | None = None,
) -> RankPlan:
    """The plan of one rank for mini-batch ``n`` (trained at policy version ``n``).

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
        mini_batch_trajectories, admitted_at: the whole mini-batch's trajectory count and admission
            time, passed on to the trainer.
    """
    docs = [_micro_batch(job, i, pairs, where, endpoint, columns) for i, pairs in enumerate(micro_batches)]
    if sign is not None:
        docs = _sign(docs, sign)
    return RankPlan(
        plan_id=PlanId(n=n, attempt=attempt, rank=rank),
        job=job,
        rank=rank,
        step=step,
        mini_batch_index=k,
        global_index=n,
        policy_version=n,
        num_tokens=sum(d.num_tokens for d in docs),
        micro_batches=tuple(docs),
        mini_batch_trajectories=mini_batch_trajectories,
        admitted_at=admitted_at,
    )
