"""Tokenizer work off the event loop when it is long, on it when short: a thread hop (``asyncio.to_thread``) costs
~120 µs of CPU (measured on the 2-core CI machine, docs/performance.md), more than encoding a short text (~45 µs for
80 characters) or rendering a short chat (~30 µs), while a long prompt's encode (~2 ms per 4,000 characters) would
stall every stream the loop serves."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

INLINE_CHARS = 512  # text up to this long is encoded on the loop (~250 µs at most)
INLINE_ITEMS = 16  # a chat of up to this many messages and tools is rendered on the loop (~50-90 µs)


async def encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, False)``, in a thread when the text is long."""
    if len(text) <= INLINE_CHARS:
        return tokenizer.encode(text, False)
    return await asyncio.to_thread(tokenizer.encode, text, False)


def _split(tokenizer: Any, text: str, at: int) -> tuple[list[int], list[int]]:
    return tokenizer.encode(text[:at], False), tokenizer.encode(text[at:], False)


async def encode_split(tokenizer: Any, text: str, at: int) -> tuple[list[int], list[int]]:
    """The ids of ``text[:at]`` and of ``text[at:]``, encoded apart (in a thread when the text is long)."""
    if len(text) <= INLINE_CHARS:
        return _split(tokenizer, text, at)
    return await asyncio.to_thread(_split, tokenizer, text, at)


async def first_message(tokenizer: Any, tenant: str, text: str) -> tuple[Sequence[int], int]:
    """The ids of ``text``'s first message and where it ends (``((), 0)``: not split off), from the tokenizer's
    ``first_messages`` cache (tokens/first_messages.py), tokenized and kept there when missing."""
    cache = getattr(tokenizer, "first_messages", None)
    n = cache.end(text) if cache is not None else 0
    if not n:
        return (), 0
    head = text[:n]
    ids = cache.get(tenant, head)
    if ids is None:
        ids = await encode(tokenizer, head)
        cache.put(tenant, head, ids)
    return ids, n


async def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
    """``tokenizer.render_chat(messages, True, **variables)``, in a thread when the chat is long."""
    if len(messages) + len(variables.get("tools") or ()) <= INLINE_ITEMS:
        return tokenizer.render_chat(messages, True, **variables)
    return await asyncio.to_thread(tokenizer.render_chat, messages, True, **variables)
