"""gpt-oss's Harmony answers (control_plane/tool_calls/harmony.py, the ``openai`` parsers): whole answers written out,
streams split at every position giving exactly the whole answer's parts, headers parsed as ``openai_harmony`` parses
them, and answers parsed as vLLM's own HarmonyParser reports them (in a subprocess), or differing only where we chose
to."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from dataclasses import dataclass

import pytest
from kvshuttle.control_plane.answer import AnswerParser, ParsedAnswer, Piece, keeps_special_tokens, parse_answer
from kvshuttle.control_plane.reasoning import REASONING_PARSERS, Harmony
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS, ParsedCall
from kvshuttle.control_plane.tool_calls.harmony import MAX_HEADER, Header, function_name, parse_header

from tests.support import harmony_reference
from tests.support.streaming import streamed

HARMONY, CALLS = REASONING_PARSERS["openai_gptoss"], TOOL_CALL_PARSERS["openai"]
PARSERS = {"both": (HARMONY, CALLS), "reasoning": (HARMONY, None), "tools": (None, CALLS)}

THINK = "<|channel|>analysis<|message|>I should look up the weather.<|end|>"
WEATHER_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city":"Paris"}')
WEATHER = '{"city": "Paris"}'  # re-serialised as vLLM does (json.dumps)


def msg(channel: str, text: str, *, to: str = "", ctype: str = "", end: str = "<|end|>") -> str:
    """A later message of the answer (the first has no ``<|start|>assistant``: see ``first``)."""
    header = f"<|channel|>{channel}" + (f" to={to}" if to else "") + (f" {ctype}" if ctype else "")
    return f"<|start|>assistant{header}<|message|>{text}{end}"


def first(message: str) -> str:
    return message.removeprefix("<|start|>assistant")


@dataclass(frozen=True)
class Case:
    """An answer, what our parser makes of it, and (``vllm``) what vLLM's HarmonyParser reports where that differs."""

    id: str
    text: str
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]
    parsers: str = "both"  # both | reasoning | tools: which of the two parsers are Harmony's (the other is unset)
    prompt: str = ""
    vllm: tuple[str | None, str | None, list[tuple[str, str]]] | None = None  # vLLM's (reasoning, content, calls)


