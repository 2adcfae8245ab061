"""What a turn asks for (TurnRequest), as the three front ends build it, and the checks they share."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import grpc
from kvshuttle.control_plane.constraints import Constraint
from kvshuttle.control_plane.session import DEFAULT_TENANT, InvalidArgument, validate_id
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.parsers import AnswerParsing

MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 512
MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS = 1024, 1024  # bounds on a request's lists (vLLM has none; they cost every step)
TOKEN_ID_LIMIT = 2**31  # token ids travel as int32 (our protos) / uint32 (vLLM's); a tokenizer's vocabulary is tighter


@dataclass
class TurnRequest:
    session_id: str = ""
    tenant: str = DEFAULT_TENANT
    # The model the turn is for, by its served name ("": the gateway's own); its sessions, finds and KV are its own.
    model: str = ""
    # A LoRA adapter's turn: the base model it adapts ("": ``model`` is a base model). The workers run the turn
    # under the adapter named ``model``; it is priced as its base model's turns.
    base_model: str = ""
    messages: list[dict] | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)  # for the chat template: tools, chat_template_kwargs
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # The most tokens the answer may have: the request's, or None (none asked: the gateway's default_max_tokens, else
    # the context left after the prompt, as vLLM does). check_length sets it, and max_tokens_source, once the
    # prompt's length is known.
    max_tokens: int | None = None
    default_max_tokens: int = 0  # the gateway's limit for a request that sets none (0: the context left)
    max_tokens_source: str = ""  # "request", "default" (the gateway's) or "context" (what the context leaves)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    disable_pull: bool = False
    policy: str = ""  # a named scheduler policy ("": the scheduler's default)
    # How session_id was known (KvReport.session_source): "client", "response", or set by the runner: "found",
    # "prompt_cache_key", "new", "".
    session_source: str = ""
    # OpenAI's prompt_cache_key: the session it names (cache_key_session) is continued when the prompt continues its
    # record (a session hint for clients that send no session id); else the session is found by content.
    cache_key: str = ""
    # Who the turn is for, as the client says (OpenAI's user and safety_identifier, Anthropic's metadata.user_id):
    # on the turn's span and log line only; they change no decision.
    end_user: str = ""
    safety_identifier: str = ""
    # vLLM's other sampling parameters (docs/api.md, "Request fields"); the defaults change nothing.
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False  # for stop token ids: keep the stopping token's text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect with a fast tokenizer (as in vLLM)
    # Guided decoding (structured output, forced tool calls): applied by D, which then samples every answer token.
    constraint: Constraint | None = None
    # The reasoning parser's (start, end) tags when the constraint is the gateway's own (JSON answer, forced calls):
    # once the prompt is rendered, the constraint is placed after the reasoning it leaves room for.
    reasoning_tags: tuple[str, str] | None = None
    logprobs: int | None = None  # None: none; 0: each sampled token's; N: also the N most likely at each position
    parsing: AnswerParsing | None = None  # how the answer is parsed (None: its text is its content)

    @property
    def cache_key_session(self) -> str:
        """The session id a prompt_cache_key names for the turn's model (any string: hashed into the session id
        alphabet; one key sent to two models names two sessions)."""
        if not self.cache_key:
            return ""
        scope = f"{self.model}\0{self.cache_key}" if self.model else self.cache_key
        return f"pck-{hashlib.sha256(scope.encode()).hexdigest()[:40]}"

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the turn runs under (None: a base model's turn)."""
        return self.model if self.base_model else None

    def engine_sampling(self) -> dict[str, Any]:
        """The sampling parameters both workers get (EngineClient.generate's keywords), min_tokens aside, and the
        adapter the turn runs under."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "ignore_eos": self.ignore_eos,
                "top_k": max(self.top_k, 0), "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias,
                "skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "logprobs": self.logprobs,
                "adapter": self.adapter}

    def room_tokens(self, answer_room_tokens: int) -> int:
        """The answer's KV room the scheduler makes on the decode worker: its limit, or for an answer that only the
        context limits (none asked), at most ``answer_room_tokens`` (a whole context of room per turn would free
        held KV it will most likely not need; the answer may still grow to its limit, as vLLM's scheduler allows)."""
        limit = self.max_tokens or 0
        return min(limit, answer_room_tokens) if self.max_tokens_source == "context" else limit

    @property
    def penalizes_output(self) -> bool:
        """Presence/frequency penalties count the answer's tokens: only a worker that samples all of them applies
        them exactly (so D samples the first token too; P's is dropped)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bad(message: str) -> TurnError:
    return TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, message)


def validate(req: TurnRequest, *, max_model_len: int, vocab: int | None) -> None:
    """Checks shared by the HTTP and gRPC front ends (types are already checked by each). ``vocab``: the model's
    vocabulary size, when known."""
    if req.max_tokens is not None and not 1 <= req.max_tokens <= max_model_len:
        raise _bad(f"max_tokens must be between 1 and {max_model_len}")
    if not 0.0 <= req.temperature <= 2.0:
        raise _bad("temperature must be between 0 and 2")
    if not 0.0 < req.top_p <= 1.0:
        raise _bad("top_p must be in (0, 1]")
    if not (req.top_k >= -1 and req.top_k < TOKEN_ID_LIMIT):
        raise _bad(f"top_k must be 0 or -1 (off) or at least 1, got {req.top_k}")
    if not 0.0 <= req.min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {req.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(req, name) <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {getattr(req, name)}")
    if not (math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0.0):
        raise _bad(f"repetition_penalty must be a finite number greater than 0, got {req.repetition_penalty}")
    if not 0 <= req.min_tokens <= (max_model_len if req.max_tokens is None else req.max_tokens):
        raise _bad(f"min_tokens must be between 0 and max_tokens ({req.max_tokens or max_model_len}), got "
                   f"{req.min_tokens}")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(req.stop_token_ids)}")
    if len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}")
    for name, ids in (("stop_token_ids", req.stop_token_ids), ("logit_bias", list(req.logit_bias))):
        outside = [i for i in ids if not 0 <= i < (vocab or TOKEN_ID_LIMIT)]
        if outside:
            where = f"the model's vocabulary (ids 0 to {vocab - 1})" if vocab else "the token ids (0 or more)"
            raise _bad(f"{name}: token id {outside[0]} is outside {where}")
    odd = [(i, b) for i, b in req.logit_bias.items() if not -100.0 <= b <= 100.0]
    if odd:
        raise _bad(f"logit_bias: the bias of token id {odd[0][0]} must be in [-100, 100], got {odd[0][1]}")
    if req.session_id:
        try:
            validate_id("session_id", req.session_id)
        except InvalidArgument as exc:
            raise _bad(str(exc)) from None
    if req.messages is not None and not req.messages:
        raise _bad("messages must not be empty")
    if req.stop:
        if len(req.stop) > MAX_STOP_STRINGS:
            raise _bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(req.stop)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
            raise _bad(f"stop strings must be 1 to {MAX_STOP_CHARS} characters long")
    if req.prompt_ids:
        low, high = min(req.prompt_ids), max(req.prompt_ids)
        if low < 0:
            raise _bad(f"prompt token id {low} is negative")
        if vocab is not None and high >= vocab:  # vLLM refuses it too, but as a failed prefill
            raise _bad(f"prompt token id {high} is outside the model's vocabulary (ids 0 to {vocab - 1})")


def check_length(req: TurnRequest, prompt_ids: list[int], *, max_prompt_tokens: int, max_model_len: int) -> None:
    """The prompt, once its ids are known: not empty, within the gateway's limit and the model's context; and the
    answer's limit (``req.max_tokens``, ``max_tokens_source``): the request's, which must fit; else the gateway's
    default, or what the context leaves when that is less or there is none (vLLM's rule)."""
    if not prompt_ids:
        raise _bad("the prompt is empty")
    if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
        raise _bad(f"the prompt has {len(prompt_ids)} tokens; this gateway accepts at most {max_prompt_tokens} "
                   "(max prompt tokens)")
    left = max_model_len - len(prompt_ids)
    if req.max_tokens_source in ("default", "context"):  # checked again (a prompt built again): resolved again
        req.max_tokens = None
    if req.max_tokens is not None:
        if req.max_tokens > left:
            raise _bad(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                       f"context of {max_model_len} tokens")
        req.max_tokens_source = "request"
        return
    if left < 1:
        raise _bad(f"the prompt ({len(prompt_ids)} tokens) leaves no room for an answer in the model's context of "
                   f"{max_model_len} tokens")
    if 0 < req.default_max_tokens < left:
        req.max_tokens, req.max_tokens_source = req.default_max_tokens, "default"
    else:
        req.max_tokens, req.max_tokens_source = left, "context"
    if req.min_tokens > req.max_tokens:
        raise _bad(f"min_tokens ({req.min_tokens}) is more than the answer may have: {req.max_tokens} tokens ("
                   + ("the gateway's default max_tokens)" if req.max_tokens_source == "default" else
                      "what the model's context leaves after the prompt)"))
