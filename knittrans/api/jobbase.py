"""The state of one job, the views every part reads and the record writes every part shares."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from knittrans.api.consumed import ConsumedLedger
from knittrans.api.entries import GroupEntry, MiniBatch
from knittrans.api.records import META_KEY, Kind
from knittrans.api.settings import RECENT_ADMISSIONS
from knittrans.api.spec import JobSpec
from knittrans.api.store import Txn
from knittrans.descriptors import UnitDescriptor
from knittrans.errors import Conflict
from knittrans.lifecycle import (
    ADMITTING,
    GROUP_MOVES,
    JOB_MOVES,
    REPLACEABLE,
    TERMINAL,
    GroupStatus,
    JobAction,
    JobStatus,
    job_move,
)
from knittrans.sched.admission import make_policy, quota_deficit
from knittrans.sched.timing import launch_headroom, launch_order, launchable
from knittrans.sched.types import StepState

__all__ = ["JobBase"]


class JobBase:
    """State of one job, its derived views, lifecycle and shared record writes (no HTTP, no SQL)."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        endpoint: Callable[[str], str],
        node_state: Callable[[str], str | None],
        recent_admissions: int = RECENT_ADMISSIONS,
        ticket_key: bytes | None = None,
        ticket_ttl_s: float = 86400.0,
    ) -> None:
        self.spec = spec
        self.ticket_key = ticket_key
        self.ticket_ttl_s = ticket_ttl_s
        self.name = spec.name
        self.state: JobStatus = "running"
        self.next_n = 0
        self.attempts: dict[int, int] = {}
        self.quota_changes: list[tuple[int, dict[str, int]]] = [(0, dict(spec.quotas))]
        self.meta_saved: dict[str, Any] | None = None
        """The meta record as last put in a change (None: write it with the next one)."""
        self.units: dict[str, UnitDescriptor] = {}
        self.unit_batches = 0
        self.groups: dict[str, GroupEntry] = {}
        self.unadmitted: dict[str, GroupEntry] = {}
        """Finished, unadmitted groups (live node or not)."""
        self.group_counts: dict[tuple[str, GroupStatus], int] = {}
        """Groups per ``(source, status)``, kept in step with :attr:`groups` (status and metrics in O(1))."""
        self.retired_groups: set[str] = set()
        """Ids of consumed groups: their entries are dropped from :attr:`groups` (memory flat over a long job)."""
        self.retired_units: set[str] = set()
        """Ids of units whose every group was consumed: dropped from :attr:`units`; registering one again is
        a duplicate (a no-op), like for a unit still held."""
        self.position = 0
        """Trainer position: the lowest global index not acked by every rank (``knittrans.sched.timing``); the
        mini-batches below it are exactly the consumed ones (a rank acks in order: :meth:`rank_cursor`)."""
        self.minibatches: dict[int, MiniBatch] = {}
        """Admitted mini-batches by global index, from :attr:`evicted_below` on (see :meth:`evict_consumed`)."""
        self.evicted_below = 0
        """Mini-batches below this index were consumed and their entries (and attempts) dropped from memory;
        their records stay in the database. Keeps a long job's memory flat."""
        self.rank_versions: dict[int, int] = {}
        self.started: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.finished_count: Counter[str] = Counter()
        self.started_ids: set[str] = set()
        self.request_ids: set[str] = set()
        self.consumed = ConsumedLedger()
        """Consumed groups, compacted (exact running summaries + the latest steps)."""
        self.to_regenerate: dict[str, dict[str, Any]] = {}
        self.admissions: deque[dict[str, Any]] = deque(maxlen=recent_admissions)
        self._endpoint = endpoint
        self._node_state = node_state
        """``alive`` or ``lost`` of a store node; None for one that never registered."""
        self._policy = make_policy(spec.policy)
        self._timing = spec.timing
        self.peak_admitted_ahead = 0
        """Most mini-batches admitted beyond the trainer's position at any admission (since this process began)."""
        self.peak_untaken = 0
        """Most groups launched but not in a started mini-batch at any supply report (since this process began)."""

    # ------------------------------------------------------------------ derived views
    @property
    def K(self) -> int:
        return self.spec.mini_batches_per_step

    def quotas_for_step(self, step: int) -> dict[str, int]:
        """Quotas in force for train step ``step``."""
        return next(quotas for from_step, quotas in reversed(self.quota_changes) if from_step <= step)

    def admitted_in_step(self, step: int) -> dict[str, int]:
        """``a[s]``: groups admitted so far in ``step`` (planned or consumed mini-batches; asked of the steps of
        the trainer's position and after, whose mini-batches are all kept: :meth:`evict_consumed`)."""
        a = dict.fromkeys(self.quotas_for_step(step), 0)
        for n in range(step * self.K, min(self.next_n, (step + 1) * self.K)):
            for s, c in self.minibatches[n].counts.items():
                a[s] = a.get(s, 0) + c
        return a

    def pending(self) -> dict[str, int]:
        """``P[s]``: groups started and neither finished nor dropped."""
        sources = set(self.started) | set(self.quotas_for_step(self.next_n // self.K))
        return {s: max(0, self.started[s] - self.finished_count[s] - self.dropped[s]) for s in sorted(sources)}

    def pool(self) -> list[GroupEntry]:
        """Finished, unadmitted groups on live nodes, earliest finished first (ties by group id)."""
        alive: dict[str, bool] = {}  # one liveness check per node, not per group
        live = []
        by_finish = sorted(self.unadmitted.values(), key=lambda g: (g.record.finished_at, g.record.group_id))
        for g in by_finish:  # groups arrive nearly in finish order: the sort is close to linear
            ok = alive.get(g.node_id)
            if ok is None:
                ok = alive[g.node_id] = self._node_state(g.node_id) == "alive"
            if ok:
                live.append(g)
        return live

    def step_state(self) -> StepState:
        """What the policy sees when forming the next mini-batch."""
        step, k = divmod(self.next_n, self.K)
        quotas = self.quotas_for_step(step)
        return StepState(
            quotas=quotas,
            admitted=self.admitted_in_step(step),
            finished=[g.view for g in self.pool() if g.record.source in quotas],
            pending=self.pending(),
            mini_batch_index=k,
            mini_batches_per_step=self.K,
            bounds=self.spec.bounds,
            current_version=self.next_n,
            max_staleness=self.spec.max_staleness,
        )

    def evict_consumed(self) -> None:
        """Drop consumed mini-batches no question needs any more: those before both the one acked just
        before the trainer's position (duplicate acks of it) and the step of the trainer's position
        (:meth:`admitted_in_step`). Progress on an evicted index is answered as consumed.

        The step of the position, not of the next index: a node loss withdraws the untouched mini-batches
        from the first one on (never before the position), and admission then counts that step's
        consumed ones again; they must still be here.
        """
        keep_from = min(self.position - 1, (self.position // self.K) * self.K)
        while self.evicted_below < keep_from:
            self.minibatches.pop(self.evicted_below, None)
            self.attempts.pop(self.evicted_below, None)
            self.evicted_below += 1

    def rank_cursor(self, rank: int) -> int:
        """Lowest mini-batch index ``rank`` has not acked."""
        n = self.position
        while True:
            mb = self.minibatches.get(n)
            if mb is None or (mb.status != "consumed" and rank not in mb.acks):
                return n
            n += 1

    def in_flight(self) -> list[MiniBatch]:
        """Admitted mini-batches not consumed yet, in order: every one from the trainer's position on (those below it
        are consumed, those from it to :attr:`next_n` planned; a node loss withdraws from one on and lowers it)."""
        return [self.minibatches[n] for n in range(self.position, self.next_n)]

    def untaken(self) -> dict[str, int]:
        """Per source: groups launched, not dropped, and not in a mini-batch the trainer has started.

        That is pending (generating) + finished unadmitted on live nodes + in admitted mini-batches beyond
        the trainer's position. Lost and expired groups left the count when they were retired.
        """
        out = Counter(self.pending())
        for g in self.unadmitted.values():
            if self._node_state(g.node_id) == "alive":
                out[g.record.source] += 1
        for mb in self.in_flight()[1:]:
            out.update(mb.counts)
        if self.spec.train_batch_handover == "step":
            self._hand_over_step(out)
        return out

    def _hand_over_step(self, untaken: dict[str, int]) -> None:
        """``train_batch_handover: step``: once the trainer has started a step, the step's groups not in a started
        mini-batch left the window too (the trainer was handed the whole train batch; ``train_batch`` admits a
        step's first mini-batch only when all of it has finished, so they are in the pool or admitted ahead)."""
        p = self.position
        step = p // self.K
        if p == self.next_n and p % self.K == 0:
            return  # the step's first mini-batch is not admitted yet: the trainer has not started the step
        end = min(self.next_n, (step + 1) * self.K)
        admitted = self.admitted_in_step(step)
        for source, quota in self.quotas_for_step(step).items():
            ahead = sum(self.minibatches[n].counts.get(source, 0) for n in range(p + 1, end))
            released = quota - admitted.get(source, 0) + ahead
            untaken[source] = max(0, untaken.get(source, 0) - released)

    def headroom(self) -> dict[str, Any]:
        """What rollout may launch now under the window ``W`` (trainer progress, not admission, frees it)."""
        quotas = self.quotas_for_step(self.next_n // self.K)
        untaken = self.untaken()
        launched = {s: self.started[s] - self.dropped[s] for s in quotas}
        room = self._timing.room(quotas, untaken)
        allowed = launchable(quotas, launched)
        idle = self.next_n <= self.position  # every admitted mini-batch acked: the trainer waits on rollout
        deficit = quota_deficit(self.step_state()) if idle and self.can_admit() else {}
        headroom = launch_headroom(quotas, room, allowed, deficit=deficit, trainer_idle=idle)
        return {
            "state": self.state,
            "position": self.position,
            "next_global_index": self.next_n,
            "lookahead": self.spec.lookahead,
            "window": self.spec.window,
            "room": room,
            "untaken": untaken,
            "headroom": headroom,
            "launch_order": launch_order(quotas, launched),
            "to_regenerate": sorted(self.to_regenerate.values(), key=lambda r: (r["at"], r["group_id"])),
        }

    @property
    def version(self) -> int:
        """Latest policy version reported by any rank (0 before the first report)."""
        return max(self.rank_versions.values(), default=0)

    def done(self) -> bool:
        """Whether the job will never plan another mini-batch."""
        return self.state in TERMINAL

    # ------------------------------------------------------------------ persistence helpers
    def count_group(self, entry: GroupEntry, delta: int) -> None:
        """Add ``delta`` to the count of ``entry``'s (source, status)."""
        key = (entry.record.source, entry.status)
        self.group_counts[key] = self.group_counts.get(key, 0) + delta

    def retire(self, group_ids: Sequence[str]) -> None:
        """Forget consumed groups (and units all of whose groups are consumed), keeping their ids.

        Their counts stay in :attr:`group_counts`; their staleness is in :attr:`consumed`; the store keeps
        their records. What stays in memory per consumed group is its id.
        """
        units: set[str] = set()
        for gid in group_ids:  # each held: a consumed mini-batch's groups, each in one mini-batch record only
            entry = self.groups.pop(gid)
            self.retired_groups.add(gid)
            units.add(entry.unit_id)
        for unit_id in units:
            unit = self.units.get(unit_id)
            if unit is not None and not any(
                (e := self.groups.get(g.group_id)) is not None and e.unit_id == unit_id for g in unit.groups
            ):
                del self.units[unit_id]
                self.retired_units.add(unit_id)

    def _set(self, entry: GroupEntry, status: GroupStatus, txn: Txn, mini_batch: int | None = None) -> None:
        """Move a group to ``status``, keeping the unadmitted index, the counts and the store in step."""
        assert status in GROUP_MOVES[entry.status], f"group {entry.record.group_id}: {entry.status} -> {status}"
        self.count_group(entry, -1)
        entry.status, entry.mini_batch = status, mini_batch
        self.count_group(entry, 1)
        gid = entry.record.group_id
        if status == "finished":
            self.unadmitted[gid] = entry
        else:
            self.unadmitted.pop(gid, None)
        if status in REPLACEABLE:  # planned/consumed follow from the mini-batch records
            txn.put(Kind.GROUP, self.name, gid, {"unit_id": entry.unit_id, "status": status})

    def _save_meta(self, txn: Txn) -> None:
        meta = {
            "spec": self.spec.to_dict(),
            "state": self.state,
            "next_n": self.next_n,
            "attempts": {str(n): a for n, a in self.attempts.items()},
            "quota_changes": [[s, q] for s, q in self.quota_changes],
        }
        if meta != self.meta_saved:  # an admission attempt that changed nothing writes nothing
            txn.put(Kind.JOB, self.name, META_KEY, meta)
            self.meta_saved = meta

    def _save_supply(self, txn: Txn, source: str) -> None:
        counts = {"started": self.started, "dropped": self.dropped, "finished": self.finished_count}
        txn.put(Kind.SUPPLY, self.name, source, {k: per_source[source] for k, per_source in counts.items()})

    def _regenerate(self, txn: Txn, entry: GroupEntry, reason: str) -> None:
        """Offer a lost or expired group for regeneration (``reason`` says why)."""
        body = {
            "group_id": entry.record.group_id,
            "source": entry.record.source,
            "reason": reason,
            "unit_id": entry.unit_id,
            "node_id": entry.node_id,
            "at": time.time(),
        }
        self.to_regenerate[entry.record.group_id] = body
        txn.put(Kind.TO_REGENERATE, self.name, entry.record.group_id, body)

    # ------------------------------------------------------------------ lifecycle
    def set_state(self, action: JobAction, txn: Txn) -> None:
        """Apply ``pause``, ``resume`` or ``drain``; raise :class:`Conflict` when not allowed now."""
        target = job_move(self.state, action)
        if target == self.state:
            return
        if target is None:
            allowed = [s for s, event in JOB_MOVES if event == action]
            raise Conflict(f"job {self.name!r} is {self.state}; {action} needs it to be {' or '.join(allowed)}")
        self.state = target
        self._save_meta(txn)

    def update_quotas(self, quotas: Mapping[str, int]) -> int:
        """Set quotas from the next train step on (checked like a spec with them); returns that step."""
        replace(self.spec, quotas=dict(quotas))  # raises InvalidJobSpec naming the field
        if self.done():
            raise Conflict(f"job {self.name!r} is {self.state}; its quotas can no longer change")
        from_step = -(-self.next_n // self.K)
        self.quota_changes = [c for c in self.quota_changes if c[0] < from_step] + [(from_step, dict(quotas))]
        return from_step

    @property
    def drain_closed(self) -> bool:
        """A draining job reached a step boundary: it admits nothing more (the one place of that rule)."""
        return self.state == "draining" and self.next_n % self.K == 0

    def can_admit(self) -> bool:
        """Whether the lifecycle lets the next mini-batch be admitted."""
        if self.state not in ADMITTING or self.drain_closed:
            return False
        total = self.spec.total_steps
        return total is None or self.next_n < total * self.K

    def _settle(self) -> None:
        """Move draining -> drained and running -> completed once nothing is left to train."""
        idle = self.position >= self.next_n  # mini-batches 0..next_n-1 exist: all consumed
        if self.next_n % self.K == 0 and idle:
            self.state = job_move(self.state, "drained") or self.state  # only a draining job drains
        total = self.spec.total_steps
        if total is not None and self.next_n >= total * self.K and idle:
            self.state = job_move(self.state, "completed") or self.state  # a drained job stays drained
