"""The demo's embedded defaults: a small two-source GRPO job that finishes in minutes on 2 cores."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["JOB", "DemoConfig"]

JOB = "demo"
"""Name of the demo job."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything ``knittrans demo`` runs; every field has a default."""

    out_dir: Path = Path("demo-results")
    """Where JSON, plots and process logs go."""
    policy: str = "constraint_preserving"
    """Admission policy: train_batch, linear_target, constraint_preserving or version_aware."""
    engine: str = "hf"
    """Rollout engine: hf (transformers) or vllm."""
    steps: int = 3
    """Train steps (each one train batch of ``sum(quotas)`` groups)."""
    mini_batches_per_step: int = 4
    """K: mini-batches (optimizer steps) per train step."""
    quotas: dict[str, int] = field(default_factory=lambda: {"math": 4, "mm_qa": 4})
    """Groups per train batch of each source."""
    sources: dict[str, str] = field(
        default_factory=lambda: {
            "math": "math:8-16:4-12",
            "mm_qa": "mm_qa:8-16:24-48:image=3x96-160x96-160",
        }
    )
    """Per-source rollout profile (``NAME:PMIN-PMAX:RMIN-RMAX[:image=CxHxW][:images=K]``): short text
    answers versus long answers to prompts that carry an image (of a random size) shared by the group.
    The policy is the tiny VLM (:mod:`knittrans.rollout.vlm`): rollout and trainer both see the image."""
    group_size: int = 4
    """Responses per prompt (GRPO group)."""
    ranks: int = 2
    """Trainer ranks (a gloo process group; one gradient all-reduce per mini-batch)."""
    stores: int = 2
    """Store nodes; rollout worker ``i`` writes to node ``i % stores``."""
    micro_batch_size: int = 2
    """Trajectories per micro-batch."""
    window: int = 1
    """``W``: groups launched but not in a mini-batch the trainer started stay ``<= W·G``."""
    lookahead: int = 1
    """``L``: mini-batches admitted beyond the trainer's position (0 = when the trainer asks)."""
    min_step_s: float = 0.0
    """Pad every mini-batch to at least this many seconds (a heavier model's step time; the slow-trainer
    scenario); 0 trains at the tiny policy's own speed."""
    chunk_tokens: int | None = 8
    """Partial rollout: generation picks up new weights every this many tokens."""
    fetch_mode: str = "iter"
    """Trainer fetch mode: iter (prefetch) or eager."""
    hidden: int = 512
    """Text hidden size of the tiny VLM policy (``heads * 64``); bigger makes training heavier relative to
    rollout, which is what separates the admission policies (see docs/getting-started/local-stack.md)."""
    layers: int = 4
    """Text decoder layers of the policy."""
    groups_per_call: int = 1
    """Groups a rollout worker generates per call and writes as one unit (a finished group is invisible until its
    partners finish: benchmarks/sim_report/README.md)."""
    train_batch_handover: str = "mini_batch"
    """``train_batch`` only: ``step`` frees the whole train batch from the window when the trainer starts a step
    (the conventional baseline), ``mini_batch`` each mini-batch's groups as it starts (the paced baseline)."""
    lr: float = 1e-3
    """Learning rate of the tiny policy."""
    seed: int = 0
    """Seed of the model, prompts and sampling."""
    timeout_s: float = 900.0
    """Give up (and stop every process) after this long."""

    def __post_init__(self) -> None:
        from knittrans.api.models import JobCreate
        from knittrans.api.spec import JobSpec

        # the job's fields (policy, K, W, L, ranks, steps, handover) as the control plane checks them, before any
        # process starts
        JobSpec.from_dict(JobCreate.model_validate(self.job_spec()).model_dump())
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"engine must be hf or vllm, not {self.engine!r}")
        if set(self.quotas) != set(self.sources):
            raise ValueError(
                f"quotas {sorted(self.quotas)} and sources {sorted(self.sources)} must name the same sources"
            )
        if not self.min_step_s >= 0:
            raise ValueError(f"min_step_s must be >= 0, got {self.min_step_s}")
        if self.stores < 1:
            raise ValueError("stores must be >= 1")
        if self.hidden % 64 or self.hidden < 64 or self.layers < 1:
            raise ValueError("hidden must be a positive multiple of 64 (head_dim 64) and layers >= 1")
        if self.fetch_mode not in ("iter", "eager"):
            raise ValueError("fetch_mode must be iter or eager")

    def job_spec(self) -> dict[str, Any]:
        """The job the demo creates (``POST /v1/jobs`` body)."""
        return {
            "name": JOB,
            "group_size": self.group_size,
            "quotas": dict(self.quotas),
            "mini_batches_per_step": self.mini_batches_per_step,
            "policy": self.policy,
            "world_size": self.ranks,
            "micro_batch_size": self.micro_batch_size,
            "total_steps": self.steps,
            "window": self.window,
            "lookahead": self.lookahead,
            "train_batch_handover": self.train_batch_handover,
        }

    @property
    def label(self) -> str:
        """Name of the run: the policy, ``train_batch`` for the whole-step baseline, ``train_batch_paced`` for the
        paced one (the simulator's row names)."""
        if self.policy == "train_batch" and self.train_batch_handover == "mini_batch":
            return "train_batch_paced"
        return self.policy