CASES = [
    # -- what gpt-oss writes --
    Case("reasoning-then-call", THINK + WEATHER_CALL, "I should look up the weather.", None,
         [("get_weather", WEATHER)]),  # the engine leaves its stop token (<|call|>) out of the text
    Case("reasoning-then-call-with-stop-token", THINK + WEATHER_CALL + "<|call|>", "I should look up the weather.",
         None, [("get_weather", WEATHER)]),
    Case("reasoning-then-final", THINK + msg("final", "It is sunny.", end="<|return|>"),
         "I should look up the weather.", "It is sunny.", []),
    Case("final-only", first(msg("final", "Hi! 👋", end="")), None, "Hi! 👋", []),
    Case("recipient-before-channel", THINK + '<|start|>assistant to=functions.get_time<|channel|>commentary json'
         '<|message|>{"tz": "UTC"}', "I should look up the weather.", None, [("get_time", '{"tz": "UTC"}')]),
    Case("answer-starts-with-recipient", ' to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}',
         None, None, [("get_time", "{}")]),
    Case("preamble-then-call", THINK + msg("commentary", "Let me check.") + WEATHER_CALL,
         "I should look up the weather.", "Let me check.", [("get_weather", WEATHER)]),
    Case("several-calls", THINK + WEATHER_CALL + "<|call|>" + msg("commentary", '{"tz":"UTC"}', to="functions.get_time",
                                                                    ctype="<|constrain|>json", end="<|call|>"),
         "I should look up the weather.", None, [("get_weather", WEATHER), ("get_time", '{"tz": "UTC"}')]),
    Case("messages-of-a-kind-joined-by-a-newline", first(msg("analysis", "First.")) + msg("analysis", "Second.") +
         msg("commentary", "Checking.") + msg("final", "Done."), "First.\nSecond.", "Checking.\nDone.", []),
    Case("empty-messages-add-no-newline", first(msg("analysis", "")) + msg("analysis", "a") + msg("final", "") +
         msg("final", "b"), "a", "b", []),
    Case("content-after-a-call", WEATHER_CALL.removeprefix("<|start|>assistant") + "<|call|>" +
         msg("final", "Sunny."), None, "Sunny.", [("get_weather", WEATHER)]),
    Case("unicode-arguments", first(msg("commentary", '{"city": "Zürich 🌤", "n": [1, 2.5]}', to="functions.f",
                                        ctype="json", end="")),
         None, None, [("f", json.dumps({"city": "Zürich 🌤", "n": [1, 2.5]}))]),
    Case("arguments-as-written-when-not-json", first(msg("commentary", '{"code":"print(1)"}',
                                                         to="functions.run_python", ctype="code")),
         None, None, [("run_python", '{"code":"print(1)"}')]),
    Case("bare-recipient", first(msg("commentary", "{}", to="get_time")), None, None, [("get_time", "{}")]),
    Case("call-on-the-final-channel", first(msg("final", "{}", to="functions.get_time")), None, None,
         [("get_time", "{}")]),
    Case("constrain-read-as-recipient", first("<|channel|>commentary <|constrain|>json<|message|>ok<|end|>"), None,
         "ok", []),  # Harmony makes <|constrain|>json the recipient; vLLM cuts it off: a preamble
    Case("leading-newline", "\n" + first(msg("final", "x")), None, "x", []),
    Case("answer-starts-with-start", msg("final", "hi"), None, "hi", []),
    Case("built-in-tool-in-analysis", first(msg("analysis", '{"query": "x"}', to="browser.search", ctype="code")),
         '{"query": "x"}', None, []),  # vLLM: the analysis channel is reasoning, whatever the recipient
    Case("cut-off-in-reasoning", first(msg("analysis", "Let me thi", end="")), "Let me thi", None, []),
    Case("cut-off-in-a-header", THINK + "<|start|>assistant<|channel|>comm", "I should look up the weather.",
         "<|start|>assistant<|channel|>comm", []),  # vLLM recovers the header's tokens as content too
    Case("not-harmony-at-all", "Just a plain answer, <|with|> a marker-like thing.", None,
         "Just a plain answer, <|with|> a marker-like thing.", []),
    Case("end-marker-in-a-header", "<|channel|>final<|end|>hello", None, "<|channel|>final<|end|>hello", []),
    # -- where we differ from vLLM: what it drops (or passes on broken) is content here, as written --
    Case("cut-off-in-a-call", THINK + WEATHER_CALL[:-5], "I should look up the weather.", WEATHER_CALL[:-5], [],
         vllm=("I should look up the weather.", None, [("get_weather", '{"city":"Pa')])),
    Case("arguments-not-an-object", first(msg("commentary", "[1, 2]", to="functions.f", ctype="json")), None,
         first(msg("commentary", "[1, 2]", to="functions.f", ctype="json")), [], vllm=(None, None, [("f", "[1, 2]")])),
    Case("broken-arguments", first(msg("commentary", "{city: Paris}", to="functions.f")), None,
         first(msg("commentary", "{city: Paris}", to="functions.f")), [],
         vllm=(None, None, [("f", "{city: Paris}")])),
    Case("built-in-tool-call", THINK + msg("commentary", "print(1)", to="python", ctype="code"),
         "I should look up the weather.", msg("commentary", "print(1)", to="python", ctype="code"), [],
         vllm=("I should look up the weather.", None, [])),
    Case("malformed-header", "<|channel|><|message|>x<|end|>" + msg("final", "ok"), None,
         "<|channel|><|message|>x<|end|>ok", [], vllm=(None, "ok", [])),
    Case("too-many-words-in-a-header", first(msg("final a b c", "x")) + msg("final", "ok"), None,
         first(msg("final a b c", "x")) + "ok", [], vllm=(None, "ok", [])),
    Case("no-channel", "<|message|>hi<|end|>", None, "<|message|>hi<|end|>", [], vllm=(None, None, [])),
    Case("unknown-channel", first(msg("summary", "x")), None, first(msg("summary", "x")), [],
         vllm=(None, None, [])),
    Case("a-tool-s-message", THINK + '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>'
         '{"time": "noon"}<|end|>', "I should look up the weather.", '<|start|>functions.get_time to=assistant'
         '<|channel|>commentary<|message|>{"time": "noon"}<|end|>', [],
         vllm=("I should look up the weather.", None, [])),
    Case("text-between-messages", first(msg("final", "a")) + "oops" + msg("final", "b"), None, "aoops\nb", [],
         vllm=(None, "a\nb", [])),
    Case("long-header", first(msg("final" + " " * MAX_HEADER, "x")), None, first(msg("final" + " " * MAX_HEADER, "x")),
         [], vllm=(None, "x", [])),
    # Lenient where the model left out a marker; Harmony reads the rest as the message's text, or drops it.
    Case("no-end-before-start", "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>done",
         "think", "done", [], vllm=("think<|start|>assistant<|channel|>final<|message|>done", None, [])),
    Case("no-start-before-channel", "<|channel|>analysis<|message|>think<|end|><|channel|>final<|message|>done",
         "think", "done", [], vllm=("think", None, [])),
    Case("channel-inside-a-call", first(msg("commentary", "{}", to="functions.f", end="")) +
         "<|channel|>final<|message|>ok", None, "ok", [("f", "{}")], vllm=(None, None, [("f", "{}<|channel|>final"
                                                                                         "<|message|>ok")])),
    # -- one of the two parsers unset: vLLM drops that part; here it is content as written --
    Case("reasoning-not-parsed", THINK + WEATHER_CALL, None, THINK, [("get_weather", WEATHER)], parsers="tools",
         vllm=(None, None, [("get_weather", WEATHER)])),
    Case("calls-not-parsed", THINK + WEATHER_CALL, "I should look up the weather.", WEATHER_CALL, [],
         parsers="reasoning", vllm=("I should look up the weather.", None, [])),
    Case("final-without-calls-parsed", THINK + msg("final", "Sunny."), "I should look up the weather.", "Sunny.", [],
         parsers="reasoning"),
    # -- the prompt's end opens the answer's message (vLLM's parser does not read the prompt) --
    Case("prompt-opened-the-final-message", "Sunny.<|return|>", None, "Sunny.", [],
         prompt="<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>final<|message|>"),
    Case("prompt-named-the-channel", "<|message|>hmm<|end|>" + msg("final", "ok"), "hmm", "ok", [],
         prompt="<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis"),
    Case("prompt-ended-as-usual", THINK + WEATHER_CALL, "I should look up the weather.", None,
         [("get_weather", WEATHER)], prompt="<|start|>user<|message|>Weather?<|end|><|start|>assistant"),
]
IDS = [c.id for c in CASES]


