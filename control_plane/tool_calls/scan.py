"""Scanning a growing answer for tags, shared by every family's parser (Harmony's included).

``partial_tail`` is the think-tag splitter's (control_plane/reasoning.py, below this package: the reasoning parser
runs first and must not import the tool-call families); it is re-exported here so the parsers take all their
scanning from one place.
"""

from __future__ import annotations

from kvshuttle.control_plane.reasoning import partial_tail

__all__ = ["JsonEnd", "first", "partial_tail"]


def first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest whole tag of ``tags`` in ``text[start:]``: (index, tag); (-1, "") when there is none.

    Ties: when two tags are found at the same index (one is a prefix of the other), the longer one wins, whatever
    their order in ``tags``: the text there is the longer tag, and reading it as the shorter one would leave the
    rest of it as text. (No family's tags tie today; Harmony's markers all end with ``|>``, so none is a prefix of
    another.)"""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best < 0 or at < best or (at == best and len(tag) > len(found))):
            best, found = at, tag
    return best, found


class JsonEnd:
    """Where the JSON object or array that a text starts with ends, found as the text grows: brackets counted outside
    strings. A text that is not JSON ends where its brackets balance (or never); parsing it then fails."""

    def __init__(self) -> None:
        self._depth, self._in_string, self._escaped, self._pos = 0, False, False, 0

    @property
    def fresh(self) -> bool:
        """Nothing scanned yet."""
        return self._pos == 0

    def end(self, text: str) -> int:
        """One past the value's closing bracket in ``text``, or -1 when it has not closed yet."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return -1
