"""input_check: what no request may hold, whatever its API (pure)."""

from __future__ import annotations

import math

import pytest
from kvshuttle.services.gateway.edge import input_check
from kvshuttle.services.gateway.edge.input_check import (
    INT32_MAX,
    MAX_BODY_DEPTH,
    MAX_SCHEMA_DEPTH,
    InputError,
    check,
    json_path,
)


def nested(levels: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def refused(body: object, api: input_check.Api = input_check.GENERIC) -> InputError:
    with pytest.raises(InputError) as err:
        check(body, api)
    return err.value


def test_json_paths():
    assert json_path(["messages", 0, "content"]) == "messages[0].content"
    assert json_path([0, "a"]) == "[0].a" and json_path([]) == ""


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "ok \ud800"}]}, "messages[0].content"),
    ({"metadata": {"k": "\udfff"}}, "metadata.k"),
    ({"\ud800x": 1}, "\\ud800x"),  # a key: named with the surrogate escaped, so the error itself can be encoded
    ({"a": [{"b\udc00": None}]}, "a[0].b\\udc00"),
    ({"\u00e9\ud800": 1}, "\u00e9\\ud800"),  # other non-ASCII text in the name stays as it is
    ("\ud83d", ""),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_where(body, param):
    err = refused(body)
    assert err.param == param
    str(err).encode("utf-8")  # the message can be sent


def test_text_utf8_can_encode_is_taken():
    check({"content": "h\u00e9llo \U0001f600 \u4e2d", "\u00e9": ["x"]})


def test_the_body_may_nest_up_to_its_limit():
    check({"a": nested(MAX_BODY_DEPTH - 1)})
    err = refused({"a": nested(MAX_BODY_DEPTH)})
    assert err.param == "a[0][0][0]" and f"deeper than {MAX_BODY_DEPTH}" in str(err)


def schema(levels: int) -> dict:
    out: dict = {"type": "object"}
    for _ in range(levels):
        out = {"type": "object", "properties": {"a": out}}
    return out


@pytest.mark.parametrize("api, body, param", [
    (input_check.CHAT, {"tools": [{"function": {"parameters": "S"}}]}, "tools[0].function.parameters"),
    (input_check.CHAT, {"response_format": {"json_schema": {"schema": "S"}}}, "response_format.json_schema.schema"),
    (input_check.COMPLETIONS, {"structured_outputs": {"json": "S"}}, "structured_outputs.json"),
    (input_check.RESPONSES, {"tools": [{}, {"parameters": "S"}]}, "tools[1].parameters"),
    (input_check.RESPONSES, {"text": {"format": {"schema": "S"}}}, "text.format.schema"),
    (input_check.MESSAGES, {"tools": [{"input_schema": "S"}]}, "tools[0].input_schema"),
])
def test_a_schema_deeper_than_its_limit_is_refused_naming_the_schema(api, body, param):
    def put(value, leaf):
        if value == "S":
            return leaf
        if isinstance(value, dict):
            return {k: put(v, leaf) for k, v in value.items()}
        if isinstance(value, list):
            return [put(v, leaf) for v in value]
        return value

    levels = (MAX_SCHEMA_DEPTH - 1) // 2  # 2 * levels + 1 JSON levels
    check(put(body, schema(levels)), api)
    err = refused(put(body, schema(levels + 1)), api)
    assert err.param == param and f"deeper than {MAX_SCHEMA_DEPTH}" in str(err)
    # elsewhere (not a schema), the same nesting is within the body's limit
    check({"chat_template_kwargs": schema(levels + 1)}, api)


@pytest.mark.parametrize("api, body, param, allowed", [
    (input_check.CHAT, {"max_tokens": 10**12}, "max_tokens", f"1 to {INT32_MAX}"),
    (input_check.CHAT, {"max_tokens": 0}, "max_tokens", f"1 to {INT32_MAX}"),
    (input_check.CHAT, {"max_completion_tokens": 2**31}, "max_completion_tokens", f"1 to {INT32_MAX}"),
    (input_check.CHAT, {"seed": -(2**31) - 1}, "seed", f"{-(2**31)} to {INT32_MAX}"),
    (input_check.CHAT, {"n": 2}, "n", "1 to 1"),
    (input_check.CHAT, {"top_logprobs": 21}, "top_logprobs", "0 to 20"),
    (input_check.CHAT, {"stop_token_ids": [1, -1]}, "stop_token_ids[1]", f"0 to {INT32_MAX}"),
    (input_check.COMPLETIONS, {"logprobs": 10**6}, "logprobs", "0 to 20"),
    (input_check.COMPLETIONS, {"prompt": [3, 2**40]}, "prompt[1]", f"0 to {INT32_MAX}"),
    (input_check.RESPONSES, {"max_output_tokens": 10**12}, "max_output_tokens", f"1 to {INT32_MAX}"),
    (input_check.MESSAGES, {"max_tokens": 10**12}, "max_tokens", f"1 to {INT32_MAX}"),
    (input_check.MESSAGES, {"thinking": {"budget_tokens": 2**32}}, "thinking.budget_tokens", f"1 to {INT32_MAX}"),
    (input_check.PROTO, {"sampling": {"max_tokens": -1}}, "sampling.max_tokens", f"0 to {INT32_MAX}"),
])
def test_an_integer_beyond_the_engines_range_is_refused_with_the_range(api, body, param, allowed):
    err = refused(body, api)
    assert err.param == param and str(err).startswith(f"{param}: ") and f"(allowed: {allowed})" in str(err)


def test_no_field_takes_an_integer_beyond_64_bits_nor_a_number_that_is_not_finite():
    assert refused({"chat_template_kwargs": {"x": [2**64]}}).param == "chat_template_kwargs.x[0]"
    assert "an integer of 4000 bits" in str(refused({"x": 2**3999}))
    for bad in (math.nan, math.inf, -math.inf):
        assert refused({"temperature": bad}).param == "temperature"
    check({"x": 2**63 - 1, "y": -(2**63), "z": 1.5e308, "t": True})


def test_the_ranges_apply_to_their_api_only():
    check({"max_tokens": 10**12}, input_check.RESPONSES)  # not a Responses field: its model refuses it by name
    check({"tools": [{"function": {"parameters": schema(MAX_SCHEMA_DEPTH // 2 + 4)}}]}, input_check.MESSAGES)


def test_a_schema_that_came_as_text_is_checked_once_parsed():
    err = refused_schema(schema(MAX_SCHEMA_DEPTH), "structured_outputs.json")
    assert err.param == "structured_outputs.json" and f"deeper than {MAX_SCHEMA_DEPTH}" in str(err)
    err = refused_schema({"properties": {"a\ud800": {}}}, "structured_outputs.json")
    assert err.param == "structured_outputs.json.properties.a\\ud800"
    input_check.check_schema(schema(4), "structured_outputs.json")


def refused_schema(value: object, param: str) -> InputError:
    with pytest.raises(InputError) as err:
        input_check.check_schema(value, param)
    return err.value
