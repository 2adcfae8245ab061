"""The Responses API (issue #16): input items to the template's messages, the answer as output items (whole and
streamed events, read by the official openai client), stored responses continued with previous_response_id in the
same session, GET/DELETE, and bad input as 400s naming the field. The turn and the registry are stand-ins here;
tests/e2e/agents/test_agents.py runs the real stack."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from kvshuttle.services.gateway.openai_api import create_app
from kvshuttle.services.gateway.responses_api import add_responses_routes

from tests.support.auth import open_guard
from tests.support.turn_fakes import AnsweringRunner

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nParis, then.\n</think>\n\n"


def _missing(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Registry:
    """Stored responses in memory, per tenant, as the registry keeps them."""

    def __init__(self):
        self.stored = {}

    async def PutResponse(self, request, timeout=None):
        self.stored[(request.response.tenant, request.response.response_id)] = request.response
        return request

    async def GetResponse(self, request, timeout=None):
        found = self.stored.get((request.tenant, request.response_id))
        if found is None:
            raise _missing("no stored response")
        return type("R", (), {"response": found})()

    async def DeleteResponse(self, request, timeout=None):
        gone = self.stored.pop((request.tenant, request.response_id), None)
        return type("R", (), {"deleted": gone is not None})()


def sdk(runner) -> openai.AsyncOpenAI:
    app = create_app(runner, "agent", 16, tool_call_parser="hermes", reasoning_parser="qwen3")
    add_responses_routes(app, runner, "agent", 16, tool_call_parser="hermes", reasoning_parser="qwen3")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http)


async def test_a_tool_loop_continues_the_stored_conversation_in_its_session():
    registry = Registry()
    runner = AnsweringRunner(THOUGHT + CALL, registry=registry, new_session="auto-7")
    async with sdk(runner) as api:
        first = await api.responses.create(model="agent", input="Weather in Paris?", tools=[TOOL],
                                           instructions="Be brief.")
        assert [item.type for item in first.output] == ["reasoning", "function_call"]
        assert first.output[0].content[0].text == "\nParis, then.\n"
        call = first.output[1]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert first.status == "completed" and first.usage.input_tokens_details.cached_tokens == 30
        runner.answer = THOUGHT + "It is sunny."
        second = await api.responses.create(model="agent", previous_response_id=first.id, tools=[TOOL], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
        assert second.output_text == "\n\nIt is sunny." and second.previous_response_id == first.id
        # The whole conversation goes to the template as the chat route would give it, in the first turn's session.
        req = runner.requests[1]
        assert req.session_id == "auto-7"
        assert req.messages == [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "\nParis, then.\n",
             "reasoning": "\nParis, then.\n", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'}]
        assert req.template_vars["tools"][0]["function"]["name"] == "get_weather"
        assert runner.requests[0].messages[0] == {"role": "system", "content": "Be brief."}  # not carried over

        got = await api.responses.retrieve(second.id)
        assert got.id == second.id and got.output_text == second.output_text
        await api.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(second.id)
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(model="agent", previous_response_id=second.id, input="more")
        assert "not found" in err.value.message


@pytest.mark.parametrize("pieces", [1, 4, 1000])
async def test_streamed_events_build_the_same_response(pieces):
    registry = Registry()
    runner = AnsweringRunner(THOUGHT + "Hi " + CALL + "\n" + CALL.replace("Paris", "Oslo"), pieces,
                             registry=registry)
    async with sdk(runner) as api:
        whole = await api.responses.create(model="agent", input="x", tools=[TOOL], store=False)
        kinds, final = [], None
        async with api.responses.stream(model="agent", input="x", tools=[TOOL]) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    strip = [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == strip
    assert final.output_text == whole.output_text == "\n\nHi "
    assert len(registry.stored) == 1  # store=False kept nothing; the streamed one is stored


@pytest.mark.parametrize("body, param, says", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "not supported"),
    ({"input": [{"type": {}, "role": "user", "content": "x"}]}, "input.0.type", "not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input", "answers no earlier"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0",
     "input_image"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", ""),
    ({"input": "x", "previous_response_id": "resp_unknown1"}, "previous_response_id", "not found"),
    ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id", ""),
    ({"input": "x", "background": True}, "background", "unsupported"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not among the tools"),
    # the chat route's tool checks, which this route had lost: one check_tools (turns/builder.py) for every API
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools.0.parameters",
     "must be a JSON Schema of type 'object'"),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools.1.name", "two tools are named"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments",
     "JSON object"),
])
async def test_bad_input_is_a_400_naming_the_field(body, param, says):
    runner = AnsweringRunner("ok", registry=Registry())
    async with sdk(runner) as api:
        got = await api._client.post("/v1/responses", json={"model": "agent", **body})
    assert got.status_code == 400 and runner.requests == [], got.text
    error = got.json()["error"]
    assert (error.get("param") or "").startswith(param) and says in error["message"], error


async def test_another_tenants_response_is_not_found():
    registry = Registry()
    runner = AnsweringRunner("ok", registry=registry)
    async with sdk(runner) as api:
        first = await api.responses.create(model="agent", input="x")
        (tenant, rid), stored = next(iter(registry.stored.items()))
        registry.stored = {("someone-else", rid): stored}
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError):
            await api.responses.create(model="agent", input="y", previous_response_id=first.id)
