"""Settings of the control-plane service (pydantic-settings; read when constructed, never at import)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["NODE_TIMEOUT_S", "RECENT_ADMISSIONS", "Settings"]


NODE_TIMEOUT_S = 30.0
"""Default heartbeat timeout of store nodes (the service's and the settings' one default)."""
RECENT_ADMISSIONS = 256
"""Default number of admission records kept per job for status."""


class Settings(BaseSettings):
    """Control-plane settings; every field can also come from ``KNITTRANS_<FIELD>`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="KNITTRANS_", frozen=True, extra="forbid")

    db_path: str = "knittrans-control.db"
    """SQLite database file holding the whole state (WAL mode); a restart on the same file resumes."""
    db_init: bool = False
    """Initialise an existing empty or foreign database file instead of refusing to start."""
    db_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """SQLite ``synchronous`` pragma: NORMAL survives a killed process, FULL also a power loss."""
    worker_token: SecretStr | None = None
    """Bearer token for writers, trainer ranks and stores; None leaves worker endpoints open."""
    admin_token: SecretStr | None = None
    """Bearer token for job and node administration; None falls back to the worker token."""
    ticket_key: SecretStr | None = None
    """HMAC key shared with the stores: plan tickets carry grants signed with it (``KNITTRANS_TICKET_KEY``)."""
    ticket_ttl_s: float = Field(default=86400.0, gt=0, allow_inf_nan=False)
    """Grants of a mini-batch stay valid this long after its admission."""
    node_timeout_s: float = Field(default=NODE_TIMEOUT_S, gt=0)
    """A node without heartbeat for this long is declared lost."""
    node_sweep_interval_s: float = Field(default=1.0, gt=0)
    """How often the service looks for nodes past their heartbeat timeout."""
    long_poll_max_s: float = Field(default=60.0, gt=0)
    """Upper bound on the ``timeout_s`` of a plan long-poll."""
    plan_stream: bool = True
    """Serve the ranks' plan streams (``GET|POST /v1/jobs/{job}/ranks/{rank}/plans``); False: those paths
    answer 404 like an unknown path (a server without them), and trainer clients long-poll ``next``."""
    plan_stream_max_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    """A plan stream ends after this long (its client opens a new one and gets its un-acked plan again)."""
    plan_gateway_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve the plan streams also from a gateway process on this port (0: a free one; None: no gateway);
    ``GET /v1/plan-gateway`` and the ready file give its URL (``knittrans.api.gateway``)."""
    plan_gateway_host: str = "127.0.0.1"
    """Bind address of the plan gateway."""
    lane_port: int | None = Field(default=0, ge=0, le=65535)
    """Serve unit registrations also on a plain TCP lane on this port (0: a free one; None: no lane);
    ``GET /v1/lane`` gives the port (``knittrans.api.lane``)."""
    lane_host: str = "127.0.0.1"
    """Bind address of the lane (``knittrans control-plane`` binds it where it serves HTTP)."""
    max_body_bytes: int = Field(default=64 << 20, gt=0)
    """Largest request body accepted (413 above it)."""
    max_json_depth: int = Field(default=32, ge=1)
    """Deepest nesting of a JSON request body (422 above it, before anything parses it)."""
    unauthenticated_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    """An HTTP connection that has not authenticated (a request with a valid token) this long after it
    opened is closed (``knittrans.api.connguard``; ``knittrans control-plane`` serves with the guard)."""
    max_unauthenticated_connections: int = Field(default=1024, ge=1)
    """Most HTTP connections open without having authenticated (at most half the process's open-files limit);
    beyond it the oldest of them is closed."""
    recent_admissions: int = Field(default=RECENT_ADMISSIONS, ge=1)
    """Admission records kept for status (time, duration, mini-batch)."""
