"""`knittrans demo` end to end: real processes, then the JSON it writes is checked for the invariants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from knittrans.demo.config import DemoConfig


@pytest.mark.slow  # ~30 s: the whole demo pipeline
def test_short_demo_keeps_quotas_and_delivers_every_trajectory_once(tmp_path: Path) -> None:
    """two steps of the demo: exact per-step composition, exactly-once rows, staleness and dedup counters."""
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "knittrans.cli",
        "demo",
        "--steps",
        "2",
        "--hidden",
        "128",
        "--layers",
        "2",
        "--out",
        str(out),
        "--timeout-s",
        "400",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mean architectural staleness" in proc.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    results = json.loads((out / "constraint_preserving" / "results.json").read_text())
    defaults = DemoConfig()
    quotas, n = defaults.quotas, defaults.group_size

    # every train batch has exactly the configured per-source composition
    assert sorted(results["trajectories_by_step"]) == ["0", "1"]
    for step, counts in results["trajectories_by_step"].items():
        assert counts == {src: q * n for src, q in quotas.items()}, (step, counts)

    # every trajectory reached exactly one rank exactly once
    records = results["rank_records"]
    trained = [t for r in records for t in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == 2 * sum(quotas.values()) * n
    per_mini_batch: dict[int, int] = {}
    for r in records:
        per_mini_batch[r["global_index"]] = per_mini_batch.get(r["global_index"], 0) + r["rows"]
    assert sorted(per_mini_batch) == list(range(2 * defaults.mini_batches_per_step))

    # staleness recorded for every consumed trajectory, under every reading
    for reading in ("start", "end", "weighted"):
        assert results["staleness"][reading]["architectural"]["count"] == len(trained)

    # dedup: each unique image moved once per rank and mini-batch, encoded once
    for r in records:
        assert r["media_unique_bytes"] <= r["media_logical_bytes"]
        assert r["encoder_calls"] <= r["unique_media"] or r["unique_media"] == 0
    logical = sum(r["media_logical_bytes"] for r in records)
    unique = sum(r["media_unique_bytes"] for r in records)
    assert unique > 0 and logical >= 2 * unique  # groups of 4 share one image

    # the policy is the tiny VLM: rollout saw the images, so the first mini-batch (no update yet) is on-policy
    assert (out / "constraint_preserving" / "model" / "knittrans_vlm.json").is_file()
    first = [r for r in records if r["global_index"] == 0]
    assert first and all(r["max_logprob_gap"] < 2e-4 for r in first), [r["max_logprob_gap"] for r in first]
    assert sum(r["image_rows"] for r in records) == quotas["mm_qa"] * n * 2
    assert all(r["encoded_rows"] == r["unique_media"] for r in records)
    assert "img enc/rows" in proc.stdout


def test_demo_config_validates_timing_fields() -> None:
    """The demo refuses a negative trainer padding, lookahead or a window below one, naming the field."""
    import pytest

    for field, value in (("min_step_s", -1.0), ("lookahead", -1), ("window", 0)):
        with pytest.raises(ValueError, match=field):
            DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_demo_cli_slow_trainer_scenario_is_accepted(tmp_path: Path) -> None:
    """`knittrans demo --scenario slow-trainer --compare` parses; an unknown scenario is refused by name."""
    ok = subprocess.run([sys.executable, "-m", "knittrans.cli", "demo", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "slow-trainer" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "knittrans.cli", "demo", "--scenario", "fast"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "fast" in bad.stderr


def test_rank_records_keep_the_last_record_of_each_mini_batch(tmp_path: Path) -> None:
    """A rank restarted between writing a mini-batch's record and acking it writes the record again: the
    report counts it once (the later line), per rank."""
    from knittrans.demo.report import _rank_records

    lines = {
        "rank-0.jsonl": [{"rank": 0, "global_index": 0, "attempt": 0, "loss": 1.0}]
        + [{"rank": 0, "global_index": 1, "attempt": 0, "loss": x} for x in (2.0, 3.0)],
        "rank-1.jsonl": [{"rank": 1, "global_index": 1, "attempt": 0, "loss": 4.0}],
    }
    for name, records in lines.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    got = sorted((r["rank"], r["global_index"], r["loss"]) for r in _rank_records(tmp_path))
    assert got == [(0, 0, 1.0), (0, 1, 3.0), (1, 1, 4.0)]


def test_compare_reports_both_train_batch_baselines() -> None:
    """`--compare`'s report: constraint_preserving against the whole-step and the paced train_batch, mean and
    positive part of every reading, pace ratio; the end reading's max beside its derived bound."""
    from knittrans.demo.report import compare_runs, format_comparison

    def run(label: str, mean: float, pos: float, mini_batches: int) -> dict[str, object]:
        reading = {"architectural": {"mean": mean, "pos_mean": pos, "max": pos * 2}}
        return {
            "label": label,
            "staleness": dict.fromkeys(("start", "end", "weighted"), reading),
            "config": {"quotas": {"math": 4, "mm_qa": 4}, "mini_batches_per_step": 4, "window": 1, "lookahead": 1},
            "timing": {"peak_admitted_ahead": 1, "peak_untaken": 8},
            "steps": [{"mini_batches": mini_batches}],
            "wall_s": 60.0,
        }

    results = {
        "train_batch": run("train_batch", 4.0, 4.0, 6),
        "train_batch_paced": run("train_batch_paced", 2.0, 2.5, 5),
        "constraint_preserving": run("constraint_preserving", 1.0, 2.0, 12),
    }
    got = compare_runs(results)
    assert set(got) == {"constraint_preserving"}
    vs_step, vs_paced = (
        got["constraint_preserving"]["vs_train_batch"],
        got["constraint_preserving"]["vs_train_batch_paced"],
    )
    assert vs_step["start_mean"] == 0.75 and vs_step["end_pos"] == 0.5 and vs_step["pace_ratio"] == 2.0
    assert vs_paced["weighted_mean"] == 0.5 and vs_paced["end_pos"] == pytest.approx(0.2)
    assert vs_paced["pace_ratio"] == pytest.approx(2.4)
    text = format_comparison(results)
    assert "train_batch_paced" in text and "4.0 / 9" in text  # max end 4.0 against ceil(8/4)·4 + 1
    assert "75%/50%" in text  # start: mean / positive part against the whole-step baseline


