"""Request and response bodies of the control-plane API (pydantic, used at the HTTP edge only)."""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, create_model
from typing_extensions import NotRequired, TypedDict

from knittrans.api.spec import MAX_MINI_BATCHES_PER_STEP
from knittrans.names import CONTENT_HASH_PATTERN
from knittrans.plans import MediaFetch, MicroBatchReads, PlanId, PlanRow, RankPlan, RowFetch
from knittrans.tickets import Ticket

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
MAX_WORLD_SIZE = 65_536
"""Most trainer ranks one job may have."""
MAX_UNITS_PER_REQUEST = 512
"""Most units one registration may carry (send more in several requests)."""

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
    "PlanGatewayOut",
    "PlanRowOut",
    "QuotasUpdate",
    "RankPlanOut",
    "RolloutWeightsIn",
    "RolloutWeightsOut",
    "RowFetchOut",
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
    "parse_units",
    "unit_dict",
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorOut(BaseModel):
    """Every error: a machine-readable kind and a message a person can act on."""

    error: str = Field(examples=["invalid_job_spec"])
    detail: str = Field(examples=["mini_batches_per_step: K=8 is larger than the train batch G=4 groups"])


class LaneOut(BaseModel):
    """Where the control plane serves unit registrations on plain TCP (``knittrans.api.lane``)."""

    port: int = Field(examples=[40713])
    """TCP port on the control plane's host (the host of its URL)."""
    max_bytes: int
    """Largest action frame (job name, NUL and body) the lane takes; larger registrations go over HTTP."""
    served: int
    """Registrations answered over the lane since the control plane started."""


class PlanGatewayOut(BaseModel):
    """Where the plan gateway serves the plan streams (``knittrans control-plane --plan-gateway-port``)."""

    url: str = Field(examples=["http://127.0.0.1:8701"])
    """Base URL: open ``GET|POST {url}/v1/jobs/{job}/ranks/{rank}/plans`` there, with the usual token."""
    pid: int
    """Process id of the gateway."""


# ---------------------------------------------------------------- jobs
class BoundsIn(_In):
    """Per-mini-batch bounds of one source."""

    lo: Int32 = 0
    hi: Int32 | None = None


class JobCreate(_In):
    """A job spec (see docs/api.md for what each field means and which values are refused)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
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


class RolloutWeightsOut(BaseModel):
    """A rollout worker's weights as the control plane recorded them."""

    version: int
    told: int
    loads: int
    late: int
    wait_s: float
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


def _annotated(t: Any, metadata: list[Any]) -> Any:
    """``Annotated[t, *metadata]`` (``t`` alone without metadata), built at run time."""
    return operator.getitem(Annotated, (t, *metadata)) if metadata else t


def _without_python_checks(t: Any, twins: Mapping[Any, Any], *, as_tuple: bool = False) -> Any:
    """``t`` without its Python-level validators (``BeforeValidator``), nested models replaced by ``twins``
    (``as_tuple``: a list type becomes the tuple type of the same items)."""
    if t in twins:
        return twins[t]
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Annotated:
        kept = [m for m in t.__metadata__ if not isinstance(m, BeforeValidator)]
        return _annotated(_without_python_checks(args[0], twins, as_tuple=as_tuple), kept)
    if origin is list:
        item = _without_python_checks(args[0], twins)
        return tuple.__class_getitem__((item, ...)) if as_tuple else list.__class_getitem__(item)
    return t


_TWIN_TUPLES = frozenset(("trajectory_tokens", "media_hashes"))
"""Fields the twins validate into tuples (what the descriptors hold)."""


def _strict_twin(model: type[BaseModel], twins: Mapping[Any, Any]) -> Any:
    """A ``TypedDict`` of ``model``'s fields in pydantic's strict mode without its Python validators: the
    same fields, in the same order, with the same constraints, validated entirely in pydantic-core into
    plain dicts (``trajectory_tokens`` and ``media_hashes`` as tuples; a field with a default is left out
    when the body leaves it out).

    Strict mode takes a JSON integer only for an integer field (no ``true``, ``8.0`` or ``"8"``) and a JSON
    number only for a float field, so what the twin accepts the lax model (with :func:`_not_bool`) accepts
    too, with the same values; anything else the twin refuses is handed to the lax model, which accepts it
    or names the error exactly as before (see :func:`parse_units`).
    """
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        kept = [m for m in info.metadata if not isinstance(m, BeforeValidator)]
        annotation = _annotated(_without_python_checks(info.annotation, twins, as_tuple=name in _TWIN_TUPLES), kept)
        fields[name] = annotation if info.is_required() else NotRequired[annotation]
    make: Any = TypedDict  # the functional form, with fields known only at run time
    twin = make(f"_Strict{model.__name__}", fields)
    twin.__pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    return twin