def _got(parsed: ParsedAnswer) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    assert [c.index for c in parsed.tool_calls] == list(range(len(parsed.tool_calls)))
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def _whole(case: Case) -> ParsedAnswer:
    return parse_answer(case.text, *PARSERS[case.parsers], prompt_text=case.prompt)


def _streamed(case: Case, cuts: list[int]) -> tuple[ParsedAnswer, list]:
    return streamed(AnswerParser(*PARSERS[case.parsers], prompt_text=case.prompt), case.text, cuts)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_answers(case: Case):
    assert _got(_whole(case)) == (case.reasoning, case.content, case.calls)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streams_split_anywhere_give_the_whole_answer(case: Case):
    whole = _got(_whole(case))
    for cut in range(1, len(case.text)):  # one split, at every position
        assert _got(_streamed(case, [cut])[0]) == whole, cut
    got, events = _streamed(case, list(range(1, len(case.text))))  # one character at a time
    assert _got(got) == whole
    assert all(e.text for e in events if isinstance(e, Piece))  # no empty pieces


def test_reasoning_and_content_stream_as_they_come():
    parser = AnswerParser(HARMONY, CALLS)
    assert list(parser.feed("<|channel|>analysis<|message|>Paris, so")) == [Piece("reasoning", "Paris, so")]
    assert list(parser.feed(" weather.<|e")) == [Piece("reasoning", " weather.")]  # a marker's start is held
    assert list(parser.feed("nd|><|start|>assistant<|channel|>commentary<|message|>Checking")) == [
        Piece("content", "Checking")]
    assert list(parser.feed("<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather json")) == []
    assert list(parser.feed('<|message|>{"city":')) == []  # a call is reported once it ends
    assert list(parser.feed('"Paris"}')) == []
    assert not parser.called_tools
    assert list(parser.finish()) == [ParsedCall(0, "get_weather", WEATHER)]  # the answer's end ends it
    assert parser.called_tools


