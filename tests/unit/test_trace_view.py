"""`kvshuttle traces`: spans exported by the real OTLP/gRPC exporter reach the receiver intact, and each turn's trace
is printed as a tree with timings."""

from __future__ import annotations

import asyncio

from kvshuttle.services.commands.trace_view import TraceReceiver, TurnPrinter, receiver_server, render_tree
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.waits import until


def a_turn() -> list:
    """Three finished SDK spans: kvshuttle.turn with a child, and an error under it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvshuttle-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("kvshuttle.turn", attributes={"kvshuttle.decision": "pull",
                                                                     "kvshuttle.pulled_tokens": 774}):
        with tracer.start_as_current_span("prefill", kind=trace.SpanKind.CLIENT,
                                          attributes={"kvshuttle.worker": "prefill-0"}):
            pass
        with tracer.start_as_current_span("record") as span:
            span.set_status(trace.StatusCode.ERROR, "registry down")
    return list(exporter.get_finished_spans())


async def test_spans_exported_over_otlp_arrive_with_their_tree():
    printed: list[str] = []
    receiver = TraceReceiver()
    receiver.on_spans = TurnPrinter(receiver, settle_s=0.05, out=printed.append)
    server, port = receiver_server(receiver, "127.0.0.1:0")
    await server.start()
    try:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True)
        result = await asyncio.to_thread(exporter.export, a_turn())  # the exporter blocks: not on this loop
        assert result == SpanExportResult.SUCCESS
        await until(lambda: printed, 1.0, "the turn printed")
        await asyncio.to_thread(exporter.shutdown)
    finally:
        await server.stop(0)
    spans = {s["name"]: s for s in receiver.spans}
    turn, prefill, record = spans["kvshuttle.turn"], spans["prefill"], spans["record"]
    assert turn["service"] == "kvshuttle-gateway" and turn["parent_id"] == ""
    assert prefill["parent_id"] == record["parent_id"] == turn["span_id"]
    assert prefill["trace_id"] == turn["trace_id"] and prefill["kind"] == "client"
    assert turn["attributes"] == {"kvshuttle.decision": "pull", "kvshuttle.pulled_tokens": 774}
    assert record["status_code"] == "error" and record["status"] == "registry down"
    assert turn["end_ns"] >= prefill["end_ns"] > prefill["start_ns"] >= turn["start_ns"] > 0
    (text,) = printed
    lines = text.splitlines()
    assert lines[0] == f"trace {turn['trace_id']}"
    assert lines[2].endswith("kvshuttle-gateway  kvshuttle.turn  [decision=pull pulled=774]")
    assert lines[3].endswith("├─ prefill  [worker=prefill-0]")
    assert lines[4].endswith("└─ record  [ERROR registry down]")


def test_tree_columns_and_orphans():
    spans = [
        {"service": "b", "name": "child", "span_id": "2", "parent_id": "1", "start_ns": 3_000_000,
         "end_ns": 4_500_000, "attributes": {}, "status_code": "unset", "status": ""},
        {"service": "a", "name": "root", "span_id": "1", "parent_id": "f", "start_ns": 1_000_000,
         "end_ns": 9_000_000, "attributes": {"http.response.status_code": 200}, "status_code": "unset",
         "status": ""},
    ]
    assert render_tree(spans).splitlines() == [
        " start ms   dur ms  service  span",
        "      0.0      8.0  a        root  [status=200]",  # its parent is not in the trace: a root
        "      2.0      1.5  b        └─ child",
    ]
    assert render_tree([]) == ""
