"""kvshuttle_http_requests_total: every request the gateway's HTTP front answers, by route template and status,
the API-key guard's refusals included (they never reach the turn logic and its metrics)."""

from __future__ import annotations

import hashlib

import httpx
from fastapi import FastAPI
from kvshuttle.services.common import metrics
from kvshuttle.services.gateway.edge.auth import KeyRing, Principal
from kvshuttle.services.gateway.edge.http_guard import HttpGuard
from kvshuttle.services.gateway.edge.http_metrics import HttpMetrics
from prometheus_client import generate_latest

from tests.support.metrics import delta, parse

KEY = "kvs-test-key"


def scrape() -> dict:
    return parse(generate_latest(metrics.registry_for("gateway")).decode())


def front() -> httpx.AsyncClient:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        return {"ok": True}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str):
        return {"ok": True}

    @app.get("/crash")
    async def crash():
        raise RuntimeError("bug")

    keys = KeyRing([(hashlib.sha256(KEY.encode()).digest(), Principal("acme"))])
    guarded = HttpMetrics(HttpGuard(app, keys, max_body_bytes=1024), app.routes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded, raise_app_exceptions=False),
                             base_url="http://gateway.test")


async def test_requests_are_counted_by_route_template_and_status_refusals_included():
    client, auth = front(), {"Authorization": f"Bearer {KEY}"}
    before = scrape()
    assert (await client.post("/v1/chat/completions", json={})).status_code == 401  # no key: the guard refuses
    assert (await client.post("/v1/chat/completions", json={}, headers=auth)).status_code == 200
    assert (await client.post("/v1/chat/completions", content=b"x" * 2048, headers=auth)).status_code == 413
    assert (await client.get("/v1/sessions/conversation-secret-7", headers=auth)).status_code == 200
    assert (await client.get("/nowhere", headers=auth)).status_code == 404
    assert (await client.get("/crash", headers=auth)).status_code == 500
    after = scrape()
    name = "kvshuttle_http_requests_total"
    chat = {"method": "POST", "route": "/v1/chat/completions"}
    assert delta(before, after, name, code="401", **chat) == 1
    assert delta(before, after, name, code="200", **chat) == 1
    assert delta(before, after, name, code="413", **chat) == 1
    assert delta(before, after, name, method="GET", route="/v1/sessions/{session_id}", code="200") == 1
    assert delta(before, after, name, method="GET", route="unmatched", code="404") == 1
    assert delta(before, after, name, method="GET", route="/crash", code="500") == 1
    assert delta(before, after, name) == 6
    assert "conversation-secret-7" not in generate_latest(metrics.registry_for("gateway")).decode()
