"""Forced tool calls (``tool_choice`` ``required`` or a named function) in every family's own syntax
(control_plane/tool_calls/, constraints.forced_tool_calls): for each family, the constraint for a named tool and for
``required`` (and ``required`` with one call, ``parallel_tool_calls`` false), compiled and checked with xgrammar (the
grammar engine vLLM's workers use) in a child process; that what the grammar accepts parses back, with the family's own
parser, into the calls written; and the real proof, that the text each family's test template (tests/support/
family_templates.py, written from the real templates) renders for an echoed call is text the grammar accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
from kvshuttle.control_plane.answer import parse_answer
from kvshuttle.control_plane.constraints import CALL_SYNTAX, forced_tool_calls, not_forced
from kvshuttle.control_plane.tool_calls import FAMILIES, TOOL_CALL_PARSERS
from kvshuttle.control_plane.tool_calls.deepseek_v3 import DeepSeekV3Parser as DS
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer

from tests.support.family_templates import FAMILY_TEMPLATES

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object
TOOLS = [WEATHER, TIME, NO_ARGS]

Call = tuple[str, dict]
WEATHER_CALL: Call = ("get_weather", {"city": "Paris", "days": 3})
TIME_CALL: Call = ("get_time", {"zone": "CET"})
PING_CALL: Call = ("ping", {})
BAD_CALL: Call = ("get_weather", {"city": "Paris", "days": "three"})  # outside the schema


def _json(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _xml_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def hermes(calls: list[Call]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {_json(a)}}}\n</tool_call>' for n, a in calls)


def qwen3_coder(calls: list[Call]) -> str:
    return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
        f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
        for n, a in calls)


def glm45(calls: list[Call]) -> str:  # GLM-4.5's template: a newline before each call and between the tags
    return "".join(f"\n<tool_call>{n}\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>"
        for n, a in calls)


def glm47(calls: list[Call]) -> str:  # GLM-4.7's: none
    return "".join(f"<tool_call>{n}" + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{_xml_value(v)}</arg_value>" for k, v in a.items()) + "</tool_call>"
        for n, a in calls)


def llama3_json(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": "{n}", "parameters": {_json(a)}}}' for n, a in calls)


def mistral(calls: list[Call]) -> str:  # v11 and later
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{_json(a)}" for n, a in calls)


def mistral_array(calls: list[Call]) -> str:  # before v11: parsed, not forced (mistral.py)
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {_json(a)}}}' for n, a in calls) + "]"


def deepseek_v3(calls: list[Call]) -> str:
    return DS.calls_begin + "\n".join(
        f"{DS.call_begin}function{DS.sep}{n}{DS.fence}{_json(a)}{DS.fence_end}{DS.call_end}" for n, a in calls
    ) + DS.calls_end


# parser name -> the ways its models write calls
WRITERS: dict[str, list[Callable[[list[Call]], str]]] = {
    "hermes": [hermes], "qwen3_json": [hermes], "qwen3_coder": [qwen3_coder], "qwen3_xml": [qwen3_coder],
    "glm45": [glm45], "glm47": [glm47], "llama3_json": [llama3_json], "llama4_json": [llama3_json],
    "mistral": [mistral], "deepseek_v3": [deepseek_v3],
}


def _padded(writer: Callable[[list[Call]], str], old: str, new: str) -> str:
    text = writer([WEATHER_CALL])
    assert old in text, (old, text)
    return text.replace(old, new, 1)


# parser -> texts that no constraint accepts: a run of two whitespace characters where the template writes one (or
# none), a form the family's template does not render
REFUSED: dict[str, list[str]] = {
    "hermes": [_padded(hermes, '"city": ', '"city":  '), _padded(hermes, '{"city"', '{ \n"city"')],
    "qwen3_coder": [_padded(qwen3_coder, "\n<parameter=city>", "\n\n<parameter=city>"),
                    _padded(qwen3_coder, "</parameter>\n", "</parameter>\n\n")],
    "glm45": [_padded(glm45, "\n<arg_key>city", "\n\n<arg_key>city"), glm47([WEATHER_CALL]),
              glm45([WEATHER_CALL]) + "\n"],
    "glm47": [_padded(glm47, "<arg_key>city", "\n\n<arg_key>city"), glm45([WEATHER_CALL]),
              "\n".join(glm47([c]) for c in (WEATHER_CALL, TIME_CALL))],
    "llama3_json": [_padded(llama3_json, '"days": ', '"days":\n\n')],
    "mistral": [mistral_array([WEATHER_CALL]), mistral_array([WEATHER_CALL, TIME_CALL]),
                _padded(mistral, '"city": ', '"city":  ')],
    "deepseek_v3": [_padded(deepseek_v3, '"city": ', '"city":   ')],
}
REFUSED.update(qwen3_json=REFUSED["hermes"], qwen3_xml=REFUSED["qwen3_coder"], llama4_json=REFUSED["llama3_json"])

CHECK = """
import json, sys
import xgrammar
from xgrammar.testing import _is_grammar_accept_string
out = []
for value, texts in json.load(sys.stdin):
    grammar = xgrammar.Grammar.from_structural_tag(value)
    out.append([_is_grammar_accept_string(grammar, t) for t in texts])
    xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), max_threads=1).compile_grammar(grammar)
