"""The express lane end to end (services/gateway/turns/context.ExpressLane): a streamed chat's tokens after D's first
are spelled and written from the read that brought them, and the stream says what the same turn says whole (text,
finish, usage), chunk for chunk as the usual path spells it; in chat, Anthropic's Messages and the Responses API. Real registry, scheduler and gateway on loopback (uvicorn
with httptools, as served), fake engines speaking vLLM's gRPC API."""

from __future__ import annotations

import asyncio
import gc
import json

import httpx
from kvshuttle.services.gateway.turns import TurnContext
from kvshuttle.services.gateway.turns import decode as decoding
from kvshuttle.services.gateway.turns.context import ExpressLane

from tests.support.traced_stack import fake_stack, stop_all


async def test_streamed_answers_go_by_the_express_lane_and_say_what_whole_answers_say(etcd, model_dir, monkeypatch):
    taken = []
    take = decoding.Decoding.take
    monkeypatch.setattr(decoding.Decoding, "take", lambda self, chunk: taken.append(chunk) or take(self, chunk))
    # D sends a token every 5 ms: each chunk arrives while the turn waits for it
    gateway, scheduler, registry, (p, d) = await fake_stack(etcd, model_dir, "express", token_delay_s=0.005)
    try:
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "Count for me."}], "max_tokens": 40}
            chunks = []
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            streamed = taken[:]
            whole = (await client.post("/v1/chat/completions", json=body)).json()

        # P's token, then D's first chunk (it confirms the call's options) come the usual way; the rest by the lane
        assert len(streamed) >= 30, len(streamed)
        assert len(taken) == len(streamed)  # a whole answer never opens it
        content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert content[0] == "" and all(isinstance(t, str) for t in content[1:-1])
        assert "".join(t for t in content if t) == whole["choices"][0]["message"]["content"]
        assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 40
        ids = {c["id"] for c in chunks}
        assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)

        # Anthropic's Messages and the Responses API open it too, and say what their whole answers say
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            for path, body, text_of, whole_text in (
                    ("/v1/messages", {"model": model, "max_tokens": 40, "messages": body["messages"]},
                     lambda e: e.get("delta", {}).get("text", "") if e.get("type") == "content_block_delta" else "",
                     lambda w: "".join(b.get("text", "") for b in w["content"])),
                    ("/v1/responses", {"model": model, "max_output_tokens": 40, "input": "Count for me."},
                     lambda e: e.get("delta", "") if e.get("type") == "response.output_text.delta" else "",
                     lambda w: "".join(c["text"] for item in w["output"] for c in item.get("content") or ()
                                       if c.get("type") == "output_text"))):
                before, pieces = len(taken), []
                async with client.stream("POST", path, json={**body, "stream": True}) as r:
                    assert r.status_code == 200, path
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            pieces.append(text_of(json.loads(line[6:])))
                expressed = len(taken) - before
                whole = (await client.post(path, json=body)).json()
                assert expressed >= 30, (path, expressed)
                assert "".join(pieces) == whole_text(whole) != "", path
    finally:
        await stop_all(gateway, scheduler, registry, (p, d))


async def test_a_finished_turn_leaves_no_reference_cycle_for_the_collector(etcd, model_dir):
    """A turn's objects are freed as its request ends, not by the collector's next full pass (which walks everything
    still waiting there: issue #36's per-token profile): no TurnContext, express lane or request scope is found
    unreachable after streamed and whole answers on each HTTP API."""
    gateway, scheduler, registry, (p, d) = await fake_stack(etcd, model_dir, "cycles", token_delay_s=0.002)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        async with httpx.AsyncClient(base_url=f"http://{gateway.http_address}", timeout=30) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            messages = [{"role": "user", "content": "Count for me."}]
            for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 12}),
                               ("/v1/messages", {"model": model, "max_tokens": 12, "messages": messages}),
                               ("/v1/responses", {"model": model, "max_output_tokens": 12, "input": "Count."})):
                for stream in (True, False):
                    async with client.stream("POST", path, json={**body, "stream": stream}) as r:
                        assert r.status_code == 200, (path, await r.aread())
                        await r.aread()
        await asyncio.sleep(0.2)  # the streams' tasks have ended
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage
                 if isinstance(o, (TurnContext, ExpressLane)) or (isinstance(o, dict) and o.get("type") == "http"
                                                                   and "asgi" in o)]
        assert found == [], found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        await stop_all(gateway, scheduler, registry, (p, d))
