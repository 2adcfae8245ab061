"""Prometheus metrics of the kvshuttle services: every definition, and the small functions that record them.

Metrics are defined once here, unregistered, in groups (``GROUPS``): each process's ``/metrics`` endpoint registers
the groups it serves (:func:`registry_for`), so a gateway never shows a registry's gauges. ``CATALOGUE`` lists every
metric (name, type, labels, help, component) for the generated metrics reference (docs/hooks/reference.py) and the
dashboard checks.

Events are recorded by the small functions below (``turn_answered``, ``plan_made``, ``etcd_op`` ...). State that a
service keeps itself (counts, what workers hold) is read at scrape time through a small typed interface: the service
registers a callable returning a frozen snapshot (``GATEWAY_STATE.register(runner.metrics_state)``, returning a
:class:`GatewayState`; :class:`SchedulerState` with its :class:`DecodeKvRow` rows; :class:`WorkerState`), and this
module only sums the snapshots of the services registered in the process. It never reads their attributes.

Labels are bounded: decisions (pull, recompute, local), reason codes (:mod:`kvshuttle.control_plane.reasons`), token kinds, failure
kinds, worker roles and states, gRPC methods that are registered on the server, etcd operation names, and the
scheduler's configured policy names. Never a tenant, session or free text; a worker id only on the decode-KV
gauges (one series per decode worker: bounded by the cluster's size), an etcd member's name only on the etcd
database gauges (bounded by etcd's cluster size).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from kvshuttle.control_plane import kv_eviction, reasons
from kvshuttle.services.common.handler_wrapping import WrappingInterceptor
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    gc_collector,
    platform_collector,
    process_collector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# No *_created series: they double the series count and no dashboard needs them.
disable_created_metrics()

# -- buckets (seconds) ---------------------------------------------------------------------------------------------
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TURN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FAST_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
GRPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

DECISIONS = ("pull", "recompute", "local")
TOKEN_KINDS = ("prompt", "pulled", "cached", "computed", "generated")
FAILURE_KINDS = ("bad_request", "unavailable", "timeout", "cancelled", "internal")
ROLES = ("prefill", "decode")
WORKER_STATES = ("live", "unreachable", "unknown")

# -- gateway ---------------------------------------------------------------------------------------------------
TURNS = Counter("kvshuttle_turns", "Turns answered, by model (the served name the request asked for), the KV decision "
                "they ran with and its reason code", ["model", "decision", "reason"], registry=None)
TURN_SESSIONS = Counter("kvshuttle_turn_sessions", "Answered turns by how their session was known: client (the request "
                        "named it), response (previous_response_id), prompt_cache_key (the session its prompt_cache_key names), found "
                        "(no session id; the prompt text extends a recorded session's), new (no "
                        "session id and none found: a new session), none (not recorded); by model", ["model", "source"],
                        registry=None)
TURN_RECORDS = Counter("kvshuttle_turn_records", "Answered turns by what became of their record (KV handle + exact ids "
                       "for the next turn): recorded, unrecorded (no session), or record_refused, record_unavailable, "
                       "record_error, no_handle (the next turn cannot pull it); by model", ["model", "outcome"],
                       registry=None)
TURN_TOKENS = Counter("kvshuttle_turn_tokens", "Tokens of answered turns: prompt = pulled (from D over NIXL) + "
                      "cached (P's own prefix cache) + computed (by P); generated = answer tokens; by model",
                      ["model", "kind"], registry=None)
TTFT = Histogram("kvshuttle_ttft_seconds", "Time to the first answer token, from the request reaching the turn logic",
                 ["model", "decision", "policy"], buckets=TTFT_BUCKETS, registry=None)
TURN_DURATION = Histogram("kvshuttle_turn_duration_seconds", "Answered turns, start to end (recording included)",
                          ["model", "decision"], buckets=TURN_BUCKETS, registry=None)
TURN_FAILURES = Counter("kvshuttle_turn_failures", "Turns that ended without a full answer, by model and kind",
                        ["model", "kind"], registry=None)
KV_PULLED_BYTES = Counter("kvshuttle_kv_pulled_bytes", "KV pulled from decode workers, estimated: pulled tokens x "
                          "the model's KV bytes per token (config.json: 2 x layers x KV heads x head dim x dtype "
                          "size); not counted when the config does not say. Exact bytes: vLLM's "
                          "vllm:nixl_bytes_transferred on the prefill workers; by model", ["model"], registry=None)
HTTP_REQUESTS = Counter("kvshuttle_http_requests", "HTTP requests answered by the gateway, by method, route "
                        "template (`unmatched`: no route) and status code; refusals before the turn logic included "
                        "(401, 413, malformed bodies)", ["method", "route", "code"], registry=None)
WORKER_FAILURES = Counter("kvshuttle_worker_failures", "Workers that failed during a turn (the turn moved away from "
                          "them, or failed when none was left)", ["role"], registry=None)
RATE_LIMITED = Counter("kvshuttle_rate_limited", "Requests and turns refused with 429 (gRPC RESOURCE_EXHAUSTED) "
                      "because their tenant was over a limit of the API keys file, by tenant and limit "
                      "(requests_per_second, tokens_per_minute, concurrent_turns)", ["tenant", "limit"],
                      registry=None)
API_KEYS_RELOADS = Counter("kvshuttle_api_keys_reloads", "Reloads of the API keys file after it changed, by result: "
                           "loaded, or failed (the file was unreadable or invalid: the previous keys stay in force)",
                           ["result"], registry=None)

# -- scheduler -------------------------------------------------------------------------------------------------
PLANS = Counter("kvshuttle_plans", "PlanTurn answers, by model (the turn's; empty when it names none), policy, "
                "decision and reason code",
                ["model", "policy", "decision", "reason"], registry=None)
KV_PULLS_LOST = Counter("kvshuttle_kv_pulls_lost", "Turns that found their session's KV freed by the scheduler's KV "
                        "manager (they recompute), by why it was freed: idle, or pressure (room for a turn "
                        "included)", ["reason"],
                        registry=None)
LEARNED_RESULTS = ("applied", "dropped", "rejected")
LEARNED_OUTCOMES = Counter("kvshuttle_learned_outcomes", "Reported turn outcomes (what the cost model learns from), by "
                           "what became of them: applied (learned here), dropped (etcd stayed away until the shared "
                           "log's buffer filled: no replica learns them), rejected (invalid)", ["result"],
                           registry=None)
PLAN_SECONDS = Histogram("kvshuttle_plan_seconds", "PlanTurn's work in the scheduler (session read, prefix check, "
                         "policy, workers, claim)", ["decision"], buckets=FAST_BUCKETS, registry=None)

# -- registry (and the scheduler when it claims in etcd itself) ------------------------------------------------------
ETCD_SECONDS = Histogram("kvshuttle_etcd_request_seconds", "etcd operations, retries included, by operation",
                         ["op"], buckets=FAST_BUCKETS, registry=None)
ETCD_ERRORS = Counter("kvshuttle_etcd_errors", "etcd operations that failed: unavailable (unreachable, no leader, "
                      "timeout) or error (any other refusal)", ["op", "kind"], registry=None)
ADAPTER_FILE_ERRORS = Counter("kvshuttle_worker_adapter_file_errors", "Reads of a worker's --lora-modules-file that "
                              "changed nothing (unreadable, or naming an adapter that cannot be served; the worker "
                              "keeps serving the adapters it had)")
LORA_ADAPTERS = Gauge("kvshuttle_worker_lora_adapters", "LoRA adapters this worker serves and has registered")
LIVE_WORKERS = Gauge("kvshuttle_live_workers", "Registered workers (etcd, counted every census interval)", ["role"],
                     registry=None)
LIVE_SESSIONS = Gauge("kvshuttle_live_sessions", "Session records in etcd (counted every census interval)",
                      registry=None)
SESSIONS_DROPPED = Counter("kvshuttle_sessions_dropped", "Session records dropped because their decode worker "
                           "departed (the janitor)", registry=None)
DEFRAG_RESULTS = ("defragmented", "not_needed", "skipped", "failed")
ETCD_DEFRAG_RUNS = Counter("kvshuttle_etcd_defrag_runs", "etcd defragmentation runs of the leading registry replica "
                           "(every --etcd-defrag-interval-s), by result: defragmented (the members that needed it), "
                           "not_needed, skipped (a member did not answer), failed", ["result"], registry=None)
ETCD_DB_SIZE = Gauge("kvshuttle_etcd_db_size_bytes", "Size of each etcd member's database file, as the leading "
                     "registry replica read it at its last defragmentation run", ["member"], registry=None)
ETCD_DB_IN_USE = Gauge("kvshuttle_etcd_db_in_use_bytes", "Bytes of each etcd member's database file that hold data "
                       "(the rest is pages freed by compaction, given back by defragmentation), as last read",
                       ["member"], registry=None)

# -- every gRPC server ---------------------------------------------------------------------------------------------
GRPC_HANDLED = Counter("kvshuttle_grpc_server_handled", "gRPC calls completed, by service, method and status code",
                       ["service", "method", "code"], registry=None)
GRPC_SECONDS = Histogram("kvshuttle_grpc_server_handling_seconds", "gRPC call handling time (streams: their whole "
                         "life)", ["service", "method"], buckets=GRPC_BUCKETS, registry=None)

# Series that exist from the start (so rate() and increase() see their first event), where the values are known; a
# gateway's per-model ones once it knows its models (declare_models).
for _reason in (kv_eviction.IDLE, kv_eviction.PRESSURE):
    KV_PULLS_LOST.labels(_reason)
for _result in LEARNED_RESULTS:
    LEARNED_OUTCOMES.labels(_result)
for _role in ROLES:
    WORKER_FAILURES.labels(_role)
    LIVE_WORKERS.labels(_role)
for _result in DEFRAG_RESULTS:
    ETCD_DEFRAG_RUNS.labels(_result)


# -- recording ------------------------------------------------------------------------------------------------------

def declare_models(models: Iterable[str]) -> None:
    """Create the gateway's per-model series of every served model (at 0), so that rate() and increase() see each
    model's first turn."""
    for model in models:
        for code in reasons.PULL_CODES:
            TURNS.labels(model, "pull", code)
        for code in reasons.RECOMPUTE_CODES:
            TURNS.labels(model, "recompute", code)
        for code in reasons.LOCAL_CODES:
            TURNS.labels(model, "local", code)
        for kind in TOKEN_KINDS:
            TURN_TOKENS.labels(model, kind)
        for kind in FAILURE_KINDS:
            TURN_FAILURES.labels(model, kind)
        KV_PULLED_BYTES.labels(model)


