"""Pool several ``cold_path.py`` result files: p50 / p99 / mean and the count over 10 ms per variant and kind.

    python benchmarks/trainer/pool_cold_path.py OUT LABEL=GLOB [LABEL=GLOB ...]

Writes ``OUT.json`` and ``OUT.txt`` (every mini-batch of the matching files pooled, per label), e.g.
``pool_cold_path.py results/cold_path_rollout_pooled "process=results/cold_path_rollout_process_r*.json"``.
"""

from __future__ import annotations

import glob
import json
import sys
from typing import Any

import numpy as np

VARIANTS = ("default", "warm_only", "baseline")


def load(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def pooled(files: list[str], variant: str, kind: str) -> dict[str, Any]:
    values = np.array(
        [
            1e3 * r["admission_to_ready_s"]
            for f in files
            for run in load(f)["variants"][variant]["raw"]
            for r in run
            if r["kind"] == kind
        ]
    )
    return {
        "n": int(values.size),
        "p50": round(float(np.percentile(values, 50)), 1),
        "p99": round(float(np.percentile(values, 99)), 1),
        "mean": round(float(values.mean()), 2),
        "over10": int((values > 10).sum()),
    }


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out: dict[str, Any] = {}
    lines = []
    for label, pattern in (a.split("=", 1) for a in sys.argv[2:]):
        files = sorted(glob.glob(pattern))
        if not files:
            sys.exit(f"no file matches {pattern!r}")
        entry: dict[str, Any] = {}
        for variant in VARIANTS:
            entry[variant] = {kind: pooled(files, variant, kind) for kind in ("cold", "warm")}
            lines += [f"{label:28s} {variant:9s} {kind}: {entry[variant][kind]}" for kind in ("cold", "warm")]
        machines = [load(f)["machine"] for f in files]
        entry["files"] = [f.rsplit("/", 1)[-1] for f in files]
        entry["load_start_end"] = [[round(m["loadavg_start"][0], 2), round(m["loadavg"][0], 2)] for m in machines]
        out[label] = entry
    with open(sys.argv[1] + ".json", "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
    with open(sys.argv[1] + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
