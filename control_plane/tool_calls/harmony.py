"""gpt-oss's Harmony format (vLLM's ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser openai``), parsed as
it streams: reasoning, content and tool calls at once, since Harmony writes all three in one syntax.

An answer is a sequence of messages, each a header, ``<|message|>``, its text and an end marker::

    <|channel|>analysis<|message|>I should look up the weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The first message has no ``<|start|>assistant``: the prompt ends with it. A header names the channel
(``<|channel|>NAME``), optionally a recipient (``to=functions.NAME``, before or after the channel) and a content type
(``json``, ``<|constrain|>json``). The markers are special tokens: the answer's text must keep them (decoded with
``skip_special_tokens=False``); the stop tokens ``<|return|>`` and ``<|call|>`` usually end the answer unseen (the
engine leaves its stop token out of the text), so the answer's end also ends its last message.

What each message is, as vLLM decides it (vllm/parser/harmony.py, on the messages the ``openai_harmony`` library
parses from the token ids; tests/slow/test_harmony_parser.py checks this module against both):

- a recipient that names a function (``functions.NAME``, or a bare name that is not one of the built-in tools
  ``python``, ``browser.*``, ``container.*``) makes the message a call to NAME, whatever its channel, its text the
  arguments: re-serialised as vLLM does (``json.dumps``), or as written when the content type says it is not JSON;
- the ``analysis`` channel is reasoning; ``final``, and ``commentary`` without a recipient (the preamble an agent
  shows before its calls), are content, wherever they come (after a call too);
- the messages of a kind are joined by a newline, as vLLM joins them in a whole answer (its streams don't).

Where this parser differs from vLLM, on purpose (the project's rule: never drop what the model wrote):

- a call whose text is not a JSON object (cut off, broken) is content as written, header and markers included (vLLM
  reports the call, that text its arguments);
- what vLLM drops is content as written, markers included: a header that does not parse, a commentary message to a
  built-in tool, a message on another channel or none, a message that is not the assistant's, text outside any
  message; and, with one of the two parsers unset, the reasoning or the calls (as the other families pass on text
  whose parser is unset);
- ``<|start|>`` or ``<|channel|>`` inside a message's text ends that message (the model left out ``<|end|>``), and
  ``<|channel|>`` between messages starts the assistant's next one (``<|start|>assistant`` left out): Harmony reads
  the first as text, and drops the second's message;
- ``<|end|>``, ``<|return|>`` or ``<|call|>`` inside a header ends it: the header's text is content (Harmony reads the
  marker as part of the header);
- a header longer than ``MAX_HEADER`` characters is none: its text is content (so an answer that is not Harmony at
  all streams as content instead of waiting for a ``<|message|>`` that never comes).

A literal ``<|channel|>`` that the model wrote as ordinary text cannot be told from the special token here.

:class:`HarmonyCalls` (at the end) is the ``openai`` tool-call parser: this parser without the reasoning. Its calls
cannot be forced (``NOT_FORCED`` says why).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from kvshuttle.control_plane.reasoning import CONTENT, REASONING
from kvshuttle.control_plane.tool_calls.base import Family, Item, ParsedCall, Tools
from kvshuttle.control_plane.tool_calls.scan import first, partial_tail

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)  # Harmony's stop tokens: they end a message
BREAKS = (START, CHANNEL)  # a new message's header (lenient: inside a message's text too)
ASSISTANT = "assistant"
ROLES = ("user", ASSISTANT, "system", "developer", "tool")
BUILTIN_TOOLS = ("python", "browser", "container")  # vLLM's built-in (MCP) tools: their recipients are no functions
MAX_HEADER = 256  # characters: a longer header is none (recipients are function names of at most 64)

_ASCII_SPACE = re.compile(r"[ \t\n\x0c\r]+")  # Rust's split_ascii_whitespace


@dataclass(frozen=True)
class Header:
    """A message's header as openai_harmony parses it: the author's role, channel, recipient and content type."""

    role: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


def _channel_end(text: str) -> int:
    return next((i for i, c in enumerate(text) if c.isspace() or c == "<"), len(text))


def parse_header(text: str, role: str | None = ASSISTANT) -> Header | None:
    """A header (the text between the message's ``<|start|>`` and ``<|message|>``), parsed as openai_harmony does
    (oss-harmony 0.0.11, the one vLLM uses); None where it fails. ``role``: the role the parser was told the message
    has (the answer's first message: the prompt ended with ``<|start|>assistant``); None: the header names it."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        after = text[at + len(CHANNEL):]
        end = _channel_end(after)
        if not end:
            return None  # a channel marker without a channel
        channel, text = after[:end], text[:at] + after[end:]
        while (at := text.find(CHANNEL)) >= 0:  # later channel markers are dropped, with their values
            after = text[at + len(CHANNEL):]
            text = text[:at] + after[_channel_end(after):]
    text = text.strip()
    if CONSTRAIN in text:
        text = text.replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = [p for p in _ASCII_SPACE.split(text) if p]
    if role is None:
        if not parts:
            return None
        if parts[0] in ROLES:
            role = parts[0]
        elif len(parts) > 1 or parts[0].startswith("to="):
            role = "tool"  # an unknown role before a recipient: a tool's message, named by it
            parts.pop(0)
        else:
            return None
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        count, last = len(parts), parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1:
            recipient = last
        else:
            content_type = last
            recipient = parts.pop().removeprefix("to=")
    if parts:
        return None  # more words than a recipient and a content type
    return Header(role, channel, recipient, content_type)


def recipient_as_read(recipient: str | None) -> str | None:
    """The recipient as vLLM reads it: cut at a ``<|constrain|>`` that Harmony left in it (``<|channel|>commentary
    <|constrain|>json`` has the content type as its recipient)."""
    if recipient is None or CONSTRAIN not in recipient:
        return recipient
    return recipient[:recipient.find(CONSTRAIN)].rstrip() or None


def function_name(recipient: str | None) -> str | None:
    """The function a recipient (as read) calls, as vLLM's chat completions tell: ``functions.NAME``, or a bare name
    that is not a built-in tool's; None when it calls none."""
    if not recipient or recipient.startswith("<|") or recipient == ASSISTANT:
        return None
    if recipient.startswith("functions."):
        return recipient[len("functions."):] or None
    if recipient.split(".", 1)[0] in BUILTIN_TOOLS:
        return None
    return recipient


_LONGEST = max(map(len, (MESSAGE, *ENDS, *BREAKS)))


def _tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that may become one of ``tags`` (all of them start with ``<``)."""
    if text.rfind("<", max(0, len(text) - _LONGEST + 1)) < 0:
        return 0
    return max(partial_tail(text, tag) for tag in tags)

_CALL, _RAW = "call", "raw"  # message kinds besides REASONING and CONTENT: a call, and text passed on as written
HarmonyEvent = tuple[str, str] | ParsedCall  # (REASONING | CONTENT, text), or a call


class HarmonyParser:
    """One answer's Harmony messages, parsed incrementally: ``feed`` the text as it arrives, ``finish`` at its end;
    out come ``(REASONING | CONTENT, text)`` pieces and finished calls (:class:`ParsedCall`, reported when the message
    ends). Reasoning and content stream as they arrive, less a suffix that may be the start of a marker. Feeding a
    whole answer at once gives what feeding it in any pieces gives.

    ``reasoning`` / ``calls``: whether analysis messages are reasoning and function messages calls (the reasoning
    and tool-call parsers are Harmony's); when not, such a message is content as written. ``prompt_text``: the
    rendered prompt, whose end may open the answer's first message (usually it ends with ``<|start|>assistant``).
    ``tools``: the request's tools, kept for the interface the other parsers share: like vLLM, Harmony's parser
    neither types arguments by them nor checks the names called. ``calls``: how many calls were found so far."""

    def __init__(self, tools: Tools = None, *, reasoning: bool = True, calls: bool = True, prompt_text: str = ""):
        self.tools = list(tools or [])
        self.calls = 0
        self._reasoning, self._calls = reasoning, calls
        self._held = ""  # answer text not decided yet
        self._state = "header"  # header | body | between (after a message's end marker)
        self._role: str | None = ASSISTANT  # the header's role when it names none (None: it names one)
        self._prefix = ""  # the header's start, in the prompt
        self._opening = ""  # the message's <|start|>, if the answer has it
        self._header: Header | None = None
        self._name: str | None = None  # the function a call message calls
        self._kind = CONTENT
        self._raw = ""  # a call's text as written, header included: content if it does not parse
        self._seen = 0  # how much of a call's text a search for its end has looked through
        self._fresh = True  # the message has sent no text yet
        self._said: set[str] = set()  # the kinds some message has sent text of (the next one starts on a newline)
        self._from_prompt(prompt_text)

    def _from_prompt(self, prompt_text: str) -> None:
        """Where the prompt leaves the answer: in its last message's header (the usual ``<|start|>assistant``), or in
        its text (a prompt that opened the message, ``...<|channel|>final<|message|>``)."""
        at = prompt_text.rfind(START)
        if at < 0:
            return
        tail = prompt_text[at + len(START):]
        if any(end in tail for end in ENDS):
            return
        body = tail.find(MESSAGE)
        if body < 0:
            self._prefix, self._role = tail, None
            return
        header = parse_header(tail[:body], None)
        if header is not None:
            self._open(header)

    # -- feeding ------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> Iterator[HarmonyEvent]:
        self._held += text
        yield from self._run(final=False)

    def finish(self) -> Iterator[HarmonyEvent]:
        """What was held back, once the answer has ended (which ends its last message)."""
        yield from self._run(final=True)

    def _run(self, *, final: bool) -> Iterator[HarmonyEvent]:
        while True:
            if self._state == "header":
                done = yield from self._read_header(final=final)
            elif self._state == "body":
                done = yield from (self._read_call(final=final) if self._kind == _CALL else
                                   self._read_text(final=final))
            else:
                done = yield from self._read_between(final=final)
            if done:
                return

    # -- the states: each consumes what it can of _held; True when it needs more text -----------------------------

    def _read_header(self, *, final: bool) -> Iterator[HarmonyEvent]:
        at, tag = first(self._held, (MESSAGE, START, *ENDS))
        header_text = self._held[:at] if at >= 0 else self._held[:len(self._held) - _tail(self._held, (MESSAGE,
                                                                                                        START, *ENDS))]
        if len(header_text) > MAX_HEADER:
            # No header: its first MAX_HEADER + 1 characters are content (cut there, whatever the pieces the text
            # came in), the rest read as a message's text.
            cut = MAX_HEADER + 1
            yield from self._out(_RAW, self._opening + self._held[:cut])
            self._held = self._held[cut:]
            self._begin_body(_RAW, None)
            return False
        if at < 0:
            if not final:
                return True
            yield from self._out(_RAW, self._opening + self._held)  # cut off in the header
            self._held, self._state = "", "between"
            return True
        self._held = self._held[at + len(tag):]
        if tag == START:  # a new message: this header's text is content
            yield from self._out(_RAW, self._opening + header_text)
            self._opening, self._role, self._prefix = START, None, ""
            return False
        if tag != MESSAGE:  # a message ended in its header
            yield from self._out(_RAW, self._opening + header_text + tag)
            self._state = "between"
            return False
        header = parse_header(self._prefix + header_text, self._role)
        raw = self._opening + header_text + MESSAGE
        kind = self._open(header)
        if kind == _CALL:
            self._raw = raw
        elif kind == _RAW:
            yield from self._out(_RAW, raw)
        return False

    def _open(self, header: Header | None) -> str:
        """Starts the message's text; returns its kind."""
        kind = _RAW
        if header is not None and header.role == ASSISTANT:
            recipient = recipient_as_read(header.recipient)
            self._name = function_name(recipient)
            if self._name is not None:
                kind = _CALL if self._calls else _RAW
            elif header.channel == "analysis":
                kind = REASONING if self._reasoning else _RAW
            elif header.channel == "final" or (header.channel == "commentary" and recipient is None):
                kind = CONTENT
        self._begin_body(kind, header)
        return kind

    def _begin_body(self, kind: str, header: Header | None) -> None:
        self._state, self._kind, self._header = "body", kind, header
        self._fresh, self._seen, self._prefix = True, 0, ""

    def _read_text(self, *, final: bool) -> Iterator[HarmonyEvent]:
        at, tag = first(self._held, (*ENDS, *BREAKS))
        if at < 0:
            keep = 0 if final else _tail(self._held, (*ENDS, *BREAKS))
            text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            yield from self._out(self._kind, text)
            if final:
                self._state = "between"
            return True
        yield from self._out(self._kind, self._held[:at])
        if tag in ENDS:
            if self._kind == _RAW:
                yield from self._out(_RAW, tag)
            self._held = self._held[at + len(tag):]
        else:
            self._held = self._held[at:]  # a new header, without the end marker: read between messages
        self._state = "between"
        return False

    def _read_call(self, *, final: bool) -> Iterator[HarmonyEvent]:
        at, tag = first(self._held, (*ENDS, *BREAKS), max(0, self._seen - _LONGEST + 1))
        if at < 0 and not final:
            self._seen = len(self._held)
            return True
        body = self._held if at < 0 else self._held[:at]
        end = tag if tag in ENDS else ""
        self._held = self._held[len(body) + len(end):]
        self._state = "between"
        arguments = self._arguments(body)
        if arguments is None:
            yield from self._out(_RAW, self._raw + body + end)
        else:
            yield ParsedCall(self.calls, self._name, arguments)
            self.calls += 1
        self._raw = ""
        return at < 0

    def _arguments(self, body: str) -> str | None:
        """A call's arguments: its text as vLLM passes it on (re-serialised, or as written when the content type is
        not JSON); None unless it is a JSON object."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        content_type = self._header.content_type
        return body if content_type is not None and "json" not in content_type else json.dumps(value)

    def _read_between(self, *, final: bool) -> Iterator[HarmonyEvent]:
        at, tag = first(self._held, BREAKS)
        if at < 0:
            keep = 0 if final else _tail(self._held, BREAKS)
            text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            yield from self._out(_RAW, text)
            return True
        yield from self._out(_RAW, self._held[:at])
        self._state, self._prefix = "header", ""
        if tag == START:
            self._held, self._opening, self._role = self._held[at + len(START):], START, None
        else:  # <|channel|> without <|start|>assistant: the assistant's next message
            self._held, self._opening, self._role = self._held[at:], "", ASSISTANT
        return False

    # -- out ----------------------------------------------------------------------------------------------------

    def _out(self, kind: str, text: str) -> Iterator[HarmonyEvent]:
        """Text of the message's kind; text passed on as written (_RAW) is content, without a joining newline."""
        if not text:
            return
        if kind == _RAW:
            yield CONTENT, text
            return
        if self._fresh and kind in self._said:
            text = "\n" + text  # vLLM joins the messages of a kind with a newline
        self._fresh = False
        self._said.add(kind)
        yield kind, text


# -- the ``openai`` tool-call parser ---------------------------------------------------------------------------------


class HarmonyCalls:
    """``openai``: gpt-oss's Harmony messages (:class:`HarmonyParser`), as a tool-call parser: content and calls,
    analysis messages passed on as content as written. answer.AnswerParser does not run this one: it parses Harmony
    answers with harmony.HarmonyParser, reasoning included when the reasoning parser is Harmony's too. The markers
    are special tokens: the answer must be decoded keeping them."""

    keeps_special_tokens = True

    def __init__(self, tools: Tools = None):
        self._parser = HarmonyParser(tools, reasoning=False)

    @property
    def calls(self) -> int:
        return self._parser.calls

    def feed(self, text: str) -> Iterator[Item]:
        yield from self._items(self._parser.feed(text))

    def finish(self) -> Iterator[Item]:
        yield from self._items(self._parser.finish())

    @staticmethod
    def _items(events) -> Iterator[Item]:
        for event in events:
            yield event if isinstance(event, ParsedCall) else event[1]


NOT_FORCED = ("a call is a Harmony message of its own, after the analysis (reasoning) message gpt-oss writes first, "
              "framed by special tokens (<|channel|>, <|constrain|>, <|message|>, <|call|>); the constraints here are "
              "placed after think-tag reasoning only, so no grammar can hold the call without holding the channels")
FAMILY = Family(("openai",), HarmonyCalls, not_forced=NOT_FORCED)