def test_a_call_is_reported_at_its_end_marker():
    parser = AnswerParser(HARMONY, CALLS)
    assert list(parser.feed(first(msg("commentary", "{}", to="functions.f", end="<|call|>")))) == [
        ParsedCall(0, "f", "{}")]
    assert list(parser.feed(msg("final", "a<|"))) == [Piece("content", "a<|")]
    assert list(parser.finish()) == []


def test_the_parsers_say_that_they_need_special_tokens():
    assert HARMONY.keeps_special_tokens and CALLS.keeps_special_tokens
    assert REASONING_PARSERS["openai"] == Harmony("openai")  # our alias: the tool-call parser's name
    assert keeps_special_tokens(HARMONY, CALLS) and keeps_special_tokens(HARMONY, None)
    assert keeps_special_tokens(None, CALLS)
    assert not keeps_special_tokens(REASONING_PARSERS["qwen3"], TOOL_CALL_PARSERS["hermes"])
    assert not keeps_special_tokens(None, None)


@pytest.mark.parametrize("reasoning,tools", [(HARMONY, TOOL_CALL_PARSERS["hermes"]),
                                             (REASONING_PARSERS["qwen3"], CALLS)])
def test_harmony_does_not_mix_with_other_families(reasoning, tools):
    with pytest.raises(ValueError, match="Harmony"):
        AnswerParser(reasoning, tools)


def test_the_tool_call_parser_alone():
    """TOOL_CALL_PARSERS["openai"] as any tool-call parser is used: content pieces and calls."""
    parser = CALLS(None)
    items = [*parser.feed(THINK + msg("commentary", "Checking.") + WEATHER_CALL), *parser.finish()]
    assert "".join(i for i in items if isinstance(i, str)) == THINK + "Checking."
    assert [i for i in items if isinstance(i, ParsedCall)] == [ParsedCall(0, "get_weather", WEATHER)]
    assert parser.calls == 1


FRAGMENTS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.get_time",
             " to=python", " <|constrain|>json", " json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", '{"tz": ',
             '"UTC"}', "{}", "text", " ", "\n", "é", "<|", "<|chan", "|>", "x" * 90]
PROMPTS = ["", "<|start|>assistant", "<|start|>assistant<|channel|>final<|message|>",
           "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"]


def test_random_answers_stream_as_they_parse_whole():
    """Answers pieced together from Harmony's markers and text, mostly broken: never an error, streams split anywhere
    give the whole answer's parts, and text without markers is content as it is."""
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 24)))
        for parsers in PARSERS:
            case = Case("fuzz", text, None, None, [], parsers=parsers, prompt=rng.choice(PROMPTS))
            whole = _got(_whole(case))
            splits = [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) for k in (1, 1, 3, 8)]
            for cuts in [*splits, list(range(1, len(text)))]:
                got, events = _streamed(case, cuts)
                assert _got(got) == whole, (text, parsers, cuts)
                assert all(e.text for e in events if isinstance(e, Piece)), (text, cuts)
    for text in ("plain", "a < b", "x <|y|> z", "{}"):
        assert _got(parse_answer(text, HARMONY, CALLS)) == (None, text, [])


