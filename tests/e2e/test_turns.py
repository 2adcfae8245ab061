"""The core promise, end to end on real vLLM: turns 2+ pull the history's KV from the decode worker, and the
answers are exactly what a full recompute gives (fp32, greedy)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import chat, flush_prefill, new_session, prompt_token_sources, user_turn

pytestmark = pytest.mark.e2e


async def run_conversation(stack, session: str, turns: int, disable_pull: bool):
    messages = [{"role": "system", "content": "You are a careful coding agent."}]
    results = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        for n in range(turns):
            messages.append(user_turn(n))
            await flush_prefill(stack)
            before = prompt_token_sources(stack)
            resp = await chat(client, session, messages, disable_pull=disable_pull)
            after = prompt_token_sources(stack)
            body = resp.json()
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
            results.append((resp, body, delta))
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return results


async def test_turns_after_the_first_pull_history_and_answer_like_a_recompute(stack):
    pulled = await run_conversation(stack, new_session("pull"), 3, disable_pull=False)
    recomputed = await run_conversation(stack, new_session("recompute"), 3, disable_pull=True)

    first_resp, first, _ = pulled[0]
    assert first_resp.headers["X-KV-Decision"] == "recompute"
    assert "no recorded KV" in first_resp.headers["X-KV-Reason"]
    for resp, body, delta in pulled[1:]:
        kv = body["kvshuttle"]
        prompt_tokens = body["usage"]["prompt_tokens"]
        assert resp.headers["X-KV-Decision"] == "pull", kv["reason"]
        assert kv["pulled_tokens"] > 128 and kv["pulled_tokens"] == kv["covered_tokens"]
        # P's prefix cache was flushed: everything P did not compute came over NIXL (vLLM's own counters).
        assert delta.get("external_kv_transfer") == kv["pulled_tokens"], delta
        assert delta.get("local_compute") == prompt_tokens - kv["pulled_tokens"], delta
        assert kv["computed_tokens"] == prompt_tokens - kv["pulled_tokens"]
    for resp, body, delta in recomputed:
        assert resp.headers["X-KV-Decision"] == "recompute"
        assert body["kvshuttle"]["pulled_tokens"] == 0
        assert delta.get("external_kv_transfer", 0) == 0 and delta["local_compute"] == body["usage"]["prompt_tokens"]

    for (_, with_pull, _), (_, without, _) in zip(pulled, recomputed, strict=True):
        assert with_pull["usage"] == without["usage"]
        assert with_pull["choices"][0]["message"] == without["choices"][0]["message"]


async def test_edited_history_is_not_pulled_past_the_divergence(stack):
    session = new_session("edit")
    messages = [{"role": "system", "content": "You are a careful coding agent."}, user_turn(0)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        first = (await chat(client, session, messages)).json()
        answer = first["choices"][0]["message"]["content"]
        # Edit the assistant's answer (as clients that strip reasoning do), then continue.
        edited = [*messages, {"role": "assistant", "content": "EDITED " + answer}, user_turn(1)]
        await flush_prefill(stack)
        before = prompt_token_sources(stack)
        resp = await chat(client, session, edited)
        delta = {k: v - before.get(k, 0) for k, v in prompt_token_sources(stack).items()}
        body = resp.json()
        reference = (await chat(client, new_session("edit-ref"), edited, disable_pull=True)).json()

    kv = body["kvshuttle"]
    first_prompt = first["usage"]["prompt_tokens"]
    # The edit sits right after the first turn's prompt: nothing past that prompt's whole blocks may be pulled.
    assert kv["matched_tokens"] <= first_prompt
    assert kv["pulled_tokens"] <= first_prompt and kv["pulled_tokens"] % 128 == 0
    assert delta.get("external_kv_transfer", 0) == kv["pulled_tokens"]
    assert body["choices"][0]["message"] == reference["choices"][0]["message"]
    assert body["usage"] == reference["usage"]
