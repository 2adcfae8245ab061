"""Request fields on both front ends (issue #16, first increment): every sampling field vLLM's gRPC API takes is
checked and mapped onto the turn, and a field the gateway does not apply is a 400 naming it, never dropped."""

from __future__ import annotations

import grpc
import httpx
import pytest
from kvshuttle.services.gateway.apis.grpc_api import GatewayServicer, unknown_field
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.edge.auth import OPEN
from kvshuttle.services.gateway.turns import TurnError
from kvshuttle.v1 import gateway_pb2

from tests.support.auth import open_guard
from tests.support.turn_fakes import CapturingRunner

CHAT = [{"role": "user", "content": "hi"}]


async def post(path: str, body: dict) -> tuple[httpx.Response, CapturingRunner]:
    runner = CapturingRunner()
    app = create_app(runner, "tiny", 8)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        return await client.post(path, json=body), runner


@pytest.mark.parametrize("extra, named", [
    ({"prediction": {"type": "content", "content": "x"}, "web_search_options": {}},
     "prediction, web_search_options"),
    ({"store": True}, "store"),
    ({"metadata": {"a": "b"}}, "metadata"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"audio": {"voice": "x"}, "modalities": ["text", "audio"]}, "audio, modalities"),
    ({"use_beam_search": True}, "use_beam_search"),
    # only the scheduler decides what P pulls: a router's params would be ignored, so they are refused
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    # the gateway salts each tenant's prefix cache itself (docs/security.md): a client's salt is refused
    ({"cache_salt": "mine"}, "cache_salt"),
    ({"some_new_field": 1}, "some_new_field"),
    ({"some_new_field": None}, "some_new_field"),  # null is "absent" only for fields known to exist
])
async def test_a_field_the_gateway_does_not_apply_is_a_400_naming_it(extra, named):
    resp, runner = await post("/v1/chat/completions", {"messages": CHAT, **extra})
    assert resp.status_code == 400 and runner.requests == []
    error = resp.json()["error"]
    assert error["message"] == f"unsupported field(s): {named}"
    assert error["param"] == named.split(",")[0] and error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize("extra", [
    {"tools": None, "tool_choice": None, "response_format": None, "logprobs": None, "top_logprobs": None},
    {"logprobs": False, "top_logprobs": 0, "store": False, "service_tier": "auto", "parallel_tool_calls": True},
    {"user": "u-1", "n": 1, "stream_options": None, "kv_transfer_params": None},
    {"modalities": ["text"], "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
])
async def test_null_or_neutral_values_are_taken_as_absent(extra):
    resp, runner = await post("/v1/chat/completions", {"messages": CHAT, **extra})
    assert resp.status_code == 503 and len(runner.requests) == 1, resp.text


async def test_who_the_turn_is_for_and_the_cache_key_reach_the_turn():
    resp, runner = await post("/v1/chat/completions", {"messages": CHAT, "user": "u-1", "safety_identifier": "h-2",
                                                       "prompt_cache_key": "conv-3"})
    assert resp.status_code == 503, resp.text
    (req,) = runner.requests
    assert (req.end_user, req.safety_identifier, req.cache_key) == ("u-1", "h-2", "conv-3")
    for bad in ({"prompt_cache_key": ""}, {"safety_identifier": "x" * 257}, {"prompt_cache_key": 5}):
        resp, runner = await post("/v1/chat/completions", {"messages": CHAT, **bad})
        assert resp.status_code == 400 and not runner.requests and next(iter(bad)) in resp.text, resp.text


@pytest.mark.parametrize("message, named", [
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
    ({"role": "tool", "content": "x", "tool_call_id": "c", "is_error": True}, "is_error"),
    ({"role": "user", "content": "x", "weight": 2}, "weight"),
    ({"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}, "extra"),
])
async def test_an_unknown_key_in_a_message_is_a_400_naming_it(message, named):
    resp, runner = await post("/v1/chat/completions", {"messages": [message]})
    assert resp.status_code == 400 and runner.requests == []
    error = resp.json()["error"]
    assert f"unsupported field(s): {named}" in error["message"] and error["param"].endswith(named)
    assert error["param"].startswith("messages.0")


async def test_a_message_echoed_from_a_response_and_a_name_are_taken():
    echoed = {"role": "assistant", "content": "ok", "tool_calls": None, "function_call": None, "refusal": None,
              "audio": None, "annotations": []}
    resp, runner = await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bo"},
                                                                    echoed, *CHAT]})
    assert resp.status_code == 503, resp.text
    messages = runner.requests[0].messages
    assert messages[0] == {"role": "user", "content": "hi", "name": "bo"}  # the chat template gets it, as in vLLM
    assert messages[1] == {"role": "assistant", "content": "ok"}


