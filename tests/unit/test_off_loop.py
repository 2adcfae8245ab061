"""Tokenizer work on the loop when short, in a thread when long (services/gateway/tokens/off_loop.py): the thread
hop costs more CPU than a short encode or render, a long one would stall every stream."""

from __future__ import annotations

import threading

from kvshuttle.services.gateway.tokens import off_loop


class Recording:
    """A stand-in tokenizer that notes the thread each call ran on."""

    def __init__(self):
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert add_special_tokens is False
        self.threads.append(threading.get_ident())
        return [len(text)]

    def render_chat(self, messages, add_generation_prompt: bool, **variables) -> str:
        assert add_generation_prompt is True
        self.threads.append(threading.get_ident())
        return f"{len(messages)} messages, {len(variables.get('tools') or ())} tools"


async def test_short_work_runs_on_the_loop_long_work_in_a_thread():
    tok, here = Recording(), threading.get_ident()
    short, long = "x" * off_loop.INLINE_CHARS, "x" * (off_loop.INLINE_CHARS + 1)
    assert await off_loop.encode(tok, short) == [len(short)]
    assert await off_loop.encode(tok, long) == [len(long)]
    assert await off_loop.encode_split(tok, short, 3) == ([3], [len(short) - 3])
    assert await off_loop.encode_split(tok, long, 3) == ([3], [len(long) - 3])
    assert tok.threads[0] == here and tok.threads[1] != here
    assert tok.threads[2] == tok.threads[3] == here and tok.threads[4] == tok.threads[5] != here


async def test_a_chat_with_many_messages_or_tools_renders_in_a_thread():
    tok, here = Recording(), threading.get_ident()
    few = [{"role": "user", "content": "hi"}] * (off_loop.INLINE_ITEMS - 1)
    assert await off_loop.render_chat(tok, few, tools=[{}]) == f"{len(few)} messages, 1 tools"
    assert await off_loop.render_chat(tok, few, tools=[{}, {}]) == f"{len(few)} messages, 2 tools"
    assert await off_loop.render_chat(tok, few * 2) == f"{2 * len(few)} messages, 0 tools"
    assert tok.threads[0] == here and tok.threads[1] != here and tok.threads[2] != here
