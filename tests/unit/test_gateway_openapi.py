"""The gateway's OpenAPI document says what the server does (regressions found by tests/e2e/test_fuzz_openapi.py)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.openai.models import CompletionIn
from kvshuttle.services.gateway.apis.rest_bridge.openapi import install_openapi
from kvshuttle.services.gateway.apis.rest_bridge.routes import BridgeOptions, bridge_routes
from kvshuttle.services.gateway.server import OPENAPI_CONSTRAINTS, REGISTRY_SERVICE, SERVICE_NAME

from tests.support.auth import open_guard


@pytest.fixture
async def app():
    channel = grpc.aio.insecure_channel("127.0.0.1:9")  # never called: every request here fails before it
    routes = bridge_routes({REGISTRY_SERVICE: channel, SERVICE_NAME: channel}, BridgeOptions())
    app = create_app(None, "tiny", 8, extra_routes=routes)
    install_openapi(app, [REGISTRY_SERVICE, SERVICE_NAME], constraints=OPENAPI_CONSTRAINTS)
    yield app
    await channel.close()


async def test_a_405_names_every_method_of_the_path(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.request("TRACE", "/v1/sessions/s1")
        assert resp.status_code == 405 and resp.json()["error"]["message"]
        assert set(resp.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}
        resp = await client.get("/v1/chat/completions")
        assert resp.status_code == 405 and resp.headers["allow"] == "POST"


async def test_the_document_declares_the_errors_and_limits_the_server_enforces(app):
    doc = app.openapi()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "422" not in chat["responses"] and {"400", "404", "413", "503"} <= set(chat["responses"])
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    header = next(p for p in chat["parameters"] if p["name"] == "X-Session-ID")
    assert header["in"] == "header" and header["schema"]["pattern"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert schemas["ChatCompletionIn"]["properties"]["conversation_id"]["anyOf"][0]["pattern"]
    assert {"minLength": 1, "type": "string"} in schemas["CompletionIn"]["properties"]["prompt"]["anyOf"]
    get = doc["paths"]["/v1/sessions/{session_id}"]["get"]
    assert get["parameters"][0]["schema"]["minLength"] == 1 and get["parameters"][0]["schema"]["pattern"]
    role = next(p for p in doc["paths"]["/v1/workers"]["get"]["parameters"] if p["name"] == "role")["schema"]
    assert "WORKER_ROLE_DECODE" in role["enum"] and 2 in role["enum"]  # protobuf JSON takes names and numbers
    assert schemas["kvshuttle.v1.ChatCompleteRequest"]["required"] == ["messages"]
    assert "anyOf" in schemas["kvshuttle.v1.CompleteRequest"] and "not" in schemas["kvshuttle.v1.CompleteRequest"]
    assert schemas["kvshuttle.v1.CompleteRequest"]["properties"]["promptTokenIds"]["items"] == {
        "type": "integer", "format": "int32", "minimum": 0}


@pytest.mark.parametrize("prompt", ["", [], [-1]])
def test_an_empty_or_negative_prompt_is_refused(prompt):
    with pytest.raises(ValueError):
        CompletionIn(prompt=prompt)


async def test_a_malformed_conversation_id_is_a_400(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.post("/v1/completions", json={"prompt": "x", "conversation_id": "a/b c"})
    assert resp.status_code == 400 and "conversation_id" in resp.json()["error"]["message"]


def test_bridged_request_fields_are_documented_as_nullable_like_protobuf_json_parses_them(app):
    schemas = app.openapi()["components"]["schemas"]
    assert "null" in schemas["kvshuttle.v1.SamplingOptions"]["properties"]["temperature"]["type"]
    assert "null" not in schemas["kvshuttle.v1.ChatCompleteRequest"]["properties"]["messages"]["type"]  # required
    assert schemas["kvshuttle.v1.Worker"]["properties"]["leaseId"] == {"type": "string", "format": "int64"}


@pytest.mark.parametrize("field", [{"prompt": [False]}, {"prompt": "x", "disable_pull": 0},
                                   {"prompt": "x", "max_tokens": "5"}])
async def test_json_types_are_taken_as_documented_not_coerced(app, field):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.post("/v1/completions", json=field)
    assert resp.status_code == 400, resp.text


async def test_a_seed_vllm_cannot_take_is_a_400_not_a_500(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.post("/v1/completions", json={"prompt": "3", "seed": 44629213354274168554455972511219712})
    assert resp.status_code == 400 and "seed" in resp.json()["error"]["message"]


@pytest.mark.parametrize("sampling", [{"topP": False}, {"maxTokens": True}, {"stop": ["x"], "temperature": True}])
async def test_the_bridge_refuses_json_booleans_for_numbers(app, sampling):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.post("/v1/gateway/completions", json={"prompt": "x", "sampling": sampling})
    assert resp.status_code == 400 and "is not a number" in resp.json()["error"]["message"], resp.text
