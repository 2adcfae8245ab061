"""gpt-oss's Harmony format through the gateway (``--tool-call-parser openai --reasoning-parser openai_gptoss``):
the answer is decoded keeping its special tokens (the channel markers), its analysis channel is the reasoning and
its calls are tool calls in all three APIs, and what the gateway cannot apply to it is refused by name. The parser
itself: tests/unit/test_harmony_parser.py. The turn is a stand-in here."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.services.gateway.server import GatewayConfig
from kvshuttle.services.gateway.turns.parsers import Parsers

from tests.support.auth import open_guard
from tests.support.turn_fakes import AnsweringRunner

HARMONY = {"tool_call_parser": "openai", "reasoning_parser": "openai_gptoss"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
THOUGHT = "<|channel|>analysis<|message|>Paris, then.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def asgi_app(runner):
    app = create_app(runner, "gpt-oss", 16, **HARMONY)
    add_anthropic_routes(app)
    add_responses_routes(app)
    return app


def app_for(runner) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(asgi_app(runner))), base_url="http://gw")


async def test_a_call_after_reasoning_in_chat_completions_whole_and_streamed():
    runner = AnsweringRunner(THOUGHT + CALL)
    api = openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=app_for(runner))
    whole = (await api.chat.completions.create(model="gpt-oss", messages=ASK, tools=[TOOL])).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.reasoning_content == "Paris, then."  # type: ignore[attr-defined]
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    stream = await api.chat.completions.create(model="gpt-oss", messages=ASK, tools=[TOOL], stream=True)
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Paris, then."
    assert not "".join(d.content or "" for d in deltas)
    assert [tc.function.arguments for d in deltas for tc in d.tool_calls or []] == ["", '{"city": "Paris"}']
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not req.skip_special_tokens for req in runner.requests)


async def test_an_answer_without_tools_keeps_its_markers_for_the_parser_and_not_for_the_client():
    runner = AnsweringRunner(THOUGHT + FINAL)
    api = openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=app_for(runner))
    resp = await api.chat.completions.create(model="gpt-oss", messages=ASK, extra_body={"skip_special_tokens": True})
    message = resp.choices[0].message
    assert (message.content, message.reasoning_content) == ("It is sunny.", "Paris, then.")  # type: ignore
    assert not runner.requests[0].skip_special_tokens  # the channel markers are special tokens


async def test_the_responses_and_messages_apis_read_the_same_answer():
    runner = AnsweringRunner(THOUGHT + CALL)
    http = app_for(runner)
    responses = openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http)
    out = (await responses.responses.create(model="gpt-oss", input="Weather in Paris?", store=False, tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}])).output
    assert [item.type for item in out] == ["reasoning", "function_call"] and out[1].name == "get_weather"
    # the anthropic SDK speaks httpx2, a fork of httpx with the same ASGI transport
    messages = anthropic.AsyncAnthropic(api_key="none", base_url="http://gw", http_client=httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=open_guard(asgi_app(runner))), base_url="http://gw"))
    msg = await messages.messages.create(model="gpt-oss", max_tokens=16, messages=ASK, tools=[
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[1].input == {"city": "Paris"}
    assert not any(req.skip_special_tokens for req in runner.requests)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
])
async def test_what_cannot_be_forced_on_harmony_answers_is_refused_by_name(body, field):
    runner = AnsweringRunner(FINAL)
    async with app_for(runner) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    assert not runner.requests


@pytest.mark.parametrize("tools, reasoning", [("openai", "qwen3"), ("hermes", "openai_gptoss"), ("openai", ""),
                                              ("", "openai")])
def test_harmony_parsers_go_together_and_alone(tmp_path, tools, reasoning):
    assert Parsers(tools, reasoning).problem() is not None
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="Harmony"):
        GatewayConfig(model_dir=str(tmp_path), tool_call_parser=tools, reasoning_parser=reasoning).validate()
    assert Parsers("openai", "openai").problem() is None and Parsers("hermes", "qwen3").problem() is None
