"""Conversation turns through an in-process, traced gateway + scheduler + registry (real etcd) and two fake vLLM
engines; prints every finished span and what the client saw as JSON. Run by tests/integration/test_tracing.py in a
subprocess (the tracer provider is process-wide and set once):

    python -m tests.support.traced_stack <etcd endpoints> <model dir>

The turns: a 3-turn HTTP conversation whose first turn carries the client's ``traceparent`` (the third streams), a
gRPC turn with ``traceparent`` in its metadata, a turn the gateway refuses (400) and one that fails because the only
prefill worker is down (503).
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import grpc
import httpx
from kvshuttle.services.common.config import TelemetryConfig
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.telemetry import setup_tracing
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.fake_engine import FakeEngineServer
from tests.support.waits import until

SESSION = f"secret-conversation-{uuid.uuid4().hex[:8]}"  # must never appear in a span
HTTP_PARENT = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")  # the HTTP client's trace and span
GRPC_PARENT = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
TOOL_OUTPUT = " ".join(f"line {i}: value={i * 7 % 13}" for i in range(40))


def traceparent(parent: tuple[str, str]) -> str:
    return f"00-{parent[0]}-{parent[1]}-01"


def span_dict(span) -> dict:
    """An SDK span in the shape of kvshuttle.services.commands.trace_view.span_dicts (the OTLP receiver's)."""
    status = {"UNSET": "unset", "OK": "ok", "ERROR": "error"}[span.status.status_code.name]
    return {"service": span.resource.attributes.get("service.name", ""), "scope": span.instrumentation_scope.name,
            "name": span.name, "kind": span.kind.name.lower(), "trace_id": f"{span.context.trace_id:032x}",
            "span_id": f"{span.context.span_id:016x}", "parent_id": f"{span.parent.span_id:016x}" if span.parent else "",
            "start_ns": span.start_time, "end_ns": span.end_time,
            "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in span.attributes.items()},
            "status": span.status.description or "", "status_code": status,
            "events": [{"name": e.name, "attributes": dict(e.attributes)} for e in span.events]}


async def register(registry_address: str, p: FakeEngineServer, d: FakeEngineServer) -> None:
    channel = client_channel(registry_address)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    for role, server, name in ((common_pb2.WORKER_ROLE_PREFILL, p, "p-traced"),
                               (common_pb2.WORKER_ROLE_DECODE, d, "d-traced")):
        worker = common_pb2.Worker(worker_id=name, role=role, engine_id=f"engine-{name}", grpc_address=server.address,
                                   nixl_host="127.0.0.1", nixl_port=server.port + 1, block_size=16,
                                   kv_blocks_ttl_s=480, model="tiny")
        await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=worker, lease_ttl_s=60))
    await channel.close()


async def fake_pair(registry_address: str) -> tuple[FakeEngineServer, FakeEngineServer]:
    """A fake prefill and decode engine, started and registered (D's final messages carry its KV handle)."""
    p = FakeEngineServer()
    d = FakeEngineServer(handle={"remote_engine_id": "engine-d-traced", "remote_host": "127.0.0.1"})
    for engine in (p, d):
        await engine.start()
    d.engine.handle["remote_port"] = d.port + 1
    await register(registry_address, p, d)
    return p, d


async def fake_stack(etcd: str, model_dir, name: str, token_delay_s: float = 0.0):
    """A registry, a scheduler (threshold policy, no load polls), a fake P/D pair (D streams a token every
    ``token_delay_s``) and a gateway on loopback, under a key prefix of their own: (gateway, scheduler, registry,
    (p, d)). Stop them with ``stop_all``."""
    prefix = f"/{name}-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, policy="threshold"))
    await scheduler.start()
    p, d = await fake_pair(registry.address)
    d.engine.token_delay_s = token_delay_s
    await until(lambda: scheduler.workers.by_role(common_pb2.WORKER_ROLE_PREFILL) and scheduler.workers.by_role(
        common_pb2.WORKER_ROLE_DECODE), what="the scheduler's view of both workers")
    gateway = GatewayService(GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0",
                                           registry=registry.address, scheduler=scheduler.address,
                                           model_dir=str(model_dir), max_model_len=2048))
    await gateway.start()
    return gateway, scheduler, registry, (p, d)