def _decision(decision: str) -> str:
    return decision if decision in DECISIONS else "recompute"


def turn_answered(finished: Any, kv_bytes_per_token: int = 0, model: str = "") -> None:
    """One answered turn of ``model`` (the gateway's ``Finished``: ``kv``, ``prompt_tokens``, ``output_ids``,
    ``timings``)."""
    kv, timings = finished.kv, finished.timings
    decision = _decision(kv.decision)
    TURNS.labels(model, decision, reasons.known(kv.reason_code)).inc()
    TURN_SESSIONS.labels(model, getattr(kv, "session_source", "") or "none").inc()
    record = getattr(kv, "record", "")
    if record:
        TURN_RECORDS.labels(model, record if record in reasons.RECORD_OUTCOMES else reasons.UNKNOWN).inc()
    TTFT.labels(model, decision, kv.figures.policy if kv.figures is not None else "").observe(
        timings.get("ttft_ms", 0.0) / 1000)
    TURN_DURATION.labels(model, decision).observe(timings.get("total_ms", 0.0) / 1000)
    prompt, pulled, computed = finished.prompt_tokens, kv.pulled_tokens, kv.computed_tokens
    for kind, n in (("prompt", prompt), ("pulled", pulled), ("cached", max(0, prompt - pulled - computed)),
                    ("computed", computed), ("generated", len(finished.output_ids))):
        if n:
            TURN_TOKENS.labels(model, kind).inc(n)
    if pulled and kv_bytes_per_token:
        KV_PULLED_BYTES.labels(model).inc(pulled * kv_bytes_per_token)


