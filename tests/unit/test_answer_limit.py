"""An answer is as long as the model wants unless someone says otherwise (issue #34): a request without a limit runs
up to the context left after the prompt, as vLLM and OpenAI do, on chat, completions, Responses and gRPC; the
operator's --default-max-tokens caps such answers, and the answer says so. The turn logic is the real TurnRunner and
front ends; the workers are stand-ins whose model writes a 300-token answer and then ends it (tests/support)."""

from __future__ import annotations

import httpx
import openai
import pytest
from kvshuttle.services.gateway.apis.grpc_api import GatewayServicer
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.services.gateway.turns import TurnError, TurnRequest
from kvshuttle.services.gateway.turns.request import check_length
from kvshuttle.v1 import gateway_pb2, scheduler_pb2

from tests.support.auth import open_guard
from tests.support.turn_fakes import Engine, runner

ANSWER = "w" * 300  # the stand-in model's answer: 300 tokens (one per character), then its end
ASK = [{"role": "user", "content": "Write the whole file."}]
CONTEXT = 1000  # turn_fakes' runner: max_model_len


def gateway(default_max_tokens: int):
    r, scheduler, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), decode=Engine(answer=ANSWER, ends=True))
    app = create_app(r, "tiny", default_max_tokens)
    add_responses_routes(app)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="none", base_url="http://gw/v1", http_client=http), r, scheduler


async def test_a_request_without_a_limit_gets_the_whole_answer_on_every_api():
    api, r, scheduler = gateway(0)
    async with api:
        chat = await api.chat.completions.create(model="tiny", messages=ASK)
        streamed = [c async for c in await api.chat.completions.create(model="tiny", messages=ASK, stream=True)]
        text = await api.completions.create(model="tiny", prompt="Write the whole file.")
        resp = await api.responses.create(model="tiny", input="Write the whole file.", store=False)
    assert chat.choices[0].message.content == ANSWER and chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == 300
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ANSWER
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert text.choices[0].text == ANSWER and text.choices[0].finish_reason == "stop"
    assert resp.output_text == ANSWER and resp.status == "completed" and resp.incomplete_details is None
    # The limit each ran under: what the context left after its prompt, which the Responses object shows.
    prompt = len(r.tokenizer.render_chat([{"role": "user", "content": "Write the whole file."}]))
    assert resp.max_output_tokens == CONTEXT - prompt
    extra = chat.model_extra["kvshuttle"]
    assert (extra["max_tokens"], extra["max_tokens_source"]) == (CONTEXT - prompt, "context")
    # D was asked for the limit; the scheduler was asked to make room for at most answer_room_tokens of it.
    assert {p.max_tokens for p in scheduler.requests} == {min(CONTEXT - prompt, r.answer_room_tokens),
                                                       min(CONTEXT - len("Write the whole file."), r.answer_room_tokens)}


async def test_the_operators_default_caps_such_answers_and_the_answer_says_so():
    api, _, _ = gateway(128)
    async with api:
        chat = await api.chat.completions.create(model="tiny", messages=ASK)
        resp = await api.responses.create(model="tiny", input="Write the whole file.", store=False)
        asked = await api.chat.completions.create(model="tiny", messages=ASK, max_tokens=400)
    assert chat.choices[0].message.content == ANSWER[:128] and chat.choices[0].finish_reason == "length"
    assert chat.model_extra["kvshuttle"]["max_tokens_source"] == "default"
    assert resp.max_output_tokens == 128 and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens" and len(resp.output_text) == 128
    # A request's own limit is the request's, above the default too.
    assert asked.choices[0].message.content == ANSWER and asked.choices[0].finish_reason == "stop"
    assert asked.model_extra["kvshuttle"]["max_tokens"] == 400
    assert asked.model_extra["kvshuttle"]["max_tokens_source"] == "request"


async def test_the_grpc_api_takes_0_as_no_limit_and_says_which_limit_applied():
    r, _, _ = runner(scheduler_pb2.DECISION_RECOMPUTE, Engine(), decode=Engine(answer=ANSWER, ends=True))
    servicer = GatewayServicer(r, "tiny", 0)

    class Context:
        def invocation_metadata(self):
            return ()

        async def send_initial_metadata(self, _):
            pass

    got = await servicer.Complete(gateway_pb2.CompleteRequest(prompt="Write it."), Context())
    assert got.text == ANSWER and got.finish_reason == "stop"
    assert (got.max_tokens, got.max_tokens_source) == (CONTEXT - len("Write it."), "context")
    events = [e async for e in servicer.CompleteStream(gateway_pb2.CompleteRequest(
        prompt="Write it.", sampling=gateway_pb2.SamplingOptions(max_tokens=7)), Context())]
    assert (events[0].started.max_tokens, events[0].started.max_tokens_source) == (7, "request")
    assert events[-1].finished.finish_reason == "length"


@pytest.mark.parametrize("asked, default, want", [
    (None, 0, (90, "context")), (None, 50, (50, "default")), (None, 500, (90, "context")),
    (30, 50, (30, "request")), (90, 0, (90, "request")),
])
def test_the_limit_is_the_requests_else_the_default_else_the_context_left(asked, default, want):
    req = TurnRequest(max_tokens=asked, default_max_tokens=default)
    check_length(req, [1] * 10, max_prompt_tokens=0, max_model_len=100)
    assert (req.max_tokens, req.max_tokens_source) == want
    if req.max_tokens_source != "request":  # checked again for a prompt built again: resolved again
        check_length(req, [1] * 40, max_prompt_tokens=0, max_model_len=100)
        assert req.max_tokens == min(60, default or 60)


@pytest.mark.parametrize("req, prompt, words", [
    (TurnRequest(max_tokens=91), 10, "exceeds the model's context of 100 tokens"),
    (TurnRequest(), 100, "leaves no room for an answer"),
    (TurnRequest(min_tokens=95), 10, "min_tokens (95) is more than the answer may have: 90 tokens"),
    (TurnRequest(min_tokens=60, default_max_tokens=50), 10, "the gateway's default max_tokens"),
])
def test_a_limit_that_cannot_be_met_is_a_400(req, prompt, words):
    with pytest.raises(TurnError) as err:
        check_length(req, [1] * prompt, max_prompt_tokens=0, max_model_len=100)
    assert err.value.http_status == 400 and words in err.value.message, err.value.message


def test_the_kv_room_of_an_answer_only_the_context_limits_is_bounded():
    req = TurnRequest()
    check_length(req, [1] * 10, max_prompt_tokens=0, max_model_len=100_000)
    assert req.room_tokens(1024) == 1024 and req.max_tokens == 99_990
    asked = TurnRequest(max_tokens=5000)
    check_length(asked, [1] * 10, max_prompt_tokens=0, max_model_len=100_000)
    assert asked.room_tokens(1024) == 5000  # a limit someone set is planned for whole
