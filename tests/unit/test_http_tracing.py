"""The gateway's HTTP server spans: OpenTelemetry's HTTP attributes, the caller's traceparent continued, the span
current inside the app, errors by status, and no secrets (keys, session ids in paths) in attributes."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from kvshuttle.services.gateway.edge.http_tracing import HttpTracing
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SECRET_SESSION = "conversation-7f3a9c"


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        ctx = trace.get_current_span().get_span_context()  # the server span is current in the app
        return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str):
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        return StreamingResponse(iter([b"x"]), status_code=503)

    @app.get("/crash")
    async def crash():
        raise RuntimeError("bug")

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=HttpTracing(app, provider.get_tracer("test")),
                                                             raise_app_exceptions=False),
                               base_url="http://gateway.test")
    return client, exporter


async def test_a_request_continues_the_callers_trace(traced):
    client, exporter = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    resp = await client.post("/v1/chat/completions", headers={"traceparent": f"00-{trace_id}-{parent}-01",
                                                               "authorization": "Bearer kvs-secret-key"})
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions" and span.kind == trace.SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == trace_id and f"{span.parent.span_id:016x}" == parent
    assert resp.json() == {"trace_id": trace_id, "span_id": f"{span.context.span_id:016x}"}
    assert dict(span.attributes) == {
        "http.request.method": "POST", "url.scheme": "http", "network.protocol.version": "1.1",
        "server.address": "gateway.test", "client.address": "127.0.0.1",  # (httpx's test transport: no port)
        "user_agent.original": client.headers["user-agent"], "http.route": "/v1/chat/completions",
        "url.path": "/v1/chat/completions", "http.response.status_code": 200}
    assert span.status.status_code == trace.StatusCode.UNSET


async def test_paths_with_parameters_are_recorded_as_their_route_only(traced):
    client, exporter = traced
    assert (await client.get(f"/v1/sessions/{SECRET_SESSION}?tenant=acme")).status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "GET /v1/sessions/{session_id}" and span.attributes["http.route"] == "/v1/sessions/{session_id}"
    assert "url.path" not in span.attributes
    assert SECRET_SESSION not in str(dict(span.attributes)) and "acme" not in str(dict(span.attributes))


async def test_server_errors_are_errors_and_client_errors_are_not(traced):
    client, exporter = traced
    assert (await client.get("/nowhere")).status_code == 404
    assert (await client.get("/boom")).status_code == 503
    assert (await client.get("/crash")).status_code == 500
    missing, boom, crash = exporter.get_finished_spans()
    assert missing.name == "GET" and "http.route" not in missing.attributes  # no route matched
    assert missing.status.status_code == trace.StatusCode.UNSET and missing.attributes["http.response.status_code"] == 404
    assert boom.status.status_code == trace.StatusCode.ERROR and boom.attributes["error.type"] == "503"
    assert crash.status.status_code == trace.StatusCode.ERROR and crash.attributes["http.response.status_code"] == 500
    assert any(e.name == "exception" for e in crash.events)


async def test_unknown_methods_are_other(traced):
    client, exporter = traced
    await client.request("BREW", "/v1/chat/completions")
    (span,) = exporter.get_finished_spans()
    assert span.attributes["http.request.method"] == "_OTHER"
    assert span.attributes["http.request.method_original"] == "BREW"


async def test_probes_and_scrapes_are_not_traced(traced):
    client, exporter = traced
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == 404  # untraced whether or not the route exists
    assert exporter.get_finished_spans() == ()
    await client.get(f"/v1/sessions/{SECRET_SESSION}")
    assert len(exporter.get_finished_spans()) == 1
