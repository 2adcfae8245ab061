"""Split a model's answer into reasoning and content at its thinking tags (``--reasoning-parser``).

One state machine serves streaming and non-streaming answers: text is fed as it arrives and comes out as
``("reasoning" | "content", text)`` pieces, a suffix that may be the start of a tag held back until it is decided.
Feeding a whole answer at once gives exactly what feeding it in any pieces gives.

The parsers are named as vLLM names them. Each is a think-tag parser; they differ in what an answer that does not
open with the start tag is:

- ``deepseek_r1``: reasoning until the end tag (R1's template opens the thinking block in the prompt, so its answers
  often start inside it);
- ``qwen3``, ``glm45``: content, unless the prompt itself ends inside an open thinking block (a template that opens it,
  as Qwen3's thinking models do).

An answer cut off inside its reasoning is all reasoning.

``openai_gptoss`` (gpt-oss; also ``openai``, the name of its tool-call parser) is no think-tag parser: its Harmony
format carries reasoning and tool calls in one syntax of messages on channels, so its rules are :class:`Harmony`,
which answer.AnswerParser parses with control_plane/tool_calls/harmony.py (reasoning and calls at once) instead of a
:class:`ReasoningSplitter`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class ThinkTags:
    """A reasoning parser's rules: its tags, and whether an answer without the start tag begins in reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    untagged_is_reasoning: bool = False
    keeps_special_tokens: ClassVar[bool] = False  # its tags are text: the answer may be decoded without special tokens

    def opens_in_prompt(self, prompt_text: str) -> bool:
        """True when the prompt ends inside an open thinking block (its last start tag after its last end tag)."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)


@dataclass(frozen=True)
class Harmony:
    """The ``openai_gptoss`` reasoning parser's rules: gpt-oss's Harmony format, whose ``analysis`` channel's messages
    are the reasoning (control_plane/tool_calls/harmony.py). Its markers (``<|channel|>``, ``<|message|>``, ...) are
    special tokens, so the answer must be decoded keeping them (``skip_special_tokens=False``)."""

    name: str
    keeps_special_tokens: ClassVar[bool] = True


ReasoningRules = ThinkTags | Harmony

REASONING_PARSERS: dict[str, ReasoningRules] = {
    "deepseek_r1": ThinkTags("deepseek_r1", untagged_is_reasoning=True),
    "qwen3": ThinkTags("qwen3"),
    "glm45": ThinkTags("glm45"),
    "openai_gptoss": Harmony("openai_gptoss"),
    "openai": Harmony("openai"),  # kvshuttle's alias: the name of Harmony's tool-call parser
}


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may become the tag).

    Runs per streamed token: only the places in the tail where the tag's first character stands are tried."""
    n = min(len(tag) - 1, len(text))
    if n <= 0:
        return 0
    tail, first = text[-n:], tag[0]
    at = tail.find(first)
    while at >= 0:  # earliest start first: the longest suffix
        if tag.startswith(tail[at:]):
            return n - at
        at = tail.find(first, at + 1)
    return 0


class ReasoningSplitter:
    """Incremental reasoning/content split of one answer."""

    def __init__(self, tags: ThinkTags, *, prompt_text: str = ""):
        self.tags = tags
        self._held = ""
        # "start": the answer's first characters decide; "reasoning": inside the block; "content": after it.
        self._state = REASONING if tags.opens_in_prompt(prompt_text) else "start"

    def feed(self, text: str) -> Iterable[tuple[str, str]]:
        if self._state == CONTENT and not self._held:  # after the reasoning: per streamed token, no generator
            return [(CONTENT, text)] if text else []
        return self._feed(text)

    def _feed(self, text: str) -> Iterator[tuple[str, str]]:
        self._held += text
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(self.tags.start):
                    self._held = stripped[len(self.tags.start):]
                    self._state = REASONING
                    continue
                if not stripped or self.tags.start.startswith(stripped):
                    return  # may still become the start tag
                self._state = REASONING if self.tags.untagged_is_reasoning else CONTENT
                continue
            if self._state == CONTENT:
                out, self._held = self._held, ""
                yield CONTENT, out
                return
            at = self._held.find(self.tags.end)
            if at >= 0:
                if at:
                    yield REASONING, self._held[:at]
                self._held = self._held[at + len(self.tags.end):]
                self._state = CONTENT
                continue
            keep = partial_tail(self._held, self.tags.end)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if out:
                yield REASONING, out
            return

    def finish(self) -> Iterator[tuple[str, str]]:
        """The held-back tail, once the answer has ended."""
        held, self._held = self._held, ""
        if not held:
            return
        if self._state == "start":
            yield (REASONING if self.tags.untagged_is_reasoning else CONTENT), held
        else:
            yield self._state, held