def failure_kind(exc: BaseException) -> str:
    """The failure kind of an exception that ended a turn (TurnError's status, else cancelled or internal)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    status = getattr(exc, "http_status", None)
    code = getattr(exc, "code", None)
    if status is None:
        return "internal"
    if status == 504 or code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if 400 <= status < 500:
        return "bad_request"
    return "unavailable" if status == 503 else "internal"


def turn_failed(exc: BaseException, model: str = "") -> None:
    TURN_FAILURES.labels(model, failure_kind(exc)).inc()


def worker_failed(role: str) -> None:
    WORKER_FAILURES.labels(role).inc()


def plan_made(*, policy: str, decision: str, reason_code: str, seconds: float, model: str = "") -> None:
    """One PlanTurn answer (the scheduler) for a turn of ``model``."""
    decision = _decision(decision)
    PLANS.labels(model, policy, decision, reasons.known(reason_code)).inc()
    PLAN_SECONDS.labels(decision).observe(seconds)


def outcomes_learned(result: str, n: int = 1) -> None:
    if n:
        LEARNED_OUTCOMES.labels(result).inc(n)


def pull_lost(reason: str) -> None:
    if reason in kv_eviction.REASONS:
        KV_PULLS_LOST.labels(reason).inc()


def etcd_op(op: str, seconds: float, error: str = "") -> None:
    """One etcd operation (``op`` is one of the store's fixed operation names); ``error``: unavailable or error."""
    op = op.replace(" ", "_").replace("-", "_")
    ETCD_SECONDS.labels(op).observe(seconds)
    if error:
        ETCD_ERRORS.labels(op, error).inc()


# -- state read at scrape time: each service registers a callable that returns its typed snapshot --------------------

@dataclass(frozen=True)
class GatewayState:
    """One gateway's turn logic (a TurnRunner): turns served without the session store, and KV handles it freed."""

    degraded: Mapping[str, int]  # kind -> turns (as GET /health's degraded counts)
    released_handles: int


@dataclass(frozen=True)
class DecodeKvRow:
    """What one decode worker holds between turns, as a scheduler's KV manager last read it, and what was freed."""

    worker_id: str
    held_sessions: int
    held_tokens: int
    held_bytes: int
    usage: tuple[int, int] | None  # (used tokens, capacity) as its engine reports them; None when unknown
    evictions: Mapping[str, int]  # reason -> handles freed
    evicted_tokens: Mapping[str, int]  # reason -> KV tokens freed
    failures: int  # freeing reads that failed


@dataclass(frozen=True)
class SchedulerState:
    """One scheduler: the workers it plans with, its policies' regret, and the decode KV its KV manager sees."""

    workers: Mapping[tuple[str, str], int]  # (role, state) -> workers; role in ROLES, state in WORKER_STATES
    judged: Mapping[str, int]  # policy -> reported turns that had an alternative
    regrets: Mapping[str, int]  # policy -> judged turns the alternative would have served faster
    decode_kv: tuple[DecodeKvRow, ...] = ()  # empty when it manages no decode KV


@dataclass(frozen=True)
class WorkerState:
    """One worker agent's registration with the registry."""

    registrations: int
    registered: bool  # holds a lease now


S = TypeVar("S")


class StateCollector(Collector, Generic[S]):
    """The metric families built from the snapshots (``S``) of the services registered in this process, read at
    scrape time (in the event loop: the endpoints serve there).

    A bound method is held weakly (``weakref.WeakMethod``): a stopped service's object can be collected, and its
    source then disappears. Any other callable is held as it is. Registering a source again changes nothing.
    """

    def __init__(self, families: Callable[[], list], read: Callable[[list, list[S]], None]):
        self._sources: list[Callable[[], Callable[[], S] | None]] = []
        self._families, self._read = families, read

    def register(self, source: Callable[[], S]) -> None:
        """Export what ``source()`` returns at each scrape, summed with the other registered sources."""
        if any(ref() == source for ref in self._sources):
            return
        if inspect.ismethod(source):
            self._sources.append(weakref.WeakMethod(source))
        else:
            self._sources.append(_Strong(source))

    def snapshots(self) -> list[S]:
        """The current snapshot of each registered source still alive (dead ones are dropped)."""
        alive = [(ref, fn) for ref in self._sources if (fn := ref()) is not None]
        self._sources = [ref for ref, _ in alive]
        return [fn() for _, fn in alive]

    def describe(self):
        return self._families()

    def collect(self):
        families = self._families()
        self._read(families, self.snapshots())
        return families


class _Strong:
    """A strong reference with the call signature of a weak one."""

    def __init__(self, target: Callable):
        self._target = target

    def __call__(self) -> Callable:
        return self._target


def _gateway_families() -> list:
    return [CounterMetricFamily("kvshuttle_degraded_turns", "Turns served without the session store, by kind "
                                "(as GET /health's degraded counts)", labels=["kind"]),
            CounterMetricFamily("kvshuttle_kv_handles_released", "KV handles the gateway freed on their decode "
                                "worker: a recomputed turn's unused one, a turn's that nothing records (no session "
                                "id), an ended session's")]


def _read_gateway(families: list, states: list[GatewayState]) -> None:
    degraded, released = families
    totals: dict[str, int] = {}
    for state in states:
        for kind, n in state.degraded.items():
            totals[kind] = totals.get(kind, 0) + n
    for kind, n in sorted(totals.items()):
        degraded.add_metric([kind], n)
    released.add_metric([], sum(state.released_handles for state in states))


def _scheduler_families() -> list:
    return [GaugeMetricFamily("kvshuttle_workers", "Workers the scheduler plans with, by role and state (live: its "
                              "load polls answer; unreachable: they fail; unknown: not polled yet, or polling off)",
                              labels=["role", "state"]),
            CounterMetricFamily("kvshuttle_policy_judged_turns", "Reported turns that had an alternative, by policy",
                                labels=["policy"]),
            CounterMetricFamily("kvshuttle_policy_regret_turns", "Judged turns the alternative would have served "
                                "faster (by the cost model), by policy", labels=["policy"]),
            GaugeMetricFamily("kvshuttle_decode_kv_held_sessions", "Sessions whose unspent KV handle a decode worker "
                              "holds between turns (the scheduler's KV manager, read every round), by decode worker",
                              labels=["decode_worker"]),
            GaugeMetricFamily("kvshuttle_decode_kv_held_tokens", "KV cache tokens (whole blocks) those handles take, "
                              "by decode worker", labels=["decode_worker"]),
            GaugeMetricFamily("kvshuttle_decode_kv_held_bytes", "KV bytes those handles take (tokens x the worker's "
                              "KV bytes per token), by decode worker", labels=["decode_worker"]),
            GaugeMetricFamily("kvshuttle_decode_kv_used_tokens", "KV cache tokens in use on a decode worker as its "
                              "engine reports them (vLLM GetLoads; held handles, running and waiting requests)",
                              labels=["decode_worker"]),
            GaugeMetricFamily("kvshuttle_decode_kv_capacity_tokens", "KV cache capacity of a decode worker in tokens",
                              labels=["decode_worker"]),
            CounterMetricFamily("kvshuttle_kv_evictions", "Held KV handles the scheduler freed on decode workers, by "
                                "reason: idle (past the idle limit), pressure (KV usage over the high-water mark or "
                                "held KV over its budget), room (a turn needed the space)", labels=["reason"]),
            CounterMetricFamily("kvshuttle_kv_evicted_tokens", "KV cache tokens freed by those evictions, by reason",
                                labels=["reason"]),
            CounterMetricFamily("kvshuttle_kv_eviction_failures", "Freeing reads that failed (the handle then ends "
                                "with its decode worker's TTL)")]


def _read_scheduler(families: list, states: list[SchedulerState]) -> None:
    workers, judged, regrets, *kv = families
    _read_decode_kv(kv, states)
    counts = {(role, state): 0 for role in ROLES for state in WORKER_STATES}
    turns: dict[str, int] = {}
    regretted: dict[str, int] = {}
    for state in states:
        for key, n in state.workers.items():
            counts[key] = counts.get(key, 0) + n
        for name, n in state.judged.items():
            turns[name] = turns.get(name, 0) + n
        for name, n in state.regrets.items():
            regretted[name] = regretted.get(name, 0) + n
    for (role, worker_state), n in counts.items():
        workers.add_metric([role, worker_state], n)
    for name in sorted(turns):
        judged.add_metric([name], turns[name])
        regrets.add_metric([name], regretted.get(name, 0))


def _read_decode_kv(families: list, states: list[SchedulerState]) -> None:
    """The decode-KV families: one series per row (decode worker) of each scheduler, the freeing counters summed."""
    sessions, tokens, nbytes, used, capacity, evictions, evicted, failures = families
    by_reason = dict.fromkeys(kv_eviction.REASONS, 0)
    tokens_by_reason = dict.fromkeys(kv_eviction.REASONS, 0)
    failed = 0
    for state in states:
        for row in state.decode_kv:
            sessions.add_metric([row.worker_id], row.held_sessions)
            tokens.add_metric([row.worker_id], row.held_tokens)
            nbytes.add_metric([row.worker_id], row.held_bytes)
            if row.usage is not None:
                used.add_metric([row.worker_id], row.usage[0])
                capacity.add_metric([row.worker_id], row.usage[1])
            for reason, n in row.evictions.items():
                by_reason[reason] = by_reason.get(reason, 0) + n
            for reason, n in row.evicted_tokens.items():
                tokens_by_reason[reason] = tokens_by_reason.get(reason, 0) + n
            failed += row.failures
    for reason in sorted(by_reason):
        evictions.add_metric([reason], by_reason[reason])
        evicted.add_metric([reason], tokens_by_reason.get(reason, 0))
    failures.add_metric([], failed)


def _worker_families() -> list:
    return [CounterMetricFamily("kvshuttle_worker_registrations", "Registrations of this worker with the registry "
                                "(more than one: its lease was lost and it registered again)"),
            GaugeMetricFamily("kvshuttle_worker_registered", "1 while this worker holds a lease, else 0")]


def _read_worker(families: list, states: list[WorkerState]) -> None:
    registrations, registered = families
    registrations.add_metric([], sum(state.registrations for state in states))
    registered.add_metric([], float(any(state.registered for state in states)))


# Register a service's snapshot method: ``metrics.GATEWAY_STATE.register(runner.metrics_state)``.
GATEWAY_STATE: StateCollector[GatewayState] = StateCollector(_gateway_families, _read_gateway)
SCHEDULER_STATE: StateCollector[SchedulerState] = StateCollector(_scheduler_families, _read_scheduler)
WORKER_STATE: StateCollector[WorkerState] = StateCollector(_worker_families, _read_worker)


# -- groups and endpoints ------------------------------------------------------------------------------------------

GROUPS: dict[str, tuple[Collector, ...]] = {
    "gateway": (TURNS, TURN_SESSIONS, TURN_RECORDS, TURN_TOKENS, KV_PULLED_BYTES, TTFT, TURN_DURATION, TURN_FAILURES, HTTP_REQUESTS,
                WORKER_FAILURES, RATE_LIMITED, API_KEYS_RELOADS, GATEWAY_STATE),
    "scheduler": (PLANS, PLAN_SECONDS, KV_PULLS_LOST, LEARNED_OUTCOMES, SCHEDULER_STATE),
    "registry": (LIVE_WORKERS, LIVE_SESSIONS, SESSIONS_DROPPED, ETCD_DEFRAG_RUNS, ETCD_DB_SIZE, ETCD_DB_IN_USE),
    "etcd": (ETCD_SECONDS, ETCD_ERRORS),
    "grpc": (GRPC_HANDLED, GRPC_SECONDS),
    "worker": (WORKER_STATE, ADAPTER_FILE_ERRORS, LORA_ADAPTERS),
}
# What each process's endpoint serves (plus the process's own CPU, memory and GC figures).
SERVICES: dict[str, tuple[str, ...]] = {
    "gateway": ("gateway", "grpc"),
    "scheduler": ("scheduler", "etcd", "grpc"),  # etcd: when it reads and claims sessions in etcd itself
    "registry": ("registry", "etcd", "grpc"),
    "worker": ("worker",),  # plus vLLM's own metrics (see workers/agent.py)
}


def registry_for(service: str, extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry with the groups ``service`` serves, this process's standard collectors and ``extra``."""
    registry = CollectorRegistry(auto_describe=True)
    for group in SERVICES[service]:
        for collector in GROUPS[group]:
            registry.register(collector)
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
    for collector in extra:
        registry.register(collector)
    return registry


@dataclass(frozen=True)
class MetricInfo:
    name: str  # as exposed (counters with their _total)
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    group: str


def _catalogue() -> tuple[MetricInfo, ...]:
    out = []
    for group, collectors in GROUPS.items():
        for collector in collectors:
            for family in collector.describe():
                labels = getattr(collector, "_labelnames", None) or getattr(family, "_labelnames", ())
                name = f"{family.name}_total" if family.type == "counter" else family.name
                out.append(MetricInfo(name, family.type, tuple(labels), family.documentation, group))
    return tuple(out)


CATALOGUE = _catalogue()


# -- gRPC server interceptor -----------------------------------------------------------------------------------------

class GrpcMetricsInterceptor(WrappingInterceptor):
    """Counts every completed call by status code and times it (kvshuttle_grpc_server_*).

    Only methods registered on the server are counted (a client cannot create label values). The instrumented
    handler is built once per method and reused (so this interceptor goes last, next to the registered handlers);
    per call the cost is two clock reads, one histogram observation and one counter increment.
    """

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return _instrumented(handler, method)


def _instrumented(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    service, _, name = (method.decode() if isinstance(method, bytes) else method).lstrip("/").rpartition("/")
    seconds = GRPC_SECONDS.labels(service, name)
    handled: dict[Any, Any] = {}

    def count(code: grpc.StatusCode, started: float) -> None:
        seconds.observe(time.perf_counter() - started)
        child = handled.get(code)
        if child is None:
            child = handled[code] = GRPC_HANDLED.labels(service, name, code.name)
        child.inc()

    def wrap(inner):
        if inspect.isasyncgenfunction(inner):
            async def stream(request, context):
                counted = _Counted(context, count)
                responses = inner(request, counted)
                try:
                    async for item in responses:
                        yield item
                except BaseException as e:
                    counted.done(e)
                    raise
                finally:
                    # Closed early (the client cancelled, the server stopped): close the handler's generator now,
                    # so its own cleanup runs at once rather than whenever it is collected.
                    await responses.aclose()
                counted.done(None)
            return stream
        if inspect.iscoroutinefunction(inner):
            async def call(request, context):
                counted = _Counted(context, count)
                try:
                    response = await inner(request, counted)
                except BaseException as exc:
                    counted.done(exc)
                    raise
                counted.done(None)
                return response
            return call
        return inner  # a synchronous handler: left as it is

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        inner = getattr(handler, kind)
        if inner is not None:
            return handler._replace(**{kind: wrap(inner)})
    return handler


class _Counted:
    """The servicer context, counting the call before its status reaches the client.

    ``context.abort`` sends the status and only then raises; counting after the raise would let a client see its
    error before the call is counted (a scrape right after could miss it). Everything but ``abort`` is the context's.
    """

    __slots__ = ("_context", "_count", "_started", "_done")

    def __init__(self, context, count) -> None:
        self._context, self._count, self._started, self._done = context, count, time.perf_counter(), False

    def __getattr__(self, attr):
        return getattr(self._context, attr)

    async def abort(self, code, details="", trailing_metadata=()):
        if not self._done:
            self._done = True
            self._count(code if isinstance(code, grpc.StatusCode) else _CODES.get(int(code), grpc.StatusCode.UNKNOWN),
                        self._started)
        await self._context.abort(code, details, trailing_metadata)

    def done(self, exc: BaseException | None) -> None:
        if not self._done:
            self._done = True
            self._count(_status(self._context, exc), self._started)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status(context, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    if exc is not None and not isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    code = context.code()
    if code is None:
        return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES.get(int(code), grpc.StatusCode.UNKNOWN)
