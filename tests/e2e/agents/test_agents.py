"""Agents through the real stack (issue #16): the agent test model (trained offline to reason and call tools,
kvshuttle.workers.agent_script) on real vLLM prefill and decode workers, driven by the official openai client as an
agent loop drives it: tools → parsed tool_calls → tool results → next turn. Every later turn pulls the whole
recorded history, and every answer is the one the model gives on a single worker (the script the model builder
checks with transformers' greedy decoding).

The agent stack of this folder (conftest.agent_stack: ``--tool-call-parser hermes --reasoning-parser qwen3``, API
keys), which test_clients and test_forced_calls share.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from kvshuttle.workers import agent_script as script
from openai import AsyncOpenAI

from tests.support.agent_stack import RUN_KEYS
from tests.support.e2e import new_session
from tests.support.waits import until

pytestmark = pytest.mark.e2e
MAX_TOKENS = 96


# Each run of a conversation that must find its own sessions (no session id) takes a tenant of its own
# (tests/support/agent_stack.py RUN_KEYS), since these tests replay one script several times and a later turn would otherwise continue
# another run's session of the same history (a fork: docs/agents.md); "unused" is the tenant "agents".
_free_keys = iter(RUN_KEYS)


def own_tenant() -> str:
    """The API key of a tenant no other test uses."""
    return next(_free_keys)


def openai_client(stack, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, timeout=300)


async def _turn(client: AsyncOpenAI, messages: list[dict], session: str | None, stream: bool) -> dict[str, Any]:
    """One agent turn (``session`` None: no session id, as SDK clients send it); returns the assistant message as the
    client echoes it back, the finish reason, the KV decision header and the `kvshuttle` figures."""
    args = dict(model="agent", messages=messages, tools=script.TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                extra_headers={"X-Session-ID": session} if session else None)
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(**args)
        resp = raw.parse()
        message = resp.choices[0].message.model_dump(exclude_none=True)
        return {"message": message, "finish": resp.choices[0].finish_reason, "session": raw.headers["x-session-id"],
                "decision": raw.headers["x-kv-decision"], "kv": resp.model_extra["kvshuttle"],
                "cached": resp.usage.prompt_tokens_details.cached_tokens, "prompt": resp.usage.prompt_tokens}
    raw = await client.chat.completions.with_raw_response.create(**args, stream=True,
                                                                 stream_options={"include_usage": True})
    reasoning, content, calls, finish, kv, usage = "", "", {}, None, None, None
    async for chunk in raw.parse():
        usage = chunk.usage or usage
        kv = (chunk.model_extra or {}).get("kvshuttle", kv)
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                   "function": {"name": tc.function.name, "arguments": ""}})
                call["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish": finish, "decision": raw.headers["x-kv-decision"], "kv": kv,
            "session": raw.headers["x-session-id"],
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("named", [True, False], ids=["session-id", "no-session-id"])
async def test_an_agent_loop_calls_tools_and_every_later_turn_pulls_its_history(agent_stack, stream, named):
    """Without a session id (what SDKs and agent frameworks send), the gateway finds the session by the prompt's
    content: the first turn starts one (``new``), every later turn continues it (``found``) and pulls."""
    client = openai_client(agent_stack, own_tenant())
    session = new_session("agent") if named else None
    messages: list[dict] = [{"role": "system", "content": script.SYSTEM}]
    call_ids, sessions = None, set()
    for step, expected in enumerate(script.TURNS):
        messages += script.inputs(step, call_ids=call_ids)
        turn = await _turn(client, messages, session, stream)
        message = turn["message"]
        calls = message.get("tool_calls", [])
        got = (message.get("reasoning_content", "").strip("\n"), (message.get("content") or "").strip("\n"),
               [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls])
        assert got == (expected.reasoning, expected.content or "", [(n, a) for n, a in expected.tool_calls]), step
        assert turn["finish"] == ("tool_calls" if expected.tool_calls else "stop"), step
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
        kv = turn["kv"]
        sessions.add(turn["session"])
        assert kv["session_source"] == ("client" if named else "found" if step else "new"), (step, kv)
        if step:
            # The echoed history re-renders to exactly what was generated: the prompt extends every recorded
            # token, and the turn pulls them.
            assert turn["decision"] == "pull", (step, kv["reason"])
            assert kv["matched_tokens"] == kv["covered_tokens"] > 0 and kv["pulled_tokens"] > 0, (step, kv)
            assert turn["cached"] >= kv["pulled_tokens"], (step, turn)
        messages.append(message)
        call_ids = [c["id"] for c in calls]
    assert sessions == ({session} if named else sessions) and len(sessions) == 1, sessions
    if not named:
        assert next(iter(sessions)).startswith("auto-")


async def test_without_tools_the_agent_model_only_reasons(agent_stack):
    client = openai_client(agent_stack)
    plain = script.PLAIN_TURNS[0]
    resp = await client.chat.completions.create(model="agent", messages=script.messages_after(0, script.PLAIN),
                                                max_tokens=MAX_TOKENS, temperature=0)
    message = resp.choices[0].message
    assert message.model_extra["reasoning_content"].strip("\n") == plain.reasoning
    assert message.content.strip("\n") == plain.content and not message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


ENUM_TOOL = {"type": "function", "function": {"name": "pick_city", "description": "Pick a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


async def test_forced_tool_calls_and_json_answers_hold_from_the_first_token(agent_stack):
    """Guided decoding runs on D, which then samples the answer's first token too (a grammar that started at the
    second token would be the wrong grammar): forcing what the model would do anyway changes nothing, on a pulled
    turn too, and forcing what it would not do gives a valid call or a valid JSON answer."""
    from jsonschema import validate

    client = openai_client(agent_stack)
    session = new_session("forced")
    headers = {"X-Session-ID": session}
    messages = script.messages_after(2)
    for step in (0, 1):  # the conversation up to step 2, recorded in this session
        await client.chat.completions.create(model="agent", messages=script.messages_after(step), tools=script.TOOLS,
                                             max_tokens=MAX_TOKENS, temperature=0, extra_headers=headers)
    raw = await client.chat.completions.with_raw_response.create(
        model="agent", messages=messages, tools=script.TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=0, extra_headers=headers)
    forced = raw.parse().choices[0]
    assert raw.headers["x-kv-decision"] == "pull", raw.headers["x-kv-reason"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls] == [
        (n, a) for n, a in script.TURNS[2].tool_calls]
    assert forced.message.model_extra["reasoning_content"].strip("\n") == script.TURNS[2].reasoning

    named = (await client.chat.completions.create(
        model="agent", messages=script.messages_after(0), tools=script.TOOLS, max_tokens=MAX_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in named.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]

    # The model would greet; forced, it calls the tool, with arguments its schema allows.
    plain = script.messages_after(0, script.PLAIN)
    made = (await client.chat.completions.create(model="agent", messages=plain, tools=[ENUM_TOOL],
                                                 tool_choice="required", max_tokens=MAX_TOKENS,
                                                 temperature=0)).choices[0]
    assert made.finish_reason == "tool_calls", made
    for call in made.message.tool_calls:
        assert call.function.name == "pick_city"
        validate(json.loads(call.function.arguments), ENUM_TOOL["function"]["parameters"])

    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 8}},
              "required": ["greeting"], "additionalProperties": False}
    answer = (await client.chat.completions.create(
        model="agent", messages=plain, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "greeting", "schema": schema}})).choices[0]
    validate(json.loads(answer.message.content), schema)
    assert answer.finish_reason == "stop"


def _response_input(messages: list[dict], call_ids: list[str]) -> list[dict]:
    """A step's new chat messages as Responses API input items (tool results answer the previous calls by id)."""
    items, results = [], iter(call_ids)
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": next(results), "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_responses_api_holds_the_conversation_and_every_later_turn_pulls(agent_stack, stream):
    """`previous_response_id` only: the server holds the conversation (items and the session with its exact ids);
    the client sends just the new input each turn."""
    client = openai_client(agent_stack)
    previous, call_ids = None, []
    for step, expected in enumerate(script.TURNS):
        args = dict(model="agent", input=_response_input(script.inputs(step), call_ids), tools=[
            {"type": "function", **script.WEATHER_TOOL["function"]}], max_output_tokens=MAX_TOKENS, temperature=0,
            instructions=script.SYSTEM, previous_response_id=previous)  # instructions are per request (OpenAI's rule)
        if stream:
            async with client.responses.stream(**{k: v for k, v in args.items() if v is not None}) as events:
                async for _ in events:
                    pass
                resp = await events.get_final_response()
        else:
            resp = await client.responses.create(**{k: v for k, v in args.items() if v is not None})
        kv = resp.model_extra["kvshuttle"]
        reasoning = "".join(i.content[0].text for i in resp.output if i.type == "reasoning")
        calls = [i for i in resp.output if i.type == "function_call"]
        assert reasoning.strip("\n") == expected.reasoning, step
        assert resp.output_text.strip("\n") == (expected.content or ""), step
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in expected.tool_calls], step
        assert kv["session_source"] == ("response" if step else "new"), (step, kv)
        if step:
            assert kv["decision"] == "pull" and kv["matched_tokens"] == kv["covered_tokens"] > 0, (step, kv)
            assert resp.usage.input_tokens_details.cached_tokens >= kv["pulled_tokens"] > 0
        previous, call_ids = resp.id, [c.call_id for c in calls]
    stored = await client.responses.retrieve(previous)
    assert stored.id == previous and stored.output_text == resp.output_text
    await client.responses.delete(previous)


