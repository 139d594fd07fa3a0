"""Control plane: FastAPI app over the scheduling core, state in SQLite."""

from __future__ import annotations

from knittrans.api.app import create_app
from knittrans.api.settings import Settings

__all__ = ["Settings", "create_app"]
