"""verl tests run only where verl 0.9.1 is installed (CI: the verl venv, ``scripts/setup_verl_env.sh``).

``.venv-verl/bin/python -m pytest tests/verl_integration``

Elsewhere these modules are not collected, and the header says so; the verl CI step runs them.
"""

from __future__ import annotations

import importlib.util

HAVE_VERL = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("transfer_queue") is not None

collect_ignore_glob = [] if HAVE_VERL else ["test_*.py"]


def pytest_report_header() -> str:
    if HAVE_VERL:
        return "tests/verl_integration: verl found, verl sampler tests collected"
    return (
        "tests/verl_integration: verl not installed here, not collected "
        "(run them with .venv-verl/bin/python -m pytest tests/verl_integration)"
    )
