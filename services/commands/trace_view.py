"""`kvshuttle traces`: a small OTLP/gRPC trace receiver that prints each turn's trace as a tree with timings.

For looking at traces without a tracing backend (point ``KVSHUTTLE_OTLP_ENDPOINT`` at it); the tests use the same
receiver and tree. Spans are kept as plain dicts (:func:`span_dicts`) so that tests can assert on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

import grpc
from kvshuttle.services.common.config import load, setting
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {trace_pb2.Span.SPAN_KIND_SERVER: "server", trace_pb2.Span.SPAN_KIND_CLIENT: "client",
         trace_pb2.Span.SPAN_KIND_INTERNAL: "internal", trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
         trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer"}
STATUS = {trace_pb2.Status.STATUS_CODE_UNSET: "unset", trace_pb2.Status.STATUS_CODE_OK: "ok",
          trace_pb2.Status.STATUS_CODE_ERROR: "error"}
# What the tree shows of each span (when present), as label=value.
SHOWN = [("kvshuttle.turn_index", "turn"), ("kvshuttle.decision", "decision"), ("kvshuttle.prompt_tokens", "prompt"),
         ("kvshuttle.pulled_tokens", "pulled"), ("kvshuttle.computed_tokens", "computed"),
         ("kvshuttle.cached_tokens", "cached"),
         ("kvshuttle.pulled_kv_bytes", "kv_bytes"), ("kvshuttle.predicted_ttft_ms", "predicted_ttft_ms"),
         ("kvshuttle.ttft_ms", "ttft_ms"), ("kvshuttle.worker", "worker"), ("kvshuttle.generated_tokens", "tokens"),
         ("http.response.status_code", "status"), ("server.address", "server"), ("server.port", "port"),
         ("gen_ai.usage.prompt_tokens", "prompt"), ("gen_ai.latency.time_to_first_token", "ttft_s")]


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(items) -> dict:
    return {a.key: _value(a.value) for a in items}


def span_dicts(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    """The spans of one OTLP export as dicts (ids in hex, times in ns since the epoch)."""
    out = []
    for rs in request.resource_spans:
        service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for span in ss.spans:
                out.append({"service": service, "scope": ss.scope.name, "name": span.name,
                            "kind": KINDS.get(span.kind, "unspecified"), "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent_id": span.parent_span_id.hex(),
                            "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                            "attributes": _attributes(span.attributes), "status": span.status.message,
                            "status_code": STATUS.get(span.status.code, "unset"),
                            "events": [{"name": e.name, "attributes": _attributes(e.attributes)}
                                       for e in span.events]})
    return out


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent (``spans``); ``on_spans`` is called with each export's spans."""

    def __init__(self, on_spans: Callable[[list[dict]], None] | None = None):
        self.spans: list[dict] = []
        self.on_spans = on_spans

    async def Export(self, request, context):
        spans = span_dicts(request)
        self.spans.extend(spans)
        if self.on_spans is not None:
            self.on_spans(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def receiver_server(receiver: TraceReceiver, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server for ``receiver`` bound to ``address`` (port 0: a free one); returns it and its port."""
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port


def _short(value: object) -> object:
    return f"{value:.4g}" if isinstance(value, float) else value


def render_tree(spans: Iterable[dict], shown: Sequence[tuple[str, str]] = SHOWN) -> str:
    """One trace's spans as an indented tree: start (ms after the first span), duration (ms), service, name and
    the ``shown`` attributes. Spans whose parent is not among ``spans`` are roots."""
    spans = sorted(spans, key=lambda s: s["start_ns"])
    if not spans:
        return ""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    t0 = spans[0]["start_ns"]
    width = max(len("service"), *(len(s["service"]) for s in spans))
    lines = [f"{'start ms':>9} {'dur ms':>8}  {'service':<{width}}  span"]

    def walk(span: dict, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        facts = [f"{label}={_short(span['attributes'][key])}" for key, label in shown if key in span["attributes"]]
        if span["status_code"] == "error":
            facts.append(f"ERROR {span['status']}".rstrip())
        start, duration = (span["start_ns"] - t0) / 1e6, (span["end_ns"] - span["start_ns"]) / 1e6
        lines.append(f"{start:9.1f} {duration:8.1f}  {span['service']:<{width}}  {prefix}{branch}{span['name']}"
                     + (f"  [{' '.join(facts)}]" if facts else ""))
        kids = children.get(span["span_id"], [])
        for i, kid in enumerate(kids):
            walk(kid, prefix + ("" if depth == 0 else "   " if last else "│  "), i == len(kids) - 1, depth + 1)

    for root in children.get("", []):
        walk(root, "", True, 0)
    return "\n".join(lines)


@dataclasses.dataclass
class TraceViewConfig:
    """Receive OTLP/gRPC traces and print each conversation turn's trace as a tree."""

    ENV_PREFIX = "KVSHUTTLE_TRACES_"
    listen: str = setting("127.0.0.1:4317", "OTLP/gRPC listen address (point KVSHUTTLE_OTLP_ENDPOINT here)")
    settle_s: float = setting(2.0, "Seconds to wait after a turn's span for the other processes' spans of its trace")


class TurnPrinter:
    """Prints the trace of every ``kvshuttle.turn`` span once ``settle_s`` have passed since it arrived."""

    def __init__(self, receiver: TraceReceiver, settle_s: float, out: Callable[[str], None] = print):
        self.receiver, self.settle_s, self.out = receiver, settle_s, out
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, spans: list[dict]) -> None:
        for span in spans:
            if span["name"] == "kvshuttle.turn":
                task = asyncio.get_running_loop().create_task(self._print(span["trace_id"]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _print(self, trace_id: str) -> None:
        await asyncio.sleep(self.settle_s)
        spans = [s for s in self.receiver.spans if s["trace_id"] == trace_id]
        self.out(f"trace {trace_id}\n{render_tree(spans)}\n")


def main(argv: Sequence[str] | None = None) -> None:
    from kvshuttle.services.common.grpc_server import run_until_signal

    cfg = load(TraceViewConfig, argv, prog="kvshuttle traces")
    logging.basicConfig(level="WARNING")

    async def run() -> None:
        receiver = TraceReceiver()
        receiver.on_spans = TurnPrinter(receiver, cfg.settle_s, lambda text: print(text, flush=True))
        server, port = receiver_server(receiver, cfg.listen)

        async def start() -> None:
            await server.start()
            print(f"receiving OTLP/gRPC traces on {cfg.listen.rsplit(':', 1)[0]}:{port}", flush=True)

        await run_until_signal(start, lambda: server.stop(1))

    asyncio.run(run())
