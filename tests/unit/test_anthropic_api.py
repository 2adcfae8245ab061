"""Anthropic's Messages API on the gateway (/v1/messages, /v1/messages/count_tokens), read by the official `anthropic`
SDK: the chat template gets what the chat route gives it for the same conversation, answers come back as thinking /
text / tool_use blocks (streamed events build the same message), and every bad input is a 4xx in Anthropic's error
shape naming the problem. The turn itself is a stand-in (tests/support/answering.py)."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx
import httpx2
import pytest
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.turns import TurnError

from tests.support.answering import AnsweringRunner, JsonTokenizer
from tests.support.auth import open_guard

MODEL = "agent"
TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                "parameters": TOOL["input_schema"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nParis, then.\n</think>\n\n"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def app_for(runner, **parsers):
    parsers = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", **parsers}
    app = create_app(runner, MODEL, 16, **parsers)
    add_anthropic_routes(app)
    return app


def http(runner, **parsers) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app_for(runner, **parsers))), base_url="http://gw")


def sdk(runner, **parsers) -> anthropic.AsyncAnthropic:
    """The official SDK over the app (it speaks httpx2, a fork of httpx with the same ASGI transport)."""
    app = app_for(runner, **parsers)
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", max_retries=0, http_client=client)


def _without_ids(message: anthropic.types.Message) -> dict:
    out = message.model_dump(exclude_none=True)
    out.pop("kvshuttle", None)  # the whole answer's; a stream sends it in message_delta
    for block in out["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return out


async def test_a_tool_use_round_trip_gives_the_template_what_the_chat_route_gives_it():
    runner = AnsweringRunner(THOUGHT + CALL)
    async with sdk(runner) as api:
        first = await api.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=ASK, tools=[TOOL])
        assert first.stop_reason == "tool_use" and first.stop_sequence is None
        assert [b.type for b in first.content] == ["thinking", "tool_use"]  # the "\n\n" before the call: no block
        thinking, call = first.content
        assert (thinking.thinking, thinking.signature) == ("\nParis, then.\n", "")
        assert call.id.startswith("toolu_") and (call.name, call.input) == ("get_weather", {"city": "Paris"})
        history = [*ASK, {"role": "assistant", "content": first.content},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature_c": 21}'},
                       {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}]
        await api.messages.create(model=MODEL, max_tokens=64, system=[{"type": "text", "text": "Be brief."}],
                                  messages=history, tools=[TOOL])
    async with http(runner) as client:
        chat_history = [{"role": "system", "content": "Be brief."}, *ASK,
                        {"role": "assistant", "content": None, "reasoning_content": "\nParis, then.\n",
                         "tool_calls": [{"id": call.id, "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
                        {"role": "user", "content": "And tomorrow?"}]
        resp = await client.post("/v1/chat/completions", json={"messages": chat_history, "tools": [OPENAI_TOOL],
                                                                "max_tokens": 64})
        assert resp.status_code == 200, resp.text
    anthropic_req, chat_req = runner.requests[1], runner.requests[2]
    assert anthropic_req.messages == chat_req.messages
    assert anthropic_req.template_vars == chat_req.template_vars == {"tools": [
        {"type": "function", "function": {**OPENAI_TOOL["function"]}}]}
    assert not anthropic_req.skip_special_tokens  # call tags must survive detokenizing, as on the chat route
    assert (anthropic_req.max_tokens, anthropic_req.constraint) == (64, None)


@pytest.mark.parametrize("pieces", [1, 2, 5, 1000])
async def test_a_stream_builds_the_message_a_whole_answer_gives(pieces):
    answer = THOUGHT + "Checking both.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    async with sdk(AnsweringRunner(answer, pieces)) as api:
        whole = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL])
        async with api.messages.stream(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL]) as stream:
            streamed = await stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole.content[1].text == "\n\nChecking both.\n" and whole.content[3].input == {"city": "Oslo"}
    assert _without_ids(streamed) == _without_ids(whole)
    assert whole.usage.cache_read_input_tokens == 30 and whole.usage.input_tokens == 10  # 40 prompt, 10 computed


async def test_the_stream_events_come_in_anthropics_order():
    async with http(AnsweringRunner(THOUGHT + "Sure.\n" + CALL, 2)) as client:
        resp = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": ASK,
                                                       "tools": [TOOL], "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-kv-decision"] == "pull"
    events = []
    for chunk in resp.text.strip().split("\n\n"):
        kind, data = chunk.split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(payload["type"] == kind for kind, payload in events)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] == 10
    opened: list[int] = []
    for kind, payload in events[1:-2]:  # each block: start, deltas, stop, before the next one starts
        if kind == "content_block_start":
            assert payload["index"] == len(opened)
            opened.append(payload["index"])
        else:
            assert payload["index"] == opened[-1]
    starts = [p["content_block"]["type"] for k, p in events if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 30,
                              "cache_creation_input_tokens": 0}
    assert delta["kvshuttle"]["decision"] == "pull"


async def test_stop_reasons():
    async with sdk(AnsweringRunner("Hello there END")) as api:
        stopped = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["D", "END"])
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
        ended = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["STOP"])
        assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)
        assert ended.content[0].text == "Hello there END"
    runner = AnsweringRunner("Hello th", finish="length")
    async with sdk(runner) as api:
        cut = await api.messages.create(model=MODEL, max_tokens=3, messages=ASK,  # sampling: not typed by this SDK
                                        extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 5})
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 7
        async with api.messages.stream(model=MODEL, max_tokens=3, messages=ASK) as stream:
            assert (await stream.get_final_message()).stop_reason == "max_tokens"
    req = runner.requests[0]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (3, 0.2, 0.9, 5)


async def test_usage_counts_the_reused_prompt_as_cache_reads_and_the_kv_is_reported():
    runner = AnsweringRunner("Hi.")
    async with http(runner) as client:
        resp = await client.post("/v1/messages", headers={"X-Session-ID": "s1"}, json={
            "model": MODEL, "max_tokens": 8, "messages": ASK, "metadata": {"user_id": "u"},
            "service_tier": "auto", "cache_control": {"type": "ephemeral", "ttl": "1h"}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"] == {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 30,
                             "cache_creation_input_tokens": 0}
    assert body["id"] == "msg_kvs-test" and body["content"] == [{"type": "text", "text": "Hi."}]
    assert body["kvshuttle"]["pulled_tokens"] == 30 and resp.headers["x-kv-pulled-tokens"] == "30"
    assert resp.headers["x-session-id"] == runner.requests[0].session_id == "s1"


async def test_count_tokens_renders_the_prompt_the_turn_would_get():
    runner = AnsweringRunner("unused")
    async with sdk(runner) as api:
        counted = await api.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=[TOOL],
                                                  thinking={"type": "enabled", "budget_tokens": 2048})
    expected = JsonTokenizer().render_chat([{"role": "system", "content": "Be brief."}, *ASK], True,
                                           tools=[OPENAI_TOOL], enable_thinking=True)
    assert counted.input_tokens == len(expected) and runner.requests == []


async def test_thinking_and_tool_choice_become_template_variables_and_constraints():
    answer = THOUGHT + CALL + "\n" + CALL.replace("Paris", "Oslo")
    runner = AnsweringRunner(answer)
    async with sdk(runner) as api:
        one = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL],
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                        thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in one.content] == ["thinking", "tool_use"]
        named = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL],
                                          tool_choice={"type": "tool", "name": "get_weather"},
                                          thinking={"type": "disabled"})
        assert named.stop_reason == "tool_use"
        unparsed = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL],
                                             tool_choice={"type": "none"})
        assert unparsed.stop_reason == "end_turn" and unparsed.content[1].text == "\n\n" + answer[len(THOUGHT):]
    forced, named_req, none = runner.requests
    assert forced.template_vars["enable_thinking"] is True and named_req.template_vars["enable_thinking"] is False
    assert "enable_thinking" not in none.template_vars and none.template_vars["tools"]
    assert forced.constraint.kind == "structural_tag"
    # disable_parallel_tool_use: the grammar forces exactly one call (the record holds no call the client never sees)
    assert json.loads(forced.constraint.value)["format"]["stop_after_first"]
    assert json.loads(named_req.constraint.value)["format"]["stop_after_first"]
    assert forced.reasoning_tags == ("<think>", "</think>")  # placed after the prompt's reasoning by the runner
    assert none.constraint is None and none.skip_special_tokens


async def test_without_parsers_the_answer_is_text_and_tools_are_refused_unless_not_called():
    answer = THOUGHT + CALL
    runner = AnsweringRunner(answer)
    async with sdk(runner, tool_call_parser="", reasoning_parser="") as api:
        plain = await api.messages.create(model=MODEL, max_tokens=64, messages=ASK)
        assert [b.model_dump(exclude_none=True) for b in plain.content] == [{"type": "text", "text": answer}]
        with pytest.raises(anthropic.BadRequestError) as refused:
            await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL])
        assert "--tool-call-parser" in refused.value.body["error"]["message"]
        await api.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[TOOL], tool_choice={"type": "none"})


def _called(call_id: str = "toolu_1") -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "get_weather",
                                              "input": {"city": "Paris"}}]}


def _result(call_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "21C"}]}


BASE = {"model": MODEL, "max_tokens": 16, "messages": ASK}


async def test_a_failed_tool_result_reaches_the_template_with_its_flag():
    runner = AnsweringRunner("ok")
    failed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
                                           "is_error": True}]}
    async with sdk(runner) as api:
        await api.messages.create(model=MODEL, max_tokens=8, messages=[*ASK, _called(), failed], tools=[TOOL])
    assert runner.requests[0].messages[-1] == {"role": "tool", "content": "timeout", "tool_call_id": "toolu_1",
                                               "is_error": True}
BAD = [
    ({**BASE, "frequency_penalty": 1}, 400, "invalid_request_error", "unsupported field(s): frequency_penalty"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": "red"}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.text: unsupported field(s): colour"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "messages.0.content.0: image blocks are not supported"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     400, "invalid_request_error", "document blocks are not supported"),
    ({**BASE, "messages": [*ASK, _called(), _result("toolu_9")], "tools": [TOOL]}, 400, "invalid_request_error",
     "messages.2.content.0.tool_use_id: tool_use_id 'toolu_9' answers no tool_use block"),
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, 400,
     "invalid_request_error", "tools.0: server tool 'web_search_20250305' is not supported"),
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({**BASE, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({**BASE, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice: tool_choice names 'nope', which is not among the tools (get_weather)"),
    ({**BASE, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice 'any' needs tools"),
    ({**BASE, "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({**BASE, "tools": [{**TOOL, "input_schema": {"type": "string"}}]}, 400, "invalid_request_error",
     "tools.0.input_schema: tool 'get_weather': parameters must be a JSON Schema of type 'object'"),
    ({**BASE, "tools": [TOOL, TOOL]}, 400, "invalid_request_error", "tools.1.name: two tools are named"),
    ({**BASE, "messages": [*ASK, {"role": "assistant", "content": "The answer is"}]}, 400, "invalid_request_error",
     "messages.1: a final assistant message (prefill) is not supported"),
    ({**BASE, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "messages.0.role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "messages.0.content.0: tool_use blocks belong in assistant messages"),
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, 400,
     "invalid_request_error", "thinking.enabled.display"),
    ({**BASE, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({**BASE, "system": [{"text": "", "type": {}}]}, 400, "invalid_request_error", "system"),  # found by fuzzing
    ({**BASE, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "thinking.budget_tokens: thinking.budget_tokens 1024 cannot be enforced"),
    ({**BASE, "model": "claude-opus-4"}, 404, "not_found_error", "model 'claude-opus-4' does not exist"),
]


@pytest.mark.parametrize("body, status, kind, says", BAD)
async def test_a_bad_request_is_an_anthropic_error_naming_the_problem(body, status, kind, says):
    runner = AnsweringRunner("ok")
    async with http(runner) as client:
        resp = await client.post("/v1/messages", json=body)
    assert resp.status_code == status and runner.requests == [], resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


async def test_a_body_that_is_not_json_and_bad_count_tokens_bodies_are_anthropic_errors():
    async with http(AnsweringRunner("ok")) as client:
        resp = await client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
        resp = await client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK, "max_tokens": 5})
        assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"]
        resp = await client.post("/v1/messages/count_tokens", json={"model": "other", "messages": ASK})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


async def test_the_sdk_reads_the_errors():
    async with sdk(AnsweringRunner("ok")) as api:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await api.messages.create(model=MODEL, max_tokens=8, messages=[*ASK, _called(), _result("toolu_9")],
                                      tools=[TOOL])
        assert bad.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError):
            await api.messages.create(model="claude-opus-4", max_tokens=8, messages=ASK)


async def test_a_failed_turn_is_an_error_response_or_an_error_event():
    class Failing(AnsweringRunner):
        async def prepare(self, req):
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "no worker", retry_after_s=2)

    async with http(Failing("x")) as client:
        resp = await client.post("/v1/messages", json=BASE)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
    assert resp.json() == {"type": "error", "error": {"type": "overloaded_error", "message": "no worker"}}
    async with http(AnsweringRunner("Hello there, world", pieces=3, fail_after=2)) as client:
        resp = await client.post("/v1/messages", json={**BASE, "stream": True})
    last = resp.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    assert json.loads(last.split("data: ", 1)[1])["error"] == {"type": "overloaded_error",
                                                                "message": "the decode worker went away"}
    async with sdk(AnsweringRunner("Hello there, world", pieces=3, fail_after=2)) as api:
        with pytest.raises(anthropic.APIStatusError, match="the decode worker went away"):
            async with api.messages.stream(model=MODEL, max_tokens=8, messages=ASK) as stream:
                await stream.get_final_message()


def test_the_routes_are_in_the_openapi_document_without_422s():
    doc = app_for(AnsweringRunner("ok")).openapi()
    post = doc["paths"]["/v1/messages"]["post"]
    assert "422" not in post["responses"] and {"400", "404", "503"} <= set(post["responses"])
    assert "MessagesIn" in doc["components"]["schemas"]
    assert "/v1/messages/count_tokens" in doc["paths"]
