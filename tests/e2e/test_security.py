"""Security on the real stack (real etcd, services and vLLM P/D): API keys and tenants, client-supplied
kv_transfer_params (refused by name), no keys or session ids in logs or traces, per-tenant limits, and the internal
APIs under the stack's mutual TLS open only to the service identities each method is for.

A second gateway with an API keys file joins the shared stack (same registry and scheduler, its own ports and log in
``stack.logs``). Keys and session ids are distinctive strings, so a leak anywhere is found by a plain search.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf.message_factory import GetMessageClass
from kvshuttle.control_plane.service_access import RULES, caller_of, refusal
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.common.tls import ClientTls
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.devtools.local_ca import LocalCA
from kvshuttle.services.gateway.edge import auth
from kvshuttle.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc, scheduler_pb2

from tests.support.e2e import flush_prefill, user_turn

pytestmark = pytest.mark.e2e
KEY_A = f"kvs-e2e-acme-{secrets.token_hex(12)}"
KEY_B = f"kvs-e2e-globex-{secrets.token_hex(12)}"
WRONG_KEY = f"kvs-e2e-wrong-{secrets.token_hex(12)}"
KEY_C = f"kvs-e2e-initech-{secrets.token_hex(12)}"  # tenant initech: one request per 20 s
SESSIONS = {name: f"e2e-secret-{name}-{uuid.uuid4().hex[:12]}" for name in ("http", "grpc", "logs")}
SYSTEM = {"role": "system", "content": "You are terse."}
BOGUS_PARAMS = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1, "remote_engine_id": "evil",
                "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 300}


@pytest.fixture(scope="module")
async def keyed(stack, tmp_path_factory):
    """A gateway that requires API keys (acme: KEY_A, globex: KEY_B, initech: KEY_C with a limit of one request per
    20 s), on the stack's registry and scheduler."""
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [auth.entry(KEY_A, "acme"), auth.entry(KEY_B, "globex"),
                                         auth.entry(KEY_C, "initech")],
                                "limits": {"initech": {"requests_per_second": 0.05}}}))
    http, grpc_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    child = await stack._spawn("gateway-keys", "gateway", "--grpc-listen", grpc_address, "--http-listen", http,
                               "--max-model-len", str(stack.cfg.max_model_len), "--api-keys-file", str(path))
    try:
        await stack.wait_grpc(child, grpc_address, time.monotonic() + 120, internal=False)
        yield f"http://{http}", grpc_address
    finally:
        await child.stop()
        stack.children.remove(child)


