"""The REST bridge against a real loopback gRPC server, through FastAPI (in-process ASGI and a real uvicorn socket)."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI
from google.api import http_pb2
from google.protobuf import timestamp_pb2
from kvshuttle.services.common.grpc_server import Server, client_channel
from kvshuttle.services.gateway.apis.rest_bridge.openapi import install_openapi
from kvshuttle.services.gateway.apis.rest_bridge.routes import BridgeOptions, bridge_routes, build_route
from kvshuttle.services.gateway.apis.rest_bridge.specs import PathTemplate, specs_from_rule
from kvshuttle.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc, scheduler_pb2

from tests.support.waits import until

pytestmark = pytest.mark.timeout(180)

REGISTRY = "kvshuttle.v1.SessionRegistry"
GATEWAY = "kvshuttle.v1.Gateway"


def _worker(worker_id: str, role: int, lease_id: int) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"eng-{worker_id}",
                             grpc_address="127.0.0.1:50051", nixl_port=5600, block_size=16, model="m",
                             lease_id=lease_id, registered_at=timestamp_pb2.Timestamp(seconds=1_700_000_000))


class FakeRegistry(registry_pb2_grpc.SessionRegistryServicer):
    """Just enough of the registry to exercise the bridge (the real one lives in services/registry)."""

    def __init__(self) -> None:
        self.workers = [_worker("p0", common_pb2.WORKER_ROLE_PREFILL, 1 << 40),
                        _worker("d0", common_pb2.WORKER_ROLE_DECODE, 42)]
        self.sessions: dict[tuple[str, str], common_pb2.Session] = {}
        self.last_metadata: dict[str, str] = {}
        self.stream_mode = "ok"

    def reset(self) -> None:
        self.sessions = {
            ("t", "s1"): common_pb2.Session(session_id="s1", tenant="t", decode_worker_id="d0", covered_tokens=31,
                                            block_size=16, prefix_digest=b"\x00\x01", history_tokens=3,
                                            checkpoints=[common_pb2.PrefixCheckpoint(tokens=16, digest=b"\xff")],
                                            turn=7, revision=1 << 53),
            ("t", "s/2"): common_pb2.Session(session_id="s/2", tenant="t"),
        }
        self.stream_mode = "ok"

    async def ListWorkers(self, request, context):
        self.last_metadata = {k: v for k, v in context.invocation_metadata()}
        role = request.role
        return registry_pb2.ListWorkersResponse(workers=[w for w in self.workers if not role or w.role == role])

    async def GetSession(self, request, context):
        if request.session_id == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id 'bad' is not allowed")
        if request.session_id == "slow":
            await asyncio.sleep(5)  # a backend that answers late (past the bridge's deadline): what is tested
        session = self.sessions.get((request.tenant, request.session_id))
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
        out = registry_pb2.GetSessionResponse(session=session, expires_in_s=12.5)
        if request.include_token_ids:  # the history store's ids, read only when asked for
            out.session.token_ids.extend([1, 2, 3])
        return out

    async def DeleteSession(self, request, context):
        deleted = self.sessions.pop((request.tenant, request.session_id), None) is not None
        return registry_pb2.DeleteSessionResponse(deleted=deleted)

    async def WatchWorkers(self, request, context):
        if self.stream_mode == "fail-first":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not allowed to watch")
        snapshot = registry_pb2.WatchWorkersResponse.EVENT_TYPE_SNAPSHOT
        yield registry_pb2.WatchWorkersResponse(type=snapshot, workers=self.workers)
        yield registry_pb2.WatchWorkersResponse(type=registry_pb2.WatchWorkersResponse.EVENT_TYPE_DELETE,
                                                workers=[common_pb2.Worker(worker_id="p0")])
        if self.stream_mode == "fail-later":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "store connection lost")


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Complete echoes its request; ChatComplete stays UNIMPLEMENTED (the generated base class)."""

    async def Complete(self, request, context):
        if not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        n = len(request.prompt_token_ids)
        sampling = request.sampling
        return gateway_pb2.CompleteResponse(
            id=f"cmpl-{request.session_id}", model=request.model, text=request.prompt.upper(),
            prompt_token_ids=request.prompt_token_ids, token_ids=[7, 8], finish_reason="stop",
            usage=gateway_pb2.Usage(prompt_tokens=n, completion_tokens=request.sampling.max_tokens,
                                    total_tokens=n + request.sampling.max_tokens),
            kv=gateway_pb2.KvReport(decision=scheduler_pb2.DECISION_PULL if not request.disable_pull
                                    else scheduler_pb2.DECISION_RECOMPUTE,
                                    reason=f"temperature={sampling.temperature:g} stop={list(sampling.stop)}"))


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def backend():
    registry, gateway = FakeRegistry(), FakeGateway()
    server = Server("127.0.0.1:0", [REGISTRY, GATEWAY], [
        lambda s: registry_pb2_grpc.add_SessionRegistryServicer_to_server(registry, s),
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, s),
    ])
    await server.start()
    channel = client_channel(server.address)
    try:
        yield registry, channel
    finally:
        await channel.close()
        await server.stop(0)


