"""Request and response bodies of the control-plane API (pydantic, used at the HTTP edge only)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AckIn",
    "AckOut",
    "BoundsIn",
    "ErrorOut",
    "FetchedOut",
    "GroupIn",
    "HeadroomOut",
    "JobCreate",
    "JobPublic",
    "MediaFetchOut",
    "MicroBatchOut",
    "NodeLostIn",
    "NodePublic",
    "NodeRegister",
    "NodeUsageIn",
    "PlanRowOut",
    "QuotasUpdate",
    "RankPlanOut",
    "RowFetchOut",
    "SupplyIn",
    "SupplyOut",
    "TransferIn",
    "UnitIn",
    "UnitsIn",
    "UnitsOut",
    "VersionIn",
    "VersionOut",
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorOut(BaseModel):
    """Every error: a machine-readable kind and a message a person can act on."""

    error: str = Field(examples=["invalid_job_spec"])
    detail: str = Field(examples=["mini_batches_per_step: K=8 is larger than the train batch G=4 groups"])


# ---------------------------------------------------------------- jobs
class BoundsIn(_In):
    """Per-mini-batch bounds of one source."""

    lo: int = 0
    hi: int | None = None


class JobCreate(_In):
    """A job spec (see docs/api.md for what each field means and which values are refused)."""

    name: str
    group_size: int
    quotas: dict[str, int]
    mini_batches_per_step: int
    policy: str = "constraint_preserving"
    world_size: int
    micro_batch_tokens: int | None = None
    micro_batch_size: int | None = None
    bounds: dict[str, BoundsIn] | None = None
    max_staleness: int | None = None
    total_steps: int | None = None
    columns: list[str] | None = None
    lookahead: int = Field(default=1, ge=0, description="L: mini-batches admitted beyond the trainer's position")
    window: int = Field(default=1, ge=1, description="W: launched groups not in a started mini-batch <= W·G")
    user_fields: dict[str, str] | None = Field(default=None, examples=[{"ref_logprobs": "list<float32>"}])


class QuotasUpdate(_In):
    """New per-source quotas; they take effect at the next train step."""

    quotas: dict[str, int]


class JobPublic(BaseModel):
    """A job: its spec, lifecycle state and the quotas in force."""

    spec: dict[str, Any]
    state: str
    next_global_index: int
    quotas: dict[str, int]
    quota_changes: list[dict[str, Any]]
    version: int
    effective_from_step: int | None = None


# ---------------------------------------------------------------- nodes
class NodeRegister(_In):
    """A store node announcing itself."""

    node_id: str
    endpoint: str = Field(examples=["grpc://127.0.0.1:8815"])
    host: str = ""


class NodeUsageIn(_In):
    """A store's own figures, sent with its heartbeat (the Flight ``stats`` action's fields)."""

    model_config = ConfigDict(extra="ignore")

    units: int = Field(default=0, ge=0)
    rows: int = Field(default=0, ge=0)
    bytes_in_memory: int = Field(default=0, ge=0)
    bytes_spilled: int = Field(default=0, ge=0)
    budget_bytes: int | None = Field(default=None, ge=0)
    budget_used: int = Field(default=0, ge=0)


class NodeLostIn(_In):
    """Why an admin declares a node lost."""

    reason: str = "declared lost by an admin"


class NodePublic(BaseModel):
    """A node as the control plane sees it."""

    node_id: str
    endpoint: str
    host: str
    state: str
    lost: bool
    lost_reason: str
    registered_at: float
    seconds_since_heartbeat: float
    withdrawn: dict[str, list[int]] | None = None


# ---------------------------------------------------------------- units and supply
class GroupIn(_In):
    """One group of a unit (mirrors :class:`knittrans.descriptors.GroupRecord`)."""

    group_id: str
    source: str
    row_start: int
    num_trajectories: int
    trajectory_tokens: list[int]
    version_start: int
    version_end: int
    version_weighted: float
    finished_at: float
    media_hashes: list[str] = []


class UnitIn(_In):
    """A sealed unit (mirrors :meth:`knittrans.descriptors.UnitDescriptor.to_dict`)."""

    unit_id: str
    job: str
    node_id: str
    endpoint: str
    num_rows: int
    num_bytes: int
    schema_version: int
    groups: list[GroupIn]


class UnitsIn(_In):
    """A batch of units, registered all or none."""

    units: list[UnitIn]


class UnitsOut(BaseModel):
    """What a unit batch did: new units, identical repeats, mini-batches it let admission form."""

    registered: int
    duplicates: int
    admitted: list[int]


class SupplyIn(_In):
    """Groups started (counts or ids) and dropped (will never finish) per source."""

    started: dict[str, int] = {}
    group_ids: dict[str, list[str]] = {}
    dropped: dict[str, int] = {}
    regenerates: list[str] = Field(default=[], description="lost/expired group ids whose replacements start now")
    request_id: str | None = Field(default=None, description="repeat-safe id: a report seen before is ignored")


class HeadroomOut(BaseModel):
    """What rollout may launch now under the job's window (``GET /v1/jobs/{job}/headroom``)."""

    state: str
    position: int = Field(description="trainer position: lowest global index not acked by every rank")
    next_global_index: int
    lookahead: int
    window: int
    room: int = Field(description="groups rollout may launch now: W·G minus untaken (<= 0: wait)")
    untaken: dict[str, int] = Field(description="launched, not dropped, not in a mini-batch the trainer started")
    headroom: dict[str, int] = Field(description="groups each source may launch now: the room for the sources "
                                     "furthest behind their quota share of launches, 0 for the others")
    launch_order: list[str] = Field(description="sources, furthest behind their quota share of launches first")
    to_regenerate: list[dict[str, Any]]