def _anthropic_input(messages: list[dict], tool_use_ids: list[str]) -> list[dict]:
    """A step's new chat messages as Anthropic user content: tool results (answering the previous tool_use ids), or
    text."""
    results, content = iter(tool_use_ids), []
    for m in messages:
        if m["role"] == "tool":
            content.append({"type": "tool_result", "tool_use_id": next(results), "content": m["content"]})
        else:
            content.append({"type": "text", "text": m["content"]})
    return content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_anthropic_client_runs_the_agent_loop_and_every_later_turn_pulls(agent_stack, stream):
    """The Messages API as Claude-Code-style agents speak it: thinking and tool_use blocks echoed back, tool_result
    blocks, no session id."""
    from anthropic import AsyncAnthropic

    client = AsyncAnthropic(base_url=agent_stack.base_url, api_key=own_tenant(), timeout=300)
    tool = {"name": "get_weather", "description": script.WEATHER_TOOL["function"]["description"],
            "input_schema": script.WEATHER_TOOL["function"]["parameters"]}
    messages: list[dict] = []
    tool_use_ids: list[str] = []
    for step, expected in enumerate(script.TURNS):
        messages.append({"role": "user", "content": _anthropic_input(script.inputs(step), tool_use_ids)})
        args = dict(model="agent", system=script.SYSTEM, messages=messages, tools=[tool], max_tokens=MAX_TOKENS,
                    extra_body={"temperature": 0})
        if stream:
            async with client.messages.stream(**args) as events:
                async for event in events:  # the kvshuttle object comes with message_delta
                    if event.type == "message_delta":
                        kv = (event.model_extra or {})["kvshuttle"]
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**args)
            kv = message.model_extra["kvshuttle"]
        thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
        text = "".join(b.text for b in message.content if b.type == "text")
        uses = [b for b in message.content if b.type == "tool_use"]
        assert thinking.strip("\n") == expected.reasoning, step
        assert text.strip("\n") == (expected.content or ""), step
        assert [(u.name, u.input) for u in uses] == [(n, a) for n, a in expected.tool_calls], step
        assert message.stop_reason == ("tool_use" if expected.tool_calls else "end_turn"), step
        assert kv["session_source"] == ("found" if step else "new"), (step, kv)
        if step:
            assert kv["decision"] == "pull" and kv["matched_tokens"] == kv["covered_tokens"] > 0, (step, kv)
            assert message.usage.cache_read_input_tokens >= kv["pulled_tokens"] > 0
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        tool_use_ids = [u.id for u in uses]


