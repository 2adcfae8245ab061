"""The metric catalogue: Prometheus naming, bounded labels, each process's endpoint, and the documentation's generated
reference pages (docs/hooks/reference.py: what dashboards are built from) in step with the code."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import re
from pathlib import Path

import httpx
import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.common.metrics_http import check_listen, metrics_app
from kvshuttle.services.registry.server import RegistryConfig
from prometheus_client import CollectorRegistry, generate_latest

from tests.support.metrics import delta, parse, value

ROOT = Path(__file__).resolve().parents[2]
UNBOUNDED = {"tenant", "session", "session_id", "worker", "worker_id", "engine_id", "address", "reason_text"}
# A model only on the turns' metrics: bounded by the models served (a gateway's turns get past the model check only
# for those; a plan is counted only once workers of its model answered it).
BY_MODEL = {"kvshuttle_turns_total", "kvshuttle_turn_sessions_total", "kvshuttle_turn_records_total",
            "kvshuttle_turn_tokens_total", "kvshuttle_ttft_seconds", "kvshuttle_turn_duration_seconds",
            "kvshuttle_turn_failures_total", "kvshuttle_kv_pulled_bytes_total", "kvshuttle_plans_total"}


def reference_page(uri: str) -> str:
    """A reference page as the docs build generates it (docs/hooks/reference.py)."""
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs/hooks/reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook.PAGES[uri]()


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
        # A tenant only where the point is per tenant (bounded by the API keys file's tenants; /metrics then needs an
        # admin key on the gateway's HTTP port).
        assert not set(m.labels) - {"tenant"} & UNBOUNDED, m
        assert "tenant" not in m.labels or m.name == "kvshuttle_rate_limited_total", m
        assert ("model" in m.labels) == (m.name in BY_MODEL), m
        # One series per decode worker, only where the point is per-worker capacity (bounded by the cluster's size).
        assert "decode_worker" not in m.labels or m.name.startswith("kvshuttle_decode_kv_"), m
        assert m.help


def test_every_metric_the_module_defines_is_served_by_a_group():
    """A metric left out of GROUPS is counted and never exposed (the worker's adapter metrics once were)."""
    from prometheus_client.metrics import MetricWrapperBase

    defined = {name for name, value in vars(metrics).items() if isinstance(value, MetricWrapperBase)}
    grouped = {name for name, value in vars(metrics).items()
               if any(value is c for collectors in metrics.GROUPS.values() for c in collectors)}
    assert defined and defined <= grouped, sorted(defined - grouped)


def test_the_reference_lists_every_metric_with_its_type_and_labels():
    rows = table_rows(reference_page("reference/metrics.md"), "Metric")
    documented = {row[0].strip("`"): (row[1], tuple(label.strip("`") for label in row[2].split(", ") if label))
                  for row in rows}
    in_code = {m.name: (m.type, m.labels) for m in metrics.CATALOGUE}
    assert documented == in_code


def test_the_reference_lists_every_reason_code():
    rows = table_rows(reference_page("reference/reason-codes.md"), "Code")
    documented = {row[0].strip("`"): row[1] for row in rows}
    assert set(documented) == reasons.VOCABULARY
    assert {code for code, decision in documented.items() if decision == "pull"} == set(reasons.PULL_CODES)
    assert {code for code, decision in documented.items() if decision == "local"} == set(reasons.LOCAL_CODES)


def test_the_reference_lists_every_etcd_operation():
    store = "".join(path.read_text() for path in sorted((ROOT / "services/store").glob("*.py")))
    ops = {op.replace(" ", "_").replace("-", "_") for op in re.findall(r'\b_?call\(\s*"([a-z -]+)"', store)}
    assert "claim_session" in ops and len(ops) > 10
    section = reference_page("reference/metrics.md")
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
    """Each served model's turn series exist once the gateway declares its models (at start-up)."""
    metrics.declare_models(["tiny", "org/big"])
    samples = parse(generate_latest(metrics.registry_for("gateway")).decode())
    for model in ("tiny", "org/big"):
        for code in reasons.RECOMPUTE_CODES:
            assert ("kvshuttle_turns_total", frozenset({("model", model), ("decision", "recompute"),
                                                        ("reason", code)})) in samples
        for kind in metrics.FAILURE_KINDS:
            assert ("kvshuttle_turn_failures_total", frozenset({("model", model), ("kind", kind)})) in samples
        assert ("kvshuttle_kv_pulled_bytes_total", frozenset({("model", model)})) in samples


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


# -- the typed state interface: services register a callable returning a frozen snapshot; metrics sums them ------

class _Service:
    """A service with its own counts, exporting them through a snapshot method."""

    def __init__(self, state):
        self.state = state

    def metrics_state(self):
        return self.state


def _state_samples(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def test_gateway_snapshots_are_summed_over_the_registered_services_and_a_collected_one_disappears():
    before = _state_samples(metrics.GATEWAY_STATE)
    one = _Service(metrics.GatewayState(degraded={"record_failed": 2, "session_read_failed": 1}, released_handles=3))
    two = _Service(metrics.GatewayState(degraded={"record_failed": 5}, released_handles=4))
    metrics.GATEWAY_STATE.register(one.metrics_state)
    metrics.GATEWAY_STATE.register(two.metrics_state)
    metrics.GATEWAY_STATE.register(two.metrics_state)  # again: counted once
    after = _state_samples(metrics.GATEWAY_STATE)
    assert delta(before, after, "kvshuttle_degraded_turns_total", kind="record_failed") == 7
    assert delta(before, after, "kvshuttle_degraded_turns_total", kind="session_read_failed") == 1
    assert delta(before, after, "kvshuttle_kv_handles_released_total") == 7
    one.state = metrics.GatewayState(degraded={"record_failed": 3}, released_handles=3)  # read at each scrape
    assert delta(before, _state_samples(metrics.GATEWAY_STATE), "kvshuttle_degraded_turns_total",
                 kind="record_failed") == 8

    del two
    gc.collect()
    gone = _state_samples(metrics.GATEWAY_STATE)
    assert delta(before, gone, "kvshuttle_degraded_turns_total", kind="record_failed") == 3
    assert delta(before, gone, "kvshuttle_kv_handles_released_total") == 3
    del one
    gc.collect()
    assert delta(before, _state_samples(metrics.GATEWAY_STATE), "kvshuttle_kv_handles_released_total") == 0


def _row(worker_id: str, held: int, usage=None, idle: int = 0, failures: int = 0) -> metrics.DecodeKvRow:
    return metrics.DecodeKvRow(worker_id=worker_id, held_sessions=held, held_tokens=16 * held,
                               held_bytes=1600 * held, usage=usage, evictions={"idle": idle},
                               evicted_tokens={"idle": 16 * idle}, failures=failures)


def test_scheduler_snapshots_are_summed_over_the_registered_services():
    before = _state_samples(metrics.SCHEDULER_STATE)
    workers = {(role, state): 0 for role in metrics.ROLES for state in metrics.WORKER_STATES}
    a = _Service(metrics.SchedulerState(
        workers={**workers, ("prefill", "live"): 2, ("decode", "unknown"): 1}, judged={"cost": 4, "ab-a": 1},
        regrets={"cost": 1, "ab-a": 0}, decode_kv=(_row("dec-a", 2, usage=(100, 1000), idle=1),)))
    b = _Service(metrics.SchedulerState(
        workers={**workers, ("prefill", "live"): 1, ("decode", "unreachable"): 1}, judged={"cost": 3},
        regrets={"cost": 2}, decode_kv=(_row("dec-b", 1, failures=2),)))
    metrics.SCHEDULER_STATE.register(a.metrics_state)
    metrics.SCHEDULER_STATE.register(b.metrics_state)
    after = _state_samples(metrics.SCHEDULER_STATE)
    assert delta(before, after, "kvshuttle_workers", role="prefill", state="live") == 3
    assert delta(before, after, "kvshuttle_workers", role="decode", state="unknown") == 1
    assert delta(before, after, "kvshuttle_workers", role="decode", state="unreachable") == 1
    assert {ls for n, ls in after if n == "kvshuttle_workers"} >= {
        frozenset({("role", role), ("state", state)}) for role in metrics.ROLES for state in metrics.WORKER_STATES}
    assert delta(before, after, "kvshuttle_policy_judged_turns_total", policy="cost") == 7
    assert delta(before, after, "kvshuttle_policy_regret_turns_total", policy="cost") == 3
    assert delta(before, after, "kvshuttle_policy_judged_turns_total", policy="ab-a") == 1
    assert ("kvshuttle_policy_regret_turns_total", frozenset({("policy", "ab-a")})) in after
    # one series per decode worker; usage only where it is known
    assert after[("kvshuttle_decode_kv_held_sessions", frozenset({("decode_worker", "dec-a")}))] == 2
    assert after[("kvshuttle_decode_kv_held_bytes", frozenset({("decode_worker", "dec-b")}))] == 1600
    assert after[("kvshuttle_decode_kv_used_tokens", frozenset({("decode_worker", "dec-a")}))] == 100
    assert after[("kvshuttle_decode_kv_capacity_tokens", frozenset({("decode_worker", "dec-a")}))] == 1000
    assert ("kvshuttle_decode_kv_used_tokens", frozenset({("decode_worker", "dec-b")})) not in after
    assert delta(before, after, "kvshuttle_kv_evictions_total", reason="idle") == 1
    assert delta(before, after, "kvshuttle_kv_evicted_tokens_total", reason="idle") == 16
    assert ("kvshuttle_kv_evictions_total", frozenset({("reason", "room")})) in after
    assert delta(before, after, "kvshuttle_kv_eviction_failures_total") == 2

    del a
    gc.collect()
    gone = _state_samples(metrics.SCHEDULER_STATE)
    assert delta(before, gone, "kvshuttle_workers", role="prefill", state="live") == 1
    assert ("kvshuttle_decode_kv_held_sessions", frozenset({("decode_worker", "dec-a")})) not in gone
    del b


def test_worker_snapshots_sum_registrations_and_any_lease_counts():
    before = _state_samples(metrics.WORKER_STATE)
    lost = _Service(metrics.WorkerState(registrations=2, registered=False))
    holding = _Service(metrics.WorkerState(registrations=1, registered=True))
    metrics.WORKER_STATE.register(lost.metrics_state)
    metrics.WORKER_STATE.register(holding.metrics_state)
    after = _state_samples(metrics.WORKER_STATE)
    assert delta(before, after, "kvshuttle_worker_registrations_total") == 3
    assert value(after, "kvshuttle_worker_registered") == 1
    del holding
    gc.collect()
    assert delta(before, _state_samples(metrics.WORKER_STATE), "kvshuttle_worker_registrations_total") == 2


def test_the_snapshots_are_frozen():
    state = metrics.WorkerState(registrations=1, registered=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.registrations = 2  # type: ignore[misc]
