"""Plain-Python state of one job: unit index, supply, admission, rank plans, acks, versions, staleness.

No HTTP and no SQL here: every method that changes state records its writes in a :class:`Txn`
that the service commits before answering. Methods validate first and mutate after, so a
rejected request leaves the state untouched.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from knittrans.api.consumed import ConsumedLedger
from knittrans.api.entries import GroupEntry, MiniBatch, mb_key
from knittrans.api.plans import layout_of, parse_plan_id, render_rank_plan, unit_json
from knittrans.api.settings import RECENT_ADMISSIONS
from knittrans.api.spec import JobSpec, check_quotas
from knittrans.api.store import Txn
from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.errors import Conflict, DataLost, InvalidRequest, NotFound
from knittrans.grants import sign_grant
from knittrans.sched.admission import expired, make_policy, quota_deficit
from knittrans.sched.assign import assign_mini_batch
from knittrans.sched.staleness import ConsumedGroup
from knittrans.sched.timing import admitted_ahead, launch_headroom, launch_order, launchable
from knittrans.sched.types import StepState

__all__ = ["JOB_STATES", "JobState"]

logger = logging.getLogger(__name__)

JOB_STATES = ("running", "paused", "draining", "drained", "completed")
"""Lifecycle: running <-> paused; running/paused -> draining -> drained; total_steps reached -> completed."""

_HEX = frozenset("0123456789abcdef")


class JobState:
    """State and rules of one job; the service owns persistence and the node registry."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        endpoint: Callable[[str], str],
        node_alive: Callable[[str], bool],
        recent_admissions: int = RECENT_ADMISSIONS,
        clock: Callable[[], float] = time.time,
        ticket_key: bytes | None = None,
        ticket_ttl_s: float = 86400.0,
    ) -> None:
        self.spec = spec
        self.ticket_key = ticket_key
        """Key that signs plan tickets (shared with the stores); None leaves them unsigned."""
        self.ticket_ttl_s = ticket_ttl_s
        """Grants expire this long after their mini-batch was admitted (stable across restarts)."""
        self.name = spec.name
        self.state = "running"
        self.next_n = 0
        self.attempts: dict[int, int] = {}
        self.quota_changes: list[tuple[int, dict[str, int]]] = [(0, dict(spec.quotas))]
        self.units: dict[str, UnitDescriptor] = {}
        self.unit_batches = 0
        self.groups: dict[str, GroupEntry] = {}
        self.unadmitted: dict[str, GroupEntry] = {}
        self.group_counts: dict[tuple[str, str], int] = {}
        """Groups per ``(source, status)``, kept in step with :attr:`groups` (status and metrics in O(1))."""
        self.lost: dict[str, GroupEntry] = {}
        """Groups whose status is ``lost``."""
        self.retired_groups: set[str] = set()
        """Ids of consumed groups: their entries are dropped from :attr:`groups` (memory flat over a long job)."""
        self.retired_units: set[str] = set()
        """Ids of units whose every group was consumed: dropped from :attr:`units`; registering one again is
        a duplicate (a no-op), like for a unit still held."""
        self.first_unconsumed = 0
        self.minibatches: dict[int, MiniBatch] = {}
        self.rank_versions: dict[int, int] = {}
        self.started: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.finished_count: dict[str, int] = {}
        self.started_ids: set[str] = set()
        self.request_ids: set[str] = set()
        self.consumed = ConsumedLedger()
        """Consumed groups, compacted (exact running summaries + the latest steps)."""
        self.consumed_mini_batches = 0
        self.to_regenerate: dict[str, dict[str, Any]] = {}
        self.admissions: deque[dict[str, Any]] = deque(maxlen=recent_admissions)
        self._endpoint = endpoint
        self._node_alive = node_alive
        self._clock = clock
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
        current = self.quota_changes[0][1]
        for from_step, quotas in self.quota_changes:
            if from_step <= step:
                current = quotas
        return current

    def admitted_in_step(self, step: int) -> dict[str, int]:
        """``a[s]``: groups admitted so far in ``step`` (planned or consumed mini-batches)."""
        a = dict.fromkeys(self.quotas_for_step(step), 0)
        for n in range(step * self.K, min(self.next_n, (step + 1) * self.K)):
            mb = self.minibatches.get(n)
            if mb is not None:
                for s, c in mb.counts.items():
                    a[s] = a.get(s, 0) + c
        return a

    def pending(self) -> dict[str, int]:
        """``P[s]``: groups started and neither finished nor dropped."""
        sources = set(self.started) | set(self.quotas_for_step(self.next_n // self.K))
        return {
            s: max(0, self.started.get(s, 0) - self.finished_count.get(s, 0) - self.dropped.get(s, 0))
            for s in sorted(sources)
        }

    def pool(self) -> list[GroupEntry]:
        """Finished, unadmitted groups on live nodes, earliest finished first (ties by group id)."""
        live = [g for g in self.unadmitted.values() if self._node_alive(g.node_id)]
        live.sort(key=lambda g: (g.record.finished_at, g.record.group_id))
        return live

    def step_state(self, n: int | None = None) -> StepState:
        """What the policy sees when forming mini-batch ``n`` (default: the next one)."""
        n = self.next_n if n is None else n
        step, k = divmod(n, self.K)
        quotas = self.quotas_for_step(step)
        return StepState(
            quotas=quotas,
            admitted=self.admitted_in_step(step),
            finished=[g.view for g in self.pool() if g.record.source in quotas],
            pending=self.pending(),
            mini_batch_index=k,
            mini_batches_per_step=self.K,
            bounds=self.spec.bounds,
            current_version=n,
            max_staleness=self.spec.max_staleness,
        )

    def rank_cursor(self, rank: int) -> int:
        """Lowest mini-batch index ``rank`` has not acked."""
        n = self.first_unconsumed
        while True:
            mb = self.minibatches.get(n)
            if mb is None or (mb.status != "consumed" and rank not in mb.acks):
                return n
            n += 1

    def in_flight(self) -> list[MiniBatch]:
        """Admitted mini-batches not consumed yet, in order (only those beyond the trainer's position)."""
        return [
            mb for n in range(self.first_unconsumed, self.next_n) if (mb := self.minibatches[n]).status == "planned"
        ]

    @property
    def position(self) -> int:
        """Trainer position: the lowest global index not acked by every rank (``knittrans.sched.timing``)."""
        return self.first_unconsumed

    def untaken(self) -> dict[str, int]:
        """Per source: groups launched, not dropped, and not in a mini-batch the trainer has started.

        That is pending (generating) + finished unadmitted on live nodes + in admitted mini-batches beyond
        the trainer's position. Lost and expired groups left the count when they were retired.
        """
        out = dict(self.pending())
        for g in self.unadmitted.values():
            if self._node_alive(g.node_id):
                out[g.record.source] = out.get(g.record.source, 0) + 1
        for n in range(self.position + 1, self.next_n):
            mb = self.minibatches.get(n)
            if mb is not None and mb.status == "planned":
                for source, count in mb.counts.items():
                    out[source] = out.get(source, 0) + count
        return out

    def headroom(self) -> dict[str, Any]:
        """What rollout may launch now under the window ``W`` (trainer progress, not admission, frees it)."""
        quotas = self.quotas_for_step(self.next_n // self.K)
        untaken = self.untaken()
        launched = {s: self.started.get(s, 0) - self.dropped.get(s, 0) for s in quotas}
        room = self._timing.room(quotas, untaken)
        allowed = launchable(quotas, launched)
        idle = self.next_n <= self.position  # every admitted mini-batch acked: the trainer waits on rollout
        deficit = quota_deficit(self.step_state()) if idle and not self.done() and self.can_admit() else {}
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
        return self.state in ("drained", "completed")

    # ------------------------------------------------------------------ persistence helpers
    def count_group(self, entry: GroupEntry, delta: int) -> None:
        """Add ``delta`` to the count of ``entry``'s (source, status) (and the lost index)."""
        key = (entry.record.source, entry.status)
        self.group_counts[key] = self.group_counts.get(key, 0) + delta
        if entry.status == "lost":
            if delta > 0:
                self.lost[entry.record.group_id] = entry
            else:
                self.lost.pop(entry.record.group_id, None)

    def recount_groups(self) -> None:
        """Rebuild :attr:`group_counts` and :attr:`lost` from :attr:`groups` (after a restore)."""
        self.group_counts, self.lost = {}, {}
        for entry in self.groups.values():
            self.count_group(entry, 1)

    def retire(self, group_ids: Sequence[str]) -> None:
        """Forget consumed groups (and units all of whose groups are consumed), keeping their ids.

        Their counts stay in :attr:`group_counts`; their staleness is in :attr:`consumed`; the store keeps
        their records. What stays in memory per consumed group is its id.
        """
        units: set[str] = set()
        for gid in group_ids:
            entry = self.groups.pop(gid, None)
            if entry is not None:
                self.retired_groups.add(gid)
                units.add(entry.unit_id)
        for unit_id in units:
            unit = self.units.get(unit_id)
            if unit is not None and not any(
                (e := self.groups.get(g.group_id)) is not None and e.unit_id == unit_id for g in unit.groups
            ):
                del self.units[unit_id]
                self.retired_units.add(unit_id)

    def _set(self, entry: GroupEntry, status: str, txn: Txn, mini_batch: int | None = None) -> None:
        """Move a group to ``status``, keeping the unadmitted index, the counts and the store in step."""
        self.count_group(entry, -1)
        entry.status, entry.mini_batch = status, mini_batch
        self.count_group(entry, 1)
        gid = entry.record.group_id
        if status == "finished":
            self.unadmitted[gid] = entry
        else:
            self.unadmitted.pop(gid, None)
        if status in ("lost", "expired"):  # planned/consumed follow from the mini-batch records
            txn.put("group", self.name, gid, {"unit_id": entry.unit_id, "status": status})

    def meta_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "state": self.state,
            "next_n": self.next_n,
            "attempts": {str(n): a for n, a in self.attempts.items()},
            "quota_changes": [[s, q] for s, q in self.quota_changes],
        }

    def _save_meta(self, txn: Txn) -> None:
        txn.put("job", self.name, "meta", self.meta_json())

    def _save_supply(self, txn: Txn, source: str) -> None:
        txn.put(
            "supply",
            self.name,
            source,
            {
                "started": self.started.get(source, 0),
                "dropped": self.dropped.get(source, 0),
                "finished": self.finished_count.get(source, 0),
            },
        )

    # ------------------------------------------------------------------ lifecycle
    def set_state(self, action: str, txn: Txn) -> None:
        """Apply ``pause``, ``resume`` or ``drain``; raise :class:`Conflict` when not allowed now."""
        allowed = {"pause": ("running",), "resume": ("paused",), "drain": ("running", "paused")}[action]
        if self.state == {"pause": "paused", "resume": "running", "drain": "draining"}[action]:
            return
        if self.state not in allowed:
            raise Conflict(f"job {self.name!r} is {self.state}; {action} needs it to be {' or '.join(allowed)}")
        self.state = {"pause": "paused", "resume": "running", "drain": "draining"}[action]
        self._save_meta(txn)

    def update_quotas(self, quotas: Mapping[str, int], txn: Txn) -> int:
        """Set quotas from the next train step on; returns that step."""
        check_quotas(quotas, mini_batches_per_step=self.K, bounds=self.spec.bounds)
        if self.done():
            raise Conflict(f"job {self.name!r} is {self.state}; its quotas can no longer change")
        from_step = -(-self.next_n // self.K)
        self.quota_changes = [c for c in self.quota_changes if c[0] < from_step] + [(from_step, dict(quotas))]
        self._save_meta(txn)
        return from_step

    # ------------------------------------------------------------------ units and supply
    def check_units(self, units: Sequence[UnitDescriptor], node_state: Callable[[str], str | None]) -> None:
        """Raise for any unit of the batch that cannot be registered; changes nothing."""
        quotas = set().union(*(q for _, q in self.quota_changes))
        seen_groups: dict[str, str] = {}
        seen_units: set[str] = set()
        for u in units:
            if u.job != self.name:
                raise InvalidRequest(f"unit {u.unit_id!r} says job {u.job!r} but was sent to job {self.name!r}")
            if u.unit_id in seen_units:
                raise InvalidRequest(f"unit {u.unit_id!r} appears twice in the batch")
            seen_units.add(u.unit_id)
            state = node_state(u.node_id)
            if state is None:
                raise NotFound(f"unit {u.unit_id!r}: node {u.node_id!r} is not registered; POST /v1/nodes first")
            if state == "lost":
                raise Conflict(f"unit {u.unit_id!r}: node {u.node_id!r} was declared lost; register it again first")
            old = self.units.get(u.unit_id)
            if old is not None:
                if old != u:
                    raise Conflict(f"unit {u.unit_id!r} is already registered with a different descriptor")
                continue
            if u.unit_id in self.retired_units:  # consumed: only its id is kept, a retry is a duplicate
                continue
            for g in u.groups:
                if g.source not in quotas:
                    raise InvalidRequest(
                        f"unit {u.unit_id!r}: group {g.group_id!r} has source {g.source!r} "
                        f"without a quota; known sources: {sorted(quotas)}"
                    )
                if g.num_trajectories != self.spec.group_size:
                    raise InvalidRequest(
                        f"unit {u.unit_id!r}: group {g.group_id!r} has {g.num_trajectories} "
                        f"trajectories, the job's group_size is {self.spec.group_size}"
                    )
                for h in g.media_hashes:
                    if len(h) != 64 or not set(h) <= _HEX:
                        raise InvalidRequest(f"group {g.group_id!r}: media hash {h!r} is not 64 lower-case hex")
                prior = self.groups.get(g.group_id)
                if (
                    g.group_id in seen_groups
                    or (prior is not None and prior.status not in ("lost", "expired"))
                    or g.group_id in self.retired_groups
                ):
                    where = seen_groups.get(g.group_id) or (prior.unit_id if prior else "(consumed)")
                    raise Conflict(f"unit {u.unit_id!r}: group {g.group_id!r} is already registered in unit {where!r}")
                seen_groups[g.group_id] = u.unit_id

    def add_units(self, units: Sequence[UnitDescriptor], txn: Txn) -> int:
        """Register already-checked units; returns how many were new."""
        fresh = [u for u in units if u.unit_id not in self.units and u.unit_id not in self.retired_units]
        for u in fresh:
            self.units[u.unit_id] = u
            for g in u.groups:
                old = self.groups.get(g.group_id)
                if old is not None:  # replaces a lost or expired incarnation
                    txn.delete("group", self.name, g.group_id)
                    self.count_group(old, -1)
                entry = GroupEntry(record=g, unit_id=u.unit_id, node_id=u.node_id)
                self.groups[g.group_id] = entry
                self.count_group(entry, 1)
                if self.to_regenerate.pop(g.group_id, None) is not None:
                    txn.delete("lost", self.name, g.group_id)
                self._set(entry, "finished", txn)
                self.finished_count[g.source] = self.finished_count.get(g.source, 0) + 1
        if fresh:
            txn.put("units", self.name, f"{self.unit_batches:012d}", [unit_json(u) for u in fresh])
            self.unit_batches += 1
        for s in {g.source for u in units for g in u.groups}:
            self._save_supply(txn, s)
        return len(fresh)

    def add_supply(
        self,
        txn: Txn,
        *,
        started: Mapping[str, int],
        group_ids: Mapping[str, Sequence[str]],
        dropped: Mapping[str, int],
        request_id: str | None,
        regenerates: Sequence[str] = (),
    ) -> bool:
        """Count groups started (and dropped) per source; returns False for a repeated ``request_id``.

        ``regenerates`` names lost or expired groups whose replacements this report starts: they leave
        the list of groups to regenerate.
        """
        for what, counts in (("started", started), ("dropped", dropped)):
            for s, c in counts.items():
                if c < 0:
                    raise InvalidRequest(f"{what}.{s}: {c} must be >= 0")
        quotas = set().union(*(q for _, q in self.quota_changes))
        for what, per_source in (("started", started), ("dropped", dropped), ("group_ids", group_ids)):
            for s in per_source:
                if s not in quotas:
                    raise InvalidRequest(f"{what}.{s}: source has no quota; known sources: {sorted(quotas)}")
        unknown = [g for g in regenerates if g not in self.to_regenerate]
        if unknown:
            raise Conflict(f"regenerates: {unknown[:5]} are not groups waiting to be regenerated")
        if request_id is not None and request_id in self.request_ids:
            return False
        for gid in regenerates:
            del self.to_regenerate[gid]
            txn.delete("lost", self.name, gid)
        touched = set(started) | set(dropped)
        for s, c in started.items():
            self.started[s] = self.started.get(s, 0) + c
        for s, c in dropped.items():
            self.dropped[s] = self.dropped.get(s, 0) + c
        for s, ids in group_ids.items():
            fresh = [i for i in dict.fromkeys(ids) if i not in self.started_ids]
            self.started_ids.update(fresh)
            for i in fresh:
                txn.put("started", self.name, i, s)
            self.started[s] = self.started.get(s, 0) + len(fresh)
            touched.add(s)
        for s in touched:
            self._save_supply(txn, s)
        self.peak_untaken = max(self.peak_untaken, sum(self.untaken().values()))
        if request_id is not None:
            self.request_ids.add(request_id)
            txn.put("request", self.name, request_id, 1)
        return True

    # ------------------------------------------------------------------ admission
    def can_admit(self) -> bool:
        """Whether the lifecycle lets the next mini-batch be admitted."""
        if self.state not in ("running", "draining"):
            return False
        if self.state == "draining" and self.next_n % self.K == 0:
            return False
        total = self.spec.total_steps
        return total is None or self.next_n < total * self.K

    def admit(self, txn: Txn) -> list[int]:
        """Admit the mini-batches the policy allows now, up to ``L`` beyond the trainer's position.

        Runs after every change that can make a mini-batch formable (registration, supply, node loss)
        or move the trainer's position (ack); returns the admitted global indices.
        """
        admitted: list[int] = []
        while self.can_admit() and self._timing.may_admit(self.next_n, self.position):
            state = self.step_state()
            if self._expire(state, txn):
                state = self.step_state()
            t0 = time.perf_counter()
            decision = self._policy.select(state)
            if decision is None:
                break
            n = self.next_n
            step, k = divmod(n, self.K)
            plans = assign_mini_batch(
                decision.groups,
                self.spec.world_size,
                micro_batch_tokens=self.spec.micro_batch_tokens,
                micro_batch_size=self.spec.micro_batch_size,
            )
            attempt = self.attempts.get(n, -1) + 1
            layout = layout_of(plans)
            seen = [(gid, row) for rank in layout for micro in rank for gid, row in micro]
            assert len(layout) == self.spec.world_size and len(seen) == len(set(seen)) == sum(
                g.num_trajectories for g in decision.groups
            ), f"mini-batch {n}: assignment lost or duplicated rows"  # every trajectory to one rank, once
            mb = MiniBatch(
                n=n,
                step=step,
                k=k,
                attempt=attempt,
                group_ids=[g.group_id for g in decision.groups],
                counts={s: c for s, c in decision.counts.items() if c},
                admitted_at=self._clock(),
                layout=layout,
            )
            for g in decision.groups:
                entry = self.groups[g.group_id]
                assert entry.status == "finished", f"group {g.group_id} admitted twice"
                self._set(entry, "planned", txn, n)
            self.minibatches[n] = mb
            self.attempts[n] = attempt
            self.next_n = n + 1
            txn.put("mb", self.name, mb_key(n), mb.to_json())
            if (k + 1) == self.K:
                a, q = self.admitted_in_step(step), self.quotas_for_step(step)
                assert all(a.get(s, 0) == q[s] for s in q), f"step {step} closed with {a}, quotas {q}"
            wait = sum(mb.admitted_at - g.finished_at for g in decision.groups) / len(decision.groups)
            ahead = admitted_ahead(n + 1, self.position)
            self.peak_admitted_ahead = max(self.peak_admitted_ahead, ahead)
            self.admissions.append(
                {
                    "global_index": n,
                    "step": step,
                    "mini_batch_index": k,
                    "at": mb.admitted_at,
                    "seconds": time.perf_counter() - t0,
                    "groups": len(mb.group_ids),
                    "wait_s": wait,
                    "position": self.position,
                    "ahead": ahead,
                }
            )
            admitted.append(n)
        self._settle(txn)
        self._save_meta(txn)
        return admitted

    def _expire(self, state: StepState, txn: Txn) -> bool:
        """Retire finished groups past the staleness bound; True when any was."""
        old = [g for g in state.finished if expired(state, g)]
        for g in old:
            entry = self.groups[g.group_id]
            self._set(entry, "expired", txn)
            self._regenerate(txn, entry, "expired")
        return bool(old)

    def _regenerate(self, txn: Txn, entry: GroupEntry, reason: str) -> None:
        body = {
            "group_id": entry.record.group_id,
            "source": entry.record.source,
            "reason": reason,
            "unit_id": entry.unit_id,
            "node_id": entry.node_id,
            "at": self._clock(),
        }
        self.to_regenerate[entry.record.group_id] = body
        txn.put("lost", self.name, entry.record.group_id, body)

    def _settle(self, txn: Txn) -> None:
        """Move draining -> drained and running -> completed once nothing is left to train."""
        idle = self.first_unconsumed >= self.next_n  # mini-batches 0..next_n-1 exist: all consumed
        if self.state == "draining" and self.next_n % self.K == 0 and idle:
            self.state = "drained"
        total = self.spec.total_steps
        if total is not None and self.next_n >= total * self.K and idle and self.state != "drained":
            self.state = "completed"

    # ------------------------------------------------------------------ plans and acks
    def next_plan(self, rank: int) -> dict[str, Any] | None:
        """The plan of ``rank``'s next un-acked mini-batch, or None when it is not admitted yet."""
        self._check_rank(rank)
        mb = self.minibatches.get(self.rank_cursor(rank))
        if mb is None or mb.status != "planned":
            return None
        return self._render(mb, rank)

    def plan_after(self, rank: int, plan_id: str) -> dict[str, Any] | None:
        """The plan of the mini-batch after ``plan_id`` (the rank's current or just-acked plan), or None.

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
        return self._render(nxt, rank)

    def done_after(self, rank: int, plan_id: str) -> bool:
        """Whether no mini-batch will ever follow ``plan_id`` (checked like :meth:`plan_after`)."""
        mb = self._current(rank, plan_id)
        if self.next_n > mb.n + 1:
            return False
        total = self.spec.total_steps
        closed = self.state == "draining" and self.next_n % self.K == 0
        return self.done() or closed or (total is not None and self.next_n >= total * self.K)

    def _current(self, rank: int, plan_id: str) -> MiniBatch:
        """The mini-batch of ``plan_id``, which must be ``rank``'s current one (or already acked by it)."""
        self._check_rank(rank)
        parsed = parse_plan_id(plan_id)
        if parsed is None or parsed[2] != rank:
            raise NotFound(f"plan {plan_id!r} is not a plan of rank {rank} of job {self.name!r}")
        n, attempt, _ = parsed
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

    def _render(self, mb: MiniBatch, rank: int) -> dict[str, Any]:
        plan = mb.rendered.get(rank)
        if plan is None:
            sign = None
            if self.ticket_key is not None:
                key, expires = self.ticket_key, mb.admitted_at + self.ticket_ttl_s
                cols = self.spec.columns

                def sign(reads: dict[str, list[tuple[int, int]]], media: dict[str, str]) -> str:
                    return sign_grant(
                        key, job=self.name, rank=rank, expires_at=expires, reads=reads, columns=cols, media=media
                    )

            plan = render_rank_plan(
                self.name,
                mb.layout[rank],
                rank=rank,
                n=mb.n,
                attempt=mb.attempt,
                step=mb.step,
                k=mb.k,
                where=self._where,
                endpoint=self._endpoint,
                columns=self.spec.columns,
                sign=sign,
            )
            if mb.rows is None:  # summed once per mini-batch, not once per rank (W x W at 1,024 ranks)
                mb.rows = sum(len(micro) for share in mb.layout for micro in share)
            plan["mini_batch_trajectories"] = mb.rows
            plan["admitted_at"] = mb.admitted_at
            mb.rendered[rank] = plan
        return plan

    def _where(self, group_id: str) -> tuple[GroupRecord, str, str]:
        entry = self.groups[group_id]
        return entry.record, entry.unit_id, entry.node_id

    def forget_rendered(self) -> None:
        """Drop rendered plans (a node's endpoint changed: tickets must carry the new one)."""
        for mb in self.minibatches.values():
            mb.rendered.clear()

    def rank_done(self, rank: int) -> bool:
        """Whether ``rank`` has acked everything and no further mini-batch will come."""
        return self.done() and self.rank_cursor(rank) >= self.next_n

    def fetched(self, rank: int, plan_id: str, txn: Txn) -> dict[str, Any]:
        """Record that ``rank`` holds its whole share of ``plan_id`` (before its optimizer step); idempotent.

        Once every rank reported it, the mini-batch no longer depends on any store node and survives
        a node loss; until then a node loss withdraws it and this call raises :class:`DataLost`.
        """
        mb = self._current(rank, plan_id)
        if mb.status == "planned" and rank not in mb.acks and rank not in mb.fetched:
            mb.fetched.add(rank)
            txn.put("fetched", self.name, f"{mb_key(mb.n)}.{rank:06d}", {"attempt": mb.attempt})
        return {"plan_id": plan_id, "global_index": mb.n, "fetched_ranks": len(mb.fetched | mb.acks)}

    def ack(self, rank: int, plan_id: str, txn: Txn) -> dict[str, Any]:
        """Record that ``rank`` finished plan ``plan_id``; idempotent; consumes the mini-batch at W acks."""
        mb = self._current(rank, plan_id)
        n, attempt = mb.n, mb.attempt
        if mb.status == "consumed" or rank in mb.acks:
            return {"plan_id": plan_id, "global_index": n, "consumed": mb.status == "consumed", "duplicate": True}
        mb.acks.add(rank)
        txn.put("ack", self.name, f"{mb_key(n)}.{rank:06d}", {"attempt": attempt})
        if len(mb.acks) == self.spec.world_size:
            self._consume(mb, txn)
        self._settle(txn)
        self._save_meta(txn)
        return {"plan_id": plan_id, "global_index": n, "consumed": mb.status == "consumed", "duplicate": False}

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
        mb.status, mb.layout, mb.rendered = "consumed", [], {}
        mb.acks, mb.fetched = set(), set()  # W ints each: a consumed mini-batch needs neither
        while (m := self.minibatches.get(self.first_unconsumed)) is not None and m.status == "consumed":
            self.first_unconsumed += 1
        txn.put("mb", self.name, mb_key(mb.n), mb.to_json())
        txn.put("consumed", self.name, mb_key(mb.n), [asdict(r) for r in records])
        for rank in range(self.spec.world_size):
            txn.delete("ack", self.name, f"{mb_key(mb.n)}.{rank:06d}")
            txn.delete("fetched", self.name, f"{mb_key(mb.n)}.{rank:06d}")

    def report_version(self, rank: int, version: int, txn: Txn) -> int:
        """Record ``rank``'s policy version after an optimizer step; versions never go back."""
        self._check_rank(rank)
        if version < 0:
            raise InvalidRequest(f"version {version} must be >= 0")
        old = self.rank_versions.get(rank, 0)
        if version < old:
            raise Conflict(f"rank {rank} already reported version {old}; versions never decrease")
        self.rank_versions[rank] = version
        txn.put("version", self.name, str(rank), version)
        return self.version

    def _held(self, mb: MiniBatch) -> bool:
        """Whether every rank holds its share of ``mb`` (some rank acked, or all reported it fetched)."""
        return bool(mb.acks) or len(mb.fetched) == self.spec.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.spec.world_size:
            raise NotFound(f"rank {rank} is outside the job's world_size {self.spec.world_size} (0..W-1)")

    # ------------------------------------------------------------------ admin repair
    def remove_unit(self, unit_id: str, reason: str, txn: Txn) -> list[str]:
        """Take a bad unit out of scheduling: its unadmitted groups become lost and are offered for
        regeneration; refused (:class:`Conflict`) once any of its groups is in a mini-batch."""
        unit = self.units.get(unit_id)
        if unit is None and unit_id in self.retired_units:
            raise Conflict(
                f"unit {unit_id!r}: every group of it was consumed; only units whose groups are not "
                f"admitted can be removed"
            )
        if unit is None:
            raise NotFound(f"unit {unit_id!r} is not registered in job {self.name!r}")
        entries = [
            self.groups[g.group_id]
            for g in unit.groups
            if g.group_id in self.groups and self.groups[g.group_id].unit_id == unit_id
        ]
        busy = [g for g in entries if g.status in ("planned", "consumed")]
        retired = [
            g.group_id for g in unit.groups if g.group_id in self.retired_groups and g.group_id not in self.groups
        ]
        if retired:
            raise Conflict(
                f"unit {unit_id!r}: group {retired[0]!r} was consumed; only units whose groups are not "
                f"admitted can be removed"
            )
        if busy:
            raise Conflict(
                f"unit {unit_id!r}: group {busy[0].record.group_id!r} is {busy[0].status} in mini-batch "
                f"{busy[0].mini_batch}; only units whose groups are not admitted can be removed"
            )
        removed = []
        for g in entries:
            if g.status == "finished":
                self._set(g, "lost", txn)
                self._regenerate(txn, g, f"unit {unit_id} removed by an admin: {reason}")
                removed.append(g.record.group_id)
        self._save_meta(txn)
        return removed

    # ------------------------------------------------------------------ node loss
    def node_lost(self, node_id: str, txn: Txn) -> list[int]:
        """Drop the node's unadmitted groups and re-plan untouched mini-batches with rows on it."""
        hit = [g for g in self.groups.values() if g.node_id == node_id and g.status in ("finished", "planned")]
        touched = sorted({g.mini_batch for g in hit if g.status == "planned" and g.mini_batch is not None})
        withdrawn: list[int] = []
        held = [n for n in touched if self._held(self.minibatches[n])]
        untouched = [n for n in touched if n not in held]
        for n in held:
            logger.warning(
                "job %s: mini-batch %d has rows on lost node %s but every rank already holds its share "
                "(fetched or acked); it is kept",
                self.name,
                n,
                node_id,
            )
        if untouched:
            first = untouched[0]
            withdrawn = [n for n in sorted(self.minibatches) if n >= first]
            for n in withdrawn:
                mb = self.minibatches.pop(n)
                assert not mb.acks, f"mini-batch {n} acked after an untouched earlier one"
                txn.delete("mb", self.name, mb_key(n))
                for rank in mb.fetched:
                    txn.delete("fetched", self.name, f"{mb_key(n)}.{rank:06d}")
                for gid in mb.group_ids:
                    self._set(self.groups[gid], "finished", txn)
            self.next_n = first
            logger.warning(
                "job %s: node %s lost, withdrew mini-batches %s for re-planning", self.name, node_id, withdrawn
            )
        for g in [g for g in self.unadmitted.values() if g.node_id == node_id]:
            self._set(g, "lost", txn)
            self._regenerate(txn, g, f"node {node_id} lost")
        self._save_meta(txn)
        return withdrawn
