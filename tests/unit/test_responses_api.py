"""The Responses API (issue #16): input items to the template's messages, the answer as output items (whole and
streamed events, read by the official openai client), stored responses continued with previous_response_id in the
same session, GET/DELETE, and bad input as 400s naming the field. The turn and the registry are stand-ins here;
tests/e2e/agents/test_agents.py runs the real stack."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes

from tests.support.auth import open_guard
from tests.support.turn_fakes import AnsweringRunner, StoredResponses

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nParis, then.\n</think>\n\n"


def sdk(runner) -> openai.AsyncOpenAI:
    app = create_app(runner, "agent", 16, tool_call_parser="hermes", reasoning_parser="qwen3")
    add_responses_routes(app)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http)


async def test_a_tool_loop_continues_the_stored_conversation_in_its_session():
    registry = StoredResponses()
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
    registry = StoredResponses()
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
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input", "answers no function_call of an earlier"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0",
     "input_image"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", ""),
    ({"input": "x", "previous_response_id": "resp_unknown1"}, "previous_response_id", "not found"),
    ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id", ""),
    ({"input": "x", "background": True}, "background", "unsupported"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not among the tools"),
    # the chat route's tool checks, which this route had lost: one check_tools (turns/tools.py) for every API
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools.0.parameters",
     "must be a JSON Schema of type 'object'"),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools.1.name", "two tools are named"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments",
     "JSON object"),
])
async def test_bad_input_is_a_400_naming_the_field(body, param, says):
    runner = AnsweringRunner("ok", registry=StoredResponses())
    async with sdk(runner) as api:
        got = await api._client.post("/v1/responses", json={"model": "agent", **body})
    assert got.status_code == 400 and runner.requests == [], got.text
    error = got.json()["error"]
    assert (error.get("param") or "").startswith(param) and says in error["message"], error


async def test_another_tenants_response_is_not_found():
    registry = StoredResponses()
    runner = AnsweringRunner("ok", registry=registry)
    async with sdk(runner) as api:
        first = await api.responses.create(model="agent", input="x")
        (tenant, rid), stored = next(iter(registry.stored.items()))
        registry.stored = {("someone-else", rid): stored}
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError):
            await api.responses.create(model="agent", input="y", previous_response_id=first.id)
        assert (await api._client.get(f"/v1/responses/{first.id}/input_items")).status_code == 404


async def test_each_stored_response_keeps_only_its_turns_items_and_a_link():
    """Issue #27: a stored body holds the turn's input and output, not the conversation; a continuation reads the
    conversation back along the links (GetResponseChain) and gives the template all of it."""
    registry = StoredResponses()
    runner = AnsweringRunner("Answer.", registry=registry)
    async with sdk(runner) as api:
        ids = []
        for n in range(3):
            r = await api.responses.create(model="agent", input=f"Question {n}?",
                                           previous_response_id=ids[-1] if ids else None)
            ids.append(r.id)
        bodies = [json.loads(registry.stored[("default", rid)].body_json) for rid in ids]
        assert [b["items"] for b in bodies] == [
            [{"type": "message", "role": "user", "content": f"Question {n}?"},
             {"type": "message", "role": "assistant", "content": "Answer."}] for n in range(3)]
        assert [registry.stored[("default", rid)].previous_response_id for rid in ids] == ["", *ids[:2]]
        assert runner.requests[2].messages == [
            {"role": "user", "content": "Question 0?"}, {"role": "assistant", "content": "Answer."},
            {"role": "user", "content": "Question 1?"}, {"role": "assistant", "content": "Answer."},
            {"role": "user", "content": "Question 2?"}]
        assert registry.chain_requests[-1].max_responses == 10_000 and registry.chain_requests[-1].max_bytes > 0


async def test_input_items_list_the_conversation_paged():
    registry = StoredResponses()
    runner = AnsweringRunner(THOUGHT + CALL, registry=registry)
    async with sdk(runner) as api:
        first = await api.responses.create(model="agent", input="Weather in Paris?", tools=[TOOL])
        call = first.output[1]
        runner.answer = "Sunny."
        second = await api.responses.create(model="agent", previous_response_id=first.id, tools=[TOOL], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sun"}])
        # The official client pages with after= the last id while has_more; newest first by default.
        listed = [item async for item in api.responses.input_items.list(second.id, limit=2)]
        assert [i.type for i in listed] == ["function_call_output", "function_call", "reasoning", "message"]
        assert listed[1].id == call.id and listed[1].call_id == call.call_id and listed[0].output == "sun"
        assert listed[3].content[0].text == "Weather in Paris?" and listed[3].role == "user"
        forward = (await api._client.get(f"/v1/responses/{second.id}/input_items",
                                         params={"order": "asc", "limit": 3})).json()
        assert [i["id"] for i in forward["data"]] == [i.id for i in reversed(listed)][:3] and forward["has_more"]
        rest = (await api._client.get(f"/v1/responses/{second.id}/input_items", params={
            "order": "asc", "after": forward["last_id"]})).json()
        assert [i["type"] for i in rest["data"]] == ["function_call_output"] and not rest["has_more"]
        only = (await api._client.get(f"/v1/responses/{first.id}/input_items")).json()
        assert [i["type"] for i in only["data"]] == ["message"]  # a response's own output is not its input
        for params, param in [({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                              ({"after": "item_nope"}, "after"), ({"include": "x"}, "include"), ({"page": 1}, "page")]:
            bad = await api._client.get(f"/v1/responses/{second.id}/input_items", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (params, bad.text)
        assert (await api._client.get("/v1/responses/resp_unknown9/input_items")).status_code == 404


async def test_a_broken_or_too_long_conversation_is_a_4xx_naming_why():
    registry = StoredResponses()
    runner = AnsweringRunner("ok", registry=registry)
    async with sdk(runner) as api:
        first = await api.responses.create(model="agent", input="a")
        second = await api.responses.create(model="agent", input="b", previous_response_id=first.id)
        await api.responses.delete(first.id)
        got = await api._client.post("/v1/responses", json={"input": "c", "previous_response_id": second.id})
        error = got.json()["error"]
        assert got.status_code == 400 and error["param"] == "previous_response_id" and first.id in error["message"]
        listed = await api._client.get(f"/v1/responses/{second.id}/input_items")
        assert listed.status_code == 404 and first.id in listed.json()["error"]["message"]
        assert (await api.responses.retrieve(second.id)).id == second.id  # itself still readable

    short = create_app(runner, "agent", 16)
    add_responses_routes(short, chain_max_responses=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(short)), base_url="http://gw") as http:
        third = (await http.post("/v1/responses", json={"input": "c"})).json()["id"]
        fourth = (await http.post("/v1/responses", json={"input": "d", "previous_response_id": third})).json()["id"]
        got = await http.post("/v1/responses", json={"input": "e", "previous_response_id": fourth})
        assert got.status_code == 400 and "response-chain-max-responses" in got.json()["error"]["message"], got.text
        listed = await http.get(f"/v1/responses/{fourth}/input_items")
        assert listed.status_code == 400 and "response-chain-max" in listed.json()["error"]["message"]
