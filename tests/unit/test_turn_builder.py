"""The turn builder and its tool rules (services/gateway/turns/builder.py, turns/tools.py): the rules every API's turn
follows, checked alone. The front ends' own tests (test_chat_tools, test_anthropic_api, test_responses_api) check that
each API reaches them."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from kvshuttle.control_plane.constraints import json_answer
from kvshuttle.services.gateway.turns import tools as tool_rules
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import (
    ANTHROPIC_TOOLS,
    OPENAI_TOOLS,
    RESPONSES_TOOLS,
    FunctionIn,
    NamedTool,
    ToolUse,
)

WEATHER = FunctionIn(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})
CLOCK = FunctionIn(name="now")


def builder(tools: str = "hermes", reasoning: str = "qwen3") -> TurnBuilder:
    return TurnBuilder("agent", 17, tool_call_parser=tools, reasoning_parser=reasoning)


@pytest.mark.parametrize("words, tools, choice, param, says", [
    (OPENAI_TOOLS, [], "required", "tool_choice", "tool_choice 'required' needs tools"),
    (RESPONSES_TOOLS, [], "required", "tool_choice", "tool_choice 'required' needs tools"),
    (ANTHROPIC_TOOLS, [], "required", "tool_choice", "tool_choice 'any' needs tools"),
    (ANTHROPIC_TOOLS, [], NamedTool("x"), "tool_choice", "tool_choice 'tool' needs tools"),
    (OPENAI_TOOLS, [], NamedTool("x"), "tool_choice", "names 'x', which is not among the tools (none given)"),
    (OPENAI_TOOLS, [WEATHER], NamedTool("x"), "tool_choice", "not among the tools (get_weather)"),
    (OPENAI_TOOLS, [WEATHER, WEATHER], "auto", "tools.1.function.name", "two tools are named 'get_weather'"),
    (RESPONSES_TOOLS, [WEATHER, WEATHER], "auto", "tools.1.name", "two tools are named"),
    (ANTHROPIC_TOOLS, [CLOCK, WEATHER, WEATHER], "auto", "tools.2.name", "two tools are named"),
    (OPENAI_TOOLS, [FunctionIn(name="f", parameters={"type": "array"})], None, "tools.0.function.parameters",
     "must be a JSON Schema of type 'object', got type 'array'"),
    (RESPONSES_TOOLS, [FunctionIn(name="f", parameters={"type": "array"})], None, "tools.0.parameters",
     "of type 'object'"),
    (ANTHROPIC_TOOLS, [FunctionIn(name="f", parameters={"type": "object", "properties": 3})], None,
     "tools.0.input_schema", "not a valid JSON Schema"),
])
def test_one_tool_check_for_every_api_naming_its_fields(words, tools, choice, param, says):
    with pytest.raises(FieldError) as err:
        builder().tools(tools, choice, words)
    assert err.value.param == param and says in str(err.value), (err.value.param, str(err.value))


def test_tools_without_a_tool_call_parser_are_refused_unless_no_call_is_asked_for():
    b = builder(tools="")
    with pytest.raises(FieldError) as err:
        b.tools([WEATHER], "auto", ANTHROPIC_TOOLS)
    assert err.value.param == "tools" and 'send tool_choice {"type": "none"}' in str(err.value)
    use = b.tools([WEATHER], "none")  # rendered for the template, calls not parsed
    assert not use.calls and use.forced is None and use.tools[0]["function"]["name"] == "get_weather"


def test_calls_are_parsed_and_kept_with_their_special_tokens():
    b = builder()
    use = b.tools([WEATHER], "auto")
    assert use.calls and use.forced is None
    req = b.request(use, messages=[{"role": "user", "content": "x"}])
    assert req.parsing.tools is not None and req.parsing.request_tools == use.tools
    assert req.skip_special_tokens is False and req.max_tokens is None  # none asked: set with the prompt's length
    assert req.default_max_tokens == 17  # the gateway's default, if the context leaves more
    plain = b.request(b.tools([WEATHER], "none"), skip_special_tokens=True, max_tokens=5)
    assert plain.parsing.tools is None and plain.skip_special_tokens is True and plain.max_tokens == 5


def test_harmony_keeps_special_tokens_and_takes_no_constraint():
    b = builder(tools="openai", reasoning="openai_gptoss")
    assert b.request().skip_special_tokens is False  # its channel markers, tools or not
    with pytest.raises(FieldError) as err:
        b.constraint(json_answer(None), "text.format")
    assert err.value.param == "text.format" and "Harmony" in str(err.value)


def test_a_forced_call_starts_after_the_reasoning_and_excludes_structured_output():
    b = builder()
    forced = b.tools([WEATHER, CLOCK], NamedTool("get_weather"))
    assert forced.calls and forced.forced is not None
    req = b.request(forced, constraint=b.constraint(None, "response_format", forced))
    assert req.constraint == forced.forced and req.reasoning_tags == ("<think>", "</think>")
    with pytest.raises(FieldError) as err:
        b.constraint(json_answer(None), "response_format", forced)
    assert err.value.param == "response_format" and "exclude each other" in str(err.value)
    # vLLM's raw structured_outputs applies from the first token, as in vLLM
    raw = b.request(ToolUse([]), constraint=json_answer(None), constraint_after_reasoning=False)
    assert raw.constraint is not None and raw.reasoning_tags is None
    assert b.request(forced).reasoning_tags is None  # no constraint: nothing to place


def test_parallel_tool_calls_false_forces_exactly_one_call():
    b = builder()
    many = json.loads(b.tools([WEATHER, CLOCK], "required").forced.value)
    one = json.loads(b.tools([WEATHER, CLOCK], "required", parallel=False).forced.value)
    assert not many["format"]["stop_after_first"] and one["format"]["stop_after_first"]


def test_a_valid_schema_is_checked_once_per_tenant_and_an_invalid_one_every_time(monkeypatch):
    checked = []
    real = Draft202012Validator.check_schema
    monkeypatch.setattr(Draft202012Validator, "check_schema",
                        classmethod(lambda cls, schema, **kw: (checked.append(schema), real(schema, **kw))[1]))
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    reordered = {"properties": {"days": {"type": "integer"}, "city": {"type": "string"}}, "type": "object"}
    tool_rules.check_schema(schema, "tools.0.function.parameters", "x", tenant="acme-memo")
    tool_rules.check_schema(reordered, "tools.0.function.parameters", "x", tenant="acme-memo")  # the same schema
    assert len(checked) == 1
    tool_rules.check_schema(schema, "tools.0.function.parameters", "x", tenant="other-memo")  # never shared
    assert len(checked) == 2
    bad = {"type": "object", "properties": {"city": {"type": 7}}}
    for _ in range(2):
        with pytest.raises(FieldError, match="not a valid JSON Schema"):
            tool_rules.check_schema(bad, "tools.0.function.parameters", "x", tenant="acme-memo")
    assert len(checked) == 4