class SupplyOut(BaseModel):
    """Whether the report was applied (False: repeated request_id) and the pending supply now."""

    applied: bool
    pending: dict[str, int]
    admitted: list[int]


# ---------------------------------------------------------------- plans
class PlanRowOut(BaseModel):
    """One trajectory row of a micro-batch."""

    group_id: str
    unit_id: str
    node_id: str
    row: int
    num_tokens: int


class RowFetchOut(BaseModel):
    """One DoGet: every row of the micro-batch on one node, returned in ``rows`` order."""

    node_id: str
    endpoint: str
    ticket: str


class MediaFetchOut(BaseModel):
    """One unique media hash of the micro-batch and the DoGet that serves it."""

    hash: str
    node_id: str
    endpoint: str
    ticket: str


class MicroBatchOut(BaseModel):
    """One micro-batch of a rank's plan."""

    index: int
    num_tokens: int
    rows: list[PlanRowOut]
    fetches: list[RowFetchOut]
    media: list[MediaFetchOut]


class RankPlanOut(BaseModel):
    """A rank's share of mini-batch ``global_index`` (trained at ``policy_version``)."""

    plan_id: str
    job: str
    rank: int
    step: int
    mini_batch_index: int
    global_index: int
    policy_version: int
    num_tokens: int
    micro_batches: list[MicroBatchOut]


class TransferIn(_In):
    """Transfer figures of the mini-batch a rank acks (summed per rank for the dashboard and /metrics)."""

    exposed_s: float = Field(default=0.0, ge=0, description="seconds the training loop blocked on data")
    fetch_s: float = Field(default=0.0, ge=0, description="seconds spent in DoGet calls")
    row_bytes: int = Field(default=0, ge=0, description="trajectory-row bytes moved")
    media_logical_bytes: int = Field(default=0, ge=0, description="media bytes the rows reference")
    media_physical_bytes: int = Field(default=0, ge=0, description="media bytes actually fetched")


class AckIn(_In):
    """The plan a rank has finished (after its optimizer step), with its transfer figures on acks."""

    plan_id: str
    transfer: TransferIn | None = None


class FetchedOut(BaseModel):
    """A rank's share is fetched; ``fetched_ranks``: ranks that hold their share of the mini-batch so far."""

    plan_id: str
    global_index: int
    fetched_ranks: int


class AckOut(BaseModel):
    """Ack result; ``consumed`` once all ranks acked; ``duplicate`` for a repeated ack."""

    plan_id: str
    global_index: int
    consumed: bool
    duplicate: bool


class VersionIn(_In):
    """A rank's policy version after an optimizer step."""

    version: int
    rank: int = 0


class VersionOut(BaseModel):
    """Latest policy version (max over ranks) and each rank's report."""

    version: int
    by_rank: dict[str, int]
