"""The tool-call parser families (control_plane.tool_calls): whole answers written out, streams split at every
position giving exactly the whole answer's parts, and vLLM's own parsers (run in a subprocess: vLLM must not be
imported here) finding the same calls and content in the same text, or differing only where we chose to."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from dataclasses import dataclass, field

import pytest
from kvshuttle.control_plane.answer import AnswerParser, ParsedAnswer, Piece, parse_answer
from kvshuttle.control_plane.reasoning import REASONING_PARSERS
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS, ParsedCall, schema_types, typed
from kvshuttle.services.gateway.apis.openai.chat_answer import AnswerShape
from kvshuttle.services.gateway.turns.parsers import AnswerEvents, AnswerParsing

from tests.support import vllm_reference
from tests.support.streaming import streamed


def tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name.replace("_", " "),
                                             "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]},
                         "detailed": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "filters": {"type": "object", "properties": {"max": {"type": "number"}}},
                         "note": {"type": ["string", "null"]}, "ratio": {"anyOf": [{"type": "number"},
                                                                                     {"type": "string"}]}}),
    tool("get_time", {"tz": {"type": "string"}}),
    tool("run_python", {"code": {"type": "string"}}),
]
WEATHER = '{"city": "Paris", "days": 3}'


@dataclass(frozen=True)
class Case:
    """An answer's content, what our parser makes of it, and (``vllm``) what vLLM's does where that differs."""

    id: str
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, str]]
    tools: list | None = field(default_factory=lambda: TOOLS)
    vllm: tuple[str | None, list[tuple[str, str]]] | None = None  # vLLM's (content, calls), where we differ
    vocab: str = "default"  # the tokenizer vLLM gets (mistral: "legacy" has no [ARGS], so it reads the JSON array)


def qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm_call(name: str, **params: str) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in params.items()) + "</tool_call>"


def ds_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds_block(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>"


QWEN_WEATHER = qwen_call("get_weather", city="Paris", days="3")
GLM_WEATHER = glm_call("get_weather", city="Paris", days="3")
TYPED = dict(city="Zürich", days="07", units="c", detailed="1", tags='["sun", "wind"]', filters='{"max": 2.50}',
             note="null", ratio="0.5")
TYPED_ARGS = ('{"city": "Zürich", "days": 7, "units": "c", "detailed": true, "tags": ["sun", "wind"], '
              '"filters": {"max": 2.5}, "note": null, "ratio": 0.5}')
CODE = "def f(x):\n    return {'a': x}  # </parameter> is not here\n"

CASES = [
    # -- qwen3_coder --
    Case("qwen-one", "qwen3_coder", "Let me check.\n\n" + QWEN_WEATHER, "Let me check.",
         [("get_weather", WEATHER)]),
    Case("qwen-parallel", "qwen3_coder", QWEN_WEATHER + "\n" + qwen_call("get_time", tz="Europe/Paris") + "\nDone.",
         None, [("get_weather", WEATHER), ("get_time", '{"tz": "Europe/Paris"}')]),
    Case("qwen-typed-unicode", "qwen3_coder", "Voilà 🌤\n" + qwen_call("get_weather", **TYPED), "Voilà 🌤",
         [("get_weather", TYPED_ARGS)]),
    Case("qwen-untyped", "qwen3_coder", QWEN_WEATHER, None, [("get_weather", '{"city": "Paris", "days": "3"}')],
         tools=None),
    Case("qwen-multiline", "qwen3_coder", qwen_call("run_python", code=CODE.replace("</parameter>", "/param")),
         None, [("run_python", json.dumps({"code": CODE.replace("</parameter>", "/param")}, ensure_ascii=False))]),
    Case("qwen-two-functions-one-block", "qwen3_coder",
         "<tool_call>\n<function=get_time>\n</function>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n"
         "</function>\n</tool_call>", None, [("get_time", "{}"), ("get_time", '{"tz": "UTC"}')]),
    Case("qwen-function-without-block", "qwen3_coder", "<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n"
         "</function>", None, [("get_time", '{"tz": "UTC"}')]),
    Case("qwen-ends-after-parameters", "qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n"
         "</parameter>\n", None, [("get_time", '{"tz": "UTC"}')]),
    Case("qwen-unclosed-parameter", "qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n"
         "<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", None, [("get_time", '{"tz": "UTC", "x": "1"}')]),
    # Cut off inside a value: the text is content; vLLM reports the call without the unfinished parameter.
    Case("qwen-truncated", "qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
         "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [],
         vllm=("Checking.", [("get_weather", "{}")])),
    # The block's text before <function= is dropped by vLLM; a block without a function is content here.
    Case("qwen-empty-block", "qwen3_coder", "a <tool_call>\n</tool_call> b", "a <tool_call>\n</tool_call> b", [],
         vllm=("a  b", [])),
    # Whitespace that starts the content stays (vLLM strips it in whole answers only, not in streams).
    Case("qwen-leading-space", "qwen3_coder", "  Sure.\n" + qwen_call("get_time"), "  Sure.", [("get_time", "{}")],
         vllm=("Sure.", [("get_time", "{}")])),
    Case("qwen-only-space-first", "qwen3_coder", "\n\n" + qwen_call("get_time", tz=" UTC "), None,
         [("get_time", '{"tz": " UTC "}')]),
    Case("qwen-no-call", "qwen3_coder", "x < y, and <tool is text; <function is too", "x < y, and <tool is text; "
         "<function is too", []),
    # -- glm45 --
    Case("glm-one", "glm45", "I'll look it up.\n" + GLM_WEATHER, "I'll look it up.", [("get_weather", WEATHER)]),
    Case("glm-compact-parallel", "glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "</tool_call><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>", None,
         [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]),
    Case("glm-typed-unicode", "glm45", glm_call("get_weather", **TYPED) + "\nafter", None,
         [("get_weather", TYPED_ARGS)]),
    Case("glm-value-kept-as-written", "glm45", glm_call("run_python", code="\n" + CODE), None,
         [("run_python", json.dumps({"code": "\n" + CODE}, ensure_ascii=False))]),
    Case("glm-no-arguments", "glm45", "<tool_call>get_time</tool_call>", None, [("get_time", "{}")]),
    Case("glm-untyped", "glm45", GLM_WEATHER, None, [("get_weather", '{"city": "Paris", "days": "3"}')],
         tools=[tool("get_weather", {})]),
    Case("glm-no-tools", "glm45", GLM_WEATHER, None, [("get_weather", '{"city": "Paris", "days": "3"}')],
         tools=None, vllm=(None, [])),  # vLLM parses no calls for a request without tools
    # A name the request has no tool for is no call (vLLM's rule); vLLM drops its text, here it is content.
    Case("glm-unknown-tool", "glm45", "Hm. " + glm_call("get_stock", sym="X") + " ok", "Hm. " +
         glm_call("get_stock", sym="X") + " ok", [], vllm=("Hm.  ok", [])),
    Case("glm-truncated", "glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", [], vllm=(None, [("get_weather", "{}")])),
    # -- llama3_json --
    Case("llama-python-tag", "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + "}",
         None, [("get_weather", WEATHER)]),
    Case("llama-parallel", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "arguments": {"tz": "UTC"}}', None,
         [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]),
    Case("llama-nested-unicode", "llama3_json", '{"name": "get_weather", "parameters": {"city": "東京", '
         '"filters": {"max": [1, 2.5, null], "q": "a}b{\\"c"}}}', None,
         [("get_weather", '{"city": "東京", "filters": {"max": [1, 2.5, null], "q": "a}b{\\"c"}}')]),
    # vLLM reports no content once it finds a call; a stream cannot take the text back, so it stays content here.
    Case("llama-text-first", "llama3_json", 'Sure, checking.\n{"name": "get_time", "parameters": {}}',
         "Sure, checking.", [("get_time", "{}")], vllm=(None, [("get_time", "{}")])),
    Case("llama-text-and-tag-first", "llama3_json", 'Sure.\n\n<|python_tag|>{"name": "get_time", "parameters": '
         'null}', "Sure.", [("get_time", "null")], vllm=(None, [("get_time", "null")])),
    Case("llama-truncated", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Par',
         '{"name": "get_weather", "parameters": {"city": "Par', []),
    # A broken second call is content; vLLM then reports the whole answer as content and no calls.
    Case("llama-broken-second", "llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
         '"parameters": {"city": }}', '{"name": "get_weather", "parameters": {"city": }}', [("get_time", "{}")], vllm=(
             '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": }}', [])),
    Case("llama-prose-braces", "llama3_json", "Use a set like {1, 2} or f'{x}'.", "Use a set like {1, 2} or "
         "f'{x}'.", []),
    Case("llama-json-not-a-call", "llama3_json", 'Here: {"city": "Paris"}', 'Here: {"city": "Paris"}', []),
    Case("llama-python-code", "llama3_json", "<|python_tag|>print(sum([1, 2]))", "<|python_tag|>print(sum([1, 2]))",
         []),
    # -- mistral, v11+ form --
    Case("mistral-one", "mistral", "Sure.\n\n[TOOL_CALLS]get_weather[ARGS]" + WEATHER, "Sure.",
         [("get_weather", WEATHER)]),
    Case("mistral-parallel-compact", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}[TOOL_CALLS]get_time'
         '[ARGS]{}', None, [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]),
    Case("mistral-typed-unicode", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": "4", '
         '"filters": {"max": "2"}, "tags": ["☀"]}', None,
         [("get_weather", '{"city": "Zürich", "days": 4, "filters": {"max": 2}, "tags": ["☀"]}')]),
    Case("mistral-name-brace", "mistral", '[TOOL_CALLS]get_time{"tz": "UTC"} and more', None,
         [("get_time", '{"tz": "UTC"}')]),
    # Cut off: content here; vLLM reports a call whose arguments are not JSON.
    Case("mistral-truncated", "mistral", 'Ok [TOOL_CALLS]get_weather[ARGS]{"city": "Par',
         'Ok [TOOL_CALLS]get_weather[ARGS]{"city": "Par', [], vllm=("Ok", [("get_weather", '{"city": "Par')])),
    # -- mistral, the JSON array of tokenizers before v11 --
    Case("mistral-array", "mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"tz": "UTC"}}]', None,
         [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')], vocab="legacy"),
    Case("mistral-array-text-first", "mistral", 'Checking 🌍.\n[TOOL_CALLS][{"name": "get_weather", "arguments": '
         '{"city": "Zürich", "filters": {"max": 1}}}] trailing', "Checking 🌍.\n",
         [("get_weather", '{"city": "Zürich", "filters": {"max": 1}}')], vocab="legacy"),
    Case("mistral-array-string-arguments", "mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": '
         '"{\\"tz\\": \\"UTC\\"}"}]', None, [("get_time", '{"tz": "UTC"}')], vocab="legacy"),
    # Each marker starts calls here; vLLM reads only the first one's.
    Case("mistral-array-twice", "mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}][TOOL_CALLS]'
         '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
         [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')], vllm=(None, [("get_time", "{}")]),
         vocab="legacy"),
    # Cut off: content here; vLLM makes the JSON after the marker the content.
    Case("mistral-array-truncated", "mistral", 'So: [TOOL_CALLS][{"name": "get_weather", "argu',
         'So: [TOOL_CALLS][{"name": "get_weather", "argu', [],
         vllm=('[{"name": "get_weather", "argu', []), vocab="legacy"),
    # -- deepseek_v3 --
    Case("deepseek-one", "deepseek_v3", "Checking.\n\n" + ds_block(ds_call("get_weather", WEATHER)), "Checking.\n\n",
         [("get_weather", WEATHER)]),
    Case("deepseek-parallel", "deepseek_v3", ds_block(ds_call("get_weather", '{"city":"Paris"}'),
                                                      ds_call("get_time", "{}")) + "\nbye", None,
         [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]),
    Case("deepseek-nested-unicode", "deepseek_v3", ds_block(ds_call("get_weather", '{"city": "São Paulo", '
                                                                    '"filters": {"max": [1, {"a": "é"}]}}')), None,
         [("get_weather", '{"city": "São Paulo", "filters": {"max": [1, {"a": "é"}]}}')]),
    # Cut off: content here; vLLM reports the content before the calls and no calls.
    Case("deepseek-truncated", "deepseek_v3", "Hi\n<｜tool▁calls▁begin｜>" + ds_call("get_weather", WEATHER)[:-40],
         "Hi\n<｜tool▁calls▁begin｜>" + ds_call("get_weather", WEATHER)[:-40], [], vllm=("Hi\n", [])),
    # Arguments over several lines: vLLM's pattern takes one-line arguments only, and misses the call.
    Case("deepseek-multiline-arguments", "deepseek_v3", ds_block(ds_call("get_time", '{\n  "tz": "UTC"\n}')), None,
         [("get_time", '{\n  "tz": "UTC"\n}')], vllm=(None, [])),
    Case("deepseek-no-call", "deepseek_v3", "Just text, with ```json\n{}\n``` in it.",
         "Just text, with ```json\n{}\n``` in it.", []),
    # -- hermes (unchanged) --
    Case("hermes-one", "hermes", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
         "Sure.", [("get_time", '{"tz": "UTC"}')]),
    Case("hermes-parallel", "hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>'
         '{"name": "get_weather", "arguments": {"city": "Köln"}}</tool_call>', None,
         [("get_time", "{}"), ("get_weather", '{"city": "Köln"}')]),
]
# (schema, value, typed value): checked by hand here, and against vLLM as mistral calls' arguments (TYPING_CASES).
TYPING = [
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, "4.5", 4.5),  # not an integer: the JSON it is
    ({"type": "integer"}, "many", "many"),
    ({"type": "number"}, "2.0", 2),
    ({"type": "number"}, "1e999", "1e999"),  # not finite: kept as text
    ({"type": "boolean"}, "False", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "NULL", None),
    ({"type": ["integer", "string"]}, "x1", "x1"),
    ({"type": "object"}, '{"a": [1]}', {"a": [1]}),
    ({"type": "array"}, "[1, 2", "[1, 2"),
    ({"type": "int"}, "7", 7),  # vLLM's aliases of the type names
    ({"type": "string"}, "7", "7"),
    ({"type": "string"}, 7, "7"),  # a JSON value typed too
    ({"type": "boolean"}, 1, True),
    ({"type": "array", "items": {"type": "integer"}}, ["1", 2, "x"], [1, 2, "x"]),
    ({"type": "object", "properties": {"n": {"type": "number"}}}, {"n": "1.5", "m": "2"}, {"n": 1.5, "m": "2"}),
]
TYPING_CASES = [
    Case(f"typed-{i}", "mistral", "[TOOL_CALLS]f[ARGS]" + json.dumps({"v": value, "other": "1"}), None,
         [("f", json.dumps({"v": want, "other": "1"}))], tools=[tool("f", {"v": schema})])
    for i, (schema, value, want) in enumerate(TYPING)
]
CASES += TYPING_CASES
IDS = [c.id for c in CASES]


def test_every_family_is_tested():
    aliases, harmony = {"qwen3_json", "qwen3_xml", "glm47", "llama4_json"}, {"openai"}  # test_harmony_parser.py
    assert {c.parser for c in CASES} | aliases | harmony == set(TOOL_CALL_PARSERS)


def _got(parsed: ParsedAnswer) -> tuple[str | None, list[tuple[str, str]]]:
    assert [c.index for c in parsed.tool_calls] == list(range(len(parsed.tool_calls)))
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_answers(case: Case):
    got = parse_answer(case.text, None, TOOL_CALL_PARSERS[case.parser], request_tools=case.tools)
    assert got.reasoning is None
    assert _got(got) == (case.content, case.calls)


def _streamed(case: Case, cuts: list[int]) -> tuple[ParsedAnswer, list]:
    return streamed(AnswerParser(None, TOOL_CALL_PARSERS[case.parser], request_tools=case.tools), case.text, cuts)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streams_split_anywhere_give_the_whole_answer(case: Case):
    whole = _got(parse_answer(case.text, None, TOOL_CALL_PARSERS[case.parser], request_tools=case.tools))
    for cut in range(1, len(case.text)):  # one split, at every position
        assert _got(_streamed(case, [cut])[0]) == whole, cut
    got, events = _streamed(case, list(range(1, len(case.text))))  # one character at a time
    assert _got(got) == whole
    assert all(e.text for e in events if isinstance(e, Piece))  # no empty pieces


FRAGMENTS = {  # tags, text, and whole calls (a call's pieces make calls only by chance)
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "get_time", "arguments": {}}', "{", "}", " ", "\n", "x",
               "<tool"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "get_time", ">", "</function>", "<parameter=", "tz",
                    "</parameter>", "\n", " ", "UTC", "é", "<", "</"],
    "glm45": ["<tool_call>", "</tool_call>", "get_time", "get_stock", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>", "tz", "UTC", "\n", " ", "é", "<"],
    "llama3_json": ["<|python_tag|>", "{", "}", '"name"', ": ", '"get_time"', ", ", '"parameters"', "{}", "; ", " ",
                    "\n", '"', "\\", "[", "]", "x", "<|"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "get_time", "{", "}", '"tz"', ": ", '"UTC"', ", ", "[", "]",
                '{"name": "get_time", "arguments": {}}', " ", "\n", "x", "[TOOL"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "function", "get_time", "\n```json\n", "{}", "\n```", "\n", " ", "x", "<｜tool"],
}
for name, call in [("qwen3_coder", qwen_call("get_time", tz="UTC")), ("glm45", glm_call("get_time", tz="UTC")),
                   ("llama3_json", '{"name": "get_time", "parameters": {"tz": "UTC"}}'),
                   ("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'), ("deepseek_v3", ds_call("get_time", "{}"))]:
    FRAGMENTS[name].append(call)


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_random_answers_stream_as_they_parse_whole(name: str):
    """Answers pieced together from a family's tags and text, mostly broken: streams split anywhere give the whole
    answer's parts, and an answer in which no call parses is all content (hermes aside: its broken call still ends
    the content)."""
    rng = random.Random(name)
    factory = TOOL_CALL_PARSERS[name]
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 24)))
        whole = parse_answer(text, None, factory, request_tools=TOOLS)
        case = Case("fuzz", name, text, whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
        splits = [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) for k in (1, 1, 3, 8)]
        for cuts in [*splits, list(range(1, len(text)))]:
            got, events = _streamed(case, cuts)
            assert _got(got) == _got(whole), (text, cuts)
            assert all(e.text for e in events if isinstance(e, Piece)), (text, cuts)
        if not whole.tool_calls and name != "hermes":
            assert whole.content == (text or None), text


def test_a_call_is_reported_when_it_ends_and_content_whitespace_waits_for_what_follows():
    parser = AnswerParser(None, TOOL_CALL_PARSERS["qwen3_coder"], request_tools=TOOLS)
    assert list(parser.feed("Checking \n")) == [Piece("content", "Checking")]
    assert list(parser.feed("the weather.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n")) == [
        Piece("content", " \nthe weather.")]
    assert list(parser.feed("</parameter>\n<parameter=days>\n3\n</parameter>\n")) == []
    assert list(parser.feed("</function>")) == [ParsedCall(0, "get_weather", WEATHER)]  # before </tool_call>
    assert list(parser.feed("\n</tool_call>\nI called it.")) == []
    assert list(parser.finish()) == []
    assert parser.called_tools


def test_reasoning_then_calls():
    got = parse_answer("<think>\nWhich city?\n</think>\n\n" + QWEN_WEATHER, REASONING_PARSERS["qwen3"],
                       TOOL_CALL_PARSERS["qwen3_coder"], request_tools=TOOLS)
    assert (got.reasoning, *_got(got)) == ("\nWhich city?\n", None, [("get_weather", WEATHER)])


def test_the_gateway_types_arguments_by_the_requests_tools():
    text = "Looking.\n" + GLM_WEATHER
    parsing = AnswerParsing(tools=TOOL_CALL_PARSERS["glm45"], request_tools=TOOLS)
    whole, events = AnswerShape(parsed=True, new_id=lambda: "call-1"), AnswerEvents(parsing, "")
    events.feed(text)
    events.finish()
    assert whole.message(text, events.events) == ({"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}]}, True)
    stream, events = AnswerShape(parsed=True, new_id=lambda: "call-1"), AnswerEvents(parsing, "")
    deltas = [d for i in range(0, len(text), 5) for d in stream.deltas(events.feed(text[i:i + 5]))]
    deltas += stream.finish_deltas(events.finish())
    assert "".join(d.get("content", "") for d in deltas) == "Looking."
    assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": WEATHER}]


def test_a_whitespace_only_content_is_kept_without_a_call():
    for name in ("qwen3_coder", "glm45", "llama3_json", "mistral", "deepseek_v3"):
        assert parse_answer("\n\n", None, TOOL_CALL_PARSERS[name]).content == "\n\n"
        assert parse_answer("a\n", None, TOOL_CALL_PARSERS[name]).content == "a\n"


def test_a_long_call_is_scanned_once():
    """Searching for a call's end resumes where it stopped, so feeding a long call in pieces stays linear."""
    value = "x" * 200_000
    for name, text in [("qwen3_coder", qwen_call("run_python", code=value)),
                       ("glm45", glm_call("run_python", code=value)),
                       ("mistral", "[TOOL_CALLS]run_python[ARGS]" + json.dumps({"code": value})),
                       ("llama3_json", json.dumps({"name": "run_python", "parameters": {"code": value}}))]:
        parser = AnswerParser(None, TOOL_CALL_PARSERS[name], request_tools=TOOLS)
        events = [e for i in range(0, len(text), 4) for e in parser.feed(text[i:i + 4])] + list(parser.finish())
        assert [e.name for e in events] == ["run_python"], name


