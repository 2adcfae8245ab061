"""A client that leaves mid-stream: the gateway's event stream (services/gateway/edge/sse.py, written from the
turn's loop) sees the disconnect and cancels the turn, and the decode worker's call is cancelled with it; the
gateway goes on serving. Real registry, scheduler and gateway on loopback, fake engines (vLLM's gRPC API)."""

from __future__ import annotations

import httpx

from tests.support.traced_stack import fake_stack, stop_all
from tests.support.waits import until


async def test_a_client_that_leaves_mid_stream_cancels_the_decode_call(etcd, model_dir):
    gateway, scheduler, registry, (p, d) = await fake_stack(etcd, model_dir, "disconnect", token_delay_s=0.05)
    # 200 tokens at 50 ms: 10 s, unless cancelled
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
