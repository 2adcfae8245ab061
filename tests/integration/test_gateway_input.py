"""Input no request may hold (services/gateway/edge/input_check.py), on the real gateway (etcd, registry, scheduler,
gateway on loopback; no vLLM: every refusal here happens before a turn reaches a worker): a 400 in the API's own
error shape naming the field, from every front end (OpenAI chat and completions, Responses, Anthropic Messages, the
REST bridge, the gRPC Gateway API). The cases of issue #26 that answered a 500 or dropped the connection are here."""

from __future__ import annotations

import json
import uuid

import grpc
import httpx
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.gateway.edge.input_check import INT32_MAX, MAX_SCHEMA_DEPTH
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(120)
HI = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"


def nested_schema(levels: int) -> dict:
    """An object schema with ``levels`` nested ``properties`` (twice as many JSON levels)."""
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def raw(body: dict) -> bytes:
    """JSON as a client may send it: lone surrogates escaped (``"\\ud800"``), which json.dumps does by default."""
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
async def gateway(etcd, model_dir):
    prefix = f"/input-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0))
    await scheduler.start()
    cfg = GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0", registry=registry.address,
                        scheduler=scheduler.address, model_dir=str(model_dir), max_model_len=2048)
    cfg.validate()
    service = GatewayService(cfg)
    await service.start()
    yield service
    await service.stop()
    await scheduler.stop()
    await registry.stop(grace=0.5)


@pytest.fixture
async def http(gateway):
    async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
        yield client


ANTHROPIC = {"model": "tiny", "max_tokens": 5, "messages": HI}
DEEP = nested_schema(MAX_SCHEMA_DEPTH // 2)  # one level more than the limit
CASES = [  # (path, body, the field the 400 names); the first ones are issue #26's
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": HI, SURROGATE: 1}, "\\ud800"),
    ("/v1/messages", {**ANTHROPIC, "messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/v1/responses", {"input": "hi", "metadata": {"a": SURROGATE}}, "metadata.a"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nested_schema(200)}}]}, "tools[0].function.parameters"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": nested_schema(200)}]},
     "tools[0].parameters"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 10**12}, "max_tokens"),
    # and more of the same, in other fields and routes
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 2**63}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HI, "seed": 10**30}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "n": 10**12}, "n"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 10**12, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": json.dumps(DEEP)}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"x": [SURROGATE]}}, "chat_template_kwargs.x[0]"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**12}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 10**12]}, "prompt[1]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**12}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}},
     "text.format.schema"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": SURROGATE}]}]},
     "input[0].content[0].text"),
    ("/v1/messages", {**ANTHROPIC, "max_tokens": 10**12}, "max_tokens"),
    ("/v1/messages", {**ANTHROPIC, "top_k": 2**40}, "top_k"),
    ("/v1/messages", {**ANTHROPIC, "tools": [{"name": "f", "input_schema": nested_schema(200)}]},
     "tools[0].input_schema"),
    ("/v1/messages", {**ANTHROPIC, "metadata": {"user_id": SURROGATE}}, "metadata.user_id"),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
]