def _watch_route(channel, options=None):
    """WatchWorkers carries no http annotation: bridge it with an ad-hoc rule through the internal API."""
    method = registry_pb2.DESCRIPTOR.services_by_name["SessionRegistry"].methods_by_name["WatchWorkers"]
    [spec] = specs_from_rule(method, http_pb2.HttpRule(get="/v1/workers:watch"))
    return build_route(spec, channel, options)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def app(backend):
    _, channel = backend
    app = FastAPI()
    app.router.routes.extend(bridge_routes({REGISTRY: channel, GATEWAY: channel}))
    app.router.routes.append(_watch_route(channel))
    # GetSession again under another path, with a deadline short enough to expire.
    method = registry_pb2.DESCRIPTOR.services_by_name["SessionRegistry"].methods_by_name["GetSession"]
    [slow] = specs_from_rule(method, http_pb2.HttpRule(get="/v1/deadline/{session_id}"))
    app.router.routes.append(build_route(slow, channel, BridgeOptions(
        method_timeouts={"/kvshuttle.v1.SessionRegistry/GetSession": 0.3})))
    install_openapi(app, [REGISTRY, GATEWAY])
    return app


@pytest_asyncio.fixture(loop_scope="session")
async def client(app, backend):
    backend[0].reset()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bridge") as c:
        yield c


def assert_error(response: httpx.Response, http: int, status: str, contains: str = "") -> dict:
    assert response.status_code == http, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == http and error["status"] == status, error
    assert contains.lower() in error["message"].lower(), error
    return error


# ------------------------------------------------------------------------------------------------------- happy paths

async def test_list_workers_uses_protobuf_json_mapping(client):
    r = await client.get("/v1/workers")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    workers = r.json()["workers"]
    assert [w["workerId"] for w in workers] == ["p0", "d0"]
    p0 = workers[0]
    assert p0["role"] == "WORKER_ROLE_PREFILL"          # enum by name
    assert p0["leaseId"] == str(1 << 40)                # int64 as a string
    assert p0["blockSize"] == 16 and p0["grpcAddress"] == "127.0.0.1:50051"
    assert p0["registeredAt"] == "2023-11-14T22:13:20Z"  # Timestamp as RFC 3339
    assert p0["nixlHost"] == ""                         # defaults are printed
    assert "worker_id" not in p0


@pytest.mark.parametrize("role", ["WORKER_ROLE_DECODE", "2"])
async def test_query_parameter_takes_enum_name_or_number(client, role):
    r = await client.get("/v1/workers", params={"role": role})
    assert r.status_code == 200, r.text
    assert [w["workerId"] for w in r.json()["workers"]] == ["d0"]