_StrictGroupIn = _strict_twin(GroupIn, {})
_StrictUnitIn = _strict_twin(UnitIn, {GroupIn: _StrictGroupIn})
_StrictUnitsIn = _strict_twin(UnitsIn, {UnitIn: _StrictUnitIn})
_STRICT_UNITS_IN = TypeAdapter(_StrictUnitsIn)


def parse_units(raw: bytes | str) -> list[dict[str, Any]]:
    """The units of a registration body (``UnitsIn`` as JSON), validated, as plain dicts: each unit's
    fields in :class:`UnitIn`'s order, its ``groups`` a list of dicts of :class:`GroupIn`'s fields (the
    descriptors' fields, in their order; ``media_hashes`` may be missing: its default is empty).

    The registration hot path: the body is first validated by a strict twin of :class:`UnitsIn` (a
    ``TypedDict``) that runs no Python code per field (most bodies; about 30 % less CPU than the lax
    model, which calls :func:`_not_bool` for each of a unit's ~16 integers, and no model objects). A body
    the twin refuses is validated by :class:`UnitsIn` itself, so what is accepted, the values it yields
    and every error message are those of :class:`UnitsIn`. Raises pydantic's ``ValidationError`` (from
    :class:`UnitsIn`).
    """
    try:
        units: list[dict[str, Any]] = _STRICT_UNITS_IN.validate_json(raw)["units"]
    except ValueError:  # pydantic's ValidationError: let the lax model accept it or say why not
        return [unit_dict(u) for u in UnitsIn.model_validate_json(raw).units]
    return units


def unit_dict(unit: UnitIn) -> dict[str, Any]:
    """A validated :class:`UnitIn` as :func:`parse_units` gives it (fields in order, groups as dicts)."""
    return {**unit.__dict__, "groups": [dict(g.__dict__) for g in unit.groups]}


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


# ---------------------------------------------------------------- plans
def _wire_type(t: Any, nested: Mapping[Any, type[BaseModel]]) -> Any:
    """The JSON type of a field of :mod:`knittrans.plans`: ids and tickets are strings, tuples lists."""
    if t in (PlanId, Ticket):
        return str
    if typing.get_origin(t) is tuple:
        return list.__class_getitem__(_wire_type(typing.get_args(t)[0], nested))
    return nested.get(t, t)


def _wire_model(cls: type[Any], name: str, nested: Mapping[Any, type[BaseModel]] | None = None) -> type[BaseModel]:
    """The response model of a :mod:`knittrans.plans` dataclass: its fields, in order, as JSON types."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {
        f.name: (_wire_type(hints[f.name], nested or {}), ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
    }
    return create_model(name, __doc__=cls.__doc__, __module__=__name__, **fields)


# The plan's OpenAPI description, made from knittrans.plans (its one definition).
PlanRowOut = _wire_model(PlanRow, "PlanRowOut")
RowFetchOut = _wire_model(RowFetch, "RowFetchOut")
MediaFetchOut = _wire_model(MediaFetch, "MediaFetchOut")
MicroBatchOut = _wire_model(
    MicroBatchReads, "MicroBatchOut", {PlanRow: PlanRowOut, RowFetch: RowFetchOut, MediaFetch: MediaFetchOut}
)
RankPlanOut = _wire_model(RankPlan, "RankPlanOut", {MicroBatchReads: MicroBatchOut})


class TransferIn(_In):
    """Transfer figures of the mini-batch a rank acks (summed per rank for the dashboard and /metrics)."""

    exposed_s: Seconds = Field(default=0.0, description="seconds the training loop blocked on data")
    fetch_s: Seconds = Field(default=0.0, description="seconds spent in DoGet calls")
    row_bytes: Count = Field(default=0, description="trajectory-row bytes moved")
    media_logical_bytes: Count = Field(default=0, description="media bytes the rows reference")
    media_physical_bytes: Count = Field(default=0, description="media bytes actually fetched")


class AckIn(_In):
    """The plan a rank has finished (after its optimizer step), with its transfer figures on acks."""

    plan_id: str = Field(min_length=1, max_length=512)
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


class TokenIn(_In):
    """The scope of a token to mint."""

    role: Literal["worker", "rank", "store"]
    job: Name | None = None
    rank: Int32 | None = None


class TokenOut(BaseModel):
    """A scoped bearer token and what it may do."""

    token: str
    role: str
    job: str | None
    rank: int | None


class VersionIn(_In):
    """A rank's policy version after an optimizer step."""

    version: Int32
    rank: Int32 = 0


class VersionOut(BaseModel):
    """Latest policy version (max over ranks) and each rank's report."""

    version: int
    by_rank: dict[str, int]