@pytest.fixture(scope="module")
async def vllm_reference(agent_model_dir, tmp_path_factory):
    """vLLM's own OpenAI server on the same model (one colocated engine, fp32), with the same parsers: the reference
    the gateway's API must match."""
    import sys

    from kvshuttle.services.common.processes import ChildProcess
    from kvshuttle.services.devtools.etcd_process import free_port

    work, port = tmp_path_factory.mktemp("vllm-reference"), free_port()
    child = ChildProcess("vllm-reference", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(agent_model_dir),
        "--served-model-name", "agent", "--dtype", "float32", "--max-model-len", "2048", "--port", str(port),
        "--host", "127.0.0.1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--enforce-eager"], work / "vllm.log", env={
        "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(work / "cache"), "KVSHUTTLE_VLLM_DIE_WITH_PARENT": "1"}, stop_grace_s=10)
    await child.start()
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as http:
            async def ready() -> bool:
                assert child.returncode is None, child.log_tail(40)
                try:
                    return (await http.get("/health")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(ready, 300, "vLLM's OpenAI server to start", interval_s=1.0)
        yield base
    finally:
        await child.stop()


async def test_the_same_requests_give_what_vllms_own_server_gives(agent_stack, vllm_reference):
    """Each step of the agent conversation (a fresh session each, so the gateway tokenizes the whole prompt as vLLM
    does) and a JSON answer: the same prompt token ids, tool calls, reasoning split, content and finish reason as
    vLLM's OpenAI server with the same parsers."""
    ours, theirs = openai_client(agent_stack), AsyncOpenAI(base_url=f"{vllm_reference}/v1", api_key="unused",
                                                           timeout=300)
    requests = [dict(messages=script.messages_after(step), tools=script.TOOLS) for step in range(len(script.TURNS))]
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 8}},
              "required": ["greeting"], "additionalProperties": False}
    # A JSON answer with thinking turned off in the prompt: both apply the same grammar from the first token. (With
    # thinking on, kvshuttle lets the model reason before the JSON and vLLM does not: docs/agents.md.)
    requests.append(dict(messages=script.messages_after(0, script.PLAIN), extra_body={
        "chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "greeting", "schema": schema}}))
    for i, request in enumerate(requests):
        extra = {**request.pop("extra_body", {}), "return_token_ids": True}
        args = dict(model="agent", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra, **request)
        mine = await ours.chat.completions.create(**args, extra_headers={"X-Session-ID": new_session("ref")})
        ref = await theirs.chat.completions.create(**args)
        assert mine.model_extra["prompt_token_ids"] == ref.model_extra["prompt_token_ids"], i
        m, r = mine.choices[0].message, ref.choices[0].message
        assert (m.model_extra.get("reasoning") or None) == (r.model_extra.get("reasoning") or None), i
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []] == [
            (c.function.name, json.loads(c.function.arguments)) for c in r.tool_calls or []], i
        assert m.content == r.content, (i, m.content, r.content)
        assert mine.choices[0].finish_reason == ref.choices[0].finish_reason, i