async def test_get_session_path_and_query(client):
    r = await client.get("/v1/sessions/s1", params={"tenant": "t"})
    assert r.status_code == 200, r.text
    body = r.json()
    session = body["session"]
    assert session["sessionId"] == "s1" and session["decodeWorkerId"] == "d0"
    assert session["turn"] == "7" and session["revision"] == str(1 << 53)
    assert session["prefixDigest"] == "AAE="     # bytes as base64
    assert session["checkpoints"] == [{"tokens": 16, "digest": "/w=="}]
    assert session["historyTokens"] == 3 and session["tokenIds"] == []  # defaults are emitted
    assert body["expiresInS"] == 12.5
    r = await client.get("/v1/sessions/s1", params={"tenant": "t", "include_token_ids": "true"})
    assert r.status_code == 200, r.text
    assert r.json()["session"]["tokenIds"] == [1, 2, 3]


async def test_path_variable_is_percent_decoded(client):
    """A single-segment variable's ``/`` travels as ``%2F`` (google/api/http.proto): matched as sent, then decoded, so
    the method gets ``s/2`` (and names it when it refuses it); a bare ``/`` is another path."""
    r = await client.get("/v1/sessions/s%2F2", params={"tenant": "t"})
    assert r.status_code == 200 and r.json()["session"]["sessionId"] == "s/2", r.text
    r = await client.get("/v1/sessions/%62ad", params={"tenant": "t"})  # "bad", percent-encoded
    assert_error(r, 400, "INVALID_ARGUMENT", "session_id 'bad'")
    assert (await client.get("/v1/sessions/s/2", params={"tenant": "t"})).status_code == 404


async def test_delete_session(client):
    r = await client.delete("/v1/sessions/s1", params={"tenant": "t"})
    assert r.status_code == 200 and r.json() == {"deleted": True}
    r = await client.delete("/v1/sessions/s1", params={"tenant": "t"})
    assert r.json() == {"deleted": False}
    assert_error(await client.get("/v1/sessions/s1", params={"tenant": "t"}), 404, "NOT_FOUND", "no session")


