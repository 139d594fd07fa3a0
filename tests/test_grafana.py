"""``deploy/grafana/knittrans.json`` uses only what ``/metrics`` exports; the metrics follow Prometheus conventions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, populate
from prometheus_client.parser import text_string_to_metric_families

from knittrans.api.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "knittrans.json"
NAME = re.compile(r"^knittrans_[a-z][a-z0-9]*(_[a-z0-9]+)*$")
SELECTOR = re.compile(r"\b(knittrans_[a-z0-9_]+)\s*(\{([^}]*)\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Unit words that must not appear as suffixes: the base unit goes into the name instead.
NON_BASE_UNITS = ("_ms", "_s", "_us", "_ns", "_secs", "_kb", "_mb", "_gb", "_kib", "_mib", "_gib", "_percent")


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Families and samples of a real app's /metrics after a consumed step, node usage and rank acks."""
    db = tmp_path_factory.mktemp("grafana") / "cp.db"
    with app_client(db) as c:
        populate(c)
        c.post("/v1/nodes/n1/lost", json={"reason": "test"})
        text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples: dict[str, set[str]] = {}
    for f in families.values():
        for s in f.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return {"families": families, "samples": samples}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def test_dashboard_structure() -> None:
    """Valid JSON with a uid, a Prometheus datasource variable, non-overlapping panels, one expr per target."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "knittrans" and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "reading"} <= set(variables)
    assert [o["value"] for o in variables["reading"]["options"]] == ["start", "end", "weighted"]
    ids, cells = set(), set()
    for p in _panels(dashboard):
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, f"panel {p['title']!r} is wider than the grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"]["uid"] == "${datasource}"
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_dashboard_covers_the_issue_topics() -> None:
    """Admission latency, staleness per source, exposed transfer per rank, bytes, store budget, node health."""
    text = DASHBOARD.read_text()
    for name in (
        "knittrans_last_admission_seconds",
        "knittrans_staleness_versions",
        "knittrans_rank_exposed_transfer_seconds_total",
        "knittrans_rank_logical_bytes_total",
        "knittrans_rank_physical_bytes_total",
        "knittrans_store_budget_bytes",
        "knittrans_node_up",
    ):
        assert name in text, f"the dashboard does not chart {name}"


def test_every_dashboard_metric_and_label_is_exported(scrape: dict[str, Any]) -> None:
    """Each metric name a query uses is a sample name of /metrics, and each label it matches or groups by exists."""
    dashboard = json.loads(DASHBOARD.read_text())
    samples = scrape["samples"]
    used = set()
    for expr in _exprs(dashboard):
        names = []
        for m in SELECTOR.finditer(expr):
            name = m.group(1)
            names.append(name)
            used.add(name)
            assert name in samples, f"{expr!r}: /metrics exports no {name} (exported: {sorted(samples)})"
            for label, _ in MATCHER.findall(m.group(3) or ""):
                assert label in samples[name], f"{expr!r}: {name} has no label {label!r} ({sorted(samples[name])})"
        assert names, f"{expr!r} uses no knittrans metric"
        for group in GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert any(label in samples[n] for n in names), f"{expr!r}: nothing to group by {label!r}"
        if "label_values(" in expr:
            metric, label = re.findall(r"label_values\((\w+),\s*(\w+)\)", expr)[0]
            assert label in samples[metric]
    assert len(used) >= 15


def test_exported_names_follow_prometheus_conventions(scrape: dict[str, Any]) -> None:
    """Prefix, snake case, base units, ``_total`` only on counters, no scraper-owned labels, METRICS is complete."""
    families = scrape["families"]
    assert set(families) == set(METRICS), "METRICS must list exactly the families /metrics exports"
    for name, family in families.items():
        assert NAME.match(name), f"{name}: not knittrans_snake_case"
        assert family.type == METRICS[name], f"{name}: exported as {family.type}, METRICS says {METRICS[name]}"
        assert not name.endswith(NON_BASE_UNITS), f"{name}: use base units (_seconds, _bytes, _ratio)"
        assert ("seconds" in name) == name.endswith("_seconds"), f"{name}: seconds go last"
        assert ("bytes" in name) == name.endswith("_bytes"), f"{name}: bytes go last"
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == name + "_total", f"{sample.name}: counters end in _total"
            else:
                assert not sample.name.endswith("_total"), f"{sample.name}: only counters end in _total"
            for label in sample.labels:
                assert re.fullmatch(r"[a-z][a-z0-9_]*", label), f"{name}: label {label!r} is not snake case"
                assert label not in ("job", "instance", "le", "quantile"), (
                    f"{name}: label {label!r} belongs to Prometheus (scrape target or histogram/summary)"
                )
        assert family.documentation, f"{name} has no help text"


def test_dashboard_test_can_fail(scrape: dict[str, Any]) -> None:
    """A query for a name /metrics does not export is caught by the same check."""
    assert "knittrans_quota_fill" not in scrape["samples"]  # the old name, renamed to ..._ratio
    assert "knittrans_staleness" not in scrape["samples"]  # renamed to ..._versions
