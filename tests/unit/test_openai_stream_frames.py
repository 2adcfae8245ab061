"""OpenAI's stream frames (services/gateway/apis/openai/stream.py): a text chunk spelled from its made-once prefix
and suffix is byte for byte the chunk ``json.dumps`` of the whole object gives, for any text (escapes, non-ASCII,
lone surrogates), and a stream's chunks concatenate to the answer."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.services.gateway.apis.openai.chat_answer import AnswerShape
from kvshuttle.services.gateway.apis.openai.stream import CHAT, _json_string, stream
from kvshuttle.services.gateway.edge.sse import frame
from kvshuttle.services.gateway.turns import TurnRequest
from kvshuttle.services.gateway.turns.parsers import Parsers

from tests.support.turn_fakes import AnsweringRunner


@given(st.text(st.characters(exclude_categories=())))  # lone surrogates too
def test_a_json_string_is_what_json_dumps_writes(text):
    assert _json_string(text) == json.dumps(text).encode()


ANSWER = 'Plain, "quoted", back\\slash, tab\t, newline\n, é, 漢字, emoji 😀, nul \x00, line sep \u2028.'


async def test_each_text_chunk_is_the_whole_objects_json_and_they_make_the_answer():
    runner = AnsweringRunner(ANSWER, pieces=4)
    turn = await runner.prepare(TurnRequest(prompt_ids=[1, 2, 3]))
    frames = [f async for f in stream(runner, turn, "m", False, CHAT, AnswerShape())]
    chunks = [json.loads(f[len(b"data: "):]) for f in frames if f != b"data: [DONE]\n\n"]
    texts = []
    for f, c in zip(frames, chunks, strict=False):
        assert f == frame(c)  # the same bytes as the object written whole
        texts.append(c["choices"][0]["delta"].get("content") or "" if c["choices"] else "")
    assert "".join(texts) == ANSWER and frames[-1] == b"data: [DONE]\n\n"


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Hi", " there", " ", "\n", "<think>", "</think>", "plan ", CALL, "é😀", "<", "tool"]),
                max_size=12), st.integers(1, 5))
async def test_the_open_text_block_s_fast_chunk_is_the_chunk_the_answer_layer_spells(parts, pieces):
    """Content added to the open text block is spelled without the answer layer's steps (AnswerBlocks.extend_text):
    the stream is byte for byte the one where every delta takes them, reasoning, calls and blank text around it."""
    async def frames(fast: bool) -> list[bytes]:
        runner = AnsweringRunner("".join(parts), pieces=pieces)
        req = TurnRequest(prompt_ids=[1, 2, 3])
        req.parsing = Parsers("hermes", "qwen3").parsing(True, [{"type": "function", "function": {"name": "f"}}])
        turn = await runner.prepare(req)
        ids = iter(range(100))
        answer = AnswerShape(parsed=True, new_id=lambda: f"call-{next(ids)}")
        if not fast:
            answer.blocks.extend_text = lambda text: False
        return [re.sub(rb'"created":\d+', b"", f) async for f in stream(runner, turn, "m", True, CHAT, answer)]

    assert await frames(True) == await frames(False)
