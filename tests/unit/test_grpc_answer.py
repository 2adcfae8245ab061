"""The gRPC API spells the same answer as the HTTP chat API (issue #36: one answer layer): a reasoning answer's
reasoning and content, whole and streamed, agree with OpenAI chat's; the raw text stays in ``text``. The turn logic is
the real TurnRunner and front ends; the workers are stand-ins whose model writes the answer below (tests/support)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from kvshuttle.services.gateway.apis.grpc_api import GatewayServicer, _template_message
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.turns import TurnError
from kvshuttle.v1 import gateway_pb2, scheduler_pb2

from tests.support.auth import open_guard
from tests.support.turn_fakes import Engine, runner

ANSWER = "<think>Two and two.</think>\n\nIt is four."
ASK = [{"role": "user", "content": "What is 2+2?"}]


class Context:
    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, _):
        pass


def stack():
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), decode=Engine(answer=ANSWER, ends=True))
    servicer = GatewayServicer(r, "tiny", 0, reasoning_parser="qwen3")
    app = create_app(r, "tiny", 0, reasoning_parser="qwen3")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return servicer, openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http)


def chat_request(**fields) -> gateway_pb2.ChatCompleteRequest:
    return gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(**m) for m in ASK], **fields)


async def test_grpc_chat_splits_reasoning_as_the_http_chat_api_does():
    servicer, api = stack()
    async with api:
        http = (await api.chat.completions.create(model="tiny", messages=ASK)).choices[0]
        streamed = [c async for c in await api.chat.completions.create(model="tiny", messages=ASK, stream=True)]
    reasoning = http.message.model_extra["reasoning_content"]
    # the parser's split, not the raw text (vLLM's qwen3 parser keeps what follows </think> as it is)
    assert (reasoning, http.message.content) == ("Two and two.", "\n\nIt is four.")

    whole = await servicer.ChatComplete(chat_request(), Context())
    assert (whole.message.reasoning_content, whole.message.content) == (reasoning, http.message.content)
    assert whole.finish_reason == http.finish_reason == "stop"

    events = [e async for e in servicer.ChatCompleteStream(chat_request(), Context())]
    deltas = [e.delta for e in events if e.HasField("delta")]
    assert "".join(d.text for d in deltas) == ANSWER  # the raw text, as the tokens decode
    assert "".join(d.reasoning_content for d in deltas) == reasoning
    assert "".join(d.content for d in deltas) == http.message.content == "".join(
        c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert events[-1].finished.finish_reason == "stop"

    # Completions are text, not chat: their deltas carry the raw text only (as OpenAI's completions API does).
    text = [e async for e in servicer.CompleteStream(gateway_pb2.CompleteRequest(prompt="2+2?"), Context())]
    assert all(not e.delta.content and not e.delta.reasoning_content for e in text if e.HasField("delta"))


async def test_an_assistant_s_reasoning_goes_back_to_the_template_and_no_other_role_has_one():
    echoed = _template_message(gateway_pb2.ChatMessage(role="assistant", content="It is four.",
                                                       reasoning_content="Two and two."))
    assert echoed == {"role": "assistant", "content": "It is four.", "reasoning_content": "Two and two.",
                      "reasoning": "Two and two."}  # both of vLLM's names, as the HTTP chat API gives them
    servicer, _ = stack()
    history = [*ASK, {"role": "assistant", "content": "It is four.", "reasoning_content": "Two and two."},
               {"role": "user", "content": "And 3+3?"}]
    got = await servicer.ChatComplete(gateway_pb2.ChatCompleteRequest(
        messages=[gateway_pb2.ChatMessage(**m) for m in history]), Context())
    assert got.message.content == "\n\nIt is four." and got.message.reasoning_content == "Two and two."

    class Refused(Exception):
        pass

    class Aborting(Context):
        async def abort(self, code, details="", trailing_metadata=()):
            raise Refused(code, details)

    bad = gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi",
                                                                            reasoning_content="no")])
    with pytest.raises((Refused, TurnError, grpc.aio.AbortError)) as err:
        await servicer.ChatComplete(bad, Aborting())
    assert "only an assistant message has reasoning" in str(err.value)