print(json.dumps(out))
"""

# (calls written; does a named-get_weather constraint accept them, a required one, a required one with one_call)
CASES: list[tuple[list[Call], bool, bool, bool]] = [
    ([WEATHER_CALL], True, True, True),
    ([TIME_CALL], False, True, True),
    ([PING_CALL], False, True, True),
    ([WEATHER_CALL, TIME_CALL], False, True, False),
    ([WEATHER_CALL, PING_CALL, WEATHER_CALL], False, True, False),
    ([BAD_CALL], False, False, False),
    ([("get_weather", {"days": 3})], False, False, False),  # a required property missing
    ([("nope", {})], False, False, False),  # no such tool
]
PLAIN = "It is sunny in Paris."
ACCEPTED = 5  # the cases a required constraint accepts, per writer

# The calls the templates render (an echoed answer); the llama3_json template renders one call only.
TEMPLATE_CALLS: list[list[Call]] = [c for c, _, required, _ in CASES if required]
THINK = ("<think>", "</think>")
SYSTEM = [{"role": "system", "content": "You are a weather assistant."}, {"role": "user", "content": "Weather?"}]

Results = dict[str, tuple[list[str], list[bool], list[bool], list[bool]]]


@pytest.fixture(scope="module")
def template_texts(tmp_path_factory) -> dict[str, list[tuple[list[Call], str]]]:
    """Per family with a test template: (calls, the answer text the template renders for them echoed back: what
    follows the generation prompt, up to the end of the message)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model = tmp_path_factory.mktemp("no-model")
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(model / "tokenizer.json"))
    out: dict[str, list[tuple[list[Call], str]]] = {}
    for family, spec in FAMILY_TEMPLATES.items():
        tokenizer = GatewayTokenizer(model, spec.template)
        prompt = tokenizer.render_chat(SYSTEM, tools=TOOLS, **spec.template_kwargs)
        out[family] = []
        for calls in TEMPLATE_CALLS:
            if spec.parser == "llama3_json" and len(calls) > 1:
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)]}
            whole = tokenizer.render_chat([*SYSTEM, message], add_generation_prompt=False, tools=TOOLS,
                                          **spec.template_kwargs)
            assert whole.startswith(prompt) and whole.endswith("<|im_end|>\n"), (family, prompt, whole)
            answer = whole[len(prompt):-len("<|im_end|>\n")]
            if answer.startswith(THINK[0]):  # Qwen3's: an empty reasoning block, which the model writes before the
                # forced calls (constraints.after_reasoning places them after it; tests/slow/test_constraints.py)
                answer = answer.split(THINK[1], 1)[1].removeprefix("\n\n")
            out[family].append((calls, answer))
    return out


@pytest.fixture(scope="module")
def results(template_texts) -> Results:
    """Per parser: the texts (each writer's for CASES, PLAIN, REFUSED, then the family template's renderings), whether
    the named constraint accepts each, the required one, the required one with one call."""
    texts = {name: [w(calls) for w in writers for calls, *_ in CASES] + [PLAIN] + REFUSED[name]
                   + [text for _, text in template_texts.get(name, [])]
             for name, writers in WRITERS.items()}
    payload = []
    for name, syntax in CALL_SYNTAX.items():
        for named, one_call in (("get_weather", False), (None, False), (None, True)):
            payload.append([forced_tool_calls(syntax, TOOLS, named, one_call=one_call).value, texts[name]])
    done = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    accepted = iter(json.loads(done.stdout))
    return {name: (texts[name], next(accepted), next(accepted), next(accepted)) for name in CALL_SYNTAX}


