"""The gateway's API keys, tenants and limits, on real processes on loopback (etcd, registry, scheduler, gateway; no
vLLM: every check here happens before a turn reaches a worker, or is about the REST bridge).

Keys map to tenants; the tenant comes only from the key (a ``?tenant=`` or body field cannot pick another one); the
REST bridge's admin-only route (worker listing) needs an admin key; the open gateway (no keys) is one default tenant.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import sys
import uuid

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.tls import TlsClientConfig
from kvshuttle.services.gateway.edge import auth
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc

from tests.support.auth import KEYS, bearer, keys_file
from tests.support.certs import TestCA

pytestmark = pytest.mark.timeout(120)
MAX_BODY, MAX_PROMPT = 64 << 10, 200


@pytest.fixture(scope="module")
async def plane(etcd):
    """A registry (own key prefix) and a scheduler on it, plus a stub on the registry and one decode worker."""
    prefix = f"/auth-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0))
    await scheduler.start()
    channel = client_channel(registry.address)
    reg = registry_pb2_grpc.SessionRegistryStub(channel)
    d = common_pb2.Worker(worker_id="d-auth", role=common_pb2.WORKER_ROLE_DECODE, engine_id="eng-d-auth",
                          grpc_address="127.0.0.1:9", nixl_host="127.0.0.1", nixl_port=5701, block_size=4,
                          kv_blocks_ttl_s=480, model="tiny")
    await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=d, lease_ttl_s=60))
    yield registry, scheduler, reg, d
    await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def start_gateway(model_dir, plane, **settings) -> GatewayService:
    registry, scheduler, _, _ = plane
    cfg = GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0", registry=registry.address,
                        scheduler=scheduler.address, model_dir=str(model_dir), max_model_len=2048, **settings)
    cfg.validate()
    service = GatewayService(cfg)
    await service.start()
    return service


@pytest.fixture(scope="module")
async def gateway(model_dir, plane, tmp_path_factory):
    service = await start_gateway(model_dir, plane, api_keys_file=keys_file(tmp_path_factory.mktemp("keys")),
                                  max_body_bytes=MAX_BODY, max_prompt_tokens=MAX_PROMPT)
    yield service
    await service.stop()


@pytest.fixture
async def http(gateway):
    async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
        yield client


async def record(reg, d, session: str, tenant: str) -> None:
    handle = json.dumps({"do_remote_decode": True, "remote_engine_id": d.engine_id, "remote_host": d.nixl_host,
                         "remote_port": d.nixl_port, "remote_num_tokens": 7, "remote_block_ids": [[1, 2]]})
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, tenant=tenant, decode_worker_id=d.worker_id,
                                                        kv_transfer_params_json=handle, token_ids=list(range(8)),
                                                        text=f"history of {tenant}",
                                                        text_key=text_key(f"history of {tenant}")))


def assert_unauthorized(resp: httpx.Response, words: str) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"].startswith("Bearer")
    error = resp.json()["error"]
    assert words in error["message"] and error["type"] == "authentication_error", error


# ---------------------------------------------------------------------------------------------------------- the keys

async def test_http_needs_a_known_bearer_key_except_for_health(http):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_unauthorized(await http.get("/v1/models"), "API key is required")
    assert_unauthorized(await http.post("/v1/chat/completions", json=chat), "API key is required")
    assert_unauthorized(await http.get("/openapi.json"), "API key is required")
    assert_unauthorized(await http.get("/v1/sessions/x"), "API key is required")
    assert_unauthorized(await http.get("/v1/models", headers={"Authorization": "Bearer kvs-not-a-key"}),
                        "invalid API key")
    assert_unauthorized(await http.get("/v1/models", headers={"Authorization": f"Basic {KEYS['acme']}"}),
                        "must be 'Bearer <key>'")
    assert_unauthorized(await http.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['acme']}x"}),
                        "invalid API key")
    assert (await http.get("/health")).status_code == 200
    models = await http.get("/v1/models", headers=bearer("acme"))
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    assert (await http.get("/openapi.json", headers=bearer("globex"))).status_code == 200
    # Past the key check, a turn gets as far as the scheduler (no prefill worker is registered here).
    resp = await http.post("/v1/chat/completions", json=chat, headers=bearer("acme"))
    assert resp.status_code == 503 and "no live prefill worker" in resp.text, resp.text
    # Anthropic clients send their key as x-api-key (Authorization, when sent too, wins).
    message = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    resp = await http.post("/v1/messages", json=message, headers={"x-api-key": KEYS["acme"]})
    assert resp.status_code == 503 and resp.json()["type"] == "error", resp.text
    assert_unauthorized(await http.post("/v1/messages", json=message, headers={"x-api-key": "kvs-nope"}),
                        "invalid API key")
    assert_unauthorized(await http.post("/v1/messages", json=message, headers={
        "x-api-key": KEYS["acme"], "Authorization": "Bearer kvs-nope"}), "invalid API key")


async def test_grpc_needs_a_known_bearer_key(gateway):
    request = gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                                              sampling=gateway_pb2.SamplingOptions(max_tokens=2))
    async with client_channel(gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for metadata, words in [(None, "API key is required"), ((("authorization", "Bearer nope"),), "invalid API key"),
                                ((("authorization", KEYS["acme"]),), "must be 'Bearer <key>'")]:
            for call in (stub.ChatComplete(request, metadata=metadata, timeout=10),
                         _drain(stub.ChatCompleteStream(request, metadata=metadata, timeout=10))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {KEYS['acme']}"),), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no live prefill worker" in err.value.details()
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health needs no key


async def _drain(call) -> None:
    async for _ in call:
        pass


async def test_rest_bridge_keeps_tenants_apart_and_admin_routes_for_admins(http, plane):
    _, _, reg, d = plane
    session = f"shared-{uuid.uuid4().hex[:8]}"
    await record(reg, d, session, "acme")

    mine = await http.get(f"/v1/sessions/{session}", headers=bearer("acme"))
    assert mine.status_code == 200, mine.text
    assert mine.json()["session"]["textKey"] == base64.b64encode(text_key("history of acme")).decode(), mine.text
    for params in ({}, {"tenant": "acme"}):  # another tenant: simply unknown, whatever it asks for
        theirs = await http.get(f"/v1/sessions/{session}", params=params, headers=bearer("globex"))
        assert theirs.status_code == 404 and "acme" not in theirs.text, theirs.text
        gone = await http.delete(f"/v1/sessions/{session}", params=params, headers=bearer("globex"))
        assert gone.status_code == 200 and gone.json()["deleted"] is False, gone.text
    still = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session, tenant="acme"))
    assert still.session.text_key == text_key("history of acme")
    # Asking for one's own session as another tenant reads one's own namespace.
    await record(reg, d, session, "globex")
    own = await http.get(f"/v1/sessions/{session}", params={"tenant": "acme"}, headers=bearer("globex"))
    assert own.status_code == 200 and own.json()["session"]["tenant"] == "globex", own.text
    deleted = await http.delete(f"/v1/sessions/{session}", headers=bearer("acme"))
    assert deleted.json()["deleted"] is True
    assert (await http.get(f"/v1/sessions/{session}", headers=bearer("globex"))).status_code == 200

    refused = await http.get("/v1/workers", headers=bearer("acme"))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["status"] == "PERMISSION_DENIED" and "admin" in refused.json()["error"]["message"]
    listed = await http.get("/v1/workers", headers=bearer("ops"))
    assert listed.status_code == 200 and "d-auth" in {w["workerId"] for w in listed.json()["workers"]}
    # The scheduler's stats (workers' loads, what each decode worker holds): admins only, like the worker list.
    assert (await http.get("/v1/scheduler/stats", headers=bearer("acme"))).status_code == 403
    stats = await http.get("/v1/scheduler/stats", headers=bearer("ops"))
    assert stats.status_code == 200 and "policies" in stats.json(), stats.text

    # The bridged gateway API authenticates the forwarded key again, and runs as its tenant.
    body = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"maxTokens": 2}}
    assert (await http.post("/v1/gateway/chat/completions", json=body)).status_code == 401
    resp = await http.post("/v1/gateway/chat/completions", json=body, headers=bearer("globex"))
    assert resp.status_code == 503 and "no live prefill worker" in resp.text, resp.text


async def test_open_gateway_is_one_tenant_and_warns_once(model_dir, plane, caplog):
    _, _, reg, d = plane
    session = f"open-{uuid.uuid4().hex[:8]}"
    await record(reg, d, session, "acme")
    with caplog.at_level(logging.WARNING, logger="kvshuttle.services.gateway.server"):
        service = await start_gateway(model_dir, plane)
    try:
        warnings = [r for r in caplog.records if "no API keys configured" in r.getMessage()]
        assert len(warnings) == 1
        async with httpx.AsyncClient(base_url=f"http://{service.http_address}", timeout=30) as http:
            assert (await http.get("/v1/models")).status_code == 200
            # ?tenant= used to pick any tenant's sessions: now the open gateway is the default tenant only.
            resp = await http.get(f"/v1/sessions/{session}", params={"tenant": "acme"})
            assert resp.status_code == 404, resp.text
            gone = await http.delete(f"/v1/sessions/{session}", params={"tenant": "acme"})
            assert gone.json()["deleted"] is False
            assert (await http.get("/v1/workers")).status_code == 200
        assert (await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session, tenant="acme"))).session
    finally:
        await service.stop()


def test_keys_file_mistakes_are_named(tmp_path, model_dir):
    def bad(content: str, words: str) -> None:
        path = tmp_path / "k.json"
        path.write_text(content)
        with pytest.raises(ConfigError, match=words):
            GatewayConfig(model_dir=str(model_dir), api_keys_file=str(path)).validate()

    digest = auth.hash_key("k")
    bad("{", "not valid JSON")
    bad('{"keys": []}', "lists no keys")
    bad(json.dumps({"keys": [{"sha256": "abc", "tenant": "t"}]}), "64 hex digits")
    bad(json.dumps({"keys": [{"sha256": digest, "tenant": "a/b"}]}), "characters outside")
    bad(json.dumps({"keys": [{"sha256": digest, "tenant": "t"}, {"sha256": digest, "tenant": "u"}]}), "twice")
    bad(json.dumps({"keys": [{"sha256": digest, "tenant": "t", "admin": "yes"}]}), "true or false")
    bad(json.dumps({"keys": [{"key": "k", "tenant": "t"}]}), "unknown fields")
    with pytest.raises(ConfigError, match="cannot read"):
        GatewayConfig(model_dir=str(model_dir), api_keys_file=str(tmp_path / "missing.json")).validate()
    ring = auth.KeyRing.load(_written(tmp_path, {"keys": [auth.entry("kvs-secret-zz9", "t", admin=True)]}))
    assert ring.principal("kvs-secret-zz9") == auth.Principal("t", True, "")
    assert "kvs-secret-zz9" not in (tmp_path / "w.json").read_text()
    with pytest.raises(auth.AuthError):
        ring.principal("kvs-secret-zz8")


def _written(tmp_path, data) -> str:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    return str(path)


async def test_hash_key_command_prints_an_entry_the_gateway_accepts(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshuttle.services.commands", "hash-key", "--tenant", "acme", "--generate",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    key = err.decode().rsplit(" ", 1)[1].strip()
    ring = auth.KeyRing.load(_written(tmp_path, {"keys": [json.loads(out)]}))
    assert key.startswith(auth.KEY_PREFIX) and ring.principal(key).tenant == "acme"
    assert key not in out.decode()


# -------------------------------------------------------------------------------------------------------- the limits

async def test_a_declared_oversized_body_is_refused_before_it_is_read(gateway):
    host, port = gateway.http_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 104857600\r\n\r\n{").encode())
        await writer.drain()  # 1 byte of a declared 100 MiB body
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413"), head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length))
        assert "request body over" in body["error"]["message"] and body["error"]["code"] == "body_too_large"
    finally:
        writer.close()


async def test_chunked_bodies_are_cut_at_the_limit_and_smaller_ones_pass(http):
    async def chunks(total: int):
        for _ in range(total // 4096):
            yield b" " * 4096  # JSON whitespace

    resp = await http.post("/v1/chat/completions", content=chunks(MAX_BODY * 4), headers=bearer("acme"))
    assert resp.status_code == 413 and "request body over" in resp.json()["error"]["message"]
    # padded with JSON whitespace (an unknown field would be a 400: the gateway drops nothing silently)
    body = ('{"messages": [{"role": "user", "content": "hi"}],' + " " * (MAX_BODY - 200) + '"max_tokens": 2}').encode()
    assert len(body) < MAX_BODY
    small = await http.post("/v1/chat/completions", content=chunks(8192), headers=bearer("acme"))
    assert small.status_code == 400  # whitespace only: not JSON, but past the limit check
    resp = await http.post("/v1/chat/completions", content=body, headers={**bearer("acme"),
                                                                         "content-type": "application/json"})
    assert resp.status_code == 503, resp.text  # read in full, then on to the scheduler
    big = await http.post("/v1/sessions/x", content=b"{" + b" " * MAX_BODY + b"}", headers=bearer("acme"))
    assert big.status_code == 413


async def test_prompts_over_the_token_limit_are_a_clear_400(http, gateway):
    long_ids = list(range(10, 10 + MAX_PROMPT + 1))
    resp = await http.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 2}, headers=bearer("acme"))
    assert resp.status_code == 400, resp.text
    assert f"prompt has {MAX_PROMPT + 1} tokens; this gateway accepts at most {MAX_PROMPT}" in resp.json()["error"][
        "message"]
    chat = {"messages": [{"role": "user", "content": "word " * (MAX_PROMPT * 2)}], "max_tokens": 2}
    resp = await http.post("/v1/chat/completions", json=chat, headers=bearer("acme"))
    assert resp.status_code == 400 and "this gateway accepts at most" in resp.text
    async with client_channel(gateway.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gateway_pb2_grpc.GatewayStub(channel).Complete(
                gateway_pb2.CompleteRequest(prompt_token_ids=long_ids, sampling=gateway_pb2.SamplingOptions(
                    max_tokens=2)), metadata=(("authorization", f"Bearer {KEYS['acme']}"),), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 200" in err.value.details()
    ok = await http.post("/v1/completions", json={"prompt": long_ids[:MAX_PROMPT], "max_tokens": 2},
                         headers=bearer("acme"))
    assert ok.status_code == 503  # within the limit: on to planning


# ----------------------------------------------------------------------------------------------------- TLS, gateway

async def test_gateway_over_https_and_mutual_tls_to_the_control_plane(model_dir, etcd, tmp_path):
    ca = TestCA(tmp_path / "ca")
    certs = {name: ca.issue(name) for name in ("registry", "scheduler", "gateway")}

    def server(name: str) -> dict:
        return {"tls_cert": certs[name].cert, "tls_key": certs[name].key, "tls_client_ca": ca.ca_file}

    def client(name: str) -> dict:
        return {"tls_ca": ca.ca_file, "tls_client_cert": certs[name].cert, "tls_client_key": certs[name].key}

    prefix = f"/auth-tls-{uuid.uuid4().hex[:6]}/"
    reg_cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix, **server("registry"))
    registry = await serve(reg_cfg)
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, **server("scheduler"),
                                                 **client("scheduler")))
    await scheduler.start()
    cfg = GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0", registry=registry.address,
                        scheduler=scheduler.address, model_dir=str(model_dir), max_model_len=2048,
                        api_keys_file=keys_file(tmp_path), http_tls_cert=certs["gateway"].cert,
                        http_tls_key=certs["gateway"].key, **server("gateway"), **client("gateway"))
    cfg.validate()
    gateway = GatewayService(cfg)
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"https://{gateway.http_address}", timeout=30,
                                     verify=ssl.create_default_context(cafile=ca.ca_file)) as https:
            assert (await https.get("/health")).status_code == 200
            assert (await https.get("/v1/sessions/none", headers=bearer("acme"))).status_code == 404  # via mTLS
            body = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"maxTokens": 2}}
            resp = await https.post("/v1/gateway/chat/completions", json=body, headers=bearer("acme"))
            assert resp.status_code == 503 and "no live prefill worker" in resp.text, resp.text  # bridge->gRPC->sched
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=5) as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get("/health")
        tls = TlsClientConfig(tls_ca=ca.ca_file, **{k: v for k, v in client("gateway").items() if k != "tls_ca"})
        async with client_channel(gateway.grpc_address, tls.client_tls()) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gateway_pb2_grpc.GatewayStub(channel).Complete(
                    gateway_pb2.CompleteRequest(prompt="hi"), metadata=(("authorization", f"Bearer {KEYS['ops']}"),),
                    timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no live prefill" in err.value.details()
        async with client_channel(gateway.grpc_address) as channel:  # plaintext: refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="hi"),
                                                                     timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await gateway.stop()
        await scheduler.stop()
        await registry.stop(grace=0.5)


# ------------------------------------------------------------------------------------------ limits per tenant (#26)

LIMITED_KEYS = {**KEYS, "initech": "kvs-initech-0d2f9a71"}


def limited_keys(directory, **extra) -> str:
    """acme: one request per 10 s; globex: 30 tokens a minute; initech: one request per 10 s (it calls the bridged
    gateway API, which must count once); ops: admin, no limits."""
    path = directory / "limited.json"
    path.write_text(json.dumps({
        "keys": [auth.entry(LIMITED_KEYS["acme"], "acme"), auth.entry(LIMITED_KEYS["globex"], "globex"),
                 auth.entry(LIMITED_KEYS["initech"], "initech"), auth.entry(LIMITED_KEYS["ops"], "ops", admin=True)],
        "limits": {"acme": {"requests_per_second": 0.1}, "initech": {"requests_per_second": 0.1},
                   "globex": {"tokens_per_minute": 30}}, **extra}))
    return str(path)


def lkey(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {LIMITED_KEYS[tenant]}"}


@pytest.fixture(scope="module")
async def limited(model_dir, plane, tmp_path_factory):
    service = await start_gateway(model_dir, plane, api_keys_file=limited_keys(tmp_path_factory.mktemp("lim")),
                                  http_receipt_timeout_s=1.0, http_max_connections=6, api_keys_reload_s=0)
    yield service
    await service.stop()


def limited_count(tenant: str, limit: str) -> float:
    return metrics.RATE_LIMITED.labels(tenant, limit)._value.get()


async def test_a_tenant_over_its_limits_gets_429_in_each_apis_shape_while_others_are_served(limited):
    before = limited_count("acme", "requests_per_second")
    message = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=f"http://{limited.http_address}", timeout=30) as http:
        assert (await http.get("/v1/models", headers=lkey("acme"))).status_code == 200
        over = await http.get("/v1/models", headers=lkey("acme"))
        assert over.status_code == 429 and 1 <= int(over.headers["retry-after"]) <= 10, over.text
        assert over.json()["error"]["type"] == "requests" and over.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requests per second" in over.json()["error"]["message"]
        anthropic = await http.post("/v1/messages", json=message, headers={"x-api-key": LIMITED_KEYS["acme"]})
        assert anthropic.status_code == 429 and anthropic.headers["retry-after"].isdigit()
        assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "rate_limit_error"
        # Another tenant, at the same moment: served as usual (here up to the scheduler: no prefill worker).
        assert (await http.get("/v1/models", headers=lkey("globex"))).status_code == 200
        served = await http.post("/v1/messages", json=message, headers={"x-api-key": LIMITED_KEYS["ops"]})
        assert served.status_code == 503 and "no live prefill worker" in served.text
        # The bridged gateway API counts a request once (the HTTP guard), not again in the gRPC API it calls.
        body = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"maxTokens": 2}}
        bridged = await http.post("/v1/gateway/chat/completions", json=body, headers=lkey("initech"))
        assert bridged.status_code == 503 and "no live prefill worker" in bridged.text, bridged.text

        # Tokens per minute: the prompt is charged before the turn (25 of globex's 30), the next one waits.
        prompt = {"prompt": list(range(10, 35)), "max_tokens": 2}
        first = await http.post("/v1/completions", json=prompt, headers=lkey("globex"))
        assert first.status_code == 503, first.text
        second = await http.post("/v1/completions", json=prompt, headers=lkey("globex"))
        assert second.status_code == 429 and second.json()["error"]["type"] == "tokens", second.text
        assert int(second.headers["retry-after"]) == 40  # 20 tokens missing at 0.5 a second
        rest = await http.post("/v1/gateway/completions", json={"promptTokenIds": list(range(10, 35))},
                               headers=lkey("globex"))
        assert rest.status_code == 429 and rest.headers["retry-after"] == "40", rest.text
        assert rest.json()["error"]["status"] == "RESOURCE_EXHAUSTED"

        # /metrics on the HTTP port: admin keys only (tenants are labels there).
        assert (await http.get("/metrics", headers=lkey("globex"))).status_code == 403
        scraped = await http.get("/metrics", headers=lkey("ops"))
        assert scraped.status_code == 200
        assert 'kvshuttle_rate_limited_total{limit="tokens_per_minute",tenant="globex"}' in scraped.text
        assert (await http.get("/metrics")).status_code == 401
    assert limited_count("acme", "requests_per_second") == before + 2

    async with client_channel(limited.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {LIMITED_KEYS['acme']}"),),
                                    timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.value.details()
        trailers = dict(err.value.trailing_metadata())
        assert 1 <= int(trailers["retry-after"]) <= 10
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds == int(trailers["retry-after"])
        with pytest.raises(grpc.aio.AioRpcError) as err:  # another tenant: on to the scheduler
            await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {LIMITED_KEYS['ops']}"),),
                                    timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(65536), 10)


async def test_half_sent_requests_get_408_and_connections_past_the_cap_503(limited):
    host, port = limited.http_address.rsplit(":", 1)
    started = asyncio.get_running_loop().time()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {LIMITED_KEYS['ops']}"
                  "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
    await writer.drain()  # 1 byte of a 100-byte body, then nothing
    answer = await _read_all(reader)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
    assert 0.9 <= asyncio.get_running_loop().time() - started < 5
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection is closed
    writer.close()

    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    await writer.drain()
    answer = await _read_all(reader)
    assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer, answer
    writer.close()

    # a kept-alive connection: a whole request is answered, then the next one's headers trickle and stop
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    first = await _read_all(reader)
    assert first.startswith(b"HTTP/1.1 200"), first
    await asyncio.sleep(0.8)  # the first request's deadline has passed by the time the second one stalls
    started = asyncio.get_running_loop().time()
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    answer = await _read_all(reader)
    assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer, answer
    assert 0.9 <= asyncio.get_running_loop().time() - started < 5
    writer.close()

    idle = [await asyncio.open_connection(host, int(port)) for _ in range(6)]
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await _read_all(reader)
        assert answer.startswith(b"HTTP/1.1 503") and b"over 6 open connections" in answer, answer
        writer.close()
    finally:
        for _, w in idle:
            w.close()
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=f"http://{limited.http_address}", timeout=30) as http:
        assert (await http.get("/health")).status_code == 200  # the cap frees as connections close


def _leaves(node):
    """Every scalar in a JSON document."""
    if isinstance(node, dict):
        for value in node.values():
            yield from _leaves(value)
    elif isinstance(node, list):
        for value in node:
            yield from _leaves(value)
    else:
        yield node


async def test_sessions_show_tenants_no_worker_addresses(http, plane):
    _, _, reg, d = plane
    session = f"addr-{uuid.uuid4().hex[:8]}"
    await record(reg, d, session, "acme")
    await record(reg, d, session, "ops")
    mine = await http.get(f"/v1/sessions/{session}", headers=bearer("acme"))
    assert mine.status_code == 200 and int(mine.json()["session"]["coveredTokens"]) == 7, mine.text
    assert "kvTransferParamsJson" not in mine.json()["session"] or not mine.json()["session"]["kvTransferParamsJson"]
    port = d.nixl_port  # by value, not as a substring of the page (its digits may turn up in a timestamp)
    assert d.engine_id not in mine.text and "remote_host" not in mine.text and "remote_port" not in mine.text
    assert not any(leaf in (port, str(port)) or (isinstance(leaf, str) and f":{port}" in leaf)
                   for leaf in _leaves(mine.json())), mine.text
    admin = await http.get(f"/v1/sessions/{session}", headers=bearer("ops"))
    assert d.engine_id in admin.json()["session"]["kvTransferParamsJson"], admin.text


async def test_a_route_without_a_caller_identity_is_401_never_full_rights(gateway):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gw") as bare:
        resp = await bare.post("/v1/chat/completions", json=chat)  # the app without its guard
        assert resp.status_code == 401 and "no caller identity" in resp.json()["error"]["message"], resp.text
        message = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        resp = await bare.post("/v1/messages", json=message)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error", resp.text
        assert (await bare.get("/v1/responses/resp_x")).status_code == 401


async def test_the_keys_file_reloads_while_running_and_a_bad_one_keeps_the_keys(model_dir, plane, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [auth.entry(KEYS["acme"], "acme")]}))
    service = await start_gateway(model_dir, plane, api_keys_file=str(path), api_keys_reload_s=0.1)
    try:
        async with httpx.AsyncClient(base_url=f"http://{service.http_address}", timeout=30) as http:
            assert (await http.get("/v1/models", headers=bearer("globex"))).status_code == 401
            path.write_text(json.dumps({"keys": [auth.entry(KEYS["acme"], "acme"), auth.entry(KEYS["globex"], "globex")],
                                        "limits": {"globex": {"requests_per_second": 0.1}}}))
            for _ in range(100):
                if (await http.get("/v1/models", headers=bearer("globex"))).status_code != 401:
                    break
                await asyncio.sleep(0.05)
            assert (await http.get("/v1/models", headers=bearer("globex"))).status_code == 429  # its limit too
            failed = metrics.API_KEYS_RELOADS.labels("failed")._value.get()
            path.write_text('{"keys": [{"sha256": "nope", "tenant": "x"}]}')
            for _ in range(100):
                if metrics.API_KEYS_RELOADS.labels("failed")._value.get() > failed:
                    break
                await asyncio.sleep(0.05)
            assert metrics.API_KEYS_RELOADS.labels("failed")._value.get() == failed + 1
            assert (await http.get("/v1/models", headers=bearer("acme"))).status_code == 200  # old keys in force
    finally:
        await service.stop()
