"""Guided-decoding constraints (control_plane.constraints): forced tool calls in the model's own syntax, JSON answers,
each optionally after a reasoning block. Compiled and checked with xgrammar (the grammar engine vLLM's workers use)
in a child process: what the grammar accepts and refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvshuttle.control_plane.constraints import CALL_SYNTAX, Constraint, after_reasoning, forced_tool_calls, json_answer
from kvshuttle.workers import agent_script as script

THINK = ("<think>", "</think>")
HERMES = CALL_SYNTAX["hermes"]
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

CHECK = """
import json, sys
import xgrammar
from xgrammar.testing import _is_grammar_accept_string
cases = json.load(sys.stdin)
out = []
for structural, kind, value, texts in cases:
    if kind == "structural_tag":
        grammar = xgrammar.Grammar.from_structural_tag(value)
    elif kind == "json_schema":
        grammar = xgrammar.Grammar.from_json_schema(value)
    else:
        grammar = xgrammar.Grammar.builtin_json_grammar()
    out.append([_is_grammar_accept_string(grammar, t) for t in texts])
print(json.dumps(out))
"""


def accepted(cases: list[tuple[object, list[str]]]) -> list[list[bool]]:
    payload = [[True, c.kind, c.value, texts] for c, texts in cases]
    done = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def generated(step: int) -> str:
    return script.assistant_text(step)[:-len(script.END)]


def without_reasoning(text: str) -> str:
    return text[text.index("</think>\n\n") + len("</think>\n\n"):]


OPEN = "<|im_start|>assistant\n"  # the model may reason first
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking turned off in the prompt
INSIDE = "<|im_start|>assistant\n<think>\n"  # the prompt opened the reasoning block


def placed(constraint, prompt: str):
    return after_reasoning(constraint, THINK, prompt)


@pytest.fixture(scope="module")
def results():
    tools = [*script.TOOLS, OTHER_TOOL]
    one, two, answer = generated(0), generated(2), generated(1)
    call_time = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
    schema = {"type": "object", "properties": {"temperature_c": {"type": "integer"}}, "required": ["temperature_c"]}
    required, named = forced_tool_calls(HERMES, tools, None), forced_tool_calls(HERMES, tools, "get_weather")
    return accepted([
        (placed(required, OPEN),
         [one, two, without_reasoning(one), call_time, answer, bad_args, one + "\n" + call_time]),
        (placed(named, OPEN), [one, two, call_time, without_reasoning(one)]),
        (placed(required, CLOSED), [one, without_reasoning(two)]),
        (placed(json_answer(schema), OPEN), ['<think>\nhot\n</think>\n\n{"temperature_c": 21}',
                                             '{"temperature_c": 21}', '{"temperature_c": "warm"}', "It is 21."]),
        (placed(json_answer(schema), CLOSED), ['{"temperature_c": 21}',
                                               '<think>\nx\n</think>\n\n{"temperature_c": 21}']),
        (placed(json_answer(None), OPEN), ['{"a": [1, {"b": null}]}', '<think>\nx\n</think>\n\n{}', "[1]"]),
        (placed(json_answer(schema), INSIDE), ['still thinking\n</think>\n\n{"temperature_c": 4}',
                                               '{"temperature_c": 4}']),
    ])


def test_required_forces_one_or_more_calls_in_the_models_own_syntax(results):
    # the script's own answers (reasoning first, one call; two calls), no reasoning, another tool: yes.
    # A plain answer, arguments outside the schema: no. Calls after calls, newline-separated as the template: yes.
    assert results[0] == [True, True, True, True, False, False, True]


def test_a_named_function_forces_exactly_one_call_of_it(results):
    assert results[1] == [True, False, False, True]


def test_a_prompt_that_closed_the_reasoning_gets_the_constraint_at_once_as_vllm_applies_it(results):
    assert results[2] == [False, True]
    assert results[4] == [True, False]
    schema = json_answer({"type": "object"})
    assert placed(schema, CLOSED) == schema and placed(schema, CLOSED + "  \n") == schema


def test_json_answers_follow_the_schema_after_optional_reasoning(results):
    assert results[3] == [True, True, False, False]
    assert results[5] == [True, True, False]  # json_object: any object, not an array


def test_inside_a_reasoning_block_the_model_finishes_it_first(results):
    assert results[6] == [True, False]


def test_the_constraint_kinds():
    assert json_answer(None).kind == "json_object" and json_answer(None).value is True
    assert json_answer({"type": "object"}).kind == "json_schema"
    assert json.loads(json_answer({"type": "object"}).value) == {"type": "object"}
    forced = forced_tool_calls(HERMES, script.TOOLS, None)
    assert forced.kind == "structural_tag" and json.loads(forced.value)["type"] == "structural_tag"
    regex = Constraint("regex", "[0-9]+")
    assert placed(regex, OPEN) == regex  # a client's own constraint is taken as given