def test_a_long_call_is_scanned_once():
    """Searching for a call's end resumes where it stopped, so feeding a long call in pieces stays linear."""
    text = first(msg("commentary", json.dumps({"code": "x" * 200_000}), to="functions.run_python", end=""))
    parser = AnswerParser(HARMONY, CALLS)
    events = [e for i in range(0, len(text), 4) for e in parser.feed(text[i:i + 4])] + list(parser.finish())
    assert [e.name for e in events] == ["run_python"]


@pytest.mark.parametrize("recipient,name", [("functions.get_time", "get_time"), ("get_time", "get_time"),
                                            ("functions.", None), ("python", None), ("browser.search", None),
                                            ("container.exec", None), ("assistant", None), ("<|constrain|>json", None),
                                            (None, None), ("", None), ("mcp.lookup", "mcp.lookup")])
def test_function_names_as_vllm_reads_recipients(recipient, name):
    assert function_name(recipient) == name


# -- openai_harmony's own parser ------------------------------------------------------------------------------------


def _require_harmony() -> None:
    if importlib.util.find_spec("openai_harmony") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("openai_harmony is not installed: CI runs every test (make install installs vLLM, which "
                        "brings it)", pytrace=False)
        pytest.skip("openai_harmony is not installed")


HEADER_FRAGMENTS = ["<|channel|>", "analysis", "final", "commentary", " ", "  ", "\n", "\t", "\x0b", "\u3000", "to=",
                    "functions.get_time", "json", "<|constrain|>", "assistant", "user", "tool", "x", "<", "<|start|>",
                    "<|end|>", "é"]


def _harmony_header(text: str, role: str | None) -> Header | None:
    messages = harmony_reference.harmony_messages(("" if role else "<|start|>") + text + "<|message|>body<|end|>",
                                                  answer=role is not None)
    parsed = [m for m in messages if m["text"] == "body"]
    if not parsed:
        return None
    m = parsed[0]
    return Header(m["role"], m["channel"], m["recipient"], m["content_type"])


def test_headers_parse_as_openai_harmony_parses_them():
    _require_harmony()
    rng = random.Random(11)
    headers = ["<|channel|>analysis", "<|channel|>commentary to=functions.get_time <|constrain|>json",
               " to=functions.get_time<|channel|>commentary json", "<|channel|>commentary json", "<|channel|>final x y",
               "<|channel|>", "<|channel|> final", "<|channel|>a<|channel|>b c<|channel|>d e", "<|channel|>final\x0bx"]
    headers += ["".join(rng.choice(HEADER_FRAGMENTS) for _ in range(rng.randint(1, 8))) for _ in range(400)]
    for text in headers:
        assert parse_header(text) == _harmony_header(text, "assistant"), text
        assert parse_header(text, None) == _harmony_header(text, None), text


def _vllm_reads(messages: list[dict], case: Case) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """vLLM's HarmonyParser.parse (vllm/parser/harmony.py) on openai_harmony's messages."""
    reasoning_on, tools_on = case.parsers in ("both", "reasoning"), case.parsers in ("both", "tools")
    reasoning, content, calls = [], [], []
    for m in messages:
        if m["role"] != "assistant" or not m["text"]:
            continue
        recipient = m["recipient"]
        if recipient is not None and "<|constrain|>" in recipient:
            recipient = recipient[:recipient.find("<|constrain|>")].rstrip() or None
        if function_name(recipient) is not None:
            if tools_on:
                ctype = m["content_type"]
                try:
                    args = m["text"] if ctype is not None and "json" not in ctype else json.dumps(json.loads(m["text"]))
                except ValueError:
                    args = m["text"]
                calls.append((function_name(recipient), args))
        elif m["channel"] == "analysis":
            if reasoning_on:
                reasoning.append(m["text"])
        elif m["channel"] == "final" or (m["channel"] == "commentary" and recipient is None):
            content.append(m["text"])
    return "\n".join(reasoning) or None, "\n".join(content) or None, calls


