"""A verl v1 sampler admitting GRPO groups by constraint-preserving admission (docs/how-to/frameworks.md, section 2)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from knittrans.api.spec import check_quotas
from knittrans.errors import InvalidJobSpec, InvalidRequest
from knittrans.sched.admission import ConstraintPreservingPolicy, expired, mini_batch_sizes
from knittrans.sched.types import AdmissionDecision, FinishedGroup, SourceBounds, StepState

__all__ = ["QuotaAdmission", "make_sampler_class"]  # + KnitTransQuotaSampler (lazy)


@dataclass(kw_only=True)
class QuotaAdmission:
    """Per-train-batch quota state for a stream of ``select`` calls (one per mini-batch)."""

    quotas: Mapping[str, int]
    """Groups of each source per train batch."""
    mini_batches_per_step: int
    """``K``: ``select`` calls per train batch (verl's ``parameter_sync_step``)."""
    max_staleness: int | None = None
    """``η`` in verl global steps; None for no bound."""
    bounds: Mapping[str, SourceBounds] = field(default_factory=dict)
    """Optional per-mini-batch per-source bounds."""
    admitted: dict[str, int] = field(init=False)
    """Groups of each source admitted in the current train batch."""
    mini_batch_index: int = field(default=0, init=False)
    """Mini-batch being formed in the current train batch."""

    def __post_init__(self) -> None:
        check_quotas(self.quotas, mini_batches_per_step=self.mini_batches_per_step, bounds=self.bounds)
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidJobSpec(f"max_staleness must be >= 0 or null, not {self.max_staleness}")
        self.admitted = {s: 0 for s in self.quotas}
        self._policy = ConstraintPreservingPolicy()

    @property
    def sizes(self) -> list[int]:
        """Groups in each mini-batch of a train batch."""
        return mini_batch_sizes(sum(self.quotas.values()), self.mini_batches_per_step)

    def _state(self, finished: Iterable[FinishedGroup], pending: Mapping[str, int], version: int) -> StepState:
        groups = [g for g in finished if g.source in self.quotas]
        return StepState(
            quotas=self.quotas,
            admitted=self.admitted,
            finished=groups,
            pending={s: pending.get(s, 0) for s in self.quotas},
            mini_batch_index=self.mini_batch_index,
            mini_batches_per_step=self.mini_batches_per_step,
            bounds=self.bounds,
            current_version=version,
            max_staleness=self.max_staleness,
        )

    def stale(self, finished: Iterable[FinishedGroup], version: int) -> list[str]:
        """uids past the staleness bound at trainer version ``version``."""
        state = self._state([], {}, version)
        return [g.group_id for g in finished if expired(state, g)]

    def select(
        self, finished: Iterable[FinishedGroup], pending: Mapping[str, int], version: int, batch_size: int
    ) -> list[str] | None:
        """uids of the next mini-batch, or None to wait; commits the admission when it returns uids."""
        want = self.sizes[self.mini_batch_index]
        if batch_size != want:
            raise InvalidRequest(
                f"verl asked for {batch_size} groups but mini-batch {self.mini_batch_index} of a train batch of "
                f"{sum(self.quotas.values())} groups in {self.mini_batches_per_step} mini-batches has {want}: set "
                "sampler_kwargs.quotas to sum to data.train_batch_size and mini_batches_per_step to "
                "parameter_sync_step"
            )
        decision: AdmissionDecision | None = self._policy.select(self._state(finished, pending, version))
        if decision is None:
            return None
        for s, x in decision.counts.items():
            self.admitted[s] = self.admitted.get(s, 0) + x
        self.mini_batch_index += 1
        if self.mini_batch_index == self.mini_batches_per_step:
            assert self.admitted == dict(self.quotas), (self.admitted, self.quotas)
            self.admitted = {s: 0 for s in self.quotas}
            self.mini_batch_index = 0
        return [g.group_id for g in decision.groups]


def _admission_from_kwargs(
    kwargs: Mapping[str, Any], trainer_config: Any, max_off_policy_threshold: int | None
) -> QuotaAdmission:
    quotas = kwargs.get("quotas")
    if not quotas:
        raise InvalidJobSpec("trainer.v1.sampler.sampler_kwargs.quotas: give {data_source: groups per train batch}")
    k = kwargs.get("mini_batches_per_step")
    if k is None:
        k = trainer_config.get("parameter_sync_step", 1) if hasattr(trainer_config, "get") else 1
    staleness = kwargs.get("max_staleness")
    if staleness is None and max_off_policy_threshold is not None:
        staleness = int(max_off_policy_threshold) - 1  # verl's span = steps - start + 1 <= threshold
    bounds = {s: SourceBounds(lo=int(b.get("lo", 0)), hi=b.get("hi")) for s, b in (kwargs.get("bounds") or {}).items()}
    return QuotaAdmission(
        quotas={str(s): int(q) for s, q in dict(quotas).items()},
        mini_batches_per_step=int(k),
        max_staleness=staleness,
        bounds=bounds,
    )


@functools.cache
def make_sampler_class() -> type[Any]:
    """Subclass verl 0.9.1's ``ReplayBufferAsync`` (imported only here) with quota-preserving admission."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    class KnitTransQuotaSamplerImpl(ReplayBufferAsync):  # type: ignore[misc]
        """verl replay buffer whose selection is KnitTrans' constraint-preserving admission."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.admission = _admission_from_kwargs(
                dict(self.sampler_kwargs or {}), self.trainer_config, self.max_off_policy_threshold
            )
            self.source_field = str((self.sampler_kwargs or {}).get("source_field", "data_source"))
            self._sources: dict[str, str] = {}
            self._first_seen: dict[str, float] = {}

        # -- group facts read from TransferQueue ------------------------------------------------
        def _group_keys(self, partition_id: str, uid: str) -> list[str]:
            return [k for k in self.partitions[partition_id] if k.split("_")[0] == uid]

        def _source_of(self, partition_id: str, uid: str) -> str | None:
            if uid not in self._sources:
                keys = self._group_keys(partition_id, uid)
                if not keys:
                    return None
                td = tq.kv_batch_get(keys=keys[:1], partition_id=partition_id, select_fields=[self.source_field])
                value = td[self.source_field]
                rows = value.tolist() if hasattr(value, "tolist") else list(value)
                self._sources[uid] = str(rows[0])
            return self._sources[uid]

        def _version_start(self, partition_id: str, uid: str) -> int:
            tags = [self.partitions[partition_id][k] for k in self._group_keys(partition_id, uid)]
            starts = [t["min_global_steps"] for t in tags if t.get("min_global_steps") is not None]
            return int(min(starts)) if starts else int(self.prompt_global_steps[partition_id].get(uid, 0))

        def _finished(self, partition_id: str, uids: Iterable[str]) -> list[FinishedGroup]:
            out = []
            for uid in uids:
                source = self._source_of(partition_id, uid)
                if source is None:
                    continue
                seen = self._first_seen.setdefault(uid, time.monotonic())
                out.append(
                    FinishedGroup(
                        group_id=uid,
                        source=source,
                        trajectory_tokens=(1,) * len(self._group_keys(partition_id, uid)),  # one per trajectory
                        finished_at=seen,
                        version_start=self._version_start(partition_id, uid),
                    )
                )
            return out

        # -- verl's interface ---------------------------------------------------------------------
        def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
            if partition_id == "val":
                return set()
            finished = self._finished(partition_id, self.finished_keys[partition_id])
            return set(self.admission.stale(finished, global_steps))

        def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
            """The next mini-batch: admitted as soon as a quota-preserving choice exists."""
            if partition_id == "val":
                result: tuple[Any, dict[str, Any]] = super().sample(global_steps, partition_id, batch_size)
                return result
            metrics: dict[str, Any] = {}
            while True:
                _, metrics_now = self.wait_for_sampleable(global_steps, partition_id, 0)
                metrics.update(metrics_now)
                reasons = self._terminal_eviction_reasons(global_steps, partition_id)
                sampleable = self._sampleable_terminal_keys(partition_id, reasons)
                pending = {s: int(q) for s, q in self.admission.quotas.items()}  # unknown supply: assume enough
                uids = self.admission.select(
                    self._finished(partition_id, sampleable), pending, global_steps, batch_size
                )
                if uids is not None:
                    snapshot = dict(self.partitions[partition_id])
                    for uid in uids:
                        self._sources.pop(uid, None)
                        self._first_seen.pop(uid, None)
                    return self._materialize_batch(partition_id, uids, snapshot), metrics
                self._wait_for_next_poll(partition_id, time.time())

    return KnitTransQuotaSamplerImpl


def __getattr__(name: str) -> Any:
    """``KnitTransQuotaSampler`` is built on first access (verl's ``load_extern_type`` does a getattr)."""
    if name == "KnitTransQuotaSampler":
        return make_sampler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