def key(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


class Traces:
    """A trace id of its own for each request a test sends (W3C ``traceparent``; the gateway continues it), and what
    each trace must hold once every process has exported its spans: (service, span name) pairs."""

    def __init__(self):
        self.expected: dict[str, set[tuple[str, str]]] = {}

    def header(self, *expected: tuple[str, str]) -> dict[str, str]:
        trace_id = secrets.token_hex(16)
        self.expected[trace_id] = set(expected)
        return {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}

    def missing(self, spans: list[dict]) -> dict[str, set[tuple[str, str]]]:
        """The expected spans not (yet) received, by trace id."""
        found: dict[str, set[tuple[str, str]]] = {}
        for s in spans:
            if s["trace_id"] in self.expected:
                found.setdefault(s["trace_id"], set()).add((s["service"], s["name"]))
        return {t: want - found.get(t, set()) for t, want in self.expected.items() if want - found.get(t, set())}

    def spans(self, spans: list[dict]) -> list[dict]:
        return [s for s in spans if s["trace_id"] in self.expected]


# A turn's trace through every process: the gateway, the scheduler, the registry, and vLLM on P and D.
TURN = (("kvshuttle-gateway", "kvshuttle.turn"), ("kvshuttle-scheduler", "scheduler.plan_turn"),
        ("kvshuttle-registry", "registry.record_turn"), ("vllm-prefill", "llm_request"), ("vllm-decode", "llm_request"))


async def chat(client: httpx.AsyncClient, k: str, session: str, messages: list[dict], *,
               headers: dict[str, str] | None = None, **extra) -> dict:
    resp = await client.post("/v1/chat/completions", headers={**key(k), "X-Session-ID": session, **(headers or {})},
                             json={"messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def follow_up(messages: list[dict], answer: dict, text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": text}]


async def test_tenants_only_reach_their_own_sessions_and_client_params_are_dropped(stack, keyed):
    base, _ = keyed
    session = SESSIONS["http"]
    await flush_prefill(stack)
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers=key(WRONG_KEY))).status_code == 401
        first = await chat(client, KEY_A, session, [SYSTEM, user_turn(4)])
        assert first["kvshuttle"]["decision"] == "recompute"
        messages = follow_up([SYSTEM, user_turn(4)], first, "And then?")

        # Tenant B knows A's session id and history: to B the id is simply unknown. Nothing is pulled, nothing read.
        other = await chat(client, KEY_B, session, messages)
        kv = other["kvshuttle"]
        assert kv["decision"] == "recompute" and "no recorded KV" in kv["reason"], kv
        assert kv["covered_tokens"] == 0 and kv["matched_tokens"] == 0 and kv["pulled_tokens"] == 0

        # A client's own kv_transfer_params are refused by name (only the scheduler decides what P pulls), and the
        # refused turn changes nothing.
        bogus = await client.post("/v1/chat/completions", headers={**key(KEY_A), "X-Session-ID": session},
                                  json={"messages": messages, "max_tokens": 8, "kv_transfer_params": BOGUS_PARAMS})
        assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "kv_transfer_params", bogus.text
        # A's own next turn still pulls A's history (B neither consumed nor replaced it), from the decode worker the
        # scheduler chose.
        second = await chat(client, KEY_A, session, messages)
        kv = second["kvshuttle"]
        assert kv["decision"] == "pull" and not kv["retried_as_recompute"], kv
        assert kv["pulled_tokens"] > 0 and kv["decode_worker"] != "evil"
        assert second["usage"]["prompt_tokens"] - kv["computed_tokens"] >= 128  # P's cache + the pull

        # The REST bridge: B reads and deletes only its own record, whatever tenant it names.
        theirs = await client.get(f"/v1/sessions/{session}", params={"tenant": "acme"}, headers=key(KEY_B))
        assert theirs.status_code == 200 and theirs.json()["session"]["tenant"] == "globex", theirs.text
        assert int(theirs.json()["session"]["turn"]) == 1  # B's one turn, not A's two
        deleted = await client.delete(f"/v1/sessions/{session}", params={"tenant": "acme"}, headers=key(KEY_B))
        assert deleted.json()["deleted"] is True
        assert (await client.get(f"/v1/sessions/{session}", headers=key(KEY_B))).status_code == 404
        mine = await client.get(f"/v1/sessions/{session}", headers=key(KEY_A))
        assert mine.status_code == 200 and int(mine.json()["session"]["turn"]) == 2, mine.text
        assert (await client.get("/v1/workers", headers=key(KEY_A))).status_code == 403

        third = await chat(client, KEY_A, session, follow_up(messages, second, "Go on."))
        assert third["kvshuttle"]["decision"] == "pull", third["kvshuttle"]


async def test_grpc_gateway_keys_decide_the_tenant(keyed):
    _, address = keyed
    session = SESSIONS["grpc"]
    request = gateway_pb2.ChatCompleteRequest(
        session_id=session, messages=[gateway_pb2.ChatMessage(**SYSTEM), gateway_pb2.ChatMessage(**user_turn(5))],
        sampling=gateway_pb2.SamplingOptions(max_tokens=8))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ChatComplete(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        first = await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=300)
        assert first.kv.decision == scheduler_pb2.DECISION_RECOMPUTE
        request.messages.add(role="assistant", content=first.message.content)
        request.messages.add(role="user", content="Go on.")
        other = await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=300)
        assert other.kv.decision == scheduler_pb2.DECISION_RECOMPUTE and "no recorded KV" in other.kv.reason
        call = stub.ChatCompleteStream(request, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=300)
        events = [e async for e in call]
    assert events[0].started.kv.decision == scheduler_pb2.DECISION_PULL, events[0]
    assert events[-1].finished.kv.pulled_tokens > 0