async def test_post_body_star_accepts_both_field_name_styles(client):
    request = {"sessionId": "conv-1", "model": "m", "prompt": "hi", "prompt_token_ids": [5, 6, 7],
               "sampling": {"maxTokens": 4, "temperature": 0.5, "stop": ["\n"]}}
    r = await client.post("/v1/gateway/completions", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "cmpl-conv-1" and body["text"] == "HI"
    assert body["promptTokenIds"] == [5, 6, 7] and body["tokenIds"] == [7, 8]
    assert body["usage"] == {"promptTokens": 3, "completionTokens": 4, "totalTokens": 7, "cachedTokens": 0}
    assert body["kv"]["decision"] == "DECISION_PULL"
    assert body["kv"]["reason"] == "temperature=0.5 stop=['\\n']"
    assert body["finishReason"] == "stop"


async def test_post_enum_and_bool_values(client):
    r = await client.post("/v1/gateway/completions", json={"model": "m", "disablePull": True})
    assert r.json()["kv"]["decision"] == "DECISION_RECOMPUTE"


async def test_empty_body_is_an_empty_request(client):
    r = await client.post("/v1/gateway/completions", content=b"")
    assert_error(r, 400, "INVALID_ARGUMENT", "model is required")


async def test_forwards_selected_headers_as_metadata(client, backend):
    registry, _ = backend
    r = await client.get("/v1/workers", headers={"X-Request-Id": "req-123", "Authorization": "Bearer tok",
                                                 "X-Secret": "nope"})
    assert r.status_code == 200
    assert registry.last_metadata["x-request-id"] == "req-123"
    assert registry.last_metadata["authorization"] == "Bearer tok"
    assert "x-secret" not in registry.last_metadata


async def test_forwards_traceparent(client, backend):
    registry, _ = backend
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = await client.get("/v1/workers", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200
    # Forwarded as is, or re-injected by an instrumented channel as a child span: the trace id survives either way.
    assert registry.last_metadata["traceparent"].split("-")[1] == trace_id


# ------------------------------------------------------------------------------------------------------------ errors

async def test_grpc_status_maps_to_http(client):
    assert_error(await client.get("/v1/sessions/nope", params={"tenant": "t"}), 404, "NOT_FOUND", "no session")
    assert_error(await client.get("/v1/sessions/bad"), 400, "INVALID_ARGUMENT", "not allowed")
    assert_error(await client.post("/v1/gateway/chat/completions", json={}), 501, "UNIMPLEMENTED")


async def test_deadline_maps_to_504(client):
    assert_error(await client.get("/v1/deadline/slow"), 504, "DEADLINE_EXCEEDED")


@pytest.mark.parametrize("body", [
    {"model": "m", "bogus": 1},
    {"model": "m", "sampling": {"maxTokens": 1, "nope": True}},
])
async def test_unknown_body_field_is_400(client, body):
    assert_error(await client.post("/v1/gateway/completions", json=body), 400, "INVALID_ARGUMENT", "no field")


@pytest.mark.parametrize("content", [b"{not json", b'{"model": "m",}', b"\xff\xfe", b"[" * 100_000])
async def test_malformed_json_is_400(client, content):
    r = await client.post("/v1/gateway/completions", content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, "INVALID_ARGUMENT")


@pytest.mark.parametrize("body", [
    [1, 2], "text", {"model": 5}, {"model": "m", "sampling": {"maxTokens": "many"}},
    {"model": "m", "promptTokenIds": "1,2"}, {"model": "m", "disablePull": "yes"}, {"model": "m", "sampling": 3},
    {"model": "m", "sampling": {"maxTokens": 1.5}}, {"model": "m", "sampling": {"maxTokens": 1 << 40}},
])
async def test_wrong_types_are_400(client, body):
    assert_error(await client.post("/v1/gateway/completions", json=body), 400, "INVALID_ARGUMENT")


@pytest.mark.parametrize("path,params,contains", [
    ("/v1/workers", {"bogus": "1"}, "unknown query parameter"),
    ("/v1/workers", {"role": "WORKER_ROLE_NOPE"}, "role"),
    ("/v1/sessions/s1", {"tenant": ["a", "b"]}, "2 times"),
    ("/v1/sessions/s1", {"session_id": "s2"}, "bound by the path"),
    ("/v1/sessions/s1", {"sessionId": "s2"}, "bound by the path"),
])
async def test_bad_query_parameters_are_400(client, path, params, contains):
    assert_error(await client.get(path, params=params), 400, "INVALID_ARGUMENT", contains)


async def test_query_parameters_rejected_when_body_is_star(client):
    r = await client.post("/v1/gateway/completions", params={"model": "m"}, json={"model": "m"})
    assert_error(r, 400, "INVALID_ARGUMENT", "from the body")


async def test_wrong_http_method_is_405(client):
    assert (await client.put("/v1/workers")).status_code == 405
    assert (await client.get("/v1/nothing-here")).status_code == 404


# --------------------------------------------------------------------------------------------------------- streaming

async def test_server_streaming_is_ndjson(client):
    r = await client.get("/v1/workers:watch")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in r.text.splitlines()]
    assert [e["type"] for e in events] == ["EVENT_TYPE_SNAPSHOT", "EVENT_TYPE_DELETE"]
    assert [w["workerId"] for w in events[0]["workers"]] == ["p0", "d0"]


async def test_stream_error_before_first_message_gets_http_status(client, backend):
    backend[0].stream_mode = "fail-first"
    assert_error(await client.get("/v1/workers:watch"), 403, "PERMISSION_DENIED", "not allowed")


async def test_stream_error_after_start_is_a_final_error_line(client, backend):
    backend[0].stream_mode = "fail-later"
    r = await client.get("/v1/workers:watch")
    assert r.status_code == 200
    events = [json.loads(line) for line in r.text.splitlines()]
    assert len(events) == 3
    assert events[-1] == {"error": {"code": 503, "status": "UNAVAILABLE", "message": "store connection lost"}}


# ------------------------------------------------------------------------------------------------------ over a socket

async def test_real_socket_with_uvicorn(app, backend):
    backend[0].reset()
    sock = _free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started, 10, "uvicorn to start")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            r = await c.get("/v1/sessions/s1", params={"tenant": "t"})
            assert r.status_code == 200 and r.json()["session"]["turn"] == "7"
            r = await c.post("/v1/gateway/completions", json={"model": "m", "prompt": "abc"})
            assert r.status_code == 200 and r.json()["text"] == "ABC"
            assert_error(await c.post("/v1/gateway/completions", content=b"{"), 400, "INVALID_ARGUMENT")
            async with c.stream("GET", "/v1/workers:watch") as stream:
                assert stream.headers["content-type"].startswith("application/x-ndjson")
                lines = [json.loads(line) async for line in stream.aiter_lines() if line]
            assert [e["type"] for e in lines] == ["EVENT_TYPE_SNAPSHOT", "EVENT_TYPE_DELETE"]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


