"""Request and response bodies of the control-plane API (pydantic, used at the HTTP edge only)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from knittrans.errors import InvalidRequest
from knittrans.names import CONTENT_HASH_PATTERN

NAME_PATTERN = r"^[A-Za-z0-9](?:\.?[A-Za-z0-9_-])*\.?$"
"""``knittrans.names.NAME_RE`` without ``..`` as one JSON-Schema pattern (matched whole)."""

Name = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=NAME_PATTERN,
        description="1-128 letters, digits, '.', '_' or '-', starting alphanumeric, no '..'",
    ),
]


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # JSON true/false are not integers (JSON Schema agrees; pydantic's lax mode not)
        raise ValueError("a boolean is not an integer")
    return value


Int32 = Annotated[int, Field(ge=0, le=(1 << 31) - 1), BeforeValidator(_not_bool)]
Count = Annotated[int, Field(ge=0, le=(1 << 53) - 1), BeforeValidator(_not_bool)]
Seconds = Annotated[float, Field(ge=0, le=1e9), BeforeValidator(_not_bool)]
Positive = Annotated[int, Field(ge=1, le=(1 << 31) - 1), BeforeValidator(_not_bool)]
Hash = Annotated[str, Field(pattern=CONTENT_HASH_PATTERN, min_length=64, max_length=64)]
Endpoint = Annotated[
    str,
    Field(
        min_length=1,
        max_length=512,
        pattern=r"^grpc(\+tls|\+tcp)?://[A-Za-z0-9._:\[\]-]+:[0-9]{1,5}$",
        examples=["grpc://127.0.0.1:8815"],
    ),
]
MAX_MINI_BATCHES_PER_STEP = 4096
"""Largest ``K`` a job may have: per-step work (mini-batch sizes, composition plans) is ``O(K)``, so an
absurd ``K`` (a typo, a fuzzer) would stall the control plane for minutes while it plans one step."""
MAX_WORLD_SIZE = 65_536
"""Most trainer ranks one job may have."""
MAX_UNITS_PER_REQUEST = 512
"""Most units one registration may carry (send more in several requests)."""

__all__ = [
    "AckIn",
    "AckOut",
    "BoundsIn",
    "ErrorOut",
    "FetchedIn",
    "FetchedOut",
    "GroupIn",
    "HeadroomOut",
    "JobCreate",
    "JobPublic",
    "ManifestOut",
    "NodeLostIn",
    "NodePublic",
    "NodeRegister",
    "NodeUsageIn",
    "ProgressOut",
    "QuotasUpdate",
    "RolloutWeightsIn",
    "RolloutWeightsOut",
    "SupplyIn",
    "SupplyOut",
    "TokenIn",
    "TokenOut",
    "TransferIn",
    "UnitIn",
    "UnitRemovedOut",
    "UnitsIn",
    "UnitsOut",
    "VersionIn",
    "VersionOut",
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorOut(BaseModel):
    """Every error: a machine-readable kind and a message a person can act on."""

    error: str = Field(examples=["invalid_job_spec"])
    detail: str = Field(examples=["mini_batches_per_step: K=8 is larger than the train batch G=4 groups"])


# ---------------------------------------------------------------- jobs
class BoundsIn(_In):
    """Per-mini-batch bounds of one source."""

    lo: Int32 = 0
    hi: Int32 | None = None


class JobCreate(_In):
    """A job spec (see docs/reference/rest.md for what each field means and which values are refused)."""

    model_config = ConfigDict(  # merged with _In's
        json_schema_extra={
            "oneOf": [
                {"required": ["micro_batch_tokens"], "properties": {"micro_batch_size": {"type": "null"}}},
                {"required": ["micro_batch_size"], "properties": {"micro_batch_tokens": {"type": "null"}}},
            ]
        },
    )

    name: Name
    group_size: Positive
    quotas: dict[Name, Int32] = Field(min_length=1)
    mini_batches_per_step: Annotated[int, Field(ge=1, le=MAX_MINI_BATCHES_PER_STEP), BeforeValidator(_not_bool)]
    policy: Literal["train_batch", "linear_target", "constraint_preserving", "version_aware"] = "constraint_preserving"
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE), BeforeValidator(_not_bool)]
    micro_batch_tokens: Positive | None = None
    micro_batch_size: Positive | None = None
    bounds: dict[Name, BoundsIn] | None = None
    max_staleness: Int32 | None = None
    total_steps: Positive | None = None
    columns: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, min_length=1, json_schema_extra={"uniqueItems": True}
    )
    lookahead: Int32 = Field(default=1, description="L: mini-batches admitted beyond the trainer's position")
    window: Positive = Field(default=1, description="W: launched groups not in a started mini-batch <= W·G")
    train_batch_handover: Literal["mini_batch", "step"] = Field(
        default="mini_batch",
        description="train_batch only: 'step' frees the whole train batch from the window when the step's first "
        "mini-batch starts (the conventional baseline); 'mini_batch' frees each mini-batch's groups as it starts",
    )
    user_fields: (
        dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(min_length=1, max_length=256)]]
        | None
    ) = Field(default=None, examples=[{"ref_logprobs": "list<float32>"}])


class QuotasUpdate(_In):
    """New per-source quotas; they take effect at the next train step."""

    quotas: dict[Name, Int32] = Field(min_length=1)


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

    node_id: Name
    endpoint: Endpoint
    host: str = Field(default="", max_length=256)
    node_key: str | None = Field(
        default=None,
        min_length=16,
        max_length=256,
        description="the node's own credential; needed (or the admin token) to move it",
    )


class NodeUsageIn(_In):
    """A store's own figures, sent with its heartbeat (the Flight ``stats`` action's fields)."""

    model_config = ConfigDict(extra="ignore")

    units: Count = 0
    rows: Count = 0
    bytes_in_memory: Count = 0
    bytes_spilled: Count = 0
    budget_bytes: Count | None = None
    budget_used: Count = 0


class RolloutWeightsIn(_In):
    """A rollout worker's weights: the version it generates with and its cumulative load counters."""

    version: Count = Field(description="policy version of the weights the worker generates with")
    told: Count = Field(0, description="newest version the control plane had reported to the worker")
    loads: Count = Field(0, description="weights files loaded so far")
    late: Count = Field(0, description="versions whose weights file was not there within the worker's wait")
    wait_s: Seconds = Field(0.0, description="seconds spent waiting for weights files")


