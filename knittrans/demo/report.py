"""Demo results: per-step table from the control plane's status and the ranks' JSON lines, plus a PNG."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from knittrans.demo.config import DemoConfig
from knittrans.sched.staleness import READINGS

__all__ = ["BASELINES", "collect_results", "compare_runs", "format_comparison", "format_table", "plot_results"]

BASELINES = ("train_batch", "train_batch_paced")
"""The two train_batch baselines ``--compare`` runs: handed whole train batches, and paced mini-batch by mini-batch."""


def _rank_records(run_dir: Path) -> list[dict[str, Any]]:
    """Each rank's records, the last one per mini-batch (a rank restarted between writing a record and
    its ack trains that plan again and writes it again)."""
    records: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records[(int(r["rank"]), int(r["global_index"]))] = r
    return list(records.values())


_COUNTS = ("media_logical_bytes", "media_unique_bytes", "row_bytes", "encoder_calls", "media_uses", "image_rows")
"""Keys of the ranks' records summed per step."""


def _total(records: list[dict[str, Any]], key: str) -> int:
    """``key`` summed over the records (every record has it; None, e.g. no dedup stats, counts as 0)."""
    return int(sum(r[key] or 0 for r in records))


def collect_results(config: DemoConfig, run_dir: Path, status: dict[str, Any], *, wall_s: float) -> dict[str, Any]:
    """Combine status and rank records into per-step rows and run totals."""
    records = _rank_records(run_dir)
    admissions = {a["global_index"]: a for a in status["recent_admissions"]}
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[int(r["step"])].append(r)
    staleness_by_step = status["staleness"]["by_step"]
    steps = []
    for step in sorted(by_step):
        rs = by_step[step]
        adm = [admissions[n] for n in sorted({int(r["global_index"]) for r in rs}) if n in admissions]
        waits = [a["wait_s"] for a in adm if a.get("wait_s") is not None]
        st = staleness_by_step.get(str(step), {})
        encoded, uses = _total(rs, "encoded_rows"), _total(rs, "media_uses")
        forward_s = float(sum(r["encoder_forward_s"] for r in rs))
        steps.append(
            {
                "step": step,
                "mini_batches": len({r["global_index"] for r in rs}),
                "admission_wait_s": sum(waits) / len(waits) if waits else None,
                **{f"arch_staleness_{r}": st.get(r, {}).get("architectural", {}).get("mean") for r in READINGS},
                "exposed_transfer_s": sum(r["wait_s"] for r in rs),
                "fetch_s": sum(r["fetch_s"] for r in rs),
                **{key: _total(rs, key) for key in _COUNTS},
                "images_encoded": encoded,
                "encoder_forward_s": forward_s,
                # forward time per encoded image times the references not encoded again (a per-row encoder would
                # have run them); the backward saves about as much again
                "encoder_forward_saved_s": forward_s / encoded * max(uses - encoded, 0) if encoded else 0.0,
                "step_time_s": sum(  # each mini-batch takes as long as its slowest rank
                    max(r["step_time_s"] for r in rs if r["global_index"] == n) for n in {r["global_index"] for r in rs}
                ),
            }
        )
    overall = status["staleness"]["overall"]
    trajectories_by_step = {  # trajectories of each source consumed per step, as the control plane counted them
        step: {src: v["staleness"]["count"] for src, v in rep["end"]["by_source"].items()}
        for step, rep in staleness_by_step.items()
    }
    return {
        "label": config.label,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "wall_s": wall_s,
        "steps": steps,
        "staleness": overall,
        "quota_fill": status.get("quota_fill"),
        "trajectories_by_step": trajectories_by_step,
        "timing": status.get("timing"),
        "counts": status["counts"],
        "rank_records": records,
    }


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: dict[str, Any]) -> str:
    """Per-step table as text."""
    head = (
        f"{'step':>4} {'mb':>3} {'adm.wait s':>10} {'arch.stal(end)':>14} {'arch(start)':>11} "
        f"{'exposed xfer ms':>15} {'fetch ms':>9} {'media MiB log/uniq':>19} {'img enc/rows':>12} "
        f"{'enc ms (saved)':>14} {'step s':>7}"
    )
    lines = [head, "-" * len(head)]
    for s in results["steps"]:
        media = f"{s['media_logical_bytes'] / 2**20:.1f}/{s['media_unique_bytes'] / 2**20:.1f}"
        lines.append(
            f"{s['step']:>4} {s['mini_batches']:>3} {_fmt(s['admission_wait_s'], '.2f'):>10} "
            f"{_fmt(s['arch_staleness_end'], '.2f'):>14} {_fmt(s['arch_staleness_start'], '.2f'):>11} "
            f"{s['exposed_transfer_s'] * 1e3:>15.1f} {s['fetch_s'] * 1e3:>9.1f} {media:>19} "
            f"{str(s['images_encoded']) + '/' + str(s['image_rows']):>12} "
            f"{s['encoder_forward_s'] * 1e3:>6.0f} ({s['encoder_forward_saved_s'] * 1e3:>5.0f})"
            f" {s['step_time_s']:>7.1f}"
        )
    arch = results["staleness"]
    summary = ", ".join(f"{reading}: {_fmt(arch[reading]['architectural']['mean'], '.3f')}" for reading in READINGS)
    lines.append(f"mean architectural staleness by reading: {summary}; wall {results['wall_s']:.1f} s")
    return "\n".join(lines)


