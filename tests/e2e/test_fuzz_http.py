"""Generated bad input for the gateway's OpenAI HTTP API and its gRPC API, on the real stack (issue #5, item 7).

hypothesis builds request bodies field by field: mostly plausible, with one field at a time of the wrong type,
missing, out of range, huge, or strange (unknown model, malformed session ids, negative and huge max_tokens, odd
roles, token-id prompts with bad ids), plus raw bodies that are not JSON or not UTF-8. Every answer must be a 2xx or a
4xx with an OpenAI-style JSON error and a message; never a 5xx, a dropped connection or a hang. The gateway must
serve a normal conversation afterwards. Valid requests run real turns with at most 4 tokens.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc

from tests.support.e2e import new_session

pytestmark = pytest.mark.e2e
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=6)


def mostly(good, bad):
    return st.integers(0, 5).flatmap(lambda i: bad if i == 0 else good)


MESSAGE = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=10) | ANY_JSON),
    "content": mostly(st.text(max_size=60), ANY_JSON | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=10)}), max_size=2)),
})
COMMON = {
    "max_tokens": mostly(st.integers(1, 4), st.integers(-(2**63), 2**63) | ANY_JSON),
    "temperature": mostly(st.sampled_from([0, 0.5]), st.floats() | ANY_JSON),
    "top_p": mostly(st.just(1.0), st.floats() | ANY_JSON),
    "model": mostly(st.just("tiny"), st.text(max_size=20) | ANY_JSON),
    "stream": mostly(st.booleans(), ANY_JSON),
    "conversation_id": mostly(st.from_regex(r"fuzz-[a-z0-9]{1,8}", fullmatch=True),
                              st.text(max_size=300) | ANY_JSON),
    "stop": mostly(st.none(), st.lists(st.text(max_size=3), max_size=2) | ANY_JSON),
    "seed": mostly(st.none(), st.integers() | ANY_JSON),
    "policy": mostly(st.just(""), st.text(max_size=80) | ANY_JSON),
    "kv_transfer_params": mostly(st.none(), ANY_JSON),
}
CHAT = st.fixed_dictionaries({"messages": mostly(st.lists(MESSAGE, min_size=1, max_size=3), ANY_JSON)},
                             optional=COMMON)
COMPLETION = st.fixed_dictionaries(
    {"prompt": mostly(st.text(min_size=1, max_size=80),
                      st.lists(st.integers(-5, 300_000), max_size=20) | ANY_JSON)}, optional=COMMON)
RAW = st.one_of(st.binary(max_size=200), st.just(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
                st.just(b"{" * 10_000), st.just(b'{"messages": '))


def check(resp: httpx.Response, body) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"], (resp.text, body)


def post(client: httpx.Client, path: str, body) -> None:
    headers = {}
    session = body.get("conversation_id") if isinstance(body, dict) else None
    if isinstance(session, str) and session.isascii() and session.isprintable():  # what an HTTP header can carry
        headers["X-Session-ID"] = session
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    check(client.post(path, content=content, headers={"content-type": "application/json", **headers}), body)


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=120) as c:
        yield c


@EXAMPLES
@given(body=CHAT)
def test_chat_completions_answer_bad_input_with_a_4xx(client, body):
    post(client, "/v1/chat/completions", body)


@EXAMPLES
@given(body=COMPLETION)
def test_completions_answer_bad_input_with_a_4xx(client, body):
    post(client, "/v1/completions", body)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=RAW, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_bodies_that_are_not_json_get_a_4xx(client, raw, path):
    check(client.post(path, content=raw, headers={"content-type": "application/json"}), raw)


def test_the_gateway_still_serves_a_conversation_after_the_fuzzing(client):
    session = new_session("after-http-fuzz")
    messages = [{"role": "user", "content": "Count to three."}]
    for _ in range(2):
        resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0},
                           headers={"X-Session-ID": session})
        assert resp.status_code == 200, resp.text
        messages += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Go on."}]
    assert resp.headers["x-kv-decision"] == "pull", resp.headers["x-kv-reason"]


GRPC_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.OUT_OF_RANGE}
SAMPLING = st.builds(
    gateway_pb2.SamplingOptions, max_tokens=mostly(st.integers(1, 4), st.integers(-(2**31), 2**31 - 1)),
    temperature=mostly(st.sampled_from([0.0, 0.5]), st.floats(width=32)),
    top_p=mostly(st.just(1.0), st.floats(width=32)), ignore_eos=st.booleans(),
    stop=mostly(st.just([]), st.lists(st.text(max_size=3), max_size=2)))
GRPC_IDS = mostly(st.from_regex(r"fuzz-[a-z0-9]{1,8}", fullmatch=True), st.text(max_size=300))


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack.gateway_grpc) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def grpc_call(method, request) -> None:
    try:
        method(request, timeout=120)
    except grpc.RpcError as exc:
        assert exc.code() in GRPC_CLIENT_ERRORS, (exc.code(), exc.details(), request)
        assert exc.details(), request


@EXAMPLES
@given(session=GRPC_IDS, model=mostly(st.just(""), st.text(max_size=20)), sampling=SAMPLING,
       messages=mostly(st.lists(st.builds(gateway_pb2.ChatMessage,
                                          role=mostly(st.sampled_from(["user", "system"]), st.text(max_size=8)),
                                          content=st.text(max_size=60)), min_size=1, max_size=3), st.just([])),
       policy=mostly(st.just(""), st.text(max_size=70)))
def test_the_grpc_chat_api_answers_bad_input_with_a_client_error(gateway, session, model, sampling, messages,
                                                                 policy):
    grpc_call(gateway.ChatComplete, gateway_pb2.ChatCompleteRequest(
        session_id=session, model=model, messages=messages, sampling=sampling, policy=policy))


@EXAMPLES
@given(session=GRPC_IDS, sampling=SAMPLING, text=st.text(max_size=60),
       ids=mostly(st.lists(st.integers(0, 4000), max_size=30), st.lists(st.integers(-(2**31), 2**31 - 1),
                                                                         max_size=30)))
def test_the_grpc_completion_api_answers_bad_input_with_a_client_error(gateway, session, sampling, text, ids):
    grpc_call(gateway.Complete, gateway_pb2.CompleteRequest(session_id=session, prompt=text, prompt_token_ids=ids,
                                                            sampling=sampling))