class RolloutWeightsOut(RolloutWeightsIn):
    """A rollout worker's weights as the control plane recorded them."""

    at: float = Field(description="unix time of the report")


class NodeLostIn(_In):
    """Why an admin declares a node lost."""

    reason: str = Field(default="declared lost by an admin", max_length=1024)


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
    heartbeat_s: float = Field(
        description="seconds between heartbeats the control plane asks of the node: a sixth of its node timeout"
    )
    withdrawn: dict[str, list[int]] | None = None


# ---------------------------------------------------------------- units and supply
class GroupIn(_In):
    """One group of a unit (mirrors :class:`knittrans.descriptors.GroupRecord`)."""

    group_id: Name
    source: Name
    row_start: Int32
    num_trajectories: Positive
    trajectory_tokens: list[Int32] = Field(min_length=1)
    version_start: Int32
    version_end: Int32
    version_weighted: Annotated[float, BeforeValidator(_not_bool)] = Field(ge=0, le=(1 << 31) - 1)
    finished_at: Annotated[float, BeforeValidator(_not_bool)] = Field(ge=0, le=1e11)
    media_hashes: list[Hash] = []


class UnitIn(_In):
    """A sealed unit (mirrors :meth:`knittrans.descriptors.UnitDescriptor.to_dict`)."""

    unit_id: Name
    job: Name
    node_id: Name
    endpoint: Endpoint
    num_rows: Int32
    num_bytes: Count
    schema_version: int = Field(ge=1, le=1, description="trajectory schema version; only 1 exists")
    groups: list[GroupIn] = Field(min_length=1)


class UnitsIn(_In):
    """A batch of units, registered all or none."""

    units: list[UnitIn] = Field(min_length=1, max_length=MAX_UNITS_PER_REQUEST)


class UnitsOut(BaseModel):
    """What a unit batch did: new units, identical repeats, mini-batches it let admission form."""

    registered: int
    duplicates: int
    admitted: list[int]


class UnitRemovedOut(BaseModel):
    """A unit taken out of scheduling: the groups now waiting to be regenerated."""

    unit_id: str
    removed_groups: list[str]
    admitted: list[int]


class SupplyIn(_In):
    """Groups started (counts or ids) and dropped (will never finish) per source."""

    started: dict[Name, Int32] = {}
    group_ids: dict[Name, list[Name]] = {}
    dropped: dict[Name, Int32] = {}
    regenerates: list[Name] = Field(default=[], description="lost/expired group ids whose replacements start now")
    request_id: Name | None = Field(default=None, description="repeat-safe id: a report seen before is ignored")


class HeadroomOut(BaseModel):
    """What rollout may launch now under the job's window (``GET /v1/jobs/{job}/headroom``)."""

    state: str
    position: int = Field(description="trainer position: lowest global index not acked by every rank")
    next_global_index: int
    lookahead: int
    window: int
    room: int = Field(description="groups rollout may launch now: W·G minus untaken (<= 0: wait)")
    untaken: dict[str, int] = Field(description="launched, not dropped, not in a mini-batch the trainer started")
    headroom: dict[str, int] = Field(
        description="groups each source may launch now: the room for the sources "
        "furthest behind their quota share of launches, 0 for the others"
    )
    launch_order: list[str] = Field(description="sources, furthest behind their quota share of launches first")
    to_regenerate: list[dict[str, Any]]


class SupplyOut(BaseModel):
    """Whether the report was applied (False: repeated request_id) and the pending supply now."""

    applied: bool
    pending: dict[str, int]
    admitted: list[int]