async def test_sampling_fields_are_mapped_onto_the_turn():
    body = {"messages": CHAT, "max_tokens": 6, "top_k": 1, "min_p": 0.2, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [7, 9],
            "logit_bias": {"11": 100, "12": -5.5}, "include_stop_str_in_output": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    resp, runner = await post("/v1/chat/completions", body)
    assert resp.status_code == 503, resp.text
    req = runner.requests[0]
    assert (req.top_k, req.min_p, req.presence_penalty, req.frequency_penalty) == (1, 0.2, 0.5, -0.5)
    assert (req.repetition_penalty, req.min_tokens, req.stop_token_ids) == (1.2, 3, [7, 9])
    assert req.logit_bias == {11: 100.0, 12: -5.5}
    assert req.include_stop_str_in_output and not req.skip_special_tokens and not req.spaces_between_special_tokens
    resp, runner = await post("/v1/completions", {"prompt": "x", "top_k": -1, "min_tokens": None})
    assert resp.status_code == 503 and runner.requests[0].top_k == -1 and runner.requests[0].min_tokens == 0
    plain = runner.requests[0]
    assert plain.repetition_penalty == 1.0 and plain.logit_bias == {} and plain.skip_special_tokens


@pytest.mark.parametrize("extra, named", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"skip_special_tokens": 0}, "skip_special_tokens"),
])
async def test_out_of_range_sampling_fields_are_a_400_naming_them(extra, named):
    resp, runner = await post("/v1/completions", {"prompt": "x", **extra})
    assert resp.status_code == 400 and runner.requests == [], resp.text
    assert resp.json()["error"]["message"].startswith(named) and resp.json()["error"]["param"].startswith(named)


async def test_completions_refuses_its_own_unapplied_fields():
    for extra, named in [({"logprobs": 21}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
                         ({"suffix": "x"}, "suffix")]:
        resp, runner = await post("/v1/completions", {"prompt": "x", **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == named, resp.text
    resp, runner = await post("/v1/completions", {"prompt": "x", "echo": False, "best_of": 1, "logprobs": None})
    assert resp.status_code == 503


# -- gRPC Gateway API ---------------------------------------------------------------------------------------


def servicer() -> GatewayServicer:
    return GatewayServicer(runner=None, served_model="tiny", default_max_tokens=8)


def test_grpc_sampling_options_are_mapped_onto_the_turn():
    msg = gateway_pb2.ChatCompleteRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="hi", name="bo")],
        sampling=gateway_pb2.SamplingOptions(
            max_tokens=5, top_k=2, min_p=0.25, presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.5,
            min_tokens=2, stop_token_ids=[3], logit_bias={4: 100.0}, include_stop_str_in_output=True,
            skip_special_tokens=False, spaces_between_special_tokens=False))
    req = servicer()._chat_request(msg, OPEN)
    assert (req.top_k, req.min_p, req.presence_penalty, req.frequency_penalty) == (2, 0.25, 0.5, 1.5)
    assert (req.repetition_penalty, req.min_tokens, req.stop_token_ids, req.logit_bias) == (1.5, 2, [3], {4: 100.0})
    assert req.include_stop_str_in_output and not req.skip_special_tokens and not req.spaces_between_special_tokens
    assert req.messages == [{"role": "user", "content": "hi", "name": "bo"}]
    plain = servicer()._chat_request(gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(
        role="user", content="hi")]), OPEN)
    assert plain.repetition_penalty == 1.0 and plain.skip_special_tokens and plain.spaces_between_special_tokens
    assert plain.messages == [{"role": "user", "content": "hi"}]
    explicit_zero = gateway_pb2.SamplingOptions(repetition_penalty=0.0)  # set: the TurnRunner refuses it
    assert servicer()._complete_request(gateway_pb2.CompleteRequest(prompt="x", sampling=explicit_zero), OPEN
                                        ).repetition_penalty == 0.0


def test_a_grpc_field_this_gateway_does_not_know_is_a_400():
    """A client built from newer protos: protobuf keeps the field as unknown; the gateway refuses it."""
    sampling = gateway_pb2.SamplingOptions(top_k=2).SerializeToString() + b"\xa8\x06\x01"  # field 101 = 1
    msg = gateway_pb2.ChatCompleteRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    msg.sampling.ParseFromString(sampling)
    assert unknown_field(msg) == "sampling#101"
    with pytest.raises(TurnError) as err:
        servicer()._chat_request(msg, OPEN)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling#101" in err.value.message
    message = gateway_pb2.ChatMessage(role="user").SerializeToString() + b"\xa0\x06\x01"  # field 100 = 1
    msg = gateway_pb2.ChatCompleteRequest()
    msg.messages.add().ParseFromString(message)
    assert unknown_field(msg) == "messages[0]#100"
    assert unknown_field(gateway_pb2.CompleteRequest(prompt="x", sampling=gateway_pb2.SamplingOptions(
        logit_bias={1: 2.0}))) is None


async def test_text_parts_are_joined_with_a_newline_as_vllm_joins_them():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    resp, runner = await post("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert resp.status_code == 503 and runner.requests[0].messages == [{"role": "user", "content": "first\nsecond"}]
