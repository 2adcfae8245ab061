"""Tools, tool calls and reasoning in the gateway's Chat Completions API (issue #16): what the template gets, how
answers are parsed and spelled (whole and streamed, read by the official openai client), and every bad input a 400
naming its field. The turn itself is a stand-in here; tests/e2e/agents/test_agents.py runs real workers."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.turns import TurnError

from tests.support.auth import open_guard
from tests.support.turn_fakes import AnsweringRunner

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nParis, then.\n</think>\n\n"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client(runner, **parsers) -> httpx.AsyncClient:
    app = create_app(runner, "agent", 16, **{"tool_call_parser": "hermes", "reasoning_parser": "qwen3", **parsers})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")


def sdk(runner, **parsers) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=client(runner, **parsers))


async def test_the_template_gets_the_tools_and_the_tool_history_as_vllm_gives_them():
    runner = AnsweringRunner("ok")
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Paris, then.",
                      "tool_calls": [{"id": "call-1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature_c": 21}'}]
    async with client(runner) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": history, "tools": [TOOL],
                                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.status_code == 200, resp.text
    req = runner.requests[0]
    assert req.template_vars == {"enable_thinking": False, "tools": [
        {"type": "function", "function": {**TOOL["function"]}}]}
    assert req.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Paris, then.",
                               "reasoning": "Paris, then.", "tool_calls": [
                                   {"id": "call-1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert req.messages[2] == {"role": "tool", "content": '{"temperature_c": 21}', "tool_call_id": "call-1"}
    assert not req.skip_special_tokens  # call tags must survive detokenizing, as vLLM's tool parsers ask


async def test_a_tool_call_with_reasoning_as_the_openai_client_reads_it():
    async with sdk(AnsweringRunner(THOUGHT + CALL)) as api:
        resp = await api.chat.completions.create(model="agent", messages=ASK, tools=[TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert choice.message.model_extra["reasoning_content"] == "\nParis, then.\n"
    assert choice.message.content is None  # only the blank line before the call: no content, as vLLM reports it
    assert resp.usage.prompt_tokens_details.cached_tokens == 30  # 40 prompt tokens, 10 computed


@pytest.mark.parametrize("pieces", [1, 2, 5, 1000])
async def test_a_streamed_answer_gives_what_the_whole_answer_gives(pieces):
    answer = THOUGHT + CALL + "\n" + CALL.replace("Paris", "Oslo")
    async with sdk(AnsweringRunner(answer, pieces)) as api:
        whole = (await api.chat.completions.create(model="agent", messages=ASK, tools=[TOOL])).choices[0]
        stream = await api.chat.completions.create(model="agent", messages=ASK, tools=[TOOL], stream=True,
                                                   stream_options={"include_usage": True})
        reasoning, content, calls, finish, usage = "", "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    if tc.index not in calls:  # the first chunk of a call: its id and name
                        assert tc.id and tc.function.name and not tc.function.arguments
                        calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                    else:
                        assert tc.id is None
                        calls[tc.index]["arguments"] += tc.function.arguments
                finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert (content or None) == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]
    assert usage.prompt_tokens_details.cached_tokens == 30


async def test_request_switches_for_tools_and_reasoning():
    answer = THOUGHT + CALL + CALL.replace("Paris", "Oslo")
    async with client(AnsweringRunner(answer)) as http:
        one = (await http.post("/v1/chat/completions", json={"messages": ASK, "tools": [TOOL],
                                                              "parallel_tool_calls": False})).json()
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1
        none = (await http.post("/v1/chat/completions", json={"messages": ASK, "tools": [TOOL],
                                                               "tool_choice": "none"})).json()["choices"][0]
        assert none["finish_reason"] == "stop" and "tool_calls" not in none["message"]
        assert none["message"]["content"] == "\n\n" + CALL + CALL.replace("Paris", "Oslo")  # calls left as text
        hidden = (await http.post("/v1/chat/completions", json={"messages": ASK, "include_reasoning": False})).json()
        assert "reasoning_content" not in hidden["choices"][0]["message"]
    async with client(AnsweringRunner(answer), reasoning_parser="", tool_call_parser="") as http:
        raw = (await http.post("/v1/chat/completions", json={"messages": ASK})).json()["choices"][0]["message"]
        assert raw == {"role": "assistant", "content": answer}  # no parser: the text as generated


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "must be a JSON Schema of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]},
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [TOOL, TOOL]}, "tools.1.function.name", "two tools are named"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "exclude each other"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, "structured_outputs.disable_fallback", ""),
    ({"structured_outputs": {"json": "{no"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"guided_json": {"type": "object"}}, "guided_json", "unsupported"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
]


@pytest.mark.parametrize("extra, param, says", BAD_TOOLS)
async def test_bad_tools_are_a_400_naming_the_field(extra, param, says):
    runner = AnsweringRunner("ok")
    async with client(runner) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert resp.status_code == 400 and runner.requests == [], resp.text
    error = resp.json()["error"]
    assert error["param"].startswith(param) and says in error["message"], error


def _called(arguments: str = '{"city": "Paris"}', call_id: str = "call-1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


@pytest.mark.parametrize("messages, param, says", [
    ([*ASK, _called(), {"role": "tool", "tool_call_id": "call-9", "content": "x"}], "messages.2.tool_call_id",
     "answers no tool call"),
    ([*ASK, {"role": "tool", "content": "x"}], "messages.1.tool_call_id", "needs the tool_call_id"),
    ([*ASK, _called("{city: Paris}")], "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
    ([*ASK, _called("[1, 2]")], "messages.1.tool_calls.0.function.arguments", "must be a JSON object"),
    ([{"role": "user", "content": "x", "tool_calls": _called()["tool_calls"]}], "messages.0.tool_calls",
     "only assistant messages"),
])
async def test_a_bad_tool_history_is_a_400_naming_the_message(messages, param, says):
    runner = AnsweringRunner("ok")
    async with client(runner) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL]})
    assert resp.status_code == 400 and runner.requests == [], resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error


async def test_tools_without_a_tool_call_parser_are_refused_unless_not_called():
    runner = AnsweringRunner("ok")
    async with client(runner, tool_call_parser="") as http:
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, "tools": [TOOL]})
        assert resp.status_code == 400 and "--tool-call-parser" in resp.json()["error"]["message"]
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, "tools": [TOOL], "tool_choice": "none"})
        assert resp.status_code == 200 and runner.requests[0].template_vars["tools"]


async def test_completions_still_refuse_tools():
    async with client(AnsweringRunner("ok")) as http:
        resp = await http.post("/v1/completions", json={"prompt": "x", "tools": [TOOL]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"


async def test_a_failed_turn_stays_a_clean_error():
    class Failing(AnsweringRunner):
        async def prepare(self, req):
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "no worker")

    async with client(Failing("x")) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, "tools": [TOOL]})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "no worker"


async def _constraint(extra: dict, **parsers):
    runner = AnsweringRunner("ok")
    async with client(runner, **parsers) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert resp.status_code == 200, resp.text
    return runner.requests[0].constraint


async def _request(extra: dict, **parsers):
    runner = AnsweringRunner("ok")
    async with client(runner, **parsers) as http:
        await http.post("/v1/chat/completions", json={"messages": ASK, **extra})
    return runner.requests[0]


async def test_forced_tool_calls_and_structured_output_become_the_turns_constraint():
    required = await _constraint({"tools": [TOOL], "tool_choice": "required"})
    calls = json.loads(required.value)["format"]
    assert required.kind == "structural_tag" and calls["type"] == "tags_with_separator"
    assert calls["tags"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert calls["separator"] == "\n" and calls["at_least_one"] and not calls["stop_after_first"]
    named = await _constraint({"tools": [TOOL], "tool_choice": {"type": "function",
                                                                 "function": {"name": "get_weather"}}},
                              reasoning_parser="")
    assert json.loads(named.value)["format"]["stop_after_first"]
    assert await _constraint({"tools": [TOOL]}) is None and await _constraint({}) is None
    assert (await _constraint({"response_format": {"type": "json_object"}}, reasoning_parser="")).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = await _constraint({"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "answer", "schema": schema}}},
                            reasoning_parser="")
    assert got.kind == "json_schema" and json.loads(got.value) == schema
    assert (await _constraint({"structured_outputs": {"regex": "[0-9]+"}})).value == "[0-9]+"
    assert (await _constraint({"structured_outputs": {"choice": ["yes", "no"]}})).value == ["yes", "no"]
    assert (await _constraint({"response_format": {"type": "text"}})) is None
    # The gateway's own constraints go after the reasoning the rendered prompt leaves room for (the runner places
    # them: control_plane.constraints.after_reasoning); a client's structured_outputs constraint is taken as given.
    assert (await _request({"tools": [TOOL], "tool_choice": "required"})).reasoning_tags == ("<think>", "</think>")
    assert (await _request({"response_format": {"type": "json_object"}})).reasoning_tags == ("<think>", "</think>")
    assert (await _request({"structured_outputs": {"regex": "a"}})).reasoning_tags is None
    assert (await _request({"tools": [TOOL], "tool_choice": "required"}, reasoning_parser="")).reasoning_tags is None


async def test_a_forced_call_is_parsed_into_tool_calls():
    async with sdk(AnsweringRunner(THOUGHT + CALL)) as api:
        resp = await api.chat.completions.create(model="agent", messages=ASK, tools=[TOOL], tool_choice="required")
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.tool_calls[0].function.name
