"""The core promise, end to end on real vLLM: turns 2+ pull the history's KV from the decode worker, and the
answers are exactly what a full recompute gives (fp32, greedy)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.e2e import chat, flush_prefill, new_session, prompt_token_sources, tokens, user_turn

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
        assert tokens(with_pull["usage"]) == tokens(without["usage"])
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
    assert tokens(body["usage"]) == tokens(reference["usage"])


async def _two_turns(client, session: str, system: str) -> tuple[list[dict], dict]:
    """A first turn, then its answer and a second user turn appended: what the session's D holds covers turn 1."""
    messages = [{"role": "system", "content": system}, user_turn(0)]
    first = (await chat(client, session, messages)).json()
    return messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}], first


@pytest.mark.parametrize("change", ["system prompt changed", "reasoning stripped", "history truncated"])
async def test_a_diverging_history_never_pulls_past_the_first_differing_block(stack, change):
    session = new_session("diverge")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        system = "You are a careful coding agent. <think>Plan the steps before answering.</think>"
        history, first = await _two_turns(client, session, system)
        if change == "system prompt changed":  # the very first tokens differ: nothing is reusable
            prompt = [{"role": "system", "content": "You are a terse agent."}, *history[1:], user_turn(1)]
        elif change == "reasoning stripped":  # the client drops the reasoning text from the system prompt
            prompt = [{"role": "system", "content": system.split(" <think>")[0]}, *history[1:], user_turn(1)]
        else:  # the client sends a shorter history: the first user turn cut in half, no answer
            cut = dict(history[1], content=history[1]["content"][: len(history[1]["content"]) // 2])
            prompt = [history[0], cut]
        await flush_prefill(stack)
        before = prompt_token_sources(stack)
        body = (await chat(client, session, prompt)).json()
        delta = {k: v - before.get(k, 0) for k, v in prompt_token_sources(stack).items()}
        reference = (await chat(client, new_session("diverge-ref"), prompt, disable_pull=True)).json()

    kv = body["kvshuttle"]
    # Whatever was pulled is whole 128-token blocks of tokens that provably match, and nothing past them.
    assert kv["pulled_tokens"] <= kv["matched_tokens"] and kv["pulled_tokens"] % 128 == 0, kv
    assert delta.get("external_kv_transfer", 0) == kv["pulled_tokens"], delta
    if change != "history truncated":
        assert kv["matched_tokens"] < 128, kv  # the system prompt is in the first block
    assert kv["matched_tokens"] < first["usage"]["prompt_tokens"], kv
    assert body["choices"][0]["message"] == reference["choices"][0]["message"]  # the same answer as a recompute
    assert tokens(body["usage"]) == tokens(reference["usage"])


async def test_two_requests_on_one_session_at_once_pull_exactly_once(stack):
    session, twin = new_session("concurrent"), new_session("concurrent-twin")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        history, _ = await _two_turns(client, session, "You are a careful coding agent.")
        prompt = [*history, user_turn(1)]
        first, second = await asyncio.gather(chat(client, session, prompt), chat(client, session, prompt))
        # The same conversation on a twin session, recomputed: the gateway continues its exact ids the same way
        # (a fresh session would re-tokenize the history: other ids, another answer).
        twin_history, _ = await _two_turns(client, twin, "You are a careful coding agent.")
        assert twin_history == history
        reference = (await chat(client, twin, prompt, disable_pull=True)).json()
    decisions = sorted(r.headers["X-KV-Decision"] for r in (first, second))
    assert decisions == ["pull", "recompute"], [r.headers["X-KV-Reason"] for r in (first, second)]
    for resp in (first, second):  # both succeed, with the answer a recompute gives
        assert resp.json()["choices"][0]["message"] == reference["choices"][0]["message"]
        assert tokens(resp.json()["usage"]) == tokens(reference["usage"])


async def test_a_warm_prefill_worker_pulls_only_what_its_cache_lacks_and_the_turn_says_so(stack):
    """P keeps its prefix cache between turns (vLLM's default): the second turn's P holds the first prompt's blocks,
    so the pull loads only the rest of the history (the answer, from D). The turn reports what P loaded over NIXL and
    computed, exactly as P's own counters count them, not what the pull could have covered."""
    session = new_session("warm-pull")
    await flush_prefill(stack)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        history, first = await _two_turns(client, session, "You are a careful coding agent. " * 30)
        before = prompt_token_sources(stack)
        resp = await chat(client, session, [*history, user_turn(1)])
        delta = {k: v - before.get(k, 0) for k, v in prompt_token_sources(stack).items()}
    body = resp.json()
    kv, usage = body["kvshuttle"], body["usage"]
    assert kv["decision"] == "pull", kv["reason"]
    assert kv["prefill_worker"] == first["kvshuttle"]["prefill_worker"], \
        f"the index sends the turn to the prefill worker caching its history: {kv['worker_choice']}"
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert delta.get("local_cache_hit", 0) >= 128, f"P's own cache held the first prompt's blocks: {delta}"
    assert delta.get("external_kv_transfer", 0) == kv["pulled_tokens"] < kv["covered_tokens"], (delta, kv)
    assert delta.get("local_cache_hit", 0) == cached - kv["pulled_tokens"], (delta, cached, kv)
    assert delta.get("local_compute", 0) == kv["computed_tokens"] == usage["prompt_tokens"] - cached, (delta, kv)
    assert int(resp.headers["X-KV-Pulled-Tokens"]) == kv["pulled_tokens"]
