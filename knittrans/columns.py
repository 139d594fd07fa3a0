"""The fixed Arrow schemas of a stored unit (schema v1); only pyarrow, so any module may name the fixed columns."""

from __future__ import annotations

import pyarrow as pa

from knittrans.descriptors import SCHEMA_VERSION

__all__ = [
    "HASH_TYPE",
    "MEDIA_SCHEMA",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "TABLE_KIND_KEY",
    "TRAJECTORY_COLUMNS",
    "TRAJECTORY_SCHEMA",
]

SCHEMA_VERSION_KEY = b"knittrans.schema_version"
"""Schema metadata key holding :data:`SCHEMA_VERSION`."""
TABLE_KIND_KEY = b"knittrans.table"
"""Schema metadata key: ``trajectories`` or ``media``."""

HASH_TYPE = pa.binary(32)
"""Arrow type of a content hash (SHA-256 digest)."""

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("source", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("version_start", pa.int32(), nullable=False),
        pa.field("version_end", pa.int32(), nullable=False),
        pa.field("version_weighted", pa.float32(), nullable=False),
        pa.field("media", pa.list_(HASH_TYPE), nullable=False),
        pa.field("finished_at", pa.timestamp("us"), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KIND_KEY: b"trajectories"},
)
"""One row per trajectory."""

MEDIA_SCHEMA = pa.schema(
    [
        pa.field("media_hash", HASH_TYPE, nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("shape", pa.list_(pa.int32()), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("data", pa.large_binary(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KIND_KEY: b"media"},
)
"""One row per unique media item of a unit."""

TRAJECTORY_COLUMNS = tuple(TRAJECTORY_SCHEMA.names)
