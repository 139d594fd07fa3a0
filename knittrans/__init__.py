"""KnitTrans: trajectory transfer layer for disaggregated LLM reinforcement learning."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
