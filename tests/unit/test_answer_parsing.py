"""Reasoning and tool-call parsing of answers (control_plane.answer): whole answers as vLLM reports them, and
streams split at every position giving exactly the whole answer's parts."""

from __future__ import annotations

import json
import random

import pytest
from kvshuttle.control_plane.answer import AnswerParser, ParsedAnswer, Piece, parse_answer
from kvshuttle.control_plane.reasoning import REASONING_PARSERS, partial_tail
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS, ParsedCall

from tests.support.streaming import streamed

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
HERMES = TOOL_CALL_PARSERS["hermes"]

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [
    # (answer, reasoning parser, tool parser, prompt, expected reasoning, content, calls)
    ("<think>\nhmm\n</think>\n\nIt is 21 °C.", QWEN3, HERMES, "", "\nhmm\n", "\n\nIt is 21 °C.", []),
    ("<think>\nA.\n</think>\n\n" + CALL, QWEN3, HERMES, "", "\nA.\n", "\n\n",
     [("get_weather", '{"city": "Paris"}')]),
    ("Sure." + CALL + "\n" + CALL.replace("Paris", "Oslo"), None, HERMES, "", None, "Sure.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]),
    ("no tags at all", QWEN3, HERMES, "", None, "no tags at all", []),
    ("no tags at all", R1, HERMES, "", "no tags at all", None, []),  # R1: an untagged answer is reasoning
    ("still thinking", QWEN3, None, "<|im_start|>assistant\n<think>\n", "still thinking", None, []),
    ("thought</think>answer", R1, None, "", "thought", "answer", []),
    ("<think>cut off mid-reasoning", QWEN3, None, "", "cut off mid-reasoning", None, []),
    ("<tool_call>{not json}</tool_call>", None, HERMES, "", None, "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": "é"}}', None, HERMES, "", None, None, [("f", '{"x": "é"}')]),
    ('<tool_call>{"name": "f", "arguments": {"x"', None, HERMES, "", None, '<tool_call>{"name": "f", "arguments": {"x"',
     []),
    ('<tool_call>{"name": "f"}</tool_call>', None, HERMES, "", None, None, [("f", "{}")]),
    ("a < b and <tool_ca is text", None, HERMES, "", None, "a < b and <tool_ca is text", []),
    ("<thin", QWEN3, None, "", None, "<thin", []),
    ("<think>x</thi", QWEN3, None, "", "x</thi", None, []),
    ("plain", None, None, "", None, "plain", []),
]


def _whole(expected_calls):
    return [ParsedCall(i, name, args) for i, (name, args) in enumerate(expected_calls)]


@pytest.mark.parametrize("answer,reasoning,tools,prompt,want_reasoning,want_content,want_calls", CASES)
def test_whole_answers(answer, reasoning, tools, prompt, want_reasoning, want_content, want_calls):
    got = parse_answer(answer, reasoning, tools, prompt_text=prompt)
    assert (got.reasoning, got.content, got.tool_calls) == (want_reasoning, want_content, _whole(want_calls))


def _streamed(answer: str, cuts: list[int], reasoning, tools, prompt: str) -> tuple[ParsedAnswer, list]:
    return streamed(AnswerParser(reasoning, tools, prompt_text=prompt), answer, cuts)


@pytest.mark.parametrize("answer,reasoning,tools,prompt,want_reasoning,want_content,want_calls", CASES)
def test_streams_split_anywhere_give_the_whole_answer(answer, reasoning, tools, prompt, want_reasoning, want_content,
                                                      want_calls):
    whole = parse_answer(answer, reasoning, tools, prompt_text=prompt)
    for cut in range(1, len(answer)):  # one split, at every position
        got, _ = _streamed(answer, [cut], reasoning, tools, prompt)
        assert (got.reasoning, got.content, got.tool_calls) == (whole.reasoning, whole.content, whole.tool_calls), cut
    got, events = _streamed(answer, list(range(1, len(answer))), reasoning, tools, prompt)  # one character at a time
    assert (got.reasoning, got.content, got.tool_calls) == (whole.reasoning, whole.content, whole.tool_calls)
    assert all(e.text for e in events if isinstance(e, Piece))  # no empty pieces


def test_a_partial_tag_is_held_back_until_decided():
    parser = AnswerParser(QWEN3, HERMES)
    assert list(parser.feed("<think>a</th")) == [Piece("reasoning", "a")]
    assert list(parser.feed("ink>b <tool")) == [Piece("content", "b ")]
    assert list(parser.feed('_call>{"name": "f", "arguments": {}}')) == []
    assert list(parser.feed("</tool_call>")) == [ParsedCall(0, "f", "{}")]
    assert parser.called_tools


def test_arguments_are_serialised_as_vllm_does():
    args = {"q": "naïve", "n": [1, 2.5, None], "nested": {"b": True}}
    got = parse_answer(f"<tool_call>{json.dumps({'name': 'search', 'arguments': args})}</tool_call>", None, HERMES)
    assert got.tool_calls[0].arguments == json.dumps(args, ensure_ascii=False)


def test_partial_tail_is_the_longest_suffix_that_may_become_the_tag():
    """The per-token fast version against the definition (every suffix tried, longest first)."""
    def by_definition(text: str, tag: str) -> int:
        return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)

    rng = random.Random(7)
    for _ in range(20_000):
        tag = "".join(rng.choice("<t/>") for _ in range(rng.randint(1, 7)))
        text = "".join(rng.choice("<t/>x") for _ in range(rng.randint(0, 12)))
        assert partial_tail(text, tag) == by_definition(text, tag), (text, tag)
    assert partial_tail("plain text </thi", "</think>") == 5 and partial_tail("a <", "<tool_call>") == 1
    assert partial_tail("done", "</think>") == 0 and partial_tail("", "</think>") == 0
