"""Generated bad input for the gateway's OpenAI HTTP API and its gRPC API, on the real stack (issue #5, item 7).

hypothesis builds request bodies field by field: mostly plausible, with one field at a time of the wrong type,
missing, out of range, huge, or strange (unknown model, malformed session ids, negative and huge max_tokens, odd
roles, token-id prompts with bad ids), plus raw bodies that are not JSON or not UTF-8. Every answer must be a 2xx or a
4xx with an OpenAI-style JSON error and a message; never a 5xx, a dropped connection or a hang. The gateway must
serve a normal conversation afterwards. Valid requests run real turns with at most 4 tokens (a gateway of
its own, --default-max-tokens 4, for those that set no limit).

Hostile input (issue #26; services/gateway/edge/input_check.py): lone surrogates, deep nesting, huge and non-finite
numbers, put in any one field (or as a field's name) of a valid request to every HTTP route, and undecodable bytes
to every gRPC method. Each must be a 4xx in the route's own error shape, never a 5xx or a dropped connection; the
cases the issue found are explicit examples.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.v1 import gateway_pb2, gateway_pb2_grpc

from tests.support.e2e import new_session, spawn_gateway

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
    # what an HTTP header can carry: printable ASCII, no whitespace at either end (h11 refuses to send " ")
    if isinstance(session, str) and session.isascii() and session.isprintable() and session == session.strip():
        headers["X-Session-ID"] = session
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    check(client.post(path, content=content, headers={"content-type": "application/json", **headers}), body)


@pytest.fixture(scope="module")
async def capped(stack):
    """A gateway of the stack's own with an operator cap of 4 tokens (--default-max-tokens): the fuzzer's valid
    requests that set no max_tokens (absent, null, or 0 over gRPC) would run to the end of the context otherwise. Its
    HTTP base URL and gRPC address."""
    grpc_address = f"127.0.0.1:{free_port()}"
    child, base_url = await spawn_gateway(stack, "gateway-http-fuzz", "--grpc-listen", grpc_address,
                                          "--default-max-tokens", "4")
    yield base_url, grpc_address
    await child.stop()


@pytest.fixture(scope="module")
def client(capped):
    with httpx.Client(base_url=capped[0], timeout=120) as c:
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
def gateway(capped):
    with grpc.insecure_channel(capped[1]) as channel:
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



# -- hostile input, every route (issue #26) ------------------------------------------------------------------------

def nest(depth: int, leaf=1, kind: str = "list"):
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
HOSTILE = st.one_of(
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), SURROGATES, st.text(max_size=5)),  # a lone surrogate
    st.integers(2**31, 2**70) | st.integers(-(2**70), -(2**31) - 1) | st.sampled_from([10**12, 2**63, 10**30]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.builds(nest, st.integers(30, 400), st.just(1), st.sampled_from(["list", "dict"])),
    st.builds(deep_schema, st.integers(30, 200)),
)
HI = [{"role": "user", "content": "hi"}]
TOOL_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}
# A valid request to each body-taking route, with as many fields as it takes: the fuzzer spoils one of them.
BASES = {
    "/v1/chat/completions": {
        "messages": [{"role": "system", "content": "Be brief."}, *HI], "max_tokens": 2, "max_completion_tokens": 2,
        "temperature": 0, "seed": 1, "n": 1, "top_k": 5, "min_tokens": 0, "stop": ["x"], "stop_token_ids": [1],
        "logprobs": True, "top_logprobs": 1, "user": "u", "conversation_id": "fuzz-h", "stream": False,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL_SCHEMA}}], "tool_choice": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TOOL_SCHEMA}},
        "chat_template_kwargs": {"k": "v"}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "seed": 1, "logprobs": 1, "min_tokens": 0,
                        "structured_outputs": {"json": TOOL_SCHEMA}, "stop": ["x"]},
    "/v1/responses": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                      "instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0, "store": False,
                      "metadata": {"k": "v"}, "tools": [{"type": "function", "name": "f", "parameters": TOOL_SCHEMA}],
                      "tool_choice": "none", "text": {"format": {"type": "json_schema", "name": "x",
                                                                  "schema": TOOL_SCHEMA}}},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": HI, "system": "Be brief.", "temperature": 0,
                     "top_k": 5, "metadata": {"user_id": "u"}, "stop_sequences": ["x"],
                     "tools": [{"name": "f", "input_schema": TOOL_SCHEMA}], "tool_choice": {"type": "none"}},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": HI, "system": "Be brief.",
                                  "tools": [{"name": "f", "input_schema": TOOL_SCHEMA}]},
    "/v1/gateway/chat/completions": {"messages": HI, "sessionId": "fuzz-h", "sampling": {
        "maxTokens": 2, "seed": 1, "topK": 5, "stopTokenIds": [1], "stop": ["x"]}},
    "/v1/gateway/completions": {"prompt": "hi", "sampling": {"maxTokens": 2, "minTokens": 0}},
    "/v1/sessions/fuzz-h/end": {},
}


def places(value, path=()):
    """Every path in ``value`` (the value itself included)."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from places(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from places(item, (*path, i))