def test_every_family_but_harmony_has_a_forced_call_syntax():
    assert set(CALL_SYNTAX) == set(WRITERS) == set(FAMILIES) - {"openai"}
    for name in CALL_SYNTAX:
        assert not_forced(name) == ""


def test_harmonys_calls_cannot_be_forced_and_the_refusal_says_why():
    why = not_forced("openai")
    assert why.startswith("the openai tool-call parser's calls cannot be forced: ")
    assert "Harmony" in why and "<|channel|>" in why and "analysis" in why
    assert "unknown_parser" in not_forced("unknown_parser")


@pytest.mark.parametrize("parser", sorted(WRITERS))
def test_the_constraint_for_a_named_tool_and_for_required(parser):
    named = json.loads(forced_tool_calls(CALL_SYNTAX[parser], TOOLS, "get_weather").value)
    required = json.loads(forced_tool_calls(CALL_SYNTAX[parser], TOOLS, None).value)
    assert named["type"] == required["type"] == "structural_tag"
    named_text, required_text = json.dumps(named["format"]), json.dumps(required["format"])
    assert "get_weather" in named_text and "get_time" not in named_text and "ping" not in named_text
    assert all(name in required_text for name in ("get_weather", "get_time", "ping"))


@pytest.mark.parametrize("parser", sorted(WRITERS))
def test_what_the_grammar_accepts_is_what_it_should(parser, results, template_texts):
    texts, *accepted = results[parser]
    rendered = [calls for calls, _ in template_texts.get(parser, [])]
    refused = [False] * (1 + len(REFUSED[parser]))  # PLAIN and REFUSED
    expected = [
        [n for _ in WRITERS[parser] for _, n, _, _ in CASES] + refused + [c == [WEATHER_CALL] for c in rendered],
        [r for _ in WRITERS[parser] for _, _, r, _ in CASES] + refused + [True for _ in rendered],
        [o for _ in WRITERS[parser] for _, _, _, o in CASES] + refused + [len(c) == 1 for c in rendered],
    ]
    for kind, got, want in zip(("named", "required", "one call"), accepted, expected, strict=True):
        assert got == want, (kind, [(t, "accepted" if a else "refused") for t, a, e in zip(texts, got, want, strict=True)
                                    if a != e])


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_the_grammar_accepts_what_the_familys_template_renders_for_an_echoed_call(family, results, template_texts):
    """The real proof: an answer written as the template renders it re-renders as written (the grammar accepts it,
    the parser reads the calls back)."""
    parser = FAMILY_TEMPLATES[family].parser
    texts, _, required, _ = results[parser]
    rendered = template_texts[family]
    assert len(rendered) >= 3
    for (calls, text), accepted in zip(rendered, required[-len(rendered):], strict=True):
        assert accepted, f"the {parser} grammar refuses what the {family} template renders: {text!r}"
        answer = parse_answer(text, None, TOOL_CALL_PARSERS[parser], request_tools=TOOLS)
        assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == calls, text


@pytest.mark.parametrize("parser", sorted(WRITERS))
def test_what_the_grammar_forces_parses_back_into_the_calls_written(parser, results):
    texts, _, required, _ = results[parser]
    written = [calls for _ in WRITERS[parser] for calls, *_ in CASES]
    checked = 0
    for text, calls, accepted in zip(texts, written, required, strict=False):
        if not accepted:
            continue
        answer = parse_answer(text, None, TOOL_CALL_PARSERS[parser], request_tools=TOOLS)
        assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == calls, text
        assert [c.index for c in answer.tool_calls] == list(range(len(calls)))
        assert not (answer.content or "").strip(), text
        checked += 1
    assert checked == ACCEPTED * len(WRITERS[parser])


