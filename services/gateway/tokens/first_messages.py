"""The ids of a new conversation's first message, tokenized once per gateway and tenant.

Agents send the same first message (the system prompt, and in most chat templates the tool list) with every new
conversation; a later turn continues its session's recorded ids and tokenizes only its new text, but a first turn
tokenizes all of it: ~160 µs for a 400-character prompt on the CI machine, ~2 ms per 4,000 characters. This cache
keeps the ids of first messages, split off at the end marker that ends them.

Splitting there gives the ids the whole text gives only when the marker is a token of its own that leaves the text
after it alone (an added token, not normalized, not eating the whitespace after it) and the tokenizer treats a text
that begins there as it treats that part of a longer text (no prefix space added to a text's first word, as
SentencePiece-style tokenizers do): ``safe_markers`` checks both, and with no safe marker there is no cache. Entries
are per tenant (one tenant's prompt never makes another's turn faster) and bounded by the ids they hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

MIN_CHARS = 256  # a shorter first message tokenizes in tens of µs: not worth an entry
MAX_IDS = 1 << 18  # ids kept over all entries (~9 MB); the least recently used entries go first
_PROBES = ("x{m}\n y", "Hello.{m}\n<|im_start|>user\n z", "a{m} b{m}\n\nc")


def safe_markers(tokenizer: Any, markers: Sequence[str]) -> list[str]:
    """The markers a text may be split after with the same ids as the whole text (see the module's docstring)."""
    backend = tokenizer.backend
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    out = []
    for m in markers:
        token = added.get(m)
        if token is None or token.rstrip or token.normalized:
            continue
        if all(_splits_alike(tokenizer, probe.replace("{m}", m), m) for probe in _PROBES):
            out.append(m)
    return out


def _splits_alike(tokenizer: Any, text: str, marker: str) -> bool:
    at = text.index(marker) + len(marker)
    return tokenizer.encode(text, False) == [*tokenizer.encode(text[:at], False), *tokenizer.encode(text[at:], False)]


class FirstMessages:
    """First messages' ids by tenant and text (least recently used out first once ``max_ids`` are kept)."""

    def __init__(self, markers: Sequence[str], *, min_chars: int = MIN_CHARS, max_ids: int = MAX_IDS):
        self.markers = [m for m in markers if m]
        self.min_chars, self.max_ids = min_chars, max_ids
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self.kept_ids = 0
        self.hits = 0
        self.misses = 0

    def end(self, text: str) -> int:
        """Where ``text``'s first message ends (just after the first marker in it), 0 when it has none or that
        message is shorter than ``min_chars``."""
        ends = [at + len(m) for m in self.markers if (at := text.find(m)) >= 0]
        n = min(ends, default=0)
        return n if n >= self.min_chars else 0

    def get(self, tenant: str, head: str) -> tuple[int, ...] | None:
        ids = self._entries.get((tenant, head))
        if ids is None:
            self.misses += 1
            return None
        self._entries.move_to_end((tenant, head))
        self.hits += 1
        return ids

    def put(self, tenant: str, head: str, ids: Sequence[int]) -> None:
        if len(ids) > self.max_ids // 4 or (tenant, head) in self._entries:
            return
        self._entries[(tenant, head)] = tuple(ids)
        self.kept_ids += len(ids)
        while self.kept_ids > self.max_ids:
            _, old = self._entries.popitem(last=False)
            self.kept_ids -= len(old)

    def __len__(self) -> int:
        return len(self._entries)