def test_demo_cli_compare_on_the_slow_trainer_runs_three_configs_and_writes_the_reductions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`knittrans demo --compare --scenario slow-trainer` (the runs stubbed): the whole-step and the paced
    train_batch and constraint_preserving, each padded to 3 s a mini-batch on the small policy; summary.json
    holds every run and the reductions against both baselines."""
    import argparse
    import dataclasses

    from knittrans.demo import cli, report, run

    seen: list[DemoConfig] = []

    def run_demo(config: DemoConfig) -> dict[str, object]:
        seen.append(config)
        reading = {"architectural": {"mean": 1.0 + len(seen), "pos_mean": 1.0, "max": 2.0}}
        step = dict.fromkeys(
            ("admission_wait_s", "arch_staleness_end", "arch_staleness_start", "exposed_transfer_s", "fetch_s"), 0.0
        ) | dict.fromkeys(("media_logical_bytes", "media_unique_bytes", "images_encoded", "image_rows"), 0)
        step |= {"step": 0, "mini_batches": 4, "encoder_forward_s": 0.0, "encoder_forward_saved_s": 0.0}
        return {
            "label": config.label,
            "config": dataclasses.asdict(config),
            "staleness": dict.fromkeys(("start", "end", "weighted"), reading),
            "steps": [step | {"step_time_s": 1.0}],
            "timing": {},
            "wall_s": 60.0,
        }

    monkeypatch.setattr(run, "run_demo", run_demo)
    monkeypatch.setattr(report, "plot_results", lambda runs, path: path)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--compare", "--scenario", "slow-trainer", "--out", str(tmp_path)])) == 0
    assert [(c.label, c.train_batch_handover, c.min_step_s, c.hidden, c.layers) for c in seen] == [
        ("train_batch", "step", 3.0, 128, 2),
        ("train_batch_paced", "mini_batch", 3.0, 128, 2),
        ("constraint_preserving", "mini_batch", 3.0, 128, 2),
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["runs"]) == ["train_batch", "train_batch_paced", "constraint_preserving"]
    vs = summary["reductions"]["constraint_preserving"]
    assert vs["vs_train_batch"]["start_mean"] == pytest.approx(1 - 4 / 2) and vs["vs_train_batch"]["pace_ratio"] == 1
    assert set(vs) == {"vs_train_batch", "vs_train_batch_paced"}


def test_train_cli_refuses_a_bad_rank_config_with_exit_2(caplog: pytest.LogCaptureFixture) -> None:
    """`knittrans train` names the bad setting and exits 2 before it loads a model or connects anywhere."""
    import argparse

    from knittrans.demo import traincli

    parser = argparse.ArgumentParser()
    traincli.add_arguments(parser)
    base = ["--control-url", "http://127.0.0.1:9", "--job", "j", "--rank", "0", "--model-dir", "m"]
    for extra, words in (
        (["--world-size", "2"], "needs dist_url"),
        (["--world-size", "1", "--lr", "0"], "lr must be > 0"),
        (["--world-size", "1", "--min-step-s", "-1"], "min_step_s must be >= 0"),
    ):
        caplog.clear()
        assert traincli.run(parser.parse_args(base + extra)) == 2
        assert words in caplog.text
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--world-size", "1", "--local-dir", "node-0"])  # NODE=DIR
