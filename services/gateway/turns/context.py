"""The one object a turn's stages pass along (TurnContext), and what the turn reports (KvOutcome, Delta, Finished)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvshuttle.control_plane.answer import Event
from kvshuttle.services.engine.client import Final, TokenLogprob
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.parsers import AnswerEvents
    from kvshuttle.services.gateway.turns.request import TurnRequest


class Tokenizer(Protocol):
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class KvOutcome:
    decision: str
    reason: str
    pulled_tokens: int = 0
    computed_tokens: int = 0
    retried_as_recompute: bool = False
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    figures: scheduler_pb2.PlanFigures | None = None
    worker_failures: list[str] = field(default_factory=list)  # workers that failed in this turn, and what followed
    reason_code: str = ""  # ``reason`` as a code of kvshuttle.control_plane.reasons
    session_source: str = ""  # how the session was known: "client", "found", "new" or "" (TurnRequest's)
    session_id: str = ""  # the session the turn ran in (the request's, a found one or a new one)
    record: str = ""  # what became of the turn's record: reasons.RECORD_OUTCOMES ("" until the record stage ran)
    record_error: str = ""  # why the record could not be written (record_refused, _unavailable, _error, no_handle)


@dataclass
class KnownSession:
    """What the prompt stage learned of the turn's session, for the scheduler (PlanTurnRequest's known-session
    fields), so it need not read the record again."""

    snapshot: registry_pb2.GetSessionResponse | None = None  # the record as read (without its history ids)
    not_found: bool = False  # the registry has no such session (a new one)
    history_match_tokens: int = 0  # how many of the prompt's first ids equal the snapshot's recorded ids

    def plan_fields(self) -> dict[str, Any]:
        """PlanTurnRequest's keywords for what is known."""
        out: dict[str, Any] = {}
        if self.snapshot is not None:
            out["session_snapshot"] = self.snapshot
            if self.history_match_tokens:
                out["history_match_tokens"] = self.history_match_tokens
        if self.not_found:
            out["session_not_found"] = True
        return out


@dataclass
class TurnContext:
    """One turn as its stages fill it in: the prompt stage sets the prompt and the session it continues, the plan
    stage the plan and the KV outcome, the prefill stage P's answer (the handle for D, perhaps the first token). What
    the front ends get from ``TurnRunner.prepare``: decoding it on D (then recording it) is what remains."""

    id: str
    request: TurnRequest
    started: float
    span: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    # prompt stage
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""  # the text the ids stand for ('' for raw ids)
    continued: bool = False  # the ids continue the session's recorded ids
    history_base: common_pb2.Session | None = None  # the record whose ids prompt_ids continue (when continued)
    history_kept: int = 0  # how many of history_base's ids prompt_ids start with (all, or up to a text boundary)
    # Cuts of the prompt text at message ends that the turn's record keeps (Session.text_boundaries): (chars, tokens,
    # loop_start), shortest first; prompt_ids[:tokens] stand for prompt_text[:chars].
    text_cuts: list[tuple[int, int, bool]] = field(default_factory=list)
    known_session: KnownSession = field(default_factory=KnownSession)
    # plan stage
    plan: scheduler_pb2.PlanTurnResponse = field(default_factory=scheduler_pb2.PlanTurnResponse)
    kv: KvOutcome = field(default_factory=lambda: KvOutcome("", ""))
    # prefill stage
    decode_params: dict[str, Any] | None = None  # kv_transfer_params for D, from P's answer
    # The answer's first token as P sampled it (None: D samples it). D then continues after it: its prompt is the
    # prompt plus this token, whose KV D computes itself, and the client gets it without waiting for D.
    first_token: int | None = None
    first_finish: str = ""  # P's finish reason for that token ("stop": it ended the answer)
    first_logprob: TokenLogprob | None = None  # P's log-probability of that token (requests that ask)
    excluded: list[str] = field(default_factory=list)  # workers that failed in this turn: never planned on again
    release: asyncio.Task | None = None  # freeing the session's previous, unused KV handle on its decode worker
    quota: Any = None  # the turn's hold on its tenant's limits (tenant_limits.TurnQuota; None: no limits)
    # decode stage
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to output_ids (requests that ask)
    text: str = ""  # the answer's text, as the client received it
    hidden: set[int] = field(default_factory=set)  # token ids left out of the text (stop ids, EOS)
    final: Final | None = None  # D's final message (its handle is what the record stage records)
    # parse stage
    held_events: list[Event] = field(default_factory=list)  # what the parser held back until the answer ended
    answer: AnswerEvents | None = None  # the answer's parser, once it has ended (its events: answer_events)
    # the answer's way out for D's plain tokens, when the front end opens it (ExpressLane)
    express: ExpressLane = field(default_factory=lambda: ExpressLane())

    @property
    def answer_events(self) -> list[Event]:
        """Every event of the answer, in order (made when read: a streamed answer's front end never reads them)."""
        return self.answer.events if self.answer is not None else []


class ExpressLane:
    """D's plain tokens written from the read that brought them, with no task woken for them.

    A token normally climbs the turn's async generators (the engine call, the decode stage, the runner, the API's
    spelling) in the stream's task, woken by the connection's read. While that chain waits at D's stream for the
    next message, a lane lets the same steps run in the connection's read callback instead: the API's front end sets
    ``spell`` (a Delta, parsed, to the frames it writes), the HTTP response sets ``ready`` (whether its transport
    takes a write now) and ``write``. Each stage's step is the same function its generator calls, so the two ways
    say the same bytes. Anything else (the first message, D's final message, an error, a paused transport) goes
    the usual way, in order (turns/decode.py, services/engine/h2_streams.py)."""

    __slots__ = ("spell", "ready", "write")

    def __init__(self) -> None:
        self.spell: Callable[[Delta], Iterable[bytes]] | None = None
        self.ready: Callable[[], bool] | None = None
        self.write: Callable[[bytes], None] | None = None

    @property
    def open(self) -> bool:
        return self.spell is not None and self.ready is not None and self.write is not None

    def close(self) -> None:
        """The stream has ended: nothing more goes this way. ``spell`` holds the turn (the lane is the turn's), so
        this also breaks that cycle: the turn is freed as its stream ends, not by the collector's next full pass."""
        self.spell = self.ready = self.write = None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    events: list[Event] = field(default_factory=list)  # what the text means (parse stage): reasoning, content, calls


@dataclass
class Finished:
    finish_reason: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    kv: KvOutcome
    timings: dict[str, float]
    logprobs: list[TokenLogprob] | None = None  # one per output id, when the request asked for logprobs
    events: list[Event] = field(default_factory=list)  # what the parser held back until the answer ended
    answer: AnswerEvents | None = None  # the answer's parser (its events: answer_events)

    @property
    def answer_events(self) -> list[Event]:
        """Every event of the answer, in order (whole answers read them; made when read)."""
        return self.answer.events if self.answer is not None else []


def elapsed_ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 3)
