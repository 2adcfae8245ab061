"""The clients people use, unchanged, on a reasoning model, with no session id (issue #24): every later user turn and
every tool-loop step is found and pulls the longest common prefix of its prompt with what the decode worker holds,
in whole blocks, whatever the client echoes back and whatever the chat template drops.

The agent test model (trained on these clients' own requests: kvshuttle.workers.agent_script, CLIENT_STEPS) on real
vLLM prefill and decode workers (the folder's agent stack: conftest.py), behind three gateways that differ only in the chat template they render with
(agent_script.TEMPLATE_VARIANTS): the agent model's own, which renders an assistant's reasoning whenever the client
echoes it; Qwen3's rule (reasoning only after the last user query); DeepSeek-R1's (never). Each client runs the
client conversation (tests/support/clients.py) through a tap (services/devtools/bench/turn_tap.py) that empties P's prefix
cache before each turn and reads P's own counters after it, so the pulled tokens are vLLM's figures, compared with
the longest common prefix of the prompt's ids and the session's recorded ids.
"""

from __future__ import annotations

import pytest
from kvshuttle.services.devtools.bench.turn_tap import TurnTap, check_pulls
from kvshuttle.workers import agent_script as script

from tests.support.agent_stack import gateways
from tests.support.clients import CLIENTS, run_aiperf, run_client

pytestmark = pytest.mark.e2e
REASONING_PARSER = {"echo": "qwen3", "qwen3": "qwen3", "deepseek_r1": "deepseek_r1"}
ANSWERS = [script.CLIENT_STEPS[i].content for i in (1, 3, 4)]
CALLS = [call for step in script.CLIENT_STEPS for call in step.tool_calls]


@pytest.fixture(scope="module")
async def variant_gateways(agent_stack, tmp_path_factory):
    """One gateway per template variant (hermes calls, the variant's reasoning parser and template; no API keys) on
    the folder's agent stack (conftest): the stack and {variant: base URL}."""
    work = tmp_path_factory.mktemp("client-templates")
    flags = {}
    for variant in script.TEMPLATE_VARIANTS:
        template = work / f"{variant}.jinja"
        template.write_text(script.chat_template(variant))
        flags[variant] = ["--tool-call-parser", "hermes", "--reasoning-parser", REASONING_PARSER[variant],
                          "--chat-template", str(template)]
    async with gateways(agent_stack, flags) as urls:
        yield agent_stack, urls


@pytest.fixture(scope="module")
def held() -> dict[str, list[int]]:
    """Each session's last recorded ids, over the module: a run may continue a session an earlier run left (the
    same history, rendered the same)."""
    return {}


def block_size(stack) -> int:
    return stack.workers[0].block_size


@pytest.mark.parametrize("variant", script.TEMPLATE_VARIANTS)
@pytest.mark.parametrize("client", list(CLIENTS))
async def test_every_later_turn_of_a_client_is_found_and_pulls_what_the_decode_worker_holds(variant_gateways, held, client,
                                                                                            variant):
    stack, urls = variant_gateways
    async with TurnTap(stack, urls[variant]) as tap:
        ran = await run_client(client, tap.base_url)
    # the model answered as trained: the client saw well-formed reasoning, calls and answers
    assert [a.strip() for a in ran.answers] == ANSWERS and ran.calls == list(map(tuple, CALLS)), ran
    assert len(tap.turns) == len(script.CLIENT_STEPS), [t.path for t in tap.turns]
    problems = check_pulls(tap.turns, block_size(stack), held)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("variant", script.TEMPLATE_VARIANTS)
async def test_aiperf_multi_turn_without_a_session_header_finds_and_pulls_every_later_turn(
        variant_gateways, held, variant, agent_model_dir, tmp_path):
    stack, urls = variant_gateways
    async with TurnTap(stack, urls[variant]) as tap:
        report = await run_aiperf(tap.base_url, agent_model_dir, tmp_path)
    turns_per = [len(c) for c in script.AIPERF_CONVERSATIONS]
    assert len(tap.turns) == sum(turns_per)
    assert report["request_count"]["avg"] == sum(turns_per), report.get("request_count")
    firsts = {sum(turns_per[:i]) for i in range(len(turns_per))}
    problems = check_pulls(tap.turns, block_size(stack), held, firsts=firsts)
    assert not problems, "\n".join(problems)
    later = [t for i, t in enumerate(tap.turns) if i not in firsts]
    share = sum(t.pulled for t in later) / sum(len(t.prompt_ids) for t in later)
    print(f"\naiperf on {variant}: {len(later)} later turns, all found; {share:.0%} of their prompt tokens pulled")


async def test_forks_of_one_history_find_the_same_session_and_only_one_pulls_its_kv(variant_gateways):
    """Two requests that both continue one record at its boundary (the reasoning dropped), at once: both are
    found in that session, one claims the KV handle and pulls, the other recomputes; both answer alike."""
    import asyncio

    import httpx

    stack, urls = variant_gateways
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": script.CLIENT_TOOL_DESCRIPTION,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    async with httpx.AsyncClient(base_url=urls["deepseek_r1"], timeout=300) as http:
        async def chat(messages):
            resp = await http.post("/v1/chat/completions", json={
                "model": "agent", "messages": messages, "tools": tools, "temperature": 0,
                "max_tokens": script.CLIENT_MAX_TOKENS, "user": "fork-test"})
            assert resp.status_code == 200, resp.text
            return resp

        messages = [{"role": "system", "content": script.CLIENT_SYSTEM},
                    {"role": "user", "content": script.CLIENT_QUESTIONS[0]}]
        first = await chat(messages)
        message = first.json()["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]})
        messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"})
        await stack.flush_prefill()
        before = await asyncio.to_thread(stack.prefill_prompt_tokens_by_source)
        forks = await asyncio.gather(chat(messages), chat(messages))
        after = await asyncio.to_thread(stack.prefill_prompt_tokens_by_source)
    assert {f.headers["x-session-id"] for f in forks} == {first.headers["x-session-id"]}
    assert [f.headers["x-session-source"] for f in forks] == ["found", "found"]
    decisions = sorted((f.headers["x-kv-decision"], f.headers["x-kv-reason-code"]) for f in forks)
    assert decisions[0][0] == "pull" and decisions[1] in (("recompute", "claim_refused"),
                                                          ("recompute", "handle_used")), decisions
    pulled = sum(int(f.headers["x-kv-pulled-tokens"]) for f in forks)
    assert pulled >= block_size(stack) and after.get("external_kv_transfer", 0) - before.get(
        "external_kv_transfer", 0) == pulled
    assert forks[0].json()["choices"][0]["message"] == forks[1].json()["choices"][0]["message"]