async def test_keys_and_session_ids_stay_out_of_logs_and_traces(stack, keyed, otlp):
    """Every request here carries a trace id of its own; the spans checked are those of these traces only (not
    whatever other tests exported), and each trace must have arrived whole: a span that never came cannot pass."""
    base, _ = keyed
    session = SESSIONS["logs"]
    traces = Traces()
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        first = await chat(client, KEY_A, session, [SYSTEM, user_turn(6)], headers=traces.header(*TURN))
        messages = follow_up([SYSTEM, user_turn(6)], first, "Why?")
        await chat(client, KEY_B, session, messages, headers=traces.header(*TURN))
        again = await chat(client, KEY_A, session, messages, headers=traces.header(*TURN))
        assert again["kvshuttle"]["decision"] == "pull"
        # refused before it is routed: the gateway's HTTP span, named by the method alone
        refused = await client.get(f"/v1/sessions/{session}", headers={
            **key(WRONG_KEY), **traces.header(("kvshuttle-gateway", "GET"))})
        assert refused.status_code == 401
        read = await client.get(f"/v1/sessions/{session}", headers={
            **key(KEY_B), **traces.header(("kvshuttle-gateway", "GET /v1/sessions/{session_id}"),
                                          ("kvshuttle-registry", "/kvshuttle.v1.SessionRegistry/GetSession"))})
        assert read.status_code == 200
        bad = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 0}, headers={
            **key(KEY_A), "X-Session-ID": session, **traces.header(("kvshuttle-gateway", "POST /v1/chat/completions"))})
        assert bad.status_code == 400

    try:
        await otlp.wait_for(lambda spans: not traces.missing(spans), timeout_s=60)
    except AssertionError:
        raise AssertionError(f"spans never received: {traces.missing(otlp.spans)}") from None
    spans = traces.spans(otlp.spans)
    secrets_ = [KEY_A, KEY_B, WRONG_KEY, *SESSIONS.values(), auth.hash_key(KEY_A), auth.hash_key(KEY_B)]
    leaks = [(s["service"], s["name"], secret) for s in spans for secret in secrets_ if secret in json.dumps(s)]
    assert not leaks, leaks
    turns = [s for s in spans if s["name"] == "kvshuttle.turn"]
    assert len(turns) == 3 and all(s["attributes"].get("kvshuttle.session") == hashed(session) for s in turns), turns

    logs = sorted(Path(stack.logs).rglob("*.log")) + sorted(Path(stack.work, "workers").rglob("*.log"))
    texts = {str(p): p.read_text(errors="replace") for p in logs}
    assert any("gateway-keys" in p for p in texts) and any("API keys required" in t for t in texts.values())
    leaks = [(p, secret) for p, text in texts.items() for secret in secrets_ if secret in text]
    assert not leaks, leaks


async def test_a_tenant_over_its_limit_gets_429_while_another_is_served_at_the_same_moment(keyed):
    base, address = keyed
    body = {"messages": [SYSTEM, user_turn(3)], "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        first = await client.post("/v1/chat/completions", headers=key(KEY_C), json=body)
        assert first.status_code == 200, first.text
        over, other = await asyncio.gather(client.post("/v1/chat/completions", headers=key(KEY_C), json=body),
                                           client.post("/v1/chat/completions", headers=key(KEY_A), json=body))
        assert over.status_code == 429, over.text
        assert 1 <= int(over.headers["retry-after"]) <= 20
        assert over.json()["error"]["type"] == "requests" and over.json()["error"]["code"] == "rate_limit_exceeded"
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] > 0, other.text
        anthropic = await client.post("/v1/messages", headers={"x-api-key": KEY_C}, json={
            "model": "tiny", "max_tokens": 8, "messages": [user_turn(3)]})
        assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
        assert anthropic.headers["retry-after"].isdigit()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(**user_turn(3))],
                                                  sampling=gateway_pb2.SamplingOptions(max_tokens=8))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {KEY_C}"),), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 1 <= int(dict(err.value.trailing_metadata())["retry-after"]) <= 20
        served = await stub.ChatComplete(request, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=300)
        assert served.usage.completion_tokens > 0


# ----------------------------------------------------------------------- internal APIs: service identity, mutual TLS

