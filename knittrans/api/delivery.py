"""Plan delivery to the trainer's ranks: next plan, prefetch (``after``), fetched, ack, policy versions."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

from knittrans.api.entries import MiniBatch
from knittrans.api.jobbase import JobBase
from knittrans.api.planjson import render_rank_plan_json
from knittrans.api.records import Kind, mb_key, rank_key, rank_keys_prefix, version_key
from knittrans.api.store import Encoded, Txn
from knittrans.descriptors import GroupRecord
from knittrans.errors import Conflict, DataLost, InvalidRequest, KnitTransError, NotFound
from knittrans.grants import sign_grant
from knittrans.plans import PlanId
from knittrans.sched.staleness import ConsumedGroup

__all__ = ["ANSWER_CHUNK", "Answer", "Delivery"]

ANSWER_CHUNK = 128
"""Ranks whose answers the plan board gets in one post (:meth:`Delivery.answer_chunks`)."""

Answer = tuple[bytes | None, str, bool]
"""What ``next`` (without ``after``) answers a rank now: ``(plan JSON, job state, done)``; the plan is
None while the rank's next mini-batch is not admitted, and ``done`` says none will ever come."""


class Delivery(JobBase):
    """Rank plans (rendered once per rank and mini-batch), fetch reports, acks and versions."""

    # ------------------------------------------------------------------ plans and acks
    def next_plan(self, rank: int) -> bytes | None:
        """The plan (JSON) of ``rank``'s next un-acked mini-batch, or None when it is not admitted yet."""
        self._check_rank(rank)
        mb = self.minibatches.get(self.rank_cursor(rank))
        if mb is None or mb.status != "planned":
            return None
        return self._plan_json(mb, rank)

    def answer(self, rank: int) -> Answer:
        """:data:`Answer` of ``rank`` (NotFound outside the world size)."""
        self._check_rank(rank)
        return self.answers((rank,))[rank]

    def answer_chunks(self, ranks: Collection[int] | None, size: int = ANSWER_CHUNK) -> Iterator[dict[int, Answer]]:
        """:meth:`answers` of ``ranks`` (None: every rank) in chunks of ``size`` ranks, rendered as they are
        taken: the plan board publishes each chunk at once, so the first ranks of a 1,024-rank
        admission get their plans while the last ones are still rendered."""
        todo = list(range(self.spec.world_size)) if ranks is None else list(ranks)
        for start in range(0, len(todo), size):
            yield self.answers(todo[start : start + size])

    def answers(self, ranks: Collection[int] | None) -> dict[int, Answer]:
        """:data:`Answer` of each of ``ranks`` (None: every rank), each plan rendered to JSON once.

        What the plan board publishes to the event loop after a change, so a waiting ``next`` is
        answered there without a state-thread hop or a second rendering.
        """
        out: dict[int, Answer] = {}
        done = self.done()
        for rank in range(self.spec.world_size) if ranks is None else ranks:
            if not 0 <= rank < self.spec.world_size:
                continue
            cursor = self.rank_cursor(rank)
            mb = self.minibatches.get(cursor)
            if mb is not None and mb.status == "planned":
                out[rank] = (self._plan_json(mb, rank), self.state, False)
            else:
                out[rank] = (None, self.state, done and cursor >= self.next_n)
        return out

    def plan_after(self, rank: int, plan_id: str) -> bytes | None:
        """The plan (JSON) of the mini-batch after ``plan_id`` (the rank's current or just-acked plan), or None.

        Lets a rank prefetch mini-batch ``n+1`` while it still trains ``n``; acks stay in order. Once
        ``n`` is acked, ``n+1`` is the rank's current mini-batch and this is the same as :meth:`next_plan`
        (a poll for it that was in flight across the ack still gets it).

        Raises:
            NotFound: ``plan_id`` is not a plan of this rank that was issued.
            DataLost: ``plan_id`` was withdrawn (its rows were on a lost node).
            Conflict: ``plan_id`` is neither the rank's current plan nor the one acked just before it
                (an earlier one is open, or the one after it is acked too).
        """
        mb = self._current(rank, plan_id)
        if rank in mb.acks or mb.status == "consumed":
            if self.rank_cursor(rank) != mb.n + 1:
                raise Conflict(
                    f"plan {plan_id!r} and the one after it are already acked; ask for the next plan without 'after'"
                )
            return self.next_plan(rank)
        nxt = self.minibatches.get(mb.n + 1)
        if nxt is None or nxt.status != "planned":
            return None
        return self._plan_json(nxt, rank)

    def done_after(self, rank: int, plan_id: str) -> bool:
        """Whether no mini-batch will ever follow ``plan_id`` (checked like :meth:`plan_after`)."""
        mb = self._current(rank, plan_id)
        if self.next_n > mb.n + 1:
            return False
        total = self.spec.total_steps
        return self.done() or self.drain_closed or (total is not None and self.next_n >= total * self.K)

    def _current(self, rank: int, plan_id: str) -> MiniBatch:
        """The mini-batch of ``plan_id``, which must be ``rank``'s current one (or already acked by it)."""
        self._check_rank(rank)
        parsed = PlanId.parse(plan_id)
        if parsed is None or parsed.rank != rank:
            raise NotFound(f"plan {plan_id!r} is not a plan of rank {rank} of job {self.name!r}")
        n, attempt = parsed.n, parsed.attempt
        if n < self.evicted_below:  # consumed long ago: its entry left memory (any attempt answers as consumed)
            return MiniBatch(
                n=n,
                step=n // self.K,
                k=n % self.K,
                attempt=attempt,
                group_ids=[],
                counts={},
                admitted_at=0.0,
                layout=[],
                status="consumed",
            )
        mb = self.minibatches.get(n)
        if mb is None or mb.attempt != attempt:
            if attempt <= self.attempts.get(n, -1):
                raise DataLost(f"plan {plan_id!r} was withdrawn (rows on a lost node); ask for the next plan again")
            raise NotFound(f"plan {plan_id!r} was never issued")
        if mb.status == "consumed" or rank in mb.acks:
            return mb
        cursor = self.rank_cursor(rank)
        if n != cursor:
            raise Conflict(f"rank {rank} must ack mini-batch {cursor} before {n}")
        return mb

    def _plan_json(self, mb: MiniBatch, rank: int) -> bytes:
        """``rank``'s plan of ``mb`` as the JSON bytes ``next`` answers, rendered once per rank and mini-batch
        (straight from the layout: :func:`~knittrans.api.planjson.render_rank_plan_json`)."""
        raw = mb.rendered_json.get(rank)
        if raw is None:
            raw = render_rank_plan_json(self.name, mb.layout[rank], **self._render_args(mb, rank))
            mb.rendered_json[rank] = raw
        return raw

    def _render_args(self, mb: MiniBatch, rank: int) -> dict[str, Any]:
        sign = None
        if self.ticket_key is not None:
            key, expires = self.ticket_key, mb.admitted_at + self.ticket_ttl_s
            cols = self.spec.columns

            def sign(reads: dict[str, list[tuple[int, int]]], media: dict[str, str]) -> str:
                return sign_grant(
                    key, job=self.name, rank=rank, expires_at=expires, reads=reads, columns=cols, media=media
                )

        if mb.rows is None:  # summed once per mini-batch, not once per rank (W x W at 1,024 ranks)
            mb.rows = sum(len(micro) for share in mb.layout for micro in share)
        return {
            "rank": rank,
            "n": mb.n,
            "attempt": mb.attempt,
            "step": mb.step,
            "k": mb.k,
            "where": self._where,
            "endpoint": self._endpoint,
            "columns": self.spec.columns,
            "sign": sign,
            "mini_batch_trajectories": mb.rows,
            "admitted_at": mb.admitted_at,
        }

    def _where(self, group_id: str) -> tuple[GroupRecord, str, str]:
        entry = self.groups[group_id]
        return entry.record, entry.unit_id, entry.node_id

    def forget_rendered(self) -> None:
        """Drop rendered plans (a node's endpoint changed: tickets must carry the new one)."""
        for mb in self.minibatches.values():
            mb.rendered_json.clear()

    def fetched(self, rank: int, plan_id: str, txn: Txn) -> dict[str, Any]:
        """Record that ``rank`` holds its whole share of ``plan_id`` (before its optimizer step); idempotent.

        Once every rank reported it, the mini-batch no longer depends on any store node and survives
        a node loss; until then a node loss withdraws it and this call raises :class:`DataLost`.
        """
        mb = self._current(rank, plan_id)
        if mb.status == "planned" and rank not in mb.acks and rank not in mb.fetched:
            mb.fetched.add(rank)
            txn.put(Kind.FETCHED, self.name, rank_key(mb.n, rank), {"attempt": mb.attempt})
        return {"plan_id": plan_id, "global_index": mb.n, "fetched_ranks": len(mb.fetched | mb.acks)}

    def ack(self, rank: int, plan_id: str, txn: Txn) -> dict[str, Any]:
        """Record that ``rank`` finished plan ``plan_id``; idempotent; consumes the mini-batch at W acks."""
        result = self._ack(rank, plan_id, txn)
        if not result["duplicate"]:
            self._settle(txn)
            self._save_meta(txn)
        return result

    def ack_many(self, acks: Sequence[tuple[int, str]], txn: Txn) -> list[dict[str, Any] | KnitTransError]:
        """:meth:`ack` of each ``(rank, plan_id)`` in order, in one transaction (group commit).

        A bad ack (unknown, withdrawn or out-of-order plan) is refused before it changes anything; its
        error takes its place in the result and the others still apply.
        """
        results: list[dict[str, Any] | KnitTransError] = []
        changed = False
        for rank, plan_id in acks:
            try:
                result = self._ack(rank, plan_id, txn)
            except KnitTransError as exc:
                results.append(exc)
                continue
            changed |= not result["duplicate"]
            results.append(result)
        if changed:
            self._settle(txn)
            self._save_meta(txn)
        return results

    def _ack(self, rank: int, plan_id: str, txn: Txn) -> dict[str, Any]:
        mb = self._current(rank, plan_id)
        n, attempt = mb.n, mb.attempt
        if mb.status == "consumed" or rank in mb.acks:
            return {"plan_id": plan_id, "global_index": n, "consumed": mb.status == "consumed", "duplicate": True}
        mb.acks.add(rank)
        txn.put(Kind.ACK, self.name, rank_key(n, rank), Encoded(f'{{"attempt":{attempt}}}'))  # = {"attempt": attempt}
        consumed = len(mb.acks) == self.spec.world_size
        if consumed:
            self._consume(mb, txn)
        return {"plan_id": plan_id, "global_index": n, "consumed": consumed, "duplicate": False}

    def _consume(self, mb: MiniBatch, txn: Txn) -> None:
        records = []
        for gid in mb.group_ids:
            entry = self.groups[gid]
            self._set(entry, "consumed", txn, mb.n)
            r = entry.record
            records.append(
                ConsumedGroup(
                    group_id=gid,
                    source=r.source,
                    num_trajectories=r.num_trajectories,
                    v_train=mb.n,
                    mini_batch_index=mb.k,
                    step=mb.step,
                    version_start=r.version_start,
                    version_end=r.version_end,
                    version_weighted=r.version_weighted,
                )
            )
        self.consumed.add(records)
        self.consumed_mini_batches += 1
        self.retire(mb.group_ids)
        mb.status, mb.layout, mb.rendered_json = "consumed", [], {}
        mb.acks, mb.fetched = set(), set()  # W ints each: a consumed mini-batch needs neither
        while (m := self.minibatches.get(self.first_unconsumed)) is not None and m.status == "consumed":
            self.first_unconsumed += 1
        self.evict_consumed()
        txn.put(Kind.MINI_BATCH, self.name, mb_key(mb.n), mb.to_json())
        # = asdict(r) (flat fields of scalars, in field order) without its recursive copy: 128 records a mini-batch
        txn.put(Kind.CONSUMED, self.name, mb_key(mb.n), [dict(vars(r)) for r in records])
        prefix = rank_keys_prefix(mb.n)  # W records each: one range delete, not W deletes
        txn.delete_prefix(Kind.ACK, self.name, prefix)
        txn.delete_prefix(Kind.FETCHED, self.name, prefix)

    def report_version(self, rank: int, version: int, txn: Txn) -> int:
        """Record ``rank``'s policy version after an optimizer step; versions never go back."""
        self._check_rank(rank)
        if version < 0:
            raise InvalidRequest(f"version {version} must be >= 0")
        old = self.rank_versions.get(rank, 0)
        if version < old:
            raise Conflict(f"rank {rank} already reported version {old}; versions never decrease")
        self.rank_versions[rank] = version
        txn.put(Kind.VERSION, self.name, version_key(rank), version)
        return self.version

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.spec.world_size:
            raise NotFound(f"rank {rank} is outside the job's world_size {self.spec.world_size} (0..W-1)")