def test_one_call_bounds_required_to_one_call_and_leaves_named_as_it_is():
    for syntax in CALL_SYNTAX.values():
        def fmt(named, one_call):
            return json.dumps(json.loads(forced_tool_calls(syntax, TOOLS, named, one_call=one_call).value))
        assert '"stop_after_first": true' in fmt(None, True)
        assert '"stop_after_first": false' in fmt(None, False)
        assert fmt("get_weather", True) == fmt("get_weather", False)


# -- XML arguments written as the template writes them (forced.XmlArguments) ----------------------------------------

SETTINGS = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {
        "mode": {"enum": ["fast", "slow"]}, "n": {"type": "integer"}, "ratio": {"type": "number"},
        "flag": {"type": "boolean"}, "note": {"type": "string", "description": "free text"}},
    "required": ["mode", "n", "ratio", "flag"]}}}
NESTED = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}}}}}}
SETTINGS_CALLS: list[list[Call]] = [
    [("set_mode", {"mode": "fast", "n": -12, "ratio": 0.25, "flag": True})],
    [("set_mode", {"mode": "slow", "n": 0, "ratio": 3, "flag": False, "note": "two\nlines, <b>bold</b>"})],
    [("set_mode", {"mode": "slow", "n": 7, "ratio": 123456.5, "flag": True, "note": ""}),
     ("set_mode", {"mode": "fast", "n": 1, "ratio": 0.0001, "flag": False})],
]
XML_FAMILIES = ("qwen3_coder", "glm45", "glm47")


def _rendered(family: str, calls: list[Call], tmp_path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    spec = FAMILY_TEMPLATES[family]
    tokenizer = GatewayTokenizer(tmp_path, spec.template)
    prompt = tokenizer.render_chat(SYSTEM, tools=[SETTINGS], **spec.template_kwargs)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}
    whole = tokenizer.render_chat([*SYSTEM, message], add_generation_prompt=False, tools=[SETTINGS],
                                  **spec.template_kwargs)
    return whole[len(prompt):-len("<|im_end|>\n")]


@pytest.mark.parametrize("family", XML_FAMILIES)
def test_xml_arguments_are_forced_exactly_as_the_template_writes_them(family, tmp_path):
    """Every scalar kind (an enum, an integer, a number, a boolean, raw text), rendered by the family's template, is
    accepted and parses back into the calls; the same text with a value written otherwise (a space inside the tag,
    JSON's ``true`` where the template writes Python's, a trailing zero, a parameter out of the schema's order) is
    refused, since the template would not render it back."""
    parser = FAMILY_TEMPLATES[family].parser
    rendered = [_rendered(family, calls, tmp_path) for calls in SETTINGS_CALLS]
    one = rendered[0]
    python = parser == "qwen3_coder"
    value_open = ">\n" if python else "<arg_value>"
    wrong = [one.replace(value_open + "fast", value_open + " fast"),
             one.replace("True", "true") if python else one.replace("true", "True"),
             one.replace("0.25", "0.250"), one.replace("-12", "-012")]
    opening = "<parameter=" if python else "<arg_key>"
    mode, n, ratio = (one.index(opening + key) for key in ("mode", "n", "ratio"))
    wrong.append(one[:mode] + one[n:ratio] + one[mode:n] + one[ratio:])  # n before mode
    assert all(w != one for w in wrong), wrong
    fmt = forced_tool_calls(CALL_SYNTAX[parser], [SETTINGS], None).value
    done = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps([[fmt, rendered + wrong]]),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    accepted = json.loads(done.stdout)[0]
    assert accepted == [True] * len(rendered) + [False] * len(wrong), list(zip(rendered + wrong, accepted))
    for calls, text in zip(SETTINGS_CALLS, rendered, strict=True):
        answer = parse_answer(text, None, TOOL_CALL_PARSERS[parser], request_tools=[SETTINGS])
        assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == calls, text


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45", "glm47"])
def test_a_schema_xml_arguments_cannot_write_out_falls_back_to_xgrammars_style(parser):
    fmt = json.dumps(json.loads(forced_tool_calls(CALL_SYNTAX[parser], [NESTED, SETTINGS], None).value))
    style = "qwen_xml" if parser == "qwen3_coder" else "glm_xml"
    assert fmt.count(f'"style": "{style}"') == 1 and '"any_text"' in fmt  # plan falls back, set_mode does not
