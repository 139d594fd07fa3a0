"""Simulated workloads: per-source rollout profiles and cluster shape, loaded from validated YAML."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from knittrans.errors import InvalidRequest
from knittrans.sched.timing import DEFAULT_LOOKAHEAD, HANDOVERS

__all__ = [
    "LAUNCH_WEIGHTS",
    "SourceProfile",
    "Workload",
    "bundled_workloads",
    "load_workload",
    "workload_from_dict",
]

LAUNCH_WEIGHTS = ("arrived", "published")
"""Values of :attr:`Workload.launch_weights`."""


@dataclass(frozen=True, kw_only=True)
class SourceProfile:
    """How long a group of one source takes to generate and how many tokens its trajectories have."""

    name: str
    """Source name (e.g. ``math``)."""
    quota: int
    """``q[s]``: groups of this source in every train batch."""
    duration_mean_s: float
    """Mean wall-clock seconds to generate one whole group (lognormal body)."""
    duration_cv: float = 0.0
    """Coefficient of variation (std / mean) of the lognormal body; 0 makes durations deterministic."""
    tail_prob: float = 0.0
    """Probability that a group is a straggler drawn from the heavy tail."""
    tail_scale: float = 1.0
    """A straggler's duration is the body draw times ``tail_scale * Pareto(tail_alpha)`` (Pareto >= 1)."""
    tail_alpha: float = 2.0
    """Pareto shape of the tail (smaller is heavier; > 1 keeps the mean finite)."""
    tokens_mean: float = 1024.0
    """Mean tokens (prompt + response) per trajectory."""
    tokens_cv: float = 0.0
    """Coefficient of variation of tokens per trajectory (lognormal); 0 makes them constant."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("source name must not be empty")
        if self.quota < 1:
            raise ValueError(f"source {self.name!r}: quota must be >= 1, got {self.quota}")
        if not (self.duration_mean_s > 0 and math.isfinite(self.duration_mean_s)):
            raise ValueError(f"source {self.name!r}: duration_mean_s must be > 0, got {self.duration_mean_s}")
        if self.duration_cv < 0 or self.tokens_cv < 0:
            raise ValueError(f"source {self.name!r}: duration_cv and tokens_cv must be >= 0")
        if not 0.0 <= self.tail_prob <= 1.0:
            raise ValueError(f"source {self.name!r}: tail_prob must be in [0, 1], got {self.tail_prob}")
        if self.tail_scale < 1.0:
            raise ValueError(f"source {self.name!r}: tail_scale must be >= 1, got {self.tail_scale}")
        if self.tail_alpha <= 1.0:
            raise ValueError(f"source {self.name!r}: tail_alpha must be > 1, got {self.tail_alpha}")
        if self.tokens_mean < 1:
            raise ValueError(f"source {self.name!r}: tokens_mean must be >= 1, got {self.tokens_mean}")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A whole simulated job: sources, train-batch shape, rollout cluster, trainer and weight sync."""

    name: str
    """Workload name shown in tables and plots."""
    sources: tuple[SourceProfile, ...]
    """Sources in a fixed order; their quotas sum to the train batch ``G``."""
    group_size: int = 16
    """Trajectories per group (GRPO ``n``)."""
    mini_batches_per_step: int = 8
    """``K``: mini-batches (optimizer steps) per train step; must divide ``G``."""
    window: int = 1
    """``W``: groups launched but not in a mini-batch the trainer started stay <= ``W·G`` (every policy)."""
    rollout_slots: int = 64
    """Groups that can be generated at the same time."""
    publish_delay_s: float = 0.0
    """Seconds the trainer spends saving the new weights after an optimizer step, before its ack."""
    sync_delay_s: float = 0.0
    """Seconds from the ack until the new weights reach the rollout hosts (0: a filesystem they share)."""
    load_s: float = 0.0
    """Seconds a rollout engine is blocked loading new weights."""
    groups_per_call: int = 1
    """Groups of one source a rollout engine generates one after the other and publishes as one unit."""
    in_flight_updates: bool = False
    """Partial rollout: running groups switch to new weights when they arrive (else keep start weights)."""
    launch_weights: str = "published"
    """Which weights a new group starts with (:data:`LAUNCH_WEIGHTS`): ``arrived`` (whatever has reached
    rollout) or ``published`` (the newest published version, waiting for it, as ``knittrans rollout`` does)."""
    launch_lead: float = 0.0
    """Duration-aware launches (a prototype the control plane does not run): this fraction of
    ``knittrans.sched.timing.launch_lead`` (0: off, 1: the whole lead), estimated from the groups finished so far."""
    trainer_overhead_s: float = 1.0
    """Fixed seconds per mini-batch (optimizer step, launch costs)."""
    trainer_s_per_token: float = 1e-5
    """Seconds per token on the busiest data-parallel rank."""
    world_size: int = 8
    """Data-parallel trainer ranks the mini-batch is split over (by ``knittrans.sched.assign``)."""
    micro_batch_tokens: int = 16384
    """Token budget of one micro-batch (dynamic batch size) passed to the assignment."""
    lookahead: int = DEFAULT_LOOKAHEAD
    """``L``: mini-batches that may be admitted beyond the one the trainer is on (0 = when it asks for it);
    the same for every policy (``knittrans.sched.timing``)."""
    train_batch_handover: str = "step"
    """How the ``train_batch`` baseline's groups leave the window (``knittrans.sched.timing.HANDOVERS``): ``step``
    (handed the whole train batch) or ``mini_batch`` (the paced baseline); other policies always use ``mini_batch``."""
    max_staleness: int | None = None
    """``η``: admission staleness bound passed to the policies; None for none."""
    steps: int = 50
    """Train steps to simulate unless the caller overrides it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("workload name must not be empty")
        if not self.sources:
            raise ValueError(f"workload {self.name!r}: needs at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name!r}: duplicate source names {names}")
        for field, value in (
            ("group_size", self.group_size),
            ("mini_batches_per_step", self.mini_batches_per_step),
            ("window", self.window),
            ("rollout_slots", self.rollout_slots),
            ("groups_per_call", self.groups_per_call),
            ("world_size", self.world_size),
            ("micro_batch_tokens", self.micro_batch_tokens),
            ("steps", self.steps),
        ):
            if value < 1:
                raise ValueError(f"workload {self.name!r}: {field} must be >= 1, got {value}")
        if self.train_batch_groups % self.mini_batches_per_step:
            raise ValueError(
                f"workload {self.name!r}: mini_batches_per_step={self.mini_batches_per_step} must divide "
                f"the train batch G={self.train_batch_groups} (sum of quotas)"
            )
        if (
            min(self.sync_delay_s, self.publish_delay_s, self.load_s, self.trainer_overhead_s, self.trainer_s_per_token)
            < 0
        ):
            raise ValueError(f"workload {self.name!r}: times must be >= 0")
        if self.trainer_overhead_s == 0 and self.trainer_s_per_token == 0:
            raise ValueError(f"workload {self.name!r}: training must take some time")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"workload {self.name!r}: lookahead must be an integer >= 0, got {self.lookahead!r}")
        if self.train_batch_handover not in HANDOVERS:
            raise ValueError(
                f"workload {self.name!r}: train_batch_handover must be one of "
                f"{', '.join(HANDOVERS)}, got {self.train_batch_handover!r}"
            )
        if self.launch_weights not in LAUNCH_WEIGHTS:
            raise ValueError(
                f"workload {self.name!r}: launch_weights must be one of {', '.join(LAUNCH_WEIGHTS)}, "
                f"got {self.launch_weights!r}"
            )
        if not 0.0 <= self.launch_lead <= 2.0:
            raise ValueError(f"workload {self.name!r}: launch_lead must be in [0, 2], got {self.launch_lead}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"workload {self.name!r}: max_staleness must be >= 0 or null")

    @property
    def train_batch_groups(self) -> int:
        """``G``: groups per train batch."""
        return sum(s.quota for s in self.sources)

    @property
    def mini_batch_groups(self) -> int:
        """``b``: groups per mini-batch."""
        return self.train_batch_groups // self.mini_batches_per_step

    @property
    def quotas(self) -> dict[str, int]:
        """``q[s]`` by source name."""
        return {s.name: s.quota for s in self.sources}

    def with_overrides(self, **changes: Any) -> Workload:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)


_SOURCE_FIELDS = {f.name for f in dataclasses.fields(SourceProfile)}
_WORKLOAD_FIELDS = {f.name for f in dataclasses.fields(Workload)}


def workload_from_dict(data: Mapping[str, Any], *, origin: str = "<dict>") -> Workload:
    """Build a workload from parsed YAML; raises InvalidRequest naming the bad field."""
    if not isinstance(data, Mapping):
        raise InvalidRequest(f"{origin}: a workload must be a mapping, got {type(data).__name__}")
    unknown = set(data) - _WORKLOAD_FIELDS
    if unknown:
        raise InvalidRequest(f"{origin}: unknown workload fields {sorted(unknown)}")
    raw_sources = data.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise InvalidRequest(f"{origin}: 'sources' must be a non-empty list")
    sources = []
    for i, raw in enumerate(raw_sources):
        if not isinstance(raw, Mapping):
            raise InvalidRequest(f"{origin}: sources[{i}] must be a mapping")
        bad = set(raw) - _SOURCE_FIELDS
        if bad:
            raise InvalidRequest(f"{origin}: sources[{i}] has unknown fields {sorted(bad)}")
        try:
            sources.append(SourceProfile(**raw))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"{origin}: sources[{i}]: {exc}") from exc
    fields = {k: v for k, v in data.items() if k != "sources"}
    fields.setdefault("name", origin)
    try:
        return Workload(sources=tuple(sources), **fields)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{origin}: {exc}") from exc


def bundled_workloads() -> list[str]:
    """Names of the workloads shipped in ``knittrans/sim/workloads``."""
    folder = resources.files("knittrans.sim") / "workloads"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_workload(name_or_path: str) -> Workload:
    """Load a bundled workload by name, or any YAML file by path."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise InvalidRequest(f"workload file {name_or_path!r} does not exist")
        text, origin = path.read_text(), str(path)
    else:
        if name_or_path not in bundled_workloads():
            raise InvalidRequest(
                f"unknown workload {name_or_path!r}; bundled: {', '.join(bundled_workloads())} (or a .yaml path)"
            )
        resource = resources.files("knittrans.sim") / "workloads" / f"{name_or_path}.yaml"
        text, origin = resource.read_text(), name_or_path
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"{origin}: not valid YAML: {exc}") from exc
    return workload_from_dict(data, origin=origin)