def plot_results(runs: dict[str, dict[str, Any]], path: Path) -> Path:
    """Staleness, transfer and bytes per step of every run (by label) in one PNG; media bytes of the last run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = list(runs.values())[-1]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for label, res in runs.items():
        steps = [s["step"] for s in res["steps"]]
        axes[0][0].plot(steps, [s["arch_staleness_end"] or 0 for s in res["steps"]], marker="o", label=label)
        axes[0][1].plot(steps, [s["admission_wait_s"] or 0 for s in res["steps"]], marker="o", label=label)
        axes[1][0].plot(
            steps, [s["exposed_transfer_s"] * 1e3 for s in res["steps"]], marker="o", label=f"{label} exposed"
        )
        axes[1][0].plot(steps, [s["fetch_s"] * 1e3 for s in res["steps"]], linestyle="--", label=f"{label} fetch")
    main = results["steps"]
    x = range(len(main))
    axes[1][1].bar([i - 0.2 for i in x], [s["media_logical_bytes"] / 2**20 for s in main], 0.4, label="logical")
    axes[1][1].bar([i + 0.2 for i in x], [s["media_unique_bytes"] / 2**20 for s in main], 0.4, label="moved (unique)")
    axes[0][0].set_title("mean architectural staleness per step (end reading)")
    axes[0][1].set_title("mean admission wait per mini-batch (s)")
    axes[1][0].set_title("transfer per step (ms): exposed vs fetch time")
    axes[1][1].set_title(f"media MiB per step ({results['label']})")
    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pace(res: dict[str, Any]) -> float:
    """Mini-batches trained per minute of the run."""
    return 60.0 * sum(int(s["mini_batches"]) for s in res["steps"]) / float(res["wall_s"])


def compare_runs(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Every non-baseline run against each baseline run present: ``1 - run / baseline`` of the mean and of the
    positive part of architectural staleness under every reading, and the ratio of mini-batches per minute."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for label, res in results.items():
        if label in BASELINES:
            continue
        for base in BASELINES:
            if base not in results:
                continue
            row: dict[str, float | None] = {}
            for reading in READINGS:
                for stat, key in (("mean", "mean"), ("pos", "pos_mean")):
                    mine = res["staleness"][reading]["architectural"][key]
                    theirs = results[base]["staleness"][reading]["architectural"][key]
                    row[f"{reading}_{stat}"] = None if mine is None or not theirs else 1.0 - mine / theirs
            row["pace_ratio"] = _pace(res) / _pace(results[base])
            out.setdefault(label, {})[f"vs_{base}"] = row
    return out


def format_comparison(results: dict[str, dict[str, Any]]) -> str:
    """Runs side by side (staleness per reading, the end reading's tail against its derived bound, timing peaks,
    pace), then every policy's reductions against both train_batch baselines."""
    from knittrans.sched.timing import staleness_bound

    head = (
        f"{'run':<22} {'arch mean s/e/w':>20} {'pos part s/e/w':>20} {'max e / bound':>13} {'peak ahead/L':>12} "
        f"{'peak untaken/WG':>15} {'mini-batches/min':>16}"
    )
    lines = [head, "-" * len(head)]
    for label, res in results.items():
        st = res["staleness"]
        means = "/".join(_fmt(st[r]["architectural"]["mean"], ".2f") for r in READINGS)
        pos = "/".join(_fmt(st[r]["architectural"]["pos_mean"], ".2f") for r in READINGS)
        cfg, timing = res["config"], res.get("timing") or {}
        g = sum(cfg["quotas"].values())
        bound = max(  # one optimizer step may end during a group's last chunk: sync lag 1
            staleness_bound(
                mini_batches_per_step=cfg["mini_batches_per_step"],
                window=cfg["window"],
                train_batch_groups=g,
                quota=q,
                sync_lag=1,
            )
            for q in cfg["quotas"].values()
        )
        tail = f"{_fmt(st['end']['architectural']['max'], '.1f')} / {bound}"
        lines.append(
            f"{label:<22} {means:>20} {pos:>20} {tail:>13} "
            f"{str(timing.get('peak_admitted_ahead', '-')) + '/' + str(cfg['lookahead']):>12} "
            f"{str(timing.get('peak_untaken', '-')) + '/' + str(cfg['window'] * g):>15} "
            f"{_pace(res):>16.1f}"
        )
    reductions = compare_runs(results)
    if reductions:
        lines += ["", "reduction of architectural staleness (1 - run / baseline): mean and positive part per reading"]
        head = (
            f"{'run':<22} {'baseline':<18} {'start mean/pos':>15} {'end mean/pos':>15} {'wtd mean/pos':>15} "
            f"{'pace x':>7}"
        )
        lines += [head, "-" * len(head)]
        for label, by_base in reductions.items():
            for base, row in by_base.items():
                cells = [f"{_pct(row[f'{r}_mean'])}/{_pct(row[f'{r}_pos'])}" for r in READINGS]
                lines.append(
                    f"{label:<22} {base[3:]:<18} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} "
                    f"{_fmt(row['pace_ratio'], '.2f'):>7}"
                )
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