def internal_methods() -> list[tuple[str, type, bool]]:
    """Every method of the registry's and the scheduler's APIs: (path, request class, server-streaming)."""
    methods = []
    for file, name in ((registry_pb2.DESCRIPTOR, "SessionRegistry"), (scheduler_pb2.DESCRIPTOR, "TransferScheduler")):
        service = file.services_by_name[name]
        methods += [(f"/{service.full_name}/{m.name}", GetMessageClass(m.input_type), m.server_streaming)
                    for m in service.methods]
    return methods


async def call_code(channel: grpc.aio.Channel, path: str, request_type: type, streaming: bool) -> grpc.StatusCode:
    """The status of one call with an empty request (OK when it succeeds)."""
    kwargs = {"request_serializer": request_type.SerializeToString, "response_deserializer": lambda b: b}
    try:
        if streaming:
            async for _ in channel.unary_stream(path, **kwargs)(request_type(), timeout=10):
                break
        else:
            await channel.unary_unary(path, **kwargs)(request_type(), timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_internal_apis_take_only_the_right_service_identities(stack, tmp_path):
    """The stack runs as the chart does (mutual TLS, each call authorized by the caller's certificate): no
    certificate, or one of another CA, fails on every internal method (UNAVAILABLE); the stack's own certificates
    reach only the methods their role is for (PERMISSION_DENIED otherwise): a gateway never registers a worker, a
    worker never reads a session, a worker's certificate acts only as that worker."""
    assert stack.ca is not None, "the e2e stack runs with TLS on (StackConfig.tls)"
    methods = internal_methods()
    assert {path for path, _, _ in methods} == set(RULES)  # every internal method, each with its rule
    rogue = LocalCA(tmp_path / "rogue", "rogue CA")
    rogue_files = rogue.issue("admin")  # the right name, the wrong CA
    ca_pem = Path(stack.ca.ca_file).read_bytes()
    strangers = {"plaintext": None, "no certificate": ClientTls(ca_pem),
                 "another CA's admin": ClientTls(ca_pem, Path(rogue_files.cert).read_bytes(),
                                                 Path(rogue_files.key).read_bytes())}
    for address in (stack.registry_address, stack.scheduler_address):
        for who, tls in strangers.items():
            async with client_channel(address, tls) as channel:
                for path, request_type, streaming in methods:
                    if path.split("/")[1].endswith("Registry") != (address == stack.registry_address):
                        continue
                    assert await call_code(channel, path, request_type, streaming) == grpc.StatusCode.UNAVAILABLE, (
                        who, path)

    worker_id = next(w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_DECODE)
    refused_calls = []
    for identity in ("gateway", "scheduler", f"worker:{worker_id}", "registry", "operator"):
        channels = {address: stack.channel(address, identity)
                    for address in (stack.registry_address, stack.scheduler_address)}
        try:
            for path, request_type, streaming in methods:
                if not refusal(path, caller_of(identity)):
                    continue
                address = stack.registry_address if "SessionRegistry" in path else stack.scheduler_address
                code = await call_code(channels[address], path, request_type, streaming)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (identity, path, code)
                refused_calls.append((identity.partition(":")[0], path.rsplit("/", 1)[1]))
        finally:
            for channel in channels.values():
                await channel.close()
    assert {("gateway", "RegisterWorker"), ("worker", "GetSession"), ("worker", "PlanTurn"),
            ("scheduler", "RecordTurn"), ("registry", "GetSession"), ("operator", "ListWorkers")} <= set(refused_calls)

    # a worker's certificate keeps alive only its own worker; an allowed caller gets past the check
    async with stack.channel(stack.registry_address, f"worker:{worker_id}") as channel:
        registry = registry_pb2_grpc.SessionRegistryStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.KeepAlive(registry_pb2.KeepAliveRequest(worker_id="prefill-0"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "only act as worker" in err.value.details()
    async with stack.channel(stack.registry_address, "gateway") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry_pb2_grpc.SessionRegistryStub(channel).GetSession(
                registry_pb2.GetSessionRequest(session_id=f"absent-{uuid.uuid4().hex[:8]}"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