def spoiled(body, path, bad, as_name: bool):
    """``body`` with ``bad`` at ``path`` (``as_name``: a field named ``bad`` added there, when it is text)."""
    if not path:
        return {**body, bad: 1} if as_name and isinstance(bad, str) and isinstance(body, dict) else bad
    head, rest = path[0], path[1:]
    copy = dict(body) if isinstance(body, dict) else list(body)
    copy[head] = spoiled(body[head], rest, bad, as_name)
    return copy


@st.composite
def hostile_requests(draw):
    route = draw(st.sampled_from(sorted(BASES)))
    base = BASES[route]
    path = draw(st.sampled_from(list(places(base))))
    return route, spoiled(base, path, draw(HOSTILE), draw(st.booleans()))


def check_refused(resp: httpx.Response, route: str, body) -> None:
    """A 4xx (or a 2xx, for what a route may take) in the route's error shape; never a 5xx."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], route, json.dumps(body, allow_nan=True)[:2000])
    if resp.status_code >= 400:
        error = resp.json()
        if route.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"], (resp.text, route)
        else:
            assert error["error"]["message"], (resp.text, route)


def send(client: httpx.Client, route: str, body) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()  # lone surrogates as \\ud800 escapes, as clients send them
    return client.post(route, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("route", sorted(BASES))
def test_the_unspoiled_requests_are_served(client, route):
    """The fuzzer's starting points are valid requests (so that spoiling one field reaches past the others)."""
    resp = send(client, route, BASES[route])
    assert resp.status_code == 200, resp.text


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=hostile_requests())
# What issue #26 found answering a 500 or dropping the connection:
@example(case=("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}))
@example(case=("/v1/chat/completions", {"messages": HI, "\ud800": 1}))
@example(case=("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]}))
@example(case=("/v1/responses", {"input": "hi", "metadata": {"a": "\ud800"}}))
@example(case=("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
    "name": "f", "parameters": deep_schema(200)}}]}))
@example(case=("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f",
                                                            "parameters": deep_schema(200)}]}))
@example(case=("/v1/chat/completions", {"messages": HI, "max_tokens": 10**12}))
# and their kin on the other routes
@example(case=("/v1/chat/completions", {"messages": HI, "max_tokens": 10**12, "stream": True}))
@example(case=("/v1/messages", {"model": "tiny", "max_tokens": 10**12, "messages": HI}))
@example(case=("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": HI,
                                "tools": [{"name": "f", "input_schema": deep_schema(200)}]}))
@example(case=("/v1/responses", {"input": "hi", "max_output_tokens": 10**12}))
@example(case=("/v1/completions", {"prompt": "hi", "seed": 10**30}))
@example(case=("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}}))
@example(case=("/v1/gateway/chat/completions", {"messages": HI, "\ud800": 1}))
@example(case=("/v1/gateway/completions", {"prompt": "hi", "sampling": {"maxTokens": 10**12}}))
def test_hostile_input_in_any_field_of_any_route_is_a_4xx(client, case):
    route, body = case
    check_refused(send(client, route, body), route, body)


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/sessions/%ED%A0%80"), ("DELETE", "/v1/sessions/%ED%A0%80"), ("GET", "/v1/responses/%ED%A0%80"),
    ("DELETE", "/v1/responses/resp_%ED%A0%80"), ("GET", "/v1/sessions/" + "9" * 40),
    ("GET", "/v1/workers?limit=99999999999999999999"), ("POST", "/v1/sessions/%ED%A0%80/end"),
])
def test_hostile_paths_and_queries_are_a_4xx(client, method, path):
    resp = client.request(method, path, **({"json": {}} if method == "POST" else {}))
    check_refused(resp, path, None)


@pytest.mark.parametrize("method", ["Complete", "CompleteStream", "ChatComplete", "ChatCompleteStream", "EndSession"])
def test_grpc_requests_that_do_not_decode_are_invalid_argument(stack, method):
    """Bytes protobuf cannot decode (every request's session_id, field 1, holding a UTF-8-encoded lone surrogate; a
    truncated field): INVALID_ARGUMENT with a message, not UNKNOWN from an exception in the server."""
    with grpc.insecure_channel(stack.gateway_grpc) as channel:
        streaming = method.endswith("Stream")
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(f"/kvshuttle.v1.Gateway/{method}", request_serializer=lambda b: b,
                    response_deserializer=lambda b: b)
        for raw in (b"\x0a\x03\xed\xa0\x80", b"\x0a\x09ab"):
            with pytest.raises(grpc.RpcError) as err:
                list(call(raw, timeout=30)) if streaming else call(raw, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details(), err.value
