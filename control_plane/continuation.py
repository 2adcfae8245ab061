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
class Boundary:
    """A cut of a recorded text at the end of a message (Session.text_boundaries): the record's first ``tokens`` ids
    stand for its first ``chars`` characters, whose content key is ``key``. ``loop_start``: the cut before the
    answer to the conversation's last user query (where its current tool loop began)."""

    key: bytes
    chars: int
    tokens: int
    loop_start: bool = False


@dataclass(frozen=True)
class Continuation:
    """How to build the next prompt: ``prefix_ids`` (standing for the new text's first ``prefix_chars``
    characters) then the tokens of ``suffix_text``. ``boundary``: the record's boundary the prefix ends at (None:
    the record's whole text, or no continuation)."""

    prefix_ids: tuple[int, ...]
    suffix_text: str
    prefix_chars: int = 0
    boundary: Boundary | None = None

    @property
    def continues(self) -> bool:
        return bool(self.prefix_ids)


def plan_continuation(prev_chars: int, prev_key: bytes, prev_ids: Sequence[int], new_text: str,
                      boundaries: Sequence[Boundary] = ()) -> Continuation:
    """Splice onto the previous ids when ``new_text`` extends the previous text, known by its length in characters
    and its content key (``text_key``: the record keeps no text); else onto the ids of the longest of the record's
    ``boundaries`` that ``new_text`` extends (the history re-rendered differently past it: reasoning dropped by the
    client or by the chat template); else start from scratch."""
    if (prev_chars and prev_key and prev_ids and len(new_text) >= prev_chars
            and text_key(new_text[:prev_chars]) == prev_key):
        return Continuation(tuple(prev_ids), new_text[prev_chars:], prev_chars)
    for b in sorted(boundaries, key=lambda b: b.chars, reverse=True):
        if 0 < b.tokens <= len(prev_ids) and 0 < b.chars < len(new_text) and text_key(new_text[:b.chars]) == b.key:
            return Continuation(tuple(prev_ids[:b.tokens]), new_text[b.chars:], b.chars, b)
    return Continuation((), new_text)


def last_message_end(text: str, markers: Sequence[str]) -> int:
    """Where the last whole message of a rendered prompt ends: just after its last end-of-turn marker (0: none).
    What follows is the generation prompt (and, in templates whose user turns carry no marker, the last user
    message)."""
    return max((at + len(m) for m in markers if m and (at := text.rfind(m)) >= 0), default=0)


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many leading ids ``a`` and ``b`` share (those before ``start`` taken as equal)."""
    n, i, step = min(len(a), len(b)), max(0, start), 512
    while i + step <= n and list(a[i:i + step]) == list(b[i:i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