@pytest.mark.parametrize("path, body, param", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
async def test_bad_input_is_a_400_naming_the_field_in_the_apis_shape(http, path, body, param):
    resp = await http.post(path, content=raw(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    if path.startswith("/v1/messages"):
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["message"].startswith(f"{param}:"), error
    else:
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"], error
    if "out of range" in resp.text:  # an integer: the message says what is allowed
        assert "allowed:" in resp.text, resp.text


async def test_an_integer_range_error_says_the_range(http):
    resp = await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 10**12})
    assert resp.json()["error"]["message"] == f"max_tokens: 1000000000000 is out of range (allowed: 1 to {INT32_MAX})"


async def test_non_finite_numbers_and_deep_bodies_are_400s(http):
    for body in (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                 b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": '
                 + b"[" * 500 + b"]" * 500 + b"}}",
                 b"[" * 100_000 + b"]" * 100_000,
                 raw({"messages": HI, "structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}})):
        resp = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text


async def test_a_schema_at_the_limit_is_taken(http):
    """The limit refuses only what is deeper: a schema just within it gets past the check (to the scheduler, which
    has no worker here: 503)."""
    fits = nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)  # 2 * levels + 1 JSON levels: one fewer than the limit
    resp = await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": fits}}})
    assert resp.status_code == 503 and "no live prefill worker" in resp.text, resp.text


@pytest.mark.parametrize("path, body", [
    ("/v1/gateway/chat/completions", {"messages": HI, SURROGATE: 1}),
    ("/v1/gateway/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("/v1/gateway/completions", {"prompt": "hi", "sampling": {"maxTokens": 10**12}}),
    ("/v1/gateway/completions", {"prompt": "hi", "sampling": {"seed": 2**31}}),
])
async def test_the_rest_bridge_refuses_them_too(http, path, body):
    resp = await http.post(path, content=raw(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["status"] == "INVALID_ARGUMENT", resp.text


async def test_the_grpc_api_refuses_out_of_range_integers_and_undecodable_text(gateway):
    channel = client_channel(gateway.grpc_address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    try:
        for sampling, field in ((gateway_pb2.SamplingOptions(max_tokens=-5), "sampling.max_tokens"),
                                (gateway_pb2.SamplingOptions(top_k=-7), "sampling.top_k"),
                                (gateway_pb2.SamplingOptions(stop_token_ids=[-1]), "sampling.stop_token_ids[0]")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(gateway_pb2.CompleteRequest(prompt="hi", sampling=sampling), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert err.value.details().startswith(f"{field}:") and "allowed:" in err.value.details()
        # Text that is not UTF-8 does not decode: INVALID_ARGUMENT (gRPC alone answers UNKNOWN, from an exception).
        raw_call = channel.unary_unary("/kvshuttle.v1.Gateway/Complete", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_call(b"\x0a\x03\xed\xa0\x80", timeout=10)  # session_id: a lone surrogate, UTF-8-encoded
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details(), err.value
    finally:
        await channel.close()


NOT_IDS = ["..", ".", "a/b"]  # "." and "..": path names a proxy or a URL resolves; "/": a path separator
SESSION_ROUTES = [("/v1/chat/completions", {"messages": HI, "max_tokens": 2}), ("/v1/completions", {"prompt": "hi"}),
                  ("/v1/responses", {"input": "hi"}), ("/v1/messages", ANTHROPIC)]


@pytest.mark.parametrize("session", NOT_IDS)
@pytest.mark.parametrize("path, body", SESSION_ROUTES, ids=[r[0] for r in SESSION_ROUTES])
async def test_a_session_header_that_is_no_id_is_a_400_naming_it(http, path, body, session):
    resp = await http.post(path, json=body, headers={"X-Session-ID": session})
    assert resp.status_code == 400, resp.text
    if path == "/v1/messages":
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("X-Session-ID:"), error
    else:
        error = resp.json()["error"]
        assert error["param"] == "X-Session-ID" and "X-Session-ID header" in error["message"], error


@pytest.mark.parametrize("session", NOT_IDS)
@pytest.mark.parametrize("path, body", SESSION_ROUTES[:3], ids=[r[0] for r in SESSION_ROUTES[:3]])
async def test_a_conversation_id_that_is_no_id_is_a_400_naming_it(http, path, body, session):
    resp = await http.post(path, json={**body, "conversation_id": session})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "conversation_id", resp.text


async def test_an_id_with_dots_and_other_characters_is_still_an_id(http):
    """Only an id of dots is refused: ``a..b`` or ``.x`` get past the check (to the scheduler: no worker, 503)."""
    for session in ("a..b", ".x", "x."):
        resp = await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                               headers={"X-Session-ID": session})
        assert resp.status_code == 503 and "no live prefill worker" in resp.text, (session, resp.text)


@pytest.mark.parametrize("method, path", [("GET", "/v1/sessions/{}"), ("DELETE", "/v1/sessions/{}"),
                                          ("POST", "/v1/sessions/{}/end")])
@pytest.mark.parametrize("session", ["%2E%2E", "%2E", "..%2F.."])
async def test_a_session_path_that_is_no_id_is_a_400(http, method, path, session):
    resp = await http.request(method, path.format(session))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["status"] == "INVALID_ARGUMENT" and "session_id" in error["message"], error


async def test_the_grpc_api_refuses_a_session_id_that_is_no_id(gateway):
    channel = client_channel(gateway.grpc_address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    try:
        for session in NOT_IDS:
            for call in (stub.Complete(gateway_pb2.CompleteRequest(prompt="hi", session_id=session), timeout=10),
                         stub.EndSession(gateway_pb2.EndSessionRequest(session_id=session), timeout=10)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert err.value.details().startswith("session_id"), err.value.details()
    finally:
        await channel.close()
