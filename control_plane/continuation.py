"""Carry a conversation's exact token ids into its next turn.

Re-tokenizing a rendered history does not always give back the ids the decode worker generated (BPE merges across
the answer's boundary, partial UTF-8 tokens), and KV for other ids is wrong KV. So when the new rendered prompt
starts with the text the previous turn's ids stand for, the next prompt is those ids plus the ids of the new text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvshuttle.control_plane.session import MAX_FIND_KEYS


@dataclass(frozen=True)
class Continuation:
    """How to build the next prompt: ``prefix_ids`` then the tokens of ``suffix_text``."""

    prefix_ids: tuple[int, ...]
    suffix_text: str

    @property
    def continues(self) -> bool:
        return bool(self.prefix_ids)


def plan_continuation(prev_chars: int, prev_key: bytes, prev_ids: Sequence[int], new_text: str) -> Continuation:
    """Splice onto the previous ids when ``new_text`` extends the previous text, known by its length in characters
    and its content key (``text_key``: the record keeps no text); else start from scratch."""
    if (prev_chars and prev_key and prev_ids and len(new_text) >= prev_chars
            and text_key(new_text[:prev_chars]) == prev_key):
        return Continuation(tuple(prev_ids), new_text[prev_chars:])
    return Continuation((), new_text)


# -- finding a session by content ----------------------------------------------------------------------------------
# A turn sent without a session id continues the session whose recorded text (rendered prompt + raw answer) its own
# prompt text extends. Records are indexed under the SHA-256 of that text; a recorded text ends where an answer ended,
# so the candidate prefixes of a new prompt end just before or just after one of the model's end-of-turn markers
# (its EOS texts, e.g. "<|im_end|>": before it when the answer was cut by max_tokens).



def text_key(text: str) -> bytes:
    """The content key of a recorded text."""
    return hashlib.sha256(text.encode()).digest()


def prefix_keys(text: str, markers: Sequence[str], limit: int = MAX_FIND_KEYS) -> list[bytes]:
    """Content keys of the prefixes of ``text`` that end just before or just after a marker, longest first (at most
    ``limit``; the whole text and the empty prefix are not candidates). One pass over the text."""
    cuts: set[int] = set()
    for marker in filter(None, markers):
        at = text.find(marker)
        while at >= 0:
            cuts.update((at, at + len(marker)))
            at = text.find(marker, at + 1)
    ordered = sorted(c for c in cuts if 0 < c < len(text))
    hasher, keys, done = hashlib.sha256(), [], 0
    for cut in ordered:
        hasher.update(text[done:cut].encode())
        done = cut
        keys.append(hasher.copy().digest())
    return keys[::-1][:limit]
