"""The served model as clients see it (issue #37): listed as vLLM lists models, and an unknown ``model`` is a 404
``model_not_found`` on every API, as OpenAI answers it: chat, completions and Responses through the openai SDK,
Messages and count_tokens through the anthropic SDK (``not_found_error``, Anthropic's type for a 404), and NOT_FOUND
on gRPC. No turn runs."""

from __future__ import annotations

import anthropic
import grpc
import httpx
import httpx2
import openai
import pytest
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.grpc_api import GatewayServicer
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.v1 import gateway_pb2

from tests.support.auth import open_guard
from tests.support.grpc_context import Aborted, Context
from tests.support.turn_fakes import AnsweringRunner

SERVED = "agent"
ASK = [{"role": "user", "content": "hi"}]


def app(runner):
    a = create_app(runner, SERVED, 16)
    add_responses_routes(a)
    add_anthropic_routes(a)
    return open_guard(a)


def openai_sdk(runner) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app(runner)), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http, max_retries=0)


def anthropic_sdk(runner) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app(runner)), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", max_retries=0, http_client=http)


def check_openai(err: openai.NotFoundError, model: str) -> None:
    assert err.status_code == 404 and err.code == "model_not_found", err.body
    assert err.body["type"] == "invalid_request_error" and f"{model!r} does not exist" in err.body["message"]


async def test_the_served_model_is_listed_as_vllm_lists_it():
    async with openai_sdk(AnsweringRunner("")) as api:
        listed = (await api.models.list()).data
    assert [m.id for m in listed] == [SERVED]
    assert listed[0].object == "model" and listed[0].owned_by == "kvshuttle"
    assert listed[0].model_extra == {"root": SERVED, "parent": None, "max_model_len": 4096}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_apis_answer_model_not_found(stream):
    runner = AnsweringRunner("never said")
    async with openai_sdk(runner) as api:
        with pytest.raises(openai.NotFoundError) as err:
            await api.chat.completions.create(model="gpt-7", messages=ASK, stream=stream)
        check_openai(err.value, "gpt-7")
        with pytest.raises(openai.NotFoundError) as err:
            await api.completions.create(model="gpt-7", prompt="hi", stream=stream)
        check_openai(err.value, "gpt-7")
        with pytest.raises(openai.NotFoundError) as err:
            await api.responses.create(model="o9", input="hi", stream=stream)
        check_openai(err.value, "o9")
        answer = await api.chat.completions.create(model=SERVED, messages=ASK)  # the served one still answers
    assert answer.choices[0].message.content == "never said"
    assert len(runner.requests) == 1


async def test_messages_and_count_tokens_answer_not_found_error():
    runner = AnsweringRunner("never said")
    async with anthropic_sdk(runner) as api:
        with pytest.raises(anthropic.NotFoundError) as err:
            await api.messages.create(model="claude-opus-9", max_tokens=8, messages=ASK)
        assert err.value.body["error"]["type"] == "not_found_error"
        assert "'claude-opus-9' does not exist" in err.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            await api.messages.count_tokens(model="claude-opus-9", messages=ASK)
    assert runner.requests == []


async def test_grpc_answers_not_found():
    runner = AnsweringRunner("never said")
    servicer = GatewayServicer(runner, SERVED, 16)
    chat = gateway_pb2.ChatCompleteRequest(model="gpt-7", messages=[gateway_pb2.ChatMessage(**m) for m in ASK])
    with pytest.raises(Aborted) as err:
        await servicer.ChatComplete(chat, Context())
    assert err.value.args[0] == grpc.StatusCode.NOT_FOUND and "'gpt-7' does not exist" in err.value.args[1]
    with pytest.raises(Aborted) as err:
        await servicer.Complete(gateway_pb2.CompleteRequest(model="gpt-7", prompt="hi"), Context())
    assert err.value.args[0] == grpc.StatusCode.NOT_FOUND
    assert runner.requests == []
