"""A minimal OTLP/gRPC trace receiver for tests: real exporters send spans to it over loopback."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _attributes(items) -> dict:
    out = {}
    for a in items:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict] = []

    async def Export(self, request, context):
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans.append({"service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                                       "span_id": span.span_id.hex(), "parent_id": span.parent_span_id.hex(),
                                       "attributes": _attributes(span.attributes),
                                       "status": span.status.message,
                                       "events": [{"name": e.name, "attributes": _attributes(e.attributes)}
                                                  for e in span.events]})
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.receiver = _Receiver()
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.receiver, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[dict]:
        return self.receiver.spans

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)

    async def wait_for(self, predicate, timeout_s: float = 30.0) -> list[dict]:
        """Spans collected so far once ``predicate(spans)`` is true; fails after ``timeout_s``."""
        for _ in range(int(timeout_s * 10)):
            if predicate(self.spans):
                return self.spans
            await asyncio.sleep(0.1)
        raise AssertionError(f"spans never satisfied the condition; got {[s['name'] for s in self.spans]}")
