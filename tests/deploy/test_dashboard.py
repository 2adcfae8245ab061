"""The Grafana dashboard: generated from deploy/helm/dashboard.py, and every query is valid PromQL over metrics and
labels the services really export (services/common/metrics.py CATALOGUE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import promql_parser
import pytest
from kvshuttle.services.common.metrics import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/helm/kvshuttle/dashboards/kvshuttle.json"
# Labels Prometheus adds to every scraped series (a ServiceMonitor's target labels).
TARGET_LABELS = {"namespace", "job", "instance", "pod", "service", "container", "endpoint"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$namespace": ".*"}


def queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def metric_labels(name: str) -> set[str] | None:
    """The labels a series name may carry, or None when no exported metric has that name."""
    for m in CATALOGUE:
        if name == m.name:
            return set(m.labels)
        if m.type == "histogram" and name in (f"{m.name}_count", f"{m.name}_sum"):
            return set(m.labels)
        if m.type == "histogram" and name == f"{m.name}_bucket":
            return set(m.labels) | {"le"}
    return None


def walk(node, selectors: list, groupings: list) -> None:
    kind = type(node).__name__
    if kind == "VectorSelector":
        selectors.append(node)
    elif kind == "MatrixSelector":
        selectors.append(node.vector_selector)
    elif kind == "AggregateExpr":
        if node.modifier is not None:
            groupings.append((node, list(node.modifier.labels)))
        walk(node.expr, selectors, groupings)
    elif kind == "Call":
        for arg in node.args:
            walk(arg, selectors, groupings)
    elif kind == "BinaryExpr":
        walk(node.lhs, selectors, groupings)
        walk(node.rhs, selectors, groupings)
    elif kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        walk(node.expr, selectors, groupings)


def parse(expr: str):
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)


def test_dashboard_file_is_generated():
    out = subprocess.run([sys.executable, str(ROOT / "deploy/helm/dashboard.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("title,expr", queries())
def test_every_query_is_promql_over_exported_metrics_and_labels(title, expr):
    selectors, groupings = [], []
    walk(parse(expr), selectors, groupings)
    assert selectors, f"{title}: no metric in {expr}"
    labels_of_query: set[str] = set()
    for s in selectors:
        labels = metric_labels(s.name)
        assert labels is not None, f"{title}: {s.name} is not exported by any kvshuttle service"
        for m in s.matchers.matchers:
            assert m.name in labels | TARGET_LABELS, f"{title}: {s.name} has no label {m.name!r}"
        labels_of_query |= labels
    for node, grouping in groupings:
        for label in grouping:
            assert label in labels_of_query | TARGET_LABELS, f"{title}: grouping by unknown label {label!r}"


def test_the_parser_rejects_what_the_check_must_catch():
    """The checks above can fail: a typo in PromQL, an unknown metric and an unknown label are all caught."""
    with pytest.raises(Exception):
        parse("sum by (decision) (rate(kvshuttle_turns_total[5m])")
    assert metric_labels("kvshuttle_turnz_total") is None
    selectors: list = []
    walk(parse('rate(kvshuttle_turns_total{tenant="a"}[5m])'), selectors, [])
    assert "tenant" not in metric_labels(selectors[0].name)


def test_dashboard_covers_what_operators_asked_for():
    """Turns by decision and reason, pulled/computed tokens, KV bytes, TTFT by decision, plan latency, etcd latency,
    live sessions and workers, failures by kind: each is charted."""
    names = set()
    for _, expr in queries():
        selectors: list = []
        walk(parse(expr), selectors, [])
        names |= {s.name for s in selectors}
    for needed in ("kvshuttle_turns_total", "kvshuttle_turn_tokens_total", "kvshuttle_kv_pulled_bytes_total",
                   "kvshuttle_ttft_seconds_bucket", "kvshuttle_plan_seconds_bucket",
                   "kvshuttle_etcd_request_seconds_bucket", "kvshuttle_live_sessions", "kvshuttle_live_workers",
                   "kvshuttle_turn_failures_total", "kvshuttle_worker_failures_total"):
        assert needed in names, needed
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
