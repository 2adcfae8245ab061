"""The parsing machine most families share (all but hermes and Harmony): content outside calls, calls numbered in
order, a call that does not parse passed on as content, and the scanning of the held-back text."""

from __future__ import annotations

from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Item, ParsedCall, Tools
from kvshuttle.control_plane.tool_calls.scan import first, partial_tail


class Calls:
    """What the families share: the content outside calls (with the whitespace a call would drop held back), calls
    numbered in order, and a call that does not parse passed on as content. A family's ``_run`` consumes ``_held``."""

    def __init__(self, tools: Tools = None):
        self.tools = list(tools or [])
        self.calls = 0
        self._held = ""  # answer text not decided yet
        self._seen = 0  # how much of _held a search for a closing tag has already looked through
        self._ws = ""  # whitespace ending the content so far: dropped if a call follows
        self._spoke = False  # the content has had more than whitespace
        self._called = False  # a call was found: text outside calls is no longer content

    def feed(self, text: str) -> Iterator[Item]:
        self._held += text
        yield from self._run(final=False)

    def finish(self) -> Iterator[Item]:
        yield from self._run(final=True)
        if self._ws and not self._called:
            yield self._ws
        self._ws = ""

    def _run(self, *, final: bool) -> Iterator[Item]:
        raise NotImplementedError

    # -- content and calls --

    def _content(self, text: str) -> Iterator[str]:
        if self._called or not text:
            return
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out, self._ws, self._spoke = self._ws + body, text[len(body):], True
        yield out

    def _found(self, calls: list[tuple[str, str]], *, keep_ws: bool = False) -> Iterator[Item]:
        """Calls found; the whitespace before them is dropped, or passed on as content (``keep_ws``)."""
        if keep_ws and self._ws and not self._called:
            yield self._ws
        self._ws, self._called = "", True
        for name, arguments in calls:
            yield ParsedCall(self.calls, name, arguments)
            self.calls += 1

    def _unparsed(self, raw: str) -> Iterator[str]:
        """A call that does not parse: its text is content, tags and all."""
        if self._called:
            if raw:
                yield raw
        else:
            yield from self._content(raw)

    # -- scanning _held --

    def _scan(self, tags: tuple[str, ...], *, final: bool) -> Iterator[str]:
        """Content up to the first of ``tags``, which is consumed and returned ("" when none has come: the text that
        cannot start one is content, the rest held back, or all content once the answer has ended)."""
        at, tag = first(self._held, tags)
        if at < 0:
            keep = 0 if final else max(partial_tail(self._held, t) for t in tags)
            cut = len(self._held) - keep
            yield from self._content(self._held[:cut])
            self._held = self._held[cut:]
            return ""
        yield from self._content(self._held[:at])
        self._held = self._held[at + len(tag):]
        self._seen = 0
        return tag

    def _take(self, tags: tuple[str, ...], *, final: bool) -> tuple[str, str] | None:
        """Inside a call: the text up to the first of ``tags`` and the tag, both consumed; at the answer's end without
        one, (all the text, ""); None while it has not come."""
        at, tag = first(self._held, tags, max(0, self._seen - max(map(len, tags)) + 1))
        if at >= 0:
            before, self._held, self._seen = self._held[:at], self._held[at + len(tag):], 0
            return before, tag
        if final:
            before, self._held, self._seen = self._held, "", 0
            return before, ""
        self._seen = len(self._held)
        return None

    def _skip_space(self) -> str:
        """The whitespace that starts ``_held``, consumed."""
        rest = self._held.lstrip()
        space, self._held = self._held[:len(self._held) - len(rest)], rest
        return space
