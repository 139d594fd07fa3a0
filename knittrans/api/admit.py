"""Admission: forming the next mini-batches from the pool under the policy, the lookahead and the staleness bound."""

from __future__ import annotations

import time

from knittrans.api.entries import MiniBatch
from knittrans.api.jobbase import JobBase
from knittrans.api.records import Kind, index_key
from knittrans.api.store import Txn
from knittrans.sched.admission import expired
from knittrans.sched.assign import Assignment
from knittrans.sched.timing import admitted_ahead
from knittrans.sched.types import StepState

__all__ = ["Admission"]


class Admission(JobBase):
    """Admits mini-batches and expires groups past the staleness bound."""

    # ------------------------------------------------------------------ admission (can_admit: JobBase)
    def admit(self, txn: Txn) -> list[int]:
        """Admit the next mini-batch if the policy allows it now (at most ``L`` beyond the trainer's position).

        Runs after every change that can make a mini-batch formable (registration, supply, node loss)
        or move the trainer's position (ack); returns the admitted global index (``[]``: none). One at a
        time: the control plane commits and publishes each manifest before it forms the next one.
        """
        n = self._admit_next(txn) if self.may_admit_next() else None
        self._settle()
        self._save_meta(txn)
        return [] if n is None else [n]

    def may_admit_next(self) -> bool:
        """Whether the lifecycle and the lookahead let the next mini-batch be admitted now (the policy may still
        find no mini-batch to form)."""
        return self.can_admit() and self._timing.may_admit(self.next_n, self.position)

    def admit_all(self, txn: Txn) -> None:
        """Every mini-batch the policy allows now, in ``txn`` (start-up, node loss: published together)."""
        while self.admit(txn):
            pass

    def _admit_next(self, txn: Txn) -> int | None:
        """Form, lay out and record the next mini-batch; None when the policy cannot form one now."""
        state = self.step_state()
        self._expire(state, txn)  # the policy skips expired groups itself (the same test): state stays valid
        t0 = time.perf_counter()
        decision = self._policy.select(state)
        if decision is None:
            return None
        n = self.next_n
        step, k = divmod(n, self.K)
        spec = self.spec
        layout = Assignment(decision.groups, spec.world_size, spec.micro_batch_tokens, spec.micro_batch_size).layout()
        attempt = self.attempts.get(n, -1) + 1
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
            admitted_at=time.time(),
            layout=layout,
        )
        for g in decision.groups:
            entry = self.groups[g.group_id]
            assert entry.status == "finished", f"group {g.group_id} admitted twice"
            self._set(entry, "planned", txn, n)
        self.minibatches[n] = mb
        self.attempts[n] = attempt
        self.next_n = n + 1
        txn.put(Kind.MINI_BATCH, self.name, index_key(n), mb.to_json())
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
        return n

    def _expire(self, state: StepState, txn: Txn) -> None:
        """Retire finished groups past the staleness bound."""
        old = [g for g in state.finished if expired(state, g)]
        for g in old:
            entry = self.groups[g.group_id]
            self._set(entry, "expired", txn)
            self._regenerate(txn, entry, "expired")
