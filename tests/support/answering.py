"""A stand-in turn runner for the HTTP front ends alone (the Anthropic Messages API's tests): it answers every turn
with a fixed text and keeps the requests; its tokenizer renders the chat as JSON (so a test can count the tokens the
same way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc
from kvshuttle.services.gateway.turns import Delta, Finished, KvOutcome, TurnError, TurnRequest
from kvshuttle.services.gateway.turns.context import ExpressLane
from kvshuttle.services.gateway.turns.parsers import AnswerEvents

PROMPT_TOKENS, COMPUTED_TOKENS, OUTPUT_IDS = 40, 10, list(range(7))


class JsonTokenizer:
    """Renders the messages and template variables as JSON; characters are tokens."""

    vocab_size = 65536

    def render_chat(self, messages, add_generation_prompt=True, **extra):
        return json.dumps({"messages": messages, **extra}, sort_keys=True) + ("<assistant>" if add_generation_prompt
                                                                             else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@dataclass
class AnsweredTurn:
    """The TurnContext fields the front ends read."""

    request: TurnRequest
    id: str = "kvs-test"
    prompt_text: str = "<prompt>"
    prompt_ids: list[int] = field(default_factory=lambda: list(range(PROMPT_TOKENS)))
    kv: KvOutcome = field(default_factory=lambda: KvOutcome("pull", "pulled", pulled_tokens=30,
                                                            computed_tokens=COMPUTED_TOKENS))
    express: ExpressLane = field(default_factory=ExpressLane)


class AnsweringRunner:
    """Answers every turn with ``answer`` (finish reason ``finish``), streamed in ``pieces``-character deltas: 40
    prompt tokens, 10 of them computed, 7 output ids. ``fail_after``: the decode fails (``TurnError`` 503) after that
    many deltas."""

    def __init__(self, answer: str, pieces: int = 3, finish: str = "stop", fail_after: int | None = None):
        self.answer, self.pieces, self.finish, self.fail_after = answer, pieces, finish, fail_after
        self.requests: list[TurnRequest] = []
        self.tokenizer = JsonTokenizer()

    async def prepare(self, req: TurnRequest) -> AnsweredTurn:
        self.requests.append(req)
        return AnsweredTurn(req)

    async def decode(self, turn: AnsweredTurn):
        """The deltas carry the events of the real parse stage (the request's parsing)."""
        answer = AnswerEvents(turn.request.parsing, turn.prompt_text)
        for n, i in enumerate(range(0, len(self.answer), self.pieces)):
            if n == self.fail_after:
                raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "the decode worker went away")
            piece = self.answer[i:i + self.pieces]
            yield Delta(piece, [], events=answer.feed(piece))
        held = answer.finish()
        yield Finished(self.finish, self.answer, list(OUTPUT_IDS), PROMPT_TOKENS, turn.kv, {}, None, held,
                       answer)