async def stop_all(gateway, scheduler, registry, engines) -> None:
    """Stop a stack built here: the gateway first, the engines last."""
    await gateway.stop()
    await scheduler.stop()
    await registry.stop(grace=0.5)
    for engine in engines:
        await engine.stop()


async def http_turns(base_url: str) -> list[dict]:
    """The 3-turn conversation; each turn's response id, usage, decision and kvshuttle timings."""
    out, messages = [], [{"role": "system", "content": "You are terse."}]
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        for n in range(3):
            messages.append({"role": "user", "content": f"Turn {n}. Tool output: {TOOL_OUTPUT}. Explain."})
            headers = {"X-Session-ID": SESSION, **({"traceparent": traceparent(HTTP_PARENT)} if n == 0 else {})}
            body = {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": n == 2}
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200, resp.text
            if n == 2:  # the stream's last data chunk before [DONE] carries the kvshuttle object
                chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                          if line.startswith("data: {")]
                answer = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
                result = {"id": chunks[0]["id"], "kvshuttle": chunks[-1]["kvshuttle"], "usage": None}
            else:
                answer = resp.json()["choices"][0]["message"]["content"]
                result = {"id": resp.json()["id"], "kvshuttle": resp.json()["kvshuttle"], "usage": resp.json()["usage"]}
            out.append({**result, "decision": resp.headers["x-kv-decision"], "stream": n == 2})
            messages.append({"role": "assistant", "content": answer})
    return out


async def grpc_turn(address: str) -> dict:
    request = gateway_pb2.ChatCompleteRequest(
        session_id=f"grpc-{uuid.uuid4().hex[:8]}", messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
        sampling=gateway_pb2.SamplingOptions(max_tokens=3))
    async with grpc.aio.insecure_channel(address) as channel:  # a plain client: its own trace context, by hand
        reply = await gateway_pb2_grpc.GatewayStub(channel).ChatComplete(
            request, metadata=(("traceparent", traceparent(GRPC_PARENT)),), timeout=30)
    return {"id": reply.id, "prompt_tokens": reply.usage.prompt_tokens}


async def failing_turns(base_url: str, p: FakeEngineServer) -> dict:
    """A refused turn (max_tokens over the context) and one whose only prefill worker is down."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        refused = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 100000})
        await p.stop()
        failed = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
    return {"refused": refused.status_code, "failed": failed.status_code}


async def main(etcd: str, model_dir: str) -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("kvshuttle-test", TelemetryConfig(), exporter=exporter)
    prefix = f"/traced-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, pull_threshold_tokens=16, policy="threshold"))
    await scheduler.start()
    p, d = await fake_pair(registry.address)
    await until(lambda: scheduler.workers.by_role(common_pb2.WORKER_ROLE_PREFILL) and scheduler.workers.by_role(
        common_pb2.WORKER_ROLE_DECODE), what="the scheduler's view of both workers")
    gateway = GatewayService(GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0",
                                           registry=registry.address, scheduler=scheduler.address,
                                           model_dir=model_dir, max_model_len=2048))
    await gateway.start()
    base_url = f"http://{gateway.http_address}"
    try:
        result = {"session": SESSION, "http_parent": HTTP_PARENT, "grpc_parent": GRPC_PARENT,
                  "prefill_address": p.address, "decode_address": d.address,
                  "http": await http_turns(base_url), "grpc": await grpc_turn(gateway.grpc_address)}
        # The turns' outcome reports and releases run in the background: all four reported, none in flight.
        await until(lambda: scheduler.planner.reported >= 4 and not gateway.runner._reports,
                    what="the turns' outcome reports")
        result["engine_metadata"] = {**p.engine.metadata, **d.engine.metadata}
        result["errors"] = await failing_turns(base_url, p)
    finally:
        await stop_all(gateway, scheduler, registry, (p, d))
    from opentelemetry import trace

    trace.get_tracer_provider().force_flush()
    result["spans"] = [span_dict(s) for s in exporter.get_finished_spans()]
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
