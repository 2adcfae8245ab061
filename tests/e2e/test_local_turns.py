"""A later turn continued on the decode worker that holds its history (DECISION_LOCAL), on the real vLLM pair: D's
own prefix cache serves the history, the history crosses no network, and the answer is exactly the recompute's."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from kvshuttle.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from openai import AsyncOpenAI

from tests.support.e2e import new_session, tokens, user_turn

pytestmark = pytest.mark.e2e

ON_D = "on_d"  # the stack's policy that continues on D whenever it can (tests/e2e/conftest.py)


def counters(stack, worker_id: str) -> dict[str, float]:
    """vLLM's prompt tokens by source on one worker (local_compute, local_cache_hit, external_kv_transfer)."""
    return stack.prefill_prompt_tokens_by_source([worker_id])


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


async def turn(client: httpx.AsyncClient, session: str, messages: list[dict], *, policy: str = "",
               disable_pull: bool = False) -> dict:
    resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json={
        "messages": messages, "max_tokens": 16, "temperature": 0, "disable_pull": disable_pull,
        **({"policy": policy} if policy else {})})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-KV-Decision"] == resp.json()["kvshuttle"]["decision"]
    return resp.json()


async def test_a_turn_continued_on_d_is_served_from_its_cache_and_answers_like_a_recompute(stack):
    (p,) = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
    (d,) = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_DECODE]
    session, twin = new_session("local"), new_session("local-twin")
    # A system prompt of its own: D's prefix cache must hold no more of this conversation than the session left
    # there (other tests on the shared stack send the same turns).
    messages = [{"role": "system", "content": f"You are a careful coding agent ({session})."}, user_turn(0)]
    twin_messages = list(messages)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        first = await turn(client, session, messages)
        assert first["kvshuttle"]["decision"] == "recompute" and first["kvshuttle"]["decode_worker"] == d
        twin_first = await turn(client, twin, twin_messages, disable_pull=True)
        assert twin_first["choices"][0]["message"] == first["choices"][0]["message"]

        # Turn 2, continued on D.
        messages += [first["choices"][0]["message"], user_turn(1)]
        p_before, d_before = counters(stack, p), counters(stack, d)
        second = await turn(client, session, messages, policy=ON_D)
        p_after, d_after = counters(stack, p), counters(stack, d)
        kv, prompt_tokens = second["kvshuttle"], second["usage"]["prompt_tokens"]
        assert kv["decision"] == "local" and kv["reason_code"] == "local_always", kv
        assert kv["decode_worker"] == d and kv["prefill_worker"] == "" and kv["pulled_tokens"] == 0
        assert kv["predicted_local_ms"] > 0 and kv["record"] == "recorded"
        # D's own counters: the history came from its prefix cache (the blocks it held for the session), the rest
        # was computed there; nothing came over NIXL.
        on_d = delta(d_after, d_before)
        history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        assert on_d.get("external_kv_transfer", 0) == 0, on_d
        assert history - 128 < on_d.get("local_cache_hit", 0) <= history, on_d
        assert on_d.get("local_compute", 0) == prompt_tokens - on_d["local_cache_hit"] == kv["computed_tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == on_d["local_cache_hit"]
        # P served no part of the turn: at most the one-block read that frees the session's previous handle on D
        # afterwards (in the background, when it is done by now), never the history.
        on_p = delta(p_after, p_before)
        assert on_p.get("external_kv_transfer", 0) <= 128 and on_p.get("local_compute", 0) <= 1, on_p

        twin_messages += [twin_first["choices"][0]["message"], user_turn(1)]
        twin_second = await turn(client, twin, twin_messages, disable_pull=True)
        assert twin_second["kvshuttle"]["decision"] == "recompute"
        assert second["choices"][0]["message"] == twin_second["choices"][0]["message"]
        assert tokens(second["usage"]) == tokens(twin_second["usage"])

        # Turn 3 pulls what the local turn left on D (its handle was recorded like any other), turn 4 continues on
        # D again, and both still answer like the recompute.
        for n, policy, decision in ((2, "", "pull"), (3, ON_D, "local")):
            messages += [second["choices"][0]["message"], user_turn(n)]
            twin_messages += [twin_second["choices"][0]["message"], user_turn(n)]
            d_before = counters(stack, d)
            second = await turn(client, session, messages, policy=policy)
            on_d = delta(counters(stack, d), d_before)
            twin_second = await turn(client, twin, twin_messages, disable_pull=True)
            assert second["kvshuttle"]["decision"] == decision, second["kvshuttle"]
            assert second["choices"][0]["message"] == twin_second["choices"][0]["message"]
            prompt_tokens = second["usage"]["prompt_tokens"]
            if decision == "pull":
                assert second["kvshuttle"]["pulled_tokens"] > 0
                # What D reads back from P on a pull turn (vLLM 0.32): the whole prompt's KV less what D's own prefix
                # cache holds (here the history it kept for the session), which a turn continued on D never moves.
                print(f"pull turn: prompt {prompt_tokens}, pulled to P {second['kvshuttle']['pulled_tokens']}, "
                      f"D's counters {on_d}")
                d_prompt = sum(on_d.values())  # the prompt, and P's first token when P sampled it
                assert prompt_tokens <= d_prompt <= prompt_tokens + 1, on_d
                assert on_d.get("external_kv_transfer", 0) > 0
            else:
                print(f"local turn: prompt {prompt_tokens}, D's counters {on_d}")
                assert on_d.get("external_kv_transfer", 0) == 0


async def stream_text(client: httpx.AsyncClient, session: str, messages: list[dict], started: asyncio.Event,
                      max_tokens: int) -> tuple[str, str]:
    """A streamed chat's text and finish reason; ``started`` is set at its first content chunk."""
    text, finish = "", ""
    async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": session}, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                if text:
                    started.set()
    return text, finish


async def d_running(stack, worker_id: str) -> int:
    """The requests the scheduler's load view has running on ``worker_id`` (GetStats)."""
    async with stack.channel(stack.scheduler_address) as channel:
        stats = await scheduler_pb2_grpc.TransferSchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                                  timeout=5)
    return max((row.running for row in stats.loads if row.worker_id == worker_id), default=0)


