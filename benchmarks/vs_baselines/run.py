"""Entry point of ``knittrans bench baselines`` (runs ``harness.main`` from a source checkout)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.vs_baselines.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
