"""Settings of the control-plane service (pydantic-settings; read when constructed, never at import)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["RECENT_ADMISSIONS", "Settings"]


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
    """HMAC key shared with the stores: manifests carry grants signed with it (``KNITTRANS_TICKET_KEY``)."""
    ticket_ttl_s: float = Field(default=86400.0, gt=0, allow_inf_nan=False)
    """Grants of a mini-batch stay valid this long after its admission."""
    node_timeout_s: float = Field(default=30.0, gt=0)
    """A node without heartbeat for this long is declared lost."""
    node_sweep_interval_s: float = Field(default=1.0, gt=0)
    """How often the service looks for nodes past their heartbeat timeout."""
    long_poll_max_s: float = Field(default=60.0, gt=0)
    """Upper bound on the ``timeout_s`` of a long-poll (manifests, headroom)."""
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