async def test_a_stream_d_is_decoding_completes_intact_through_a_local_turn(stack):
    (d,) = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_DECODE]
    other = [{"role": "system", "content": "You write long answers."}, user_turn(5)]
    session = new_session("local-busy")
    messages = [{"role": "system", "content": "You are a careful coding agent."}, user_turn(0)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        alone, alone_finish = await stream_text(client, new_session("alone"), other, asyncio.Event(), 160)
        first = await turn(client, session, messages)
        messages += [first["choices"][0]["message"], user_turn(1)]
        started = asyncio.Event()
        streaming = asyncio.create_task(stream_text(client, new_session("busy"), other, started, 160))
        await asyncio.wait_for(started.wait(), 120)
        seen = 0
        for _ in range(40):  # the scheduler reads D's load from its feed every 0.5 s
            seen = await d_running(stack, d)
            if seen or streaming.done():
                break
            await asyncio.sleep(0.1)
        local = await turn(client, session, messages, policy=ON_D)
        text, finish = await streaming
    assert local["kvshuttle"]["decision"] == "local", local["kvshuttle"]
    if seen:  # D's stream was in the scheduler's view when it planned: the plan priced the turn with it
        assert local["kvshuttle"]["decode_streams"] >= 1, local["kvshuttle"]
    else:
        print("the scheduler never saw D's stream running before it ended; decode_streams not checked")
    assert (text, finish) == (alone, alone_finish) and finish == "length" and text


async def test_the_openai_sdk_without_a_session_id_continues_its_later_turns_on_d(stack):
    """As the OpenAI SDK's docs show it: no session id, the answer echoed as the standard format carries it,
    streamed, the policy chosen with the SDK's extra_body. Each later turn is found by its content and continued on
    the decode worker that holds it, served from D's prefix cache."""
    (d,) = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_DECODE]
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=300)
    model = (await client.models.list()).data[0].id
    messages = [{"role": "system", "content": "You are a patient agent that calls tools."}, user_turn(7)]
    history = 0  # the previous turn's prompt and answer: what D holds for the session
    for n in range(3):
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"policy": ON_D})
        pieces, usage = [], None
        async for chunk in raw.parse():
            pieces += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        answer = "".join(pieces)
        assert answer and usage.completion_tokens == 12
        decision = raw.headers["x-kv-decision"]
        if n == 0:
            assert decision == "recompute", raw.headers
        else:
            assert decision == "local", (raw.headers["x-kv-reason"], raw.headers.get("x-kv-reason-code"))
            assert raw.headers["x-kv-decode-worker"] == d
            assert usage.prompt_tokens_details.cached_tokens >= history - 128, usage
        history = usage.prompt_tokens + usage.completion_tokens
        messages += [{"role": "assistant", "content": answer}, user_turn(8 + n)]