# ---------------------------------------------------------------- mini-batches
class ManifestOut(BaseModel):
    """The manifest of one admitted mini-batch (:mod:`knittrans.manifest`: its one definition and reader)."""

    manifest: Literal[1] = Field(description="layout version")
    job: str
    global_index: int
    attempt: int = Field(description="0 first; +1 each time a node loss withdraws the mini-batch")
    step: int
    mini_batch_index: int
    policy_version: int
    admitted_at: float
    world_size: int
    columns: list[str] | None = Field(description="trajectory columns the ranks read; null for all")
    nodes: list[tuple[str, str, str | None]] = Field(description="[node id, Flight location, signed grant or null]")
    units: list[tuple[str, int]] = Field(description="[unit id, index into nodes]")
    groups: list[tuple[str, int, list[int]]] = Field(description="[group id, index into units, indices into media]")
    media: list[tuple[Hash, int]] = Field(description="[content hash, index into units of a unit holding it]")
    ranks: list[list[list[tuple[int, int, int]]]] = Field(
        description="rank -> micro-batch -> rows [index into groups, row in its unit, tokens], in read order"
    )


class TransferIn(_In):
    """Transfer figures of the mini-batch, one entry per rank the ack names (in ``ranks`` order; every rank
    in rank order when ``ranks`` is null): summed per rank for the dashboard and /metrics."""

    exposed_s: list[Seconds] = Field(max_length=MAX_WORLD_SIZE, description="seconds the loop blocked on data")
    fetch_s: list[Seconds] = Field(max_length=MAX_WORLD_SIZE, description="seconds spent in DoGet calls")
    row_bytes: list[Count] = Field(max_length=MAX_WORLD_SIZE, description="trajectory-row bytes moved")
    media_logical_bytes: list[Count] = Field(max_length=MAX_WORLD_SIZE, description="media bytes the rows reference")
    media_physical_bytes: list[Count] = Field(max_length=MAX_WORLD_SIZE, description="media bytes actually fetched")

    def columns(self, count: int) -> dict[str, list[Any]]:
        """``{figure: values}``, each with one entry per reported rank (``count`` of them).

        Raises:
            InvalidRequest: a column does not have one entry per rank.
        """
        columns = {name: getattr(self, name) for name in type(self).model_fields}
        bad = [name for name, values in columns.items() if len(values) != count]
        if bad:
            raise InvalidRequest(f"transfer figures {bad} must have one entry per acked rank ({count})")
        return columns


RankList = Annotated[list[Int32], Field(min_length=1, max_length=MAX_WORLD_SIZE)]


class FetchedIn(_In):
    """Ranks that hold their whole share of the mini-batch (before the optimizer step)."""

    attempt: Count = Field(description="the manifest's attempt")
    ranks: RankList | None = Field(default=None, description="the ranks reported for; null: every rank")


class AckIn(FetchedIn):
    """Ranks that finished the mini-batch (after their optimizer step), with what the step produced."""

    version: Int32 | None = Field(default=None, description="policy version the optimizer step produced")
    transfer: TransferIn | None = Field(default=None, description="the ranks' transfer figures, one entry per rank")


class FetchedOut(BaseModel):
    """``fetched_ranks``: ranks holding their share so far; ``held``: all do (a node loss no longer withdraws it)."""

    global_index: int
    attempt: int
    fetched_ranks: int
    held: bool


class AckOut(BaseModel):
    """Ack result; ``consumed`` once all ranks acked; ``duplicate`` for a repeated ack."""

    global_index: int
    attempt: int
    consumed: bool
    duplicate: bool
    world_size: int


class InFlightOut(BaseModel):
    """An admitted mini-batch the trainer has not consumed yet."""

    global_index: int
    attempt: int
    admitted_at: float
    fetched_ranks: list[tuple[int, int]] = Field(description="[start, stop) runs of ranks that reported fetched")
    acked_ranks: list[tuple[int, int]] = Field(description="[start, stop) runs of ranks that acked")


class ProgressOut(BaseModel):
    """Where the trainer is in a job."""

    state: str
    position: int = Field(description="first mini-batch not acked by every rank")
    next_global_index: int = Field(description="index the next admission gets")
    final: int | None = Field(description="no mini-batch at or beyond this index will be admitted (null: open)")
    world_size: int
    in_flight: list[InFlightOut]


class TokenIn(_In):
    """The scope of a token to mint."""

    role: Literal["worker", "rank", "store"]
    job: Name | None = None
    rank: Int32 | None = None


class TokenOut(TokenIn):
    """A scoped bearer token and what it may do."""

    token: str


class VersionIn(_In):
    """A rank's policy version after an optimizer step."""

    version: Int32
    rank: Int32 = 0


class VersionOut(BaseModel):
    """Latest policy version (max over ranks) and each rank's report."""

    version: int
    by_rank: dict[str, int]
