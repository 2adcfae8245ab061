"""The kvshuttle Grafana dashboard, written as data: `python deploy/helm/dashboard.py` writes
deploy/helm/kvshuttle/dashboards/kvshuttle.json (inside the chart, which ships it in a ConfigMap for Grafana's
dashboard sidecar); `--check` exits 1 when that file is stale. tests/deploy checks every query with a PromQL parser
against the metrics the services export (services/common/metrics.py CATALOGUE).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "kvshuttle/dashboards/kvshuttle.json"
NS = 'namespace=~"$namespace"'  # every selector: the namespace picked at the top (all of them by default)
RATE = "$__rate_interval"
PULL, LOCAL, NOT_OK = 'decision="pull"', 'decision="local"', 'code!="OK"'
PULLED, PROMPT, PROMPT_PARTS = 'kind="pulled"', 'kind="prompt"', 'kind=~"pulled|cached|computed"'
# The gateway's turn metrics carry the model a turn asked for: their panels follow the model picked at the top.
BY_MODEL = {"kvshuttle_turns_total", "kvshuttle_turn_tokens_total", "kvshuttle_kv_pulled_bytes_total",
            "kvshuttle_ttft_seconds_bucket", "kvshuttle_turn_duration_seconds_bucket", "kvshuttle_turn_failures_total",
            "kvshuttle_turn_sessions_total", "kvshuttle_turn_records_total"}
MODEL = 'model=~"$model"'


def sel(metric: str, matchers: str = "") -> str:
    matchers = ", ".join(m for m in (MODEL if metric in BY_MODEL else "", matchers) if m)
    return f"{metric}{{{NS}{', ' + matchers if matchers else ''}}}"


def rate(metric: str, matchers: str = "") -> str:
    return f"rate({sel(metric, matchers)}[{RATE}])"


def quantile(q: float, metric: str, by: str = "", matchers: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(metric + '_bucket', matchers)}))"


def panel(title: str, targets: list[tuple[str, str]], *, unit: str = "short", kind: str = "timeseries",
          description: str = "", stack: bool = False, width: int = 8) -> dict:
    """A panel; ``targets`` are (PromQL, legend) pairs."""
    p = {
        "type": kind, "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"w": width, "h": 8},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal" if stack else "none"},
                                                  "fillOpacity": 20 if stack else 0}
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    return p


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": 24, "h": 1}, "panels": []}


PANELS = [
    row("Turns and KV reuse"),
    panel("Turns per second by decision", [(f"sum by (decision) ({rate('kvshuttle_turns_total')})", "{{decision}}")],
          unit="reqps", stack=True, description="pull: the history's KV came back from the decode worker over "
          "NIXL; recompute: the prefill worker computed the whole prompt; local: the decode worker holding the "
          "history served the turn from its own prefix cache"),
    panel("Share of turns that pulled or continued on D",
          [(f"sum({rate('kvshuttle_turns_total', PULL)}) / sum({rate('kvshuttle_turns_total')})", "pulled"),
           (f"sum({rate('kvshuttle_turns_total', LOCAL)}) / sum({rate('kvshuttle_turns_total')})", "continued on D")],
          unit="percentunit"),
    panel("Prompt tokens per second: pulled, cached, computed",
          [(f"sum by (kind) ({rate('kvshuttle_turn_tokens_total', PROMPT_PARTS)})",
            "{{kind}}")], stack=True,
          description="pulled: from D over NIXL; cached: P's own prefix cache; computed: P's prefill work"),
    panel("Prefill work saved (pulled / prompt tokens)",
          [(f"sum({rate('kvshuttle_turn_tokens_total', PULLED)}) / "
            f"sum({rate('kvshuttle_turn_tokens_total', PROMPT)})", "saved")], unit="percentunit"),
    panel("KV pulled", [(f"sum({rate('kvshuttle_kv_pulled_bytes_total')})", "bytes/s")], unit="Bps",
          description="Estimated from pulled tokens x the model's KV bytes per token"),
    panel("Turns by decision and reason (range)",
          [(f"sum by (decision, reason) (increase({sel('kvshuttle_turns_total')}[$__range]))",
            "{{decision}}: {{reason}}")], kind="bargauge"),
    row("Latency"),
    panel("Time to first token by decision",
          [(quantile(0.5, "kvshuttle_ttft_seconds", "decision"), "p50 {{decision}}"),
           (quantile(0.95, "kvshuttle_ttft_seconds", "decision"), "p95 {{decision}}")], unit="s"),
    panel("Turn duration by decision",
          [(quantile(0.5, "kvshuttle_turn_duration_seconds", "decision"), "p50 {{decision}}"),
           (quantile(0.95, "kvshuttle_turn_duration_seconds", "decision"), "p95 {{decision}}")], unit="s"),
    panel("Plan latency (scheduler)",
          [(quantile(0.5, "kvshuttle_plan_seconds"), "p50"), (quantile(0.99, "kvshuttle_plan_seconds"), "p99")],
          unit="s"),
    panel("etcd latency p99 by operation", [(quantile(0.99, "kvshuttle_etcd_request_seconds", "op"), "{{op}}")],
          unit="s"),
    panel("gRPC handling p99 by method",
          [(quantile(0.99, "kvshuttle_grpc_server_handling_seconds", "service, method"), "{{method}}")], unit="s",
          width=16),
    row("Decode KV between turns"),
    panel("Decode KV usage (engine) and held by sessions",
          [("max by (decode_worker) (" + sel("kvshuttle_decode_kv_used_tokens") + ") / max by (decode_worker) ("
            + sel("kvshuttle_decode_kv_capacity_tokens") + ")", "{{decode_worker}} used"),
           ("max by (decode_worker) (" + sel("kvshuttle_decode_kv_held_tokens") + ") / max by (decode_worker) ("
            + sel("kvshuttle_decode_kv_capacity_tokens") + ")", "{{decode_worker}} held")], unit="percentunit",
          description="used: the engine's KV cache in use (vLLM GetLoads); held: the share of it sessions hold "
                      "between turns (the scheduler's KV manager frees it past --kv-high-water / --kv-held-budget); "
                      "every scheduler replica reports the same view (max)"),
    panel("Held KV by decode worker",
          [("max by (decode_worker) (" + sel("kvshuttle_decode_kv_held_bytes") + ")", "{{decode_worker}}")],
          unit="bytes"),
    panel("Sessions holding decode KV",
          [("max by (decode_worker) (" + sel("kvshuttle_decode_kv_held_sessions") + ")", "{{decode_worker}}")]),
    panel("Held KV freed by reason",
          [(f"sum by (reason) ({rate('kvshuttle_kv_evictions_total')})", "{{reason}}")], unit="ops", stack=True,
          description="idle: past --kv-idle-limit-s; pressure: KV usage over the high-water mark or held KV over "
                      "its budget; room: a turn needed the space"),
    panel("Pulls lost to evictions",
          [(f"sum by (reason) ({rate('kvshuttle_kv_pulls_lost_total')})", "{{reason}}")], unit="reqps",
          description="Turns that found their session's KV freed (they recompute, with reason kv_freed_*)"),
    panel("Freeing reads that failed", [(f"sum({rate('kvshuttle_kv_eviction_failures_total')})", "failed/s")],
          unit="ops"),
    row("Fleet and failures"),
    panel("Registered workers by role", [("max by (role) (" + sel("kvshuttle_live_workers") + ")", "{{role}}")],
          description="From etcd (the registry's census); every registry replica reports the same count"),
    panel("Workers by state (scheduler's view)",
          [("max by (role, state) (" + sel("kvshuttle_workers") + ")", "{{role}} {{state}}")]),
    panel("Live sessions", [("max(" + sel("kvshuttle_live_sessions") + ")", "sessions")]),
    panel("Gateway HTTP responses by route and status",
          [(f"sum by (route, code) ({rate('kvshuttle_http_requests_total')})", "{{route}} {{code}}")], unit="reqps",
          description="Every request, refusals before the turn logic included (401, 413, malformed bodies)"),
    panel("Turn failures by kind", [(f"sum by (kind) ({rate('kvshuttle_turn_failures_total')})", "{{kind}}")],
          unit="reqps"),
    panel("Workers that failed during a turn", [(f"sum by (role) ({rate('kvshuttle_worker_failures_total')})",
                                                 "{{role}}")], unit="reqps"),
    panel("Degraded turns (no session store)",
          [(f"sum by (kind) ({rate('kvshuttle_degraded_turns_total')})", "{{kind}}")], unit="reqps"),
    panel("gRPC errors by method and code",
          [(f"sum by (method, code) ({rate('kvshuttle_grpc_server_handled_total', NOT_OK)})",
            "{{method}} {{code}}")], unit="reqps"),
    panel("etcd errors by operation", [(f"sum by (op, kind) ({rate('kvshuttle_etcd_errors_total')})",
                                        "{{op}} {{kind}}")], unit="reqps"),
    panel("Sessions dropped (departed decode workers)",
          [(f"sum({rate('kvshuttle_sessions_dropped_total')})", "dropped/s")], unit="reqps"),
]


def layout(panels: list[dict]) -> list[dict]:
    """Place panels left to right in rows of 24 columns; ids in order."""
    x = y = height = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:
            x, y, height = 0, y + height, 0
        p["gridPos"].update(x=x, y=y)
        x, height = x + w, max(height, h)
        if p["type"] == "row":
            x, y, height = 0, y + h, 0
    return panels


def dashboard() -> dict:
    return {
        "title": "kvshuttle",
        "uid": "kvshuttle-overview",
        "description": "Turns, KV reuse and what it saves, latency by hop, workers and failures "
                       "(metrics: docs/metrics.md)",
        "tags": ["kvshuttle", "llm", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0},
            {"type": "query", "name": "namespace", "label": "Namespace",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(kvshuttle_turns_total, namespace)", "refId": "namespace"},
             "definition": "label_values(kvshuttle_turns_total, namespace)",
             "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "refresh": 2, "hide": 0},
            {"type": "query", "name": "model", "label": "Model",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(kvshuttle_turns_total{namespace=~\"$namespace\"}, model)",
                       "refId": "model"},
             "definition": "label_values(kvshuttle_turns_total{namespace=~\"$namespace\"}, model)",
             "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "refresh": 2, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": layout([json.loads(json.dumps(p)) for p in PANELS]),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python deploy/helm/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
