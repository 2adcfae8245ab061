"""Log-probabilities in OpenAI's two shapes: chat's ``logprobs.content`` entries and completions' parallel lists.

Each token is spelled as its own text (the tokenizer's decoding of that one id, special tokens included: a byte
that is part of a longer character decodes to U+FFFD, as in vLLM) with its UTF-8 bytes. Tokens left out of the
answer's text (EOS, a stop token id) are left out here too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvshuttle.services.engine.client import TokenLogprob

Spell = Callable[[int], str]


def speller(tokenizer: Any) -> Spell:
    """One token id's text, cached per call site (a turn's answer repeats many ids)."""
    cache: dict[int, str] = {}

    def spell(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], False)
        return cache[token_id]

    return spell


def _entry(spell: Spell, token_id: int, logprob: float) -> dict[str, Any]:
    text = spell(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_content(lps: Sequence[TokenLogprob], spell: Spell, hidden: Collection[int] = ()) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: per token, its text, logprob, bytes and ``top_logprobs`` (as many as asked)."""
    return [{**_entry(spell, lp.token_id, lp.logprob),
             "top_logprobs": [_entry(spell, i, v) for i, v in lp.top]}
            for lp in lps if lp.token_id not in hidden]


def completion_logprobs(lps: Sequence[TokenLogprob], spell: Spell, hidden: Collection[int] = (),
                        offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token text -> logprob) and
    ``text_offset`` (each token's start in the answer text, from ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        if lp.token_id in hidden:
            continue
        text = spell(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({spell(i): v for i, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