@pytest.mark.parametrize("schema,types", [
    ({"type": "integer"}, {"integer"}),
    ({"type": ["string", "null"]}, {"string", "null"}),
    ({"enum": ["a", 1, 2.5, True, None]}, {"string", "integer", "number", "boolean", "null"}),
    ({"anyOf": [{"type": "number"}, {"oneOf": [{"type": "object"}]}]}, {"number", "object"}),
    ({"description": "no type"}, {"string"}),
    (None, {"string"}),
])
def test_schema_types(schema, types):
    assert schema_types(schema) == types


@pytest.mark.parametrize("schema,value,want", TYPING)
def test_values_are_typed_by_the_schema_as_vllm_types_them(schema, value, want):
    tools = [tool("f", {"v": schema})]
    got = json.loads(typed(json.dumps({"v": value, "other": "1"}), "f", tools))
    assert got == {"v": want, "other": "1"} and type(got["v"]) is type(want)


def test_arguments_stay_as_written_when_nothing_is_typed():
    assert typed('{"city":"Paris"}', "get_weather", TOOLS) == '{"city":"Paris"}'
    assert typed('{"days":"3"}', "get_weather", None) == '{"days":"3"}'
    assert typed('{"days":"3"}', "get_weather", TOOLS) == '{"days": 3}'


# -- vLLM's own parsers on the same text ----------------------------------------------------------------------------


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # vLLM passes some unparsable arguments on as they are


def _comparable(content: str | None, calls: list) -> tuple:
    return content, [(name, _arguments(args)) for name, args in calls]


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory) -> dict[str, dict]:
    if importlib.util.find_spec("vllm") is None:  # looked up, not imported (see tests/conftest.py require_module)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("vllm is not installed: CI runs every test (make install installs it)", pytrace=False)
        pytest.skip("vllm is not installed")
    cases = [{"parser": c.parser, "text": c.text, "tools": c.tools, "vocab": c.vocab} for c in CASES]
    proc = vllm_reference.start(cases, tmp_path_factory.mktemp("vllm"))
    return dict(zip(IDS, vllm_reference.results(proc), strict=True))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vllm_finds_the_same_calls(case: Case, vllm_results):
    result = vllm_results[case.id]
    assert "error" not in result, result.get("error")
    want = case.vllm or (case.content, case.calls)
    assert _comparable(result["content"], result["calls"]) == _comparable(*want)
