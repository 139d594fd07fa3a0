"""Markdown table of the sweep in results.json (written by `knittrans sim ... --json`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results.json")
    data = json.loads(path.read_text())
    print(
        "| workload | K | W | policy | red. mean arch start / end / wtd | red. pos. part start / end / wtd "
        "| arch p99 / max (end) | steps/h | trainer idle |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in data["configs"]:
        for policy, r in c["policies"].items():
            if policy == "colocated":
                continue
            reds = " / ".join(pct(r[f"{x}_arch_reduction"]) for x in ("start", "end", "weighted"))
            pos = " / ".join(pct(r[f"{x}_arch_pos_reduction"]) for x in ("start", "end", "weighted"))
            print(
                f"| {c['workload']} | {c['mini_batches_per_step']} | {c['window']} | {policy} | {reds} | {pos} "
                f"| {r['end_arch_p99']:.1f} / {r['end_arch_max']:.1f} | {r['steps_per_hour']:.1f} "
                f"| {100 * r['trainer_idle']:.0f}% |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