# ---------------------------------------------------------------------------------------------- building and OpenAPI

def test_path_templates():
    t = PathTemplate.parse("/v1/{parent.name=shelves/*}/books/{book_id}:archive")
    m = t.regex.match("/v1/shelves/s1/books/b2:archive")
    assert m and {name: m[group] for group, name in [(g, ".".join(p)) for g, p in t.variables]} == {
        "parent.name": "shelves/s1", "book_id": "b2"}
    assert t.openapi_path == "/v1/{parent.name}/books/{book_id}:archive"
    assert not t.regex.match("/v1/shelves/s1/x/books/b2:archive")
    assert PathTemplate.parse("/v1/files/**").regex.match("/v1/files/a/b/c")
    for bad in ["v1/x", "/v1/{a", "/v1/{a-b}", "/v1//x"]:
        with pytest.raises(ValueError):
            PathTemplate.parse(bad)


def test_bridge_rejects_bad_configuration(backend):
    _, channel = backend
    with pytest.raises(ValueError, match="unknown gRPC service"):
        bridge_routes({"kvshuttle.v1.Nope": channel})
    method = registry_pb2.DESCRIPTOR.services_by_name["SessionRegistry"].methods_by_name["GetSession"]
    with pytest.raises(ValueError, match="no field"):
        specs_from_rule(method, http_pb2.HttpRule(get="/v1/x/{nope}"))
    rule = http_pb2.HttpRule(get="/v1/a/{session_id}")
    rule.additional_bindings.add(delete="/v1/b/{session_id}")
    assert [(s.http_method, s.template.template) for s in specs_from_rule(method, rule)] == [
        ("GET", "/v1/a/{session_id}"), ("DELETE", "/v1/b/{session_id}")]


def test_every_annotated_method_is_bridged(backend):
    _, channel = backend
    routes = bridge_routes({REGISTRY: channel, GATEWAY: channel,
                            "kvshuttle.v1.TransferScheduler": channel})
    assert sorted((sorted(r.methods - {"HEAD"})[0], r.path) for r in routes) == [
        ("DELETE", "/v1/sessions/{session_id}"), ("GET", "/v1/scheduler/stats"), ("GET", "/v1/sessions/{session_id}"),
        ("GET", "/v1/workers"), ("POST", "/v1/gateway/chat/completions"), ("POST", "/v1/gateway/completions"),
        ("POST", "/v1/sessions/{session_id}/end")]


async def test_openapi_document(client):
    r = await client.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    paths = doc["paths"]
    assert set(paths["/v1/sessions/{session_id}"]) == {"get", "delete"}
    get = paths["/v1/sessions/{session_id}"]["get"]
    assert {(p["name"], p["in"]) for p in get["parameters"]} == {("session_id", "path"), ("tenant", "query"),
                                                                  ("includeTokenIds", "query")}
    post = paths["/v1/gateway/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/kvshuttle.v1.CompleteRequest"}
    schemas = doc["components"]["schemas"]
    assert schemas["kvshuttle.v1.Worker"]["properties"]["leaseId"] == {"type": "string", "format": "int64"}
    assert schemas["kvshuttle.v1.Worker"]["properties"]["role"]["enum"][0] == "WORKER_ROLE_UNSPECIFIED"
    # Every reference resolves.
    refs = {v.rsplit("/", 1)[1] for v in _refs(doc)}
    assert refs <= set(schemas), refs - set(schemas)


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)
