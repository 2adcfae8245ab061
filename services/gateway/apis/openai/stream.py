"""A turn's answer in the OpenAI routes' shapes: how each endpoint spells its objects (Shape), logprobs and usage,
and the event stream of a ``stream: true`` request (chunks, the ``kvshuttle`` object on the last one, usage when
asked, ``[DONE]``; OpenAI's error object then ``[DONE]`` when the turn fails mid-stream)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from kvshuttle.control_plane.answer import Piece
from kvshuttle.control_plane.reasoning import CONTENT
from kvshuttle.services.engine.client import TokenLogprob
from kvshuttle.services.gateway.apis.openai.chat_answer import AnswerShape
from kvshuttle.services.gateway.apis.openai.logprob_format import Spell, chat_content, completion_logprobs
from kvshuttle.services.gateway.edge.api_errors import error_body
from kvshuttle.services.gateway.edge.sse import frame as _sse
from kvshuttle.services.gateway.turns import Delta, TurnContext, TurnRunner
from kvshuttle.services.gateway.turns.reply import Usage, kv_body


def _json_string(text: str) -> bytes:
    """``text`` as a JSON string, as ``json.dumps`` writes it (ASCII, escaped), without its Python frames."""
    return encode_basestring_ascii(text).encode()


def usage(used: Usage) -> dict[str, Any]:
    """OpenAI's usage (``cached_tokens``: see reply.Usage)."""
    return {"prompt_tokens": used.prompt, "completion_tokens": used.completion, "total_tokens": used.total,
            "prompt_tokens_details": {"cached_tokens": used.cached}}


def error_tail(status: int, message: str) -> list[bytes]:
    """How a chat or completions stream ends after a failure: OpenAI's error object, then ``[DONE]``."""
    return [_sse(error_body(status, message)), _sse("[DONE]")]


@dataclass(frozen=True)
class Shape:
    """How one OpenAI endpoint spells its objects and choices."""

    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A completions choice (chat choices come from chat_answer)."""
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}


@dataclass
class Logprobs:
    """A turn's logprobs in OpenAI's shapes; ``offset``: where the next completions token starts in the text."""

    spell: Spell
    hidden: set[int]
    offset: int = 0

    def chat(self, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"content": chat_content(lps or [], self.spell, self.hidden), "refusal": None}

    def completion(self, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        out = completion_logprobs(lps or [], self.spell, self.hidden, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


class TextChunks:
    """The per-token chunk (a delta of one text field, nothing else) of one stream, spelled from a prefix and suffix
    made once per field: the same bytes as _sse() would write, without building and encoding the whole dict each
    token. ``base``: the stream's chunk fields (id, object, created, model)."""

    __slots__ = ("_base", "_frames")

    def __init__(self, base: dict[str, Any]):
        self._base = base
        self._frames: dict[str, tuple[bytes, bytes]] = {}

    def __call__(self, key: str, text: str) -> bytes:
        frame = self._frames.get(key)
        if frame is None:
            whole = _sse({**self._base, "choices": [{"index": 0, "delta": {key: ""}, "finish_reason": None}]})
            cut = whole.index(b'""}', whole.index(b'"delta":'))
            frame = self._frames[key] = (whole[:cut], whole[cut + 2:])
        return frame[0] + _json_string(text) + frame[1]


CHAT = Shape("chat.completion", "chat.completion.chunk", chat=True)
COMPLETION = Shape("text_completion", "text_completion", chat=False)


async def stream(runner: TurnRunner, turn: TurnContext, model: str, include_usage: bool, shape: Shape,
                 answer: AnswerShape, lps: Logprobs | None = None, ids: bool = False) -> AsyncIterator[bytes]:
    """``ids`` (vLLM's return_token_ids): the first chunk carries the prompt's ids, each chunk its tokens' ids."""
    base = {"id": turn.id, "object": shape.chunk_object, "created": int(time.time()), "model": model}
    text_chunk = TextChunks(base)

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None,
              token_ids: list[int] | None = None) -> bytes:
        if finish is None and not logprobs and not (ids and token_ids is not None) and len(delta) == 1:
            (key, text), = delta.items()
            if type(text) is str:
                return text_chunk(key, text)
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                          **({"logprobs": logprobs} if logprobs else {}),
                                          **({"token_ids": token_ids} if ids and token_ids is not None else {})}]})

    sent_prompt, plain = False, shape.chat and lps is None and not ids
    extend_text = answer.blocks.extend_text

    def spell(event: Delta) -> list[bytes]:
        """A delta's chunks (the express lane's too: context.ExpressLane)."""
        nonlocal sent_prompt
        if not shape.chat:
            choice = shape.choice(event.text, None, lps.completion(event.logprobs) if lps else None)
            frame = _sse({**base, "choices": [{**choice, **({"token_ids": event.token_ids} if ids else {})}],
                          **({"prompt_token_ids": list(turn.prompt_ids)} if ids and not sent_prompt else {})})
            sent_prompt = True
            return [frame]
        if plain:  # no logprobs, no ids: each delta of one text field is one text chunk
            events = event.events
            if len(events) == 1 and type(piece := events[0]) is Piece and piece.kind == CONTENT \
                    and extend_text(piece.text):  # the usual token: more of the open text block's content
                return [text_chunk("content", piece.text)]
            frames = []
            for delta in answer.deltas(events):
                if len(delta) == 1:
                    (key, text), = delta.items()
                    if type(text) is str:
                        frames.append(text_chunk(key, text))
                        continue
                frames.append(chunk(delta))
            return frames
        # The delta's token logprobs and ids go with its first chunk (on an empty delta when the parser holds the
        # text).
        logprobs = lps.chat(event.logprobs) if lps and event.logprobs else None
        token_ids = list(event.token_ids) if ids else None
        frames = []
        for delta in answer.deltas(event.events) or ([{}] if logprobs or token_ids else []):
            frames.append(chunk(delta, logprobs=logprobs, token_ids=token_ids))
            logprobs, token_ids = None, []
        return frames

    if shape.chat:
        first = {"role": "assistant", "content": ""}
        yield _sse({**base, "choices": [{"index": 0, "delta": first, "finish_reason": None}],
                    **({"prompt_token_ids": list(turn.prompt_ids)} if ids else {})})
    turn.express.spell = spell
    async for event in runner.decode(turn):
        if isinstance(event, Delta):
            for frame in spell(event):
                yield frame
        else:
            if shape.chat:
                for delta in answer.finish_deltas(event.events):
                    yield chunk(delta)
                last = {**base, "choices": [{"index": 0, "delta": {},
                                             "finish_reason": answer.finish_reason(event.finish_reason)}]}
            else:
                last = {**base, "choices": [shape.choice("", event.finish_reason)]}
            yield _sse({**last, "kvshuttle": kv_body(event.kv, event.timings, turn.request)})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(Usage.of(event))})
    yield _sse("[DONE]")
