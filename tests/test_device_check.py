"""scripts/device_check.sh on a machine without CUDA: says so and exits 0 (CI machines have no GPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_without_cuda_says_so_and_exits_zero() -> None:
    """The script and its Python half both exit 0 and name the missing device; nothing is written."""
    assert not torch.cuda.is_available()
    script = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert script.returncode == 0, script.stderr
    if shutil.which("nvidia-smi") is None:
        assert "no NVIDIA GPU" in script.stdout
    check = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "transfer" / "device_check.py"),
            "--out",
            "/nonexistent/dir/device_check",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    assert "no CUDA device" in check.stderr