def _well_formed(rng: random.Random) -> str:
    """A random answer as gpt-oss writes them: messages on the three channels, calls with JSON object arguments in
    either header form and content type, text with unicode, newlines and marker-like characters."""
    words = ["The", " weather", " é", " 🌤", "\n", " <", "|", " {", "}", " to=", " x", "  ", "<|chan"]
    out = []
    for i in range(rng.randint(1, 5)):
        kind = rng.choice(["analysis", "final", "preamble", "call", "call"])
        to, ctype = f"functions.{rng.choice(['get_time', 'get_weather'])}", rng.choice(["", " json", " code",
                                                                                         " <|constrain|>json"])
        if kind == "call":
            text = json.dumps({"q": "".join(rng.choice(words) for _ in range(3)), "n": rng.randint(0, 9)},
                              ensure_ascii=rng.random() < 0.5)
            header = rng.choice([f"<|channel|>commentary to={to}{ctype}", f" to={to}<|channel|>commentary{ctype}"])
        else:
            text = "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            header = "<|channel|>" + ("commentary" if kind == "preamble" else kind)
        if i:
            header = "<|start|>assistant" + header
        out.append(header + "<|message|>" + text + rng.choice(["<|end|>", "<|end|>", "<|call|>", "<|return|>"]))
    if rng.random() < 0.5:  # the engine left the last stop token out
        out[-1] = out[-1].rsplit("<|", 1)[0]
    return "".join(out)


WELL_FORMED = [Case(f"well-formed-{i}", text, None, None, [])
               for i, text in enumerate(_well_formed(random.Random(i)) for i in range(40))]


@pytest.mark.parametrize("case", WELL_FORMED, ids=[c.id for c in WELL_FORMED])
def test_well_formed_answers_read_as_openai_harmony_reads_them(case: Case):
    _require_harmony()
    assert _got(_whole(case)) == _vllm_reads(harmony_reference.harmony_messages(case.text), case)


VLLM_CASES = [c for c in CASES if not c.prompt]  # vLLM's parser does not read the prompt


@pytest.mark.parametrize("case", VLLM_CASES, ids=[c.id for c in VLLM_CASES])
def test_openai_harmony_reads_the_same_messages(case: Case):
    """openai_harmony's messages, read as vLLM reads them, give our answer (or, where we differ, the pinned one)."""
    _require_harmony()
    want = case.vllm or (case.reasoning, case.content, case.calls)
    assert _vllm_reads(harmony_reference.harmony_messages(case.text), case) == want


# -- vLLM's own HarmonyParser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory) -> dict[str, dict]:
    if importlib.util.find_spec("vllm") is None:  # looked up, not imported (see tests/conftest.py require_module)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("vllm is not installed: CI runs every test (make install installs it)", pytrace=False)
        pytest.skip("vllm is not installed")
    cases = [{"text": c.text, "reasoning": c.parsers != "tools", "tools": c.parsers != "reasoning"}
             for c in [*VLLM_CASES, *WELL_FORMED]]
    proc = harmony_reference.start(cases, tmp_path_factory.mktemp("vllm_harmony"))
    return dict(zip([c.id for c in [*VLLM_CASES, *WELL_FORMED]], harmony_reference.results(proc), strict=True))


@pytest.mark.parametrize("case", VLLM_CASES, ids=[c.id for c in VLLM_CASES])
def test_vllm_reports_the_same_answer(case: Case, vllm_results):
    result = vllm_results[case.id]
    assert "error" not in result, result.get("error")
    want = case.vllm or (case.reasoning, case.content, case.calls)
    assert (result["reasoning"], result["content"], [tuple(c) for c in result["calls"]]) == want


@pytest.mark.parametrize("case", WELL_FORMED, ids=[c.id for c in WELL_FORMED])
def test_vllm_reports_the_same_well_formed_answer(case: Case, vllm_results):
    result = vllm_results[case.id]
    assert "error" not in result, result.get("error")
    assert (result["reasoning"], result["content"], [tuple(c) for c in result["calls"]]) == _got(_whole(case))
