"""A client that leaves mid-stream: the gateway's event stream (services/gateway/edge/sse.py, written from the
turn's loop) sees the disconnect and cancels the turn, and the decode worker's call is cancelled with it; the
gateway goes on serving. Real registry, scheduler and gateway on loopback, fake engines (vLLM's gRPC API)."""

from __future__ import annotations

import uuid

import httpx
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2

from tests.support.traced_stack import fake_pair, stop_all
from tests.support.waits import until


async def test_a_client_that_leaves_mid_stream_cancels_the_decode_call(etcd, model_dir):
    prefix = f"/disconnect-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, policy="threshold"))
    await scheduler.start()
    p, d = await fake_pair(registry.address)
    d.engine.token_delay_s = 0.05  # 200 tokens: 10 s, unless cancelled
    await until(lambda: scheduler.workers.by_role(common_pb2.WORKER_ROLE_PREFILL) and scheduler.workers.by_role(
        common_pb2.WORKER_ROLE_DECODE), what="the scheduler's view of both workers")
    gateway = GatewayService(GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0",
                                           registry=registry.address, scheduler=scheduler.address,
                                           model_dir=str(model_dir), max_model_len=2048))
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while '"content":"' not in await anext(lines):  # the role chunk, then P's token
                    pass
                await until(lambda: d.engine.requests, what="the decode call under way")
                decode_ids = [r.request_id for r in d.engine.requests]
            # The connection is closed here, mid-answer.
            assert len(decode_ids) == 1
            await until(lambda: decode_ids[0] in d.engine.cancelled, 10.0, "the decode call to be cancelled")
            assert len(d.engine.requests) == 1  # the turn was not moved to another decode worker either

            d.engine.token_delay_s = 0
            answer = await client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    finally:
        await stop_all(gateway, scheduler, registry, (p, d))
