"""scripts/device_check.sh on any host: without a usable GPU it says so and writes nothing; with one it writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_runs_the_gpu_path_or_says_why_not(tmp_path: Path) -> None:
    """Exit 0 on every host; results (all three micro-batches) exactly when torch sees CUDA, else the reason."""
    out = tmp_path / "device_check"
    script = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--runs", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=290,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert script.returncode == 0, script.stderr
    gpu_listed = shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None and "GPU 0" in script.stdout
    if torch.cuda.is_available() and gpu_listed:
        report = json.loads(out.with_suffix(".json").read_text())
        assert sorted(report["micro_batches"], key=int) == ["16", "64", "256"]
        assert all(r["GBps"]["to_device"] > 0 for r in report["micro_batches"].values())
        assert "correctness checks passed" in out.with_suffix(".md").read_text()
    else:
        assert not out.with_suffix(".json").exists()
        assert "no NVIDIA GPU" in script.stdout or "no CUDA device" in script.stderr


def test_device_check_python_half_without_cuda_writes_nothing(tmp_path: Path) -> None:
    """The Python half in a process that sees no CUDA device (CUDA_VISIBLE_DEVICES empty) names it and exits 0."""
    out = tmp_path / "device_check"
    check = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transfer" / "device_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert check.returncode == 0, check.stderr
    assert "no CUDA device" in check.stderr
    assert not out.with_suffix(".json").exists()
