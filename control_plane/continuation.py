"""Carry a conversation's exact token ids into its next turn.

Re-tokenizing a rendered history does not always give back the ids the decode worker generated (BPE merges across
the answer's boundary, partial UTF-8 tokens), and KV for other ids is wrong KV. So when the new rendered prompt
starts with the text the previous turn's ids stand for, the next prompt is those ids plus the ids of the new text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Continuation:
    """How to build the next prompt: ``prefix_ids`` then the tokens of ``suffix_text``."""

    prefix_ids: tuple[int, ...]
    suffix_text: str

    @property
    def continues(self) -> bool:
        return bool(self.prefix_ids)


def plan_continuation(prev_text: str, prev_ids: Sequence[int], new_text: str) -> Continuation:
    """Splice onto the previous ids when ``new_text`` extends ``prev_text``; else start from scratch."""
    if prev_text and prev_ids and new_text.startswith(prev_text):
        return Continuation(tuple(prev_ids), new_text[len(prev_text):])
    return Continuation((), new_text)
