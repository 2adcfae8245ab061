"""The metric catalogue: Prometheus naming, bounded labels, each process's endpoint, and the README's tables (what
dashboards are built from) in step with the code."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.common.metrics_http import check_listen, metrics_app
from kvshuttle.services.registry.server import RegistryConfig
from prometheus_client import generate_latest

from tests.support.metrics import parse

ROOT = Path(__file__).resolve().parents[2]
UNBOUNDED = {"tenant", "session", "session_id", "worker", "worker_id", "engine_id", "address", "reason_text", "model"}


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(section: str, first_header: str) -> list[list[str]]:
    lines = section.split(f"| {first_header} |", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip()[1:-1].split("|")])
    return rows


def test_names_types_and_labels_follow_prometheus_conventions():
    seen = set()
    for m in metrics.CATALOGUE:
        assert m.name not in seen, m.name
        seen.add(m.name)
        assert re.fullmatch(r"kvshuttle_[a-z_]+", m.name), m.name
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
        if m.type == "histogram":
            assert m.name.endswith(("_seconds", "_bytes")), m.name
        assert not set(m.labels) & UNBOUNDED, m
        # One series per decode worker, only where the point is per-worker capacity (bounded by the cluster's size).
        assert "decode_worker" not in m.labels or m.name.startswith("kvshuttle_decode_kv_"), m
        assert m.help


def test_the_readme_lists_every_metric_with_its_type_and_labels():
    rows = table_rows(readme_section("Metrics"), "Metric")
    documented = {row[0].strip("`"): (row[1], tuple(label.strip("`") for label in row[2].split(", ") if label))
                  for row in rows}
    in_code = {m.name: (m.type, m.labels) for m in metrics.CATALOGUE}
    assert documented == in_code


def test_the_readme_lists_every_reason_code():
    rows = table_rows(readme_section("Metrics"), "Code")
    documented = {row[0].strip("`"): row[1] for row in rows}
    assert set(documented) == reasons.VOCABULARY - {reasons.UNKNOWN}
    assert {code for code, decision in documented.items() if decision == "pull"} == set(reasons.PULL_CODES)


def test_the_readme_lists_every_etcd_operation():
    store = (ROOT / "services/store/etcd_store.py").read_text()
    ops = {op.replace(" ", "_").replace("-", "_") for op in re.findall(r'_call\(\s*"([a-z -]+)"', store)}
    assert "claim_session" in ops and len(ops) > 10
    section = readme_section("Metrics")
    assert all(f"`{op}`" in section for op in ops), sorted(op for op in ops if f"`{op}`" not in section)


@pytest.mark.parametrize("service", list(metrics.SERVICES))
def test_each_endpoint_serves_its_groups_only(service):
    exposed = {name for name, _ in parse(generate_latest(metrics.registry_for(service)).decode())}
    mine = {m.name for m in metrics.CATALOGUE if m.group in metrics.SERVICES[service]}
    others = {m.name for m in metrics.CATALOGUE} - mine
    # labelled metrics show once they have a series; the pre-initialized and unlabelled ones always do
    assert not {n for n in exposed for o in others if n == o or n.startswith(o + "_")}, service
    assert "process_cpu_seconds_total" in exposed
    assert not any(n.endswith("_created") for n in exposed)


def test_counters_with_known_label_values_exist_from_the_start():
    samples = parse(generate_latest(metrics.registry_for("gateway")).decode())
    for code in reasons.RECOMPUTE_CODES:
        assert ("kvshuttle_turns_total", frozenset({("decision", "recompute"), ("reason", code)})) in samples
    for kind in metrics.FAILURE_KINDS:
        assert ("kvshuttle_turn_failures_total", frozenset({("kind", kind)})) in samples


async def test_the_endpoint_answers_get_metrics_only():
    transport = httpx.ASGITransport(app=metrics_app(metrics.registry_for("registry")))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        ok = await client.get("/metrics")
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "kvshuttle_live_sessions" in ok.text
        assert (await client.get("/")).status_code == 404
        assert (await client.post("/metrics")).status_code == 405
        head = await client.head("/metrics")
        assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("value,ok", [("", True), ("127.0.0.1:0", True), ("0.0.0.0:9464", True), ("[::1]:9464", True),
                                      ("9464", False), ("host:", False), (":9464", False), ("h:99999", False)])
def test_metrics_listen_must_be_host_and_port(value, ok):
    if ok:
        check_listen(value)
        RegistryConfig(metrics_listen=value).validate()
    else:
        with pytest.raises(ConfigError, match="--metrics-listen"):
            RegistryConfig(metrics_listen=value).validate()
