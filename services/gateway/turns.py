"""One conversation turn through the disaggregated pair: tokenize → plan → prefill on P → decode on D → record.

Data flows one way: the request becomes exact prompt ids (continuing the session's recorded ids when the chat
extends them), the scheduler's plan says which workers and which kv_transfer_params, P's answer carries the params
for D, and D's final message carries the handle the registry records for the next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.constraints import Constraint, after_reasoning
from kvshuttle.control_plane.continuation import plan_continuation, prefix_keys, text_key
from kvshuttle.control_plane.lru import BoundedLru
from kvshuttle.control_plane.prefix import matched_prefix_tokens
from kvshuttle.control_plane.session import DEFAULT_TENANT
from kvshuttle.services.common import metrics
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.engine.client import EngineClient, EngineError, Final, TokenLogprob
from kvshuttle.services.gateway.detokenizer import IncrementalText
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kvshuttle.gateway")


MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 512
MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS = 1024, 1024  # bounds on a request's lists (vLLM has none; they cost every step)
TOKEN_ID_LIMIT = 2**31  # token ids travel as int32 (our protos) / uint32 (vLLM's); a tokenizer's vocabulary is tighter
# TurnRunner.degraded: session reads that failed, turns that recomputed because the registry/etcd was unreachable,
# and turns whose record could not be written (their next turn cannot pull them).
DEGRADED_KINDS = ("session_read_failed", "recomputed_store_unavailable", "record_failed")


class TurnError(Exception):
    """A turn that cannot run; carries both an HTTP status and a gRPC code for the two front ends."""

    def __init__(self, http_status: int, code: grpc.StatusCode, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.http_status, self.code, self.message, self.retry_after_s = http_status, code, message, retry_after_s


class Tokenizer(Protocol):
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class TurnRequest:
    session_id: str = ""
    tenant: str = DEFAULT_TENANT
    messages: list[dict] | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)  # for the chat template: tools, chat_template_kwargs
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    disable_pull: bool = False
    policy: str = ""  # a named scheduler policy ("": the scheduler's default)
    # How session_id was known (KvReport.session_source): "client", or set by the runner: "found", "new", "".
    session_source: str = ""
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

    def engine_sampling(self) -> dict[str, Any]:
        """The sampling parameters both workers get (EngineClient.generate's keywords), min_tokens aside."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "ignore_eos": self.ignore_eos,
                "top_k": max(self.top_k, 0), "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias,
                "skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "logprobs": self.logprobs}

    @property
    def penalizes_output(self) -> bool:
        """Presence/frequency penalties count the answer's tokens: only a worker that samples all of them applies
        them exactly (so D samples the first token too; P's is dropped)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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


@dataclass
class PreparedTurn:
    """A turn whose prompt is prefilled on P; decoding it on D is what remains."""

    id: str
    request: TurnRequest
    prompt_ids: list[int]
    prompt_text: str
    plan: scheduler_pb2.PlanTurnResponse
    decode_params: dict[str, Any] | None
    kv: KvOutcome
    started: float
    timings: dict[str, float] = field(default_factory=dict)
    span: Any = None
    # The answer's first token as P sampled it (None: D samples it). D then continues after it: its prompt is the
    # prompt plus this token, whose KV D computes itself, and the client gets it without waiting for D.
    first_token: int | None = None
    first_finish: str = ""  # P's finish reason for that token ("stop": it ended the answer)
    first_logprob: TokenLogprob | None = None  # P's log-probability of that token (requests that ask)
    excluded: list[str] = field(default_factory=list)  # workers that failed in this turn: never planned on again
    release: asyncio.Task | None = None  # freeing the session's previous, unused KV handle on its decode worker


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs


@dataclass
class Finished:
    finish_reason: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    kv: KvOutcome
    timings: dict[str, float]
    logprobs: list[TokenLogprob] | None = None  # one per output id, when the request asked for logprobs


def _without_history(resp: registry_pb2.GetSessionResponse) -> registry_pb2.GetSessionResponse:
    """The snapshot the scheduler gets: it checks the prompt against the hash chain, not the token ids."""
    out = registry_pb2.GetSessionResponse()
    out.CopyFrom(resp)
    out.session.ClearField("token_ids")
    out.session.ClearField("text")
    return out


class WorkerDown(Exception):
    """A worker failed a call (unreachable, crashed, timed out, engine dead): the turn goes on elsewhere."""

    def __init__(self, worker_id: str, error: EngineError):
        super().__init__(f"{worker_id}: {error}")
        self.worker_id, self.error = worker_id, error


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 3)


class TurnRunner:
    max_prompt_tokens = 0  # the gateway's limit on a prompt's tokens (0: only the context length limits it)
    served_model = ""  # the model's name for clients (trace attributes)
    kv_bytes_per_token = 0  # an estimate of one token's KV in bytes (trace attributes; 0: unknown)

    def __init__(self, tokenizer: Tokenizer, registry: registry_pb2_grpc.SessionRegistryStub,
                 scheduler: scheduler_pb2_grpc.TransferSchedulerStub, *, max_model_len: int,
                 engine_timeout_s: float = 120.0, control_timeout_s: float = 5.0, session_cache_bytes: int = 64 << 20,
                 first_token_from_prefill: bool = True, prefill_timeout_s: float = 120.0,
                 decode_stall_timeout_s: float = 120.0, worker_retries: int = 2):
        """``prefill_timeout_s`` bounds one prefill call, ``decode_stall_timeout_s`` the wait for each of D's
        tokens (the first included): past them the worker counts as failed. ``worker_retries``: how many failed
        workers one turn may move away from (to another worker of the same role) before it fails with a 503."""
        self.tokenizer = tokenizer
        self.registry = registry
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.engine_timeout_s = engine_timeout_s
        self.control_timeout_s = control_timeout_s
        self.first_token_from_prefill = first_token_from_prefill
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_stall_timeout_s = decode_stall_timeout_s
        self.worker_retries = worker_retries
        self._engines: dict[str, EngineClient] = {}
        # The records this gateway wrote (RecordTurn's answer, with its revision): the next turn of a session that
        # stays on this gateway needs no registry read. A record another gateway changed since makes the scheduler
        # report the snapshot stale (its claim is at our revision), and the turn reads the record and plans again.
        self._sessions: BoundedLru[common_pb2.Session] = BoundedLru(session_cache_bytes)
        self._reports: set[asyncio.Task] = set()  # outcome reports in flight (kept so they are not collected)
        # Turns served without the session store (registry/etcd unreachable), by kind; GET /health shows them, and
        # /metrics (metrics_state).
        self.degraded: dict[str, int] = dict.fromkeys(DEGRADED_KINDS, 0)
        self.release_unused_handles = True
        self.free_unrecorded_kv = True  # free the KV of turns nothing records (no session id, record refused)
        self.released_handles = 0  # KV handles freed on their decode worker: unused, unrecorded, or ended sessions
        # Chats sent without a session id continue the session their prompt text extends (FindSession), or start a
        # new one, recorded under a new id; off: such turns are not recorded (their KV is freed after the answer).
        self.find_sessions = False
        self.sessions_found = 0  # turns without a session id that continued a recorded session

    def engine(self, worker: common_pb2.Worker) -> EngineClient:
        client = self._engines.get(worker.grpc_address)
        if client is None:
            client = self._engines[worker.grpc_address] = EngineClient(worker.grpc_address,
                                                                       timeout_s=self.engine_timeout_s)
        return client

    async def close(self) -> None:
        for client in self._engines.values():
            await client.close()

    def metrics_state(self) -> metrics.GatewayState:
        """This runner's counts for the gateway's /metrics (registered with ``metrics.GATEWAY_STATE``)."""
        return metrics.GatewayState(degraded=dict(self.degraded), released_handles=self.released_handles)

    # -- prompt ----------------------------------------------------------------------------------------------

    async def _previous(self, req: TurnRequest, *, fresh: bool = False,
                        ) -> tuple[registry_pb2.GetSessionResponse | None, dict[str, Any]]:
        """The session's record (this gateway's own copy unless ``fresh``), and what to tell the scheduler about it
        (so it need not read it again)."""
        own = None if fresh else self._sessions.get((req.tenant, req.session_id))
        if own is not None:
            resp = registry_pb2.GetSessionResponse(session=own,
                                                   expires_in_s=session_rules.expires_in(own, time.time()))
            return resp, {"session_snapshot": _without_history(resp)}
        try:
            resp = await self.registry.GetSession(
                registry_pb2.GetSessionRequest(session_id=req.session_id, tenant=req.tenant),
                timeout=self.control_timeout_s)
            return resp, {"session_snapshot": _without_history(resp)}
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise TurnError(400, exc.code(), exc.details() or "invalid session id") from None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None, {"session_not_found": True}
            self.degraded["session_read_failed"] += 1
            log.warning("registry unavailable reading a session (%s: %s): tokenizing from scratch (%d such reads)",
                        exc.code().name, exc.details(), self.degraded["session_read_failed"])
            return None, {}

    async def build_prompt(self, req: TurnRequest, timings: dict[str, float] | None = None, *, fresh: bool = False,
                           ) -> tuple[list[int], str, bool, dict[str, Any]]:
        """Exact prompt ids, the text they stand for ('' for raw ids), whether they continue recorded ids, and the
        session snapshot for the scheduler (PlanTurnRequest's ``known_session``). ``timings["session_ms"]``: the
        registry read."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids), "", False, {}
        if req.messages is not None:
            try:
                text = await asyncio.to_thread(self.tokenizer.render_chat, req.messages, True, **req.template_vars)
            except Exception as exc:  # template errors are the caller's input
                raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"cannot render chat: {exc}") from None
        else:
            text = req.prompt_text or ""
        if req.session_id and not req.session_source:
            req.session_source = "client"
        t = time.perf_counter()
        if req.session_id:
            prev, known = await self._previous(req, fresh=fresh)
        elif self.find_sessions and req.messages is not None:
            prev, known = await self._find(req, text)
            if timings is not None:
                timings["find_ms"] = _ms(t)
        else:
            prev, known = None, {}
        if timings is not None:
            timings["session_ms"] = _ms(t)
        cont = plan_continuation(prev.session.text, prev.session.token_ids, text) if prev else plan_continuation(
            "", [], text)
        suffix_ids = await asyncio.to_thread(self.tokenizer.encode, cont.suffix_text, False)
        return [*cont.prefix_ids, *suffix_ids], text, cont.continues, known

    async def _find(self, req: TurnRequest, text: str,
                    ) -> tuple[registry_pb2.GetSessionResponse | None, dict[str, Any]]:
        """A chat without a session id: the session whose recorded text ``text`` extends (found by content key), or
        a new session id. Sets ``req.session_id`` and ``req.session_source``."""
        markers = getattr(self.tokenizer, "end_markers", None) or []
        keys = prefix_keys(text, markers) if isinstance(markers, list) else []
        found = None
        if keys:
            try:
                found = await self.registry.FindSession(registry_pb2.FindSessionRequest(
                    tenant=req.tenant, text_keys=keys), timeout=self.control_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    self.degraded["session_read_failed"] += 1
                    log.warning("registry unavailable finding a session (%s: %s): starting a new one",
                                exc.code().name, exc.details())
        if found is None:
            req.session_id, req.session_source = f"auto-{uuid.uuid4().hex}", "new"
            return None, {"session_not_found": True}
        req.session_id, req.session_source = found.session.session_id, "found"
        self.sessions_found += 1
        resp = registry_pb2.GetSessionResponse(session=found.session, expires_in_s=found.expires_in_s)
        return resp, {"session_snapshot": _without_history(resp)}

    # -- phases ----------------------------------------------------------------------------------------------

    async def prepare(self, req: TurnRequest) -> PreparedTurn:
        started = time.perf_counter()
        turn_id = f"kvs-{uuid.uuid4().hex[:24]}"
        span = tracer.start_span("kvshuttle.turn", attributes=_request_attributes(req, self.served_model))
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                return await self._prepare(req, turn_id, started, span)
        except BaseException as exc:
            record_failure(span, exc)
            span.end()
            metrics.turn_failed(exc)
            raise

    def validate(self, req: TurnRequest) -> None:
        """Checks shared by the HTTP and gRPC front ends (types are already checked by each)."""
        def bad(message: str) -> TurnError:
            return TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, message)

        if not 1 <= req.max_tokens <= self.max_model_len:
            raise bad(f"max_tokens must be between 1 and {self.max_model_len}")
        if not 0.0 <= req.temperature <= 2.0:
            raise bad("temperature must be between 0 and 2")
        if not 0.0 < req.top_p <= 1.0:
            raise bad("top_p must be in (0, 1]")
        if not (req.top_k >= -1 and req.top_k < TOKEN_ID_LIMIT):
            raise bad(f"top_k must be 0 or -1 (off) or at least 1, got {req.top_k}")
        if not 0.0 <= req.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {req.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(req, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(req, name)}")
        if not (math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be a finite number greater than 0, got {req.repetition_penalty}")
        if not 0 <= req.min_tokens <= req.max_tokens:
            raise bad(f"min_tokens must be between 0 and max_tokens ({req.max_tokens}), got {req.min_tokens}")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        vocab = vocab if isinstance(vocab, int) else None
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(req.stop_token_ids)}")
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}")
        for name, ids in (("stop_token_ids", req.stop_token_ids), ("logit_bias", list(req.logit_bias))):
            outside = [i for i in ids if not 0 <= i < (vocab or TOKEN_ID_LIMIT)]
            if outside:
                where = f"the model's vocabulary (ids 0 to {vocab - 1})" if vocab else "the token ids (0 or more)"
                raise bad(f"{name}: token id {outside[0]} is outside {where}")
        odd = [(i, b) for i, b in req.logit_bias.items() if not -100.0 <= b <= 100.0]
        if odd:
            raise bad(f"logit_bias: the bias of token id {odd[0][0]} must be in [-100, 100], got {odd[0][1]}")
        if len(req.session_id) > 256:
            raise bad("session id longer than 256 characters")
        if req.messages is not None and not req.messages:
            raise bad("messages must not be empty")
        if req.stop:
            if len(req.stop) > MAX_STOP_STRINGS:
                raise bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(req.stop)}")
            if any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
                raise bad(f"stop strings must be 1 to {MAX_STOP_CHARS} characters long")
        if req.prompt_ids:
            low, high = min(req.prompt_ids), max(req.prompt_ids)
            if low < 0:
                raise bad(f"prompt token id {low} is negative")
            if vocab is not None and high >= vocab:  # vLLM refuses it too, but as a failed prefill
                raise bad(f"prompt token id {high} is outside the model's vocabulary (ids 0 to {vocab - 1})")

    async def _prepare(self, req: TurnRequest, turn_id: str, started: float, span) -> PreparedTurn:
        self.validate(req)
        timings: dict[str, float] = {}
        t = time.perf_counter()
        prompt_ids, prompt_text, continued, known_session = await self.build_prompt(req, timings)
        timings["prompt_ms"] = _ms(t)
        if req.session_id:
            snapshot = known_session.get("session_snapshot")
            span.set_attribute("kvshuttle.turn_index", snapshot.session.turn + 1 if snapshot else 1)
        self._check_length(req, prompt_ids)

        t = time.perf_counter()
        plan = await self._plan(req, prompt_ids, known_session)
        if plan.figures.snapshot_stale:  # our copy of the record is out of date: read it, build the prompt again
            self._sessions.discard((req.tenant, req.session_id))
            prompt_ids, prompt_text, continued, known_session = await self.build_prompt(req, timings, fresh=True)
            self._check_length(req, prompt_ids)
            plan = await self._plan(req, prompt_ids, known_session)
        if plan.decision == scheduler_pb2.DECISION_PULL:  # the claim consumed the record we hold
            self._sessions.discard((req.tenant, req.session_id))
        timings["plan_ms"] = _ms(t)
        if req.constraint is not None and req.reasoning_tags is not None and prompt_text:
            req.constraint = after_reasoning(req.constraint, req.reasoning_tags, prompt_text)
            req.reasoning_tags = None  # placed
        if plan.decision != scheduler_pb2.DECISION_PULL and plan.reason.startswith(session_rules.STORE_UNAVAILABLE):
            self.degraded["recomputed_store_unavailable"] += 1
            log.warning("turn %s recomputes without the session store: %s (%d such turns)", turn_id, plan.reason,
                        self.degraded["recomputed_store_unavailable"])
        pull = plan.decision == scheduler_pb2.DECISION_PULL
        kv = KvOutcome("pull" if pull else "recompute", plan.reason, prefill_worker_id=plan.prefill.worker_id,
                       decode_worker_id=plan.decode.worker_id, figures=plan.figures, reason_code=plan.reason_code,
                       session_source=req.session_source, session_id=req.session_id)
        span.set_attributes({
            "kvshuttle.session": hashed(req.session_id) if req.session_id else "",
            "kvshuttle.session_source": req.session_source, "kvshuttle.decision": kv.decision, "kvshuttle.reason": plan.reason, "kvshuttle.reason_code": kv.reason_code,
            "kvshuttle.prompt_tokens": len(prompt_ids), "kvshuttle.continued_ids": continued,
            "kvshuttle.reusable_tokens": plan.figures.reusable_tokens,
            "kvshuttle.prefill_worker": plan.prefill.worker_id, "kvshuttle.decode_worker": plan.decode.worker_id,
            "kvshuttle.policy": plan.figures.policy, **_predicted_ttft(plan),
        })

        t = time.perf_counter()
        excluded: list[str] = []
        plan, p_final = await self._prefill_on_live_worker(turn_id, plan, prompt_ids, kv, req, excluded)
        timings["prefill_ms"] = _ms(t)
        kv.computed_tokens = len(prompt_ids) - p_final.cached_tokens
        kv.pulled_tokens = plan.figures.reusable_tokens if kv.decision == "pull" else 0
        self._report(plan, kv, len(prompt_ids), timings["prefill_ms"])
        span.set_attributes({"kvshuttle.pulled_tokens": kv.pulled_tokens,
                             "kvshuttle.computed_tokens": kv.computed_tokens,
                             "kvshuttle.retried_as_recompute": kv.retried_as_recompute,
                             "kvshuttle.decision": kv.decision, "kvshuttle.reason": kv.reason,
                             "kvshuttle.reason_code": kv.reason_code,
                             "kvshuttle.prefill_worker": kv.prefill_worker_id,
                             "kvshuttle.decode_worker": kv.decode_worker_id, "kvshuttle.prefill_ms": timings["prefill_ms"],
                             "gen_ai.usage.input_tokens": len(prompt_ids),
                             "gen_ai.usage.cache_read.input_tokens": len(prompt_ids) - kv.computed_tokens})
        if self.kv_bytes_per_token:
            span.set_attribute("kvshuttle.pulled_kv_bytes", kv.pulled_tokens * self.kv_bytes_per_token)
        prepared = PreparedTurn(turn_id, req, prompt_ids, prompt_text, plan, p_final.kv_transfer_params, kv,
                                started, timings, span, excluded=excluded,
                                release=self._release_unused_handle(turn_id, plan, known_session, prompt_ids, req))
        # Stop strings are matched by D on what it generates; one starting inside the first token would be missed.
        # Presence/frequency penalties count the answer's tokens, and D's answer would not hold P's token. Either
        # way D samples the first token itself. D's prompt grows by P's token: P's handle must list a block for it
        # (see covers_extra_token).
        # A constraint (grammar) must hold from the answer's first token: D, which applies it, samples that token too.
        if (self.first_token_from_prefill and not req.stop and not req.penalizes_output and req.constraint is None
                and p_final.output_ids
                and kv_params.covers_extra_token(p_final.kv_transfer_params, len(prompt_ids),
                                                 plan.decode.block_size)):
            prepared.first_token, prepared.first_finish = p_final.output_ids[-1], p_final.finish_reason
            prepared.first_logprob = p_final.logprobs[-1] if p_final.logprobs else None
        return prepared

    def _release_unused_handle(self, turn_id: str, plan: scheduler_pb2.PlanTurnResponse,
                               known_session: dict[str, Any], prompt_ids: list[int], req: TurnRequest,
                               ) -> asyncio.Task | None:
        """A turn that recomputed leaves the session's previous KV handle unread, and its decode worker would keep
        those blocks until its TTL (``decoder_kv_blocks_ttl``, minutes): under steady load that fills D's KV cache
        and new turns wait for blocks. Free them: claim the handle (so no other turn can be reading it), then have
        this turn's P read its first block, whose tokens the prompt provably repeats (P usually has that block in its
        own cache just now, and then only notifies D); D frees all of a handle's blocks after any read.

        Runs in the background; the record is written only after it (the claim is at the old record's revision)."""
        snapshot = known_session.get("session_snapshot")
        if (plan.decision == scheduler_pb2.DECISION_PULL or snapshot is None or not self.release_unused_handles
                or req.disable_pull):  # a forced recompute (benchmarks, comparisons) leaves the session's KV alone
            return None
        record = snapshot.session
        n = min(record.covered_tokens, record.block_size)
        if not plan.figures.source_worker_alive or not session_rules.freeable(record, len(prompt_ids), time.time()):
            return None
        try:
            if matched_prefix_tokens(list(record.block_hashes), record.covered_tokens, record.block_size,
                                     prompt_ids[:n]) < n:
                return None  # the prompt's first block differs: P must not take D's KV for it
        except ValueError:
            return None
        return asyncio.create_task(_release_span(self._free_handle(
            f"{turn_id}-release", record, plan.prefill, prompt_ids, req.tenant, req.session_id)))

    async def _free_handle(self, request_id: str, record: common_pb2.Session, prefill: common_pb2.Worker,
                           ids: Sequence[int], tenant: str, session_id: str) -> bool:
        """Claim ``record``'s handle, then have ``prefill`` read its first block (from ``ids``, tokens that repeat
        the handle's: kv_params.free_read, EngineClient.read_to_free); D then frees all of the handle's blocks. Best
        effort: False when not freed."""
        try:
            params, prompt = kv_params.free_read(kv_params.parse_handle(record.kv_transfer_params_json), ids,
                                                 record.block_size)
            claim = await self.registry.ClaimSession(registry_pb2.ClaimSessionRequest(
                session_id=session_id, tenant=tenant, revision=record.revision), timeout=self.control_timeout_s)
            if not claim.claimed:
                return False  # a concurrent turn took it (and reads it), or the record changed
            if not await self.engine(prefill).read_to_free(request_id, prompt, params,
                                                           timeout_s=self.prefill_timeout_s):
                log.debug("%s: freeing a KV handle failed at the prefill worker", request_id)
                return False
        except (grpc.aio.AioRpcError, EngineError, kv_params.HandleError) as exc:
            log.debug("%s: could not free a KV handle: %s", request_id, exc)
            return False
        self.released_handles += 1
        return True

    async def end_session(self, tenant: str, session_id: str) -> tuple[bool, bool]:
        """Free the session's KV on its decode worker (when it has a usable handle), then delete its record.
        Returns (record deleted, KV freed)."""
        try:
            session_rules.validate_id("session_id", session_id)
        except session_rules.InvalidArgument as exc:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._sessions.discard((tenant, session_id))
        released = False
        try:
            record = (await self.registry.GetSession(registry_pb2.GetSessionRequest(
                session_id=session_id, tenant=tenant), timeout=self.control_timeout_s)).session
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False, False
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                            retry_after_s=1) from None
        if session_rules.freeable(record, len(record.token_ids), time.time()):
            first_block = list(record.token_ids[:record.block_size + 1])
            try:  # any live prefill worker will do: ask the scheduler for one
                plan = await self.scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(
                    tenant=tenant, prompt_token_ids=first_block, disable_pull=True), timeout=self.control_timeout_s)
                released = await _release_span(self._free_handle(f"end-{uuid.uuid4().hex[:16]}", record, plan.prefill,
                                                                 record.token_ids, tenant, session_id))
            except grpc.aio.AioRpcError as exc:
                log.debug("ending a session: no prefill worker to free its KV (%s)", exc.code().name)
        try:
            deleted = await self.registry.DeleteSession(registry_pb2.DeleteSessionRequest(
                session_id=session_id, tenant=tenant), timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                            retry_after_s=1) from None
        return deleted.deleted, released

    def _report(self, plan: scheduler_pb2.PlanTurnResponse, kv: KvOutcome, prompt_tokens: int,
                prefill_ms: float) -> None:
        """Tell the scheduler what the prefill cost (its cost model learns from it); off the turn's path."""
        request = scheduler_pb2.ReportOutcomeRequest(
            prefill_worker_id=plan.prefill.worker_id, decode_worker_id=plan.decode.worker_id,
            prompt_tokens=prompt_tokens, pulled_tokens=kv.pulled_tokens, computed_tokens=kv.computed_tokens,
            prefill_ms=prefill_ms, source_worker_id=plan.source.worker_id,
            pullable_tokens=plan.figures.pullable_tokens, policy=plan.figures.policy,
            cached_tokens_estimate=plan.figures.cached_tokens_estimate,
            decision=scheduler_pb2.DECISION_PULL if kv.decision == "pull" else scheduler_pb2.DECISION_RECOMPUTE)

        async def send() -> None:
            try:
                await self.scheduler.ReportOutcome(request, timeout=self.control_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.debug("could not report a turn's outcome (%s)", exc.code().name)

        task = asyncio.create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _check_length(self, req: TurnRequest, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        if self.max_prompt_tokens and len(prompt_ids) > self.max_prompt_tokens:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT,
                            f"the prompt has {len(prompt_ids)} tokens; this gateway accepts at most "
                            f"{self.max_prompt_tokens} (max prompt tokens)")
        if len(prompt_ids) + req.max_tokens > self.max_model_len:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT,
                            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                            f"model's context of {self.max_model_len} tokens")

    async def _plan(self, req: TurnRequest, prompt_ids: list[int], known_session: dict[str, Any], *,
                    exclude: Sequence[str] = ()) -> scheduler_pb2.PlanTurnResponse:
        """The scheduler's plan. With ``exclude`` (workers that failed in this turn) it is a re-plan: the session's
        handle is not used (the failed attempt claimed it) and those workers are not chosen."""
        with tracer.start_as_current_span("plan"):
            try:
                return await self.scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(
                    session_id=req.session_id, tenant=req.tenant, prompt_token_ids=prompt_ids,
                    disable_pull=req.disable_pull or bool(exclude), policy=req.policy,
                    exclude_worker_ids=list(exclude), max_tokens=req.max_tokens, **known_session),
                    timeout=self.control_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise TurnError(400, exc.code(), exc.details() or "invalid request") from None
                what = "scheduler" if exc.code() != grpc.StatusCode.UNAVAILABLE or not exclude else "no worker left"
                raise TurnError(503, grpc.StatusCode.UNAVAILABLE,
                                f"{what}: {exc.details() or exc.code().name}", retry_after_s=1) from None

    async def _prefill_on_live_worker(self, turn_id: str, plan: scheduler_pb2.PlanTurnResponse,
                                      prompt_ids: list[int], kv: KvOutcome, req: TurnRequest, excluded: list[str],
                                      ) -> tuple[scheduler_pb2.PlanTurnResponse, Final]:
        """Prefill on the planned P; when P fails, plan again without it (and without the workers in ``excluded``,
        which grows) and recompute there, up to ``worker_retries`` times. Returns the plan that worked."""
        attempt = 0
        while True:
            try:
                return plan, await self._prefill(f"{turn_id}-{attempt}" if attempt else turn_id, plan, prompt_ids,
                                                 kv, req)
            except WorkerDown as down:
                attempt += 1
                excluded.append(down.worker_id)
                metrics.worker_failed("prefill")
                failure = f"prefill worker {down.worker_id} failed ({down.error})"
                log.warning("turn %s: %s", turn_id, failure)
                trace.get_current_span().add_event("worker_failed", {"kvshuttle.worker": down.worker_id,
                                                                     "error": str(down.error)})
                if attempt > self.worker_retries:
                    kv.worker_failures.append(failure)
                    raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"{failure}; no retries left",
                                    retry_after_s=1) from None
                try:
                    plan = await self._plan(req, prompt_ids, {}, exclude=excluded)
                except TurnError as exc:
                    kv.worker_failures.append(failure)
                    raise TurnError(exc.http_status, exc.code, f"{failure}; {exc.message}",
                                    exc.retry_after_s) from None
                kv.worker_failures.append(f"{failure}; recomputed on {plan.prefill.worker_id}")
                kv.decision, kv.reason = "recompute", f"{failure}: recomputed on another worker"
                kv.reason_code = why.WORKER_FAILED
                kv.prefill_worker_id, kv.decode_worker_id = plan.prefill.worker_id, plan.decode.worker_id

    async def _prefill(self, turn_id: str, plan, prompt_ids: list[int], kv: KvOutcome, req: TurnRequest) -> Final:
        """P's prefill (a failed pull is run once more as a recompute on the same P). WorkerDown when P failed."""
        engine = self.engine(plan.prefill)
        worker = plan.prefill.worker_id
        # P samples at most the answer's first token: with min_tokens it must not end the answer there.
        sampling = {**req.engine_sampling(), "min_tokens": min(req.min_tokens, 1), "timeout_s": self.prefill_timeout_s}
        params = json.loads(plan.prefill_kv_transfer_params_json)
        with tracer.start_as_current_span("prefill") as span:
            span.set_attributes({"kvshuttle.worker": worker, "kvshuttle.decision": kv.decision})
            try:
                final = await engine.prefill(f"{turn_id}-p", prompt_ids, kv_transfer_params=params, **sampling)
                if final.finish_reason != "error":
                    span.set_attribute("kvshuttle.cached_tokens", final.cached_tokens)
                    return final
                failure = "prefill finished with error"
            except EngineError as exc:
                failure = f"prefill failed: {exc}"
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT and kv.decision != "pull":
                    raise _refused(exc) from None
                if kv.decision != "pull":
                    raise WorkerDown(worker, exc) from None
            if kv.decision != "pull":  # a recompute that finished with error: P's engine is not well
                raise WorkerDown(worker, EngineError(None, failure))
            # A failed pull (stale handle, decode worker gone): the same turn once more, computing everything.
            log.warning("pull failed for turn %s (%s); retrying as recompute", turn_id, failure)
            span.add_event("pull_failed", {"error": failure})
            kv.decision, kv.retried_as_recompute = "recompute", True
            kv.reason, kv.reason_code = f"pull failed ({failure}); retried as recompute", why.PULL_FAILED
            try:
                final = await engine.prefill(f"{turn_id}-r", prompt_ids,
                                             kv_transfer_params=kv_params.prefill_request_params(), **sampling)
            except EngineError as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _refused(exc) from None
                raise WorkerDown(worker, exc) from None
            if final.finish_reason == "error":
                raise WorkerDown(worker, EngineError(None, "prefill finished with error"))
            return final

    async def decode(self, turn: PreparedTurn) -> AsyncIterator[Delta | Finished]:
        """Stream D's tokens as text deltas, record the session, then yield the summary.

        The consumer may resume this generator from another task (HTTP streaming), so no span is made current
        across a ``yield``; child spans name their parent explicitly.
        """
        answered = False
        try:
            async for event in self._decode(turn):
                if isinstance(event, Finished):  # the turn is done (a consumer may close this generator later)
                    turn.span.set_attributes(_finished_attributes(turn, event, self.served_model))
                    turn.span.end()
                    answered = True
                    metrics.turn_answered(event, self.kv_bytes_per_token)
                yield event
        except BaseException as exc:
            if turn.span.is_recording():
                record_failure(turn.span, exc)
            if not answered:
                metrics.turn_failed(exc)
            raise
        finally:
            if turn.span.is_recording():
                turn.span.end()

    async def _decode(self, turn: PreparedTurn) -> AsyncIterator[Delta | Finished]:
        req, timings = turn.request, turn.timings
        engine = self.engine(turn.plan.decode)
        output: list[int] = []
        output_lps: list[TokenLogprob] = []  # parallel to output (requests that ask for logprobs)
        pending: list[int] = []  # ids not yet sent in a Delta (held back while they end in a partial character)
        pending_lps: list[TokenLogprob] = []
        detok = IncrementalText(self.tokenizer, req.skip_special_tokens)
        stoppers = self.hidden_token_ids(req)

        def detokenize(ids: Sequence[int]) -> str:
            return detok.add([i for i in ids if i not in stoppers])

        final: Final | None = None
        t = time.perf_counter()
        d_prompt, d_max_tokens, done_at_first = turn.prompt_ids, req.max_tokens, ""
        if turn.first_token is not None:
            # P's token is the answer's first: the client gets it now, D continues after it.
            first = turn.first_token
            d_prompt, d_max_tokens = [*turn.prompt_ids, first], max(1, req.max_tokens - 1)
            if turn.first_finish == "stop" or req.max_tokens == 1:
                done_at_first = "stop" if turn.first_finish == "stop" else "length"
                d_max_tokens = 1
            output.append(first)
            first_lps = [turn.first_logprob] if turn.first_logprob else []
            output_lps.extend(first_lps)
            timings["ttft_ms"] = _ms(turn.started)
            piece = detokenize([first])
            if piece:
                yield Delta(piece, [first], first_lps or None)
            else:
                pending.append(first)
                pending_lps.extend(first_lps)
        attempt, before = 0, len(output)
        while True:
            engine = self.engine(turn.plan.decode)
            before = len(output)
            span = tracer.start_span("decode", context=trace.set_span_in_context(turn.span),
                                     attributes={"kvshuttle.worker": turn.plan.decode.worker_id})
            try:
                # When the answer already ended at P's token, D still runs one step: it reads the prompt's KV
                # (releasing P's blocks) and keeps prompt + first token for the next turn; its token is dropped.
                async for item in self._stream_tokens(
                        engine, f"{turn.id}-d{attempt or ''}", d_prompt, span, max_tokens=d_max_tokens,
                        min_tokens=0 if done_at_first else min(max(req.min_tokens - len(output), 0), d_max_tokens),
                        stop=req.stop, kv_transfer_params=turn.decode_params, **req.engine_sampling(),
                        constraint=(req.constraint.kind, req.constraint.value) if req.constraint else None):
                    if isinstance(item, Final):
                        final = item
                        break
                    if not item.token_ids or done_at_first:
                        continue
                    if not output:
                        timings["ttft_ms"] = _ms(turn.started)
                    output.extend(item.token_ids)
                    pending.extend(item.token_ids)
                    output_lps.extend(item.logprobs or ())
                    pending_lps.extend(item.logprobs or ())
                    piece = detokenize(item.token_ids)
                    if not piece:
                        continue
                    yield Delta(piece, pending, pending_lps or None)
                    pending, pending_lps = [], []
                break
            except EngineError as exc:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise TurnError(400, exc.code, f"the decode worker refused the request: {exc.message}") from None
                attempt += 1
                if not done_at_first and len(output) >= req.max_tokens:  # only D's final message was lost
                    log.warning("turn %s: decode worker %s failed after the last token (%s); the answer is complete "
                                "but the session keeps no KV for its next turn", turn.id, turn.plan.decode.worker_id,
                                exc)
                    turn.kv.worker_failures.append(f"decode worker {turn.plan.decode.worker_id} failed after the "
                                                   f"last token ({exc})")
                    metrics.worker_failed("decode")
                    final = Final([], "length", len(d_prompt), 0, 0, None)
                    break
                d_prompt = await self._resume(turn, output, exc, attempt)
                d_max_tokens = 1 if done_at_first else req.max_tokens - len(output)
            finally:
                span.set_attribute("kvshuttle.generated_tokens", len(output) - before)
                span.end()
        timings["decode_ms"] = _ms(t)
        if final is None:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a final message")
        late = ""
        if done_at_first:
            final = dataclasses.replace(final, finish_reason=done_at_first)
        elif final.output_ids and len(final.output_ids) > len(output) - before:
            fed = len(output)  # non-streaming engines report everything at the end
            output = [*output[:before], *final.output_ids]
            output_lps = [*output_lps[:before], *(final.logprobs or ())]
            pending, pending_lps = [*pending, *output[fed:]], [*pending_lps, *output_lps[fed:]]
            late = detokenize(output[fed:])
        tail = late + detok.finish()  # what came at the end, and what was held back (e.g. an unfinished character)
        if pending or tail:
            yield Delta(tail, pending, pending_lps or None)
        # One text for the stream, the whole answer and the record: the concatenation of the pieces.
        text = detok.text
        timings.setdefault("ttft_ms", _ms(turn.started))

        t = time.perf_counter()
        await self._record(turn, output, final, text, stoppers)
        timings["record_ms"] = _ms(t)
        timings["total_ms"] = _ms(turn.started)
        yield Finished(final.finish_reason, text, output, len(turn.prompt_ids), turn.kv, timings,
                       output_lps if req.logprobs is not None else None)

    def _end_marker(self, output: list[int], hidden: set[int] | frozenset[int]) -> str:
        """The text of the answer's last token when it is an EOS token left out of the answer's text."""
        eos = getattr(self.tokenizer, "eos_token_ids", None)
        last = output[-1] if output else None
        if last is None or last not in hidden or not isinstance(eos, list) or last not in eos:
            return ""
        return self.tokenizer.decode([last], False)

    def hidden_token_ids(self, req: TurnRequest) -> set[int]:
        """Token ids whose text is left out of the answer, as vLLM leaves out the token that stopped it: stop token
        ids, and EOS unless ignored (none with include_stop_str_in_output). Such a token can only be the answer's
        last (min_tokens keeps them from being sampled earlier), so every one in the output is left out."""
        if req.include_stop_str_in_output:
            return set()
        eos = getattr(self.tokenizer, "eos_token_ids", None)
        return set(req.stop_token_ids) | (set(eos) if isinstance(eos, list) and not req.ignore_eos else set())

    async def _stream_tokens(self, engine: EngineClient, request_id: str, prompt: list[int], span, **kwargs: Any,
                             ) -> AsyncIterator[Any]:
        """D's stream, each item awaited at most ``decode_stall_timeout_s`` (a hung worker fails like a dead one).
        The call is made with ``span`` current (its client span is a child), which is never current across a yield."""
        stream = engine.generate(request_id, prompt, stream=True, **kwargs).__aiter__()
        try:
            while True:
                try:
                    with trace.use_span(span, end_on_exit=False, record_exception=False,
                                        set_status_on_exception=False):
                        item = await asyncio.wait_for(anext(stream), self.decode_stall_timeout_s)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise EngineError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no token for {self.decode_stall_timeout_s:g} s") from None
                yield item
        finally:
            await stream.aclose()

    async def _resume(self, turn: PreparedTurn, output: list[int], error: EngineError, attempt: int) -> list[int]:
        """D failed mid-answer: prefill the prompt plus the tokens already generated on a live P (a recompute), point
        the turn at a new D, and return D's new prompt. The client's stream goes on where it stopped (with greedy
        sampling, exactly as if nothing happened). TurnError (503) when no retry or no worker is left."""
        failed = turn.plan.decode.worker_id
        turn.excluded.append(failed)
        metrics.worker_failed("decode")
        failure = f"decode worker {failed} failed after {len(output)} tokens ({error})"
        log.warning("turn %s: %s", turn.id, failure)
        turn.span.add_event("worker_failed", {"kvshuttle.worker": failed, "error": str(error),
                                              "kvshuttle.generated_tokens": len(output)})
        if attempt > self.worker_retries or (turn.request.constraint is not None and output):
            # A constrained answer cannot go on elsewhere: a new D would start the grammar afresh mid-answer.
            why_not = "no retries left" if attempt > self.worker_retries else "a constrained answer cannot resume"
            turn.kv.worker_failures.append(failure)
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"{failure}; {why_not}", retry_after_s=1)
        resume_ids = [*turn.prompt_ids, *output]
        scratch = KvOutcome("recompute", "resume after a decode worker failed")
        with trace.use_span(turn.span, end_on_exit=False):
            try:
                plan = await self._plan(turn.request, resume_ids, {}, exclude=turn.excluded)
                plan, p_final = await self._prefill_on_live_worker(f"{turn.id}-resume{attempt}", plan, resume_ids,
                                                                   scratch, turn.request, turn.excluded)
            except TurnError as exc:
                turn.kv.worker_failures.extend([*scratch.worker_failures, failure])
                raise TurnError(exc.http_status, exc.code, f"{failure}; {exc.message}", exc.retry_after_s) from None
        turn.kv.worker_failures.extend(scratch.worker_failures)
        turn.kv.worker_failures.append(f"{failure}; resumed on {plan.decode.worker_id} (prefilled "
                                       f"{len(resume_ids)} tokens on {plan.prefill.worker_id})")
        turn.kv.decode_worker_id = plan.decode.worker_id
        turn.plan, turn.decode_params = plan, p_final.kv_transfer_params
        return resume_ids

    def _free_unrecorded(self, turn: PreparedTurn, output: list[int], final: Final) -> None:
        """A turn whose handle nothing records (no session id, or the registry could not take it) would leave its
        decode worker holding the blocks until its TTL, where no turn can pull them and the scheduler cannot find
        them (clients that send no session id would fill it): free them now, in the background (a one-block read
        on the turn's prefill worker)."""
        if not self.free_unrecorded_kv or not final.kv_transfer_params:
            return
        try:
            params, prompt = kv_params.free_read(kv_params.parse_handle(final.kv_transfer_params),
                                                 [*turn.prompt_ids, *output], turn.plan.decode.block_size)
        except kv_params.HandleError as exc:
            log.debug("turn %s: its KV handle cannot be freed (%s)", turn.id, exc)
            return

        async def free() -> None:
            try:
                if await self.engine(turn.plan.prefill).read_to_free(f"{turn.id}-free", prompt, params,
                                                                     timeout_s=self.prefill_timeout_s):
                    self.released_handles += 1
            except EngineError as exc:
                log.debug("turn %s: could not free its unrecorded KV handle: %s", turn.id, exc)

        task = asyncio.create_task(free())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _record(self, turn: PreparedTurn, output: list[int], final: Final, answer: str = "",
                      hidden: set[int] | frozenset[int] = frozenset()) -> None:
        """Record the turn's handle and exact ids, with the text they stand for *as the client received it*: the
        prompt's text, the answer's text (``answer``: special tokens skipped if the request skipped them, hidden
        stop tokens left out), and the end-of-turn marker's text when the answer ended with one (the chat template
        writes it after the echoed answer). A client that echoes the answer back then renders a prompt that starts
        with this text, and the next turn continues the exact ids (special tokens included)."""
        req = turn.request
        if not req.session_id:
            self._free_unrecorded(turn, output, final)
            return
        if not final.kv_transfer_params:
            log.warning("decode worker returned no KV handle for turn %s: nothing to record", turn.id)
            return
        if turn.release is not None:  # it claims the old record: before this turn replaces it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(turn.release), self.control_timeout_s)
        with trace.use_span(turn.span, end_on_exit=False), tracer.start_as_current_span("record") as span:
            recorded_text = (turn.prompt_text + answer + self._end_marker(output, hidden)) if turn.prompt_text else ""
            key = (req.tenant, req.session_id)
            self._sessions.discard(key)
            try:
                resp = await self.registry.RecordTurn(registry_pb2.RecordTurnRequest(
                    session_id=req.session_id, tenant=req.tenant, decode_worker_id=turn.plan.decode.worker_id,
                    kv_transfer_params_json=json.dumps(final.kv_transfer_params),
                    token_ids=[*turn.prompt_ids, *output], text=recorded_text,
                    text_key=text_key(recorded_text) if recorded_text else b""), timeout=self.control_timeout_s)
                self._sessions.put(key, resp.session, resp.session.ByteSize())
                turn.span.set_attribute("kvshuttle.turn_index", resp.session.turn)
            except grpc.aio.AioRpcError as exc:
                # The answer is fine; only the next turn loses its pull.
                span.set_attribute("error.type", exc.code().name)
                span.set_status(trace.StatusCode.ERROR, f"RecordTurn failed: {exc.code().name}")
                self.degraded["record_failed"] += 1
                log.warning("could not record turn %s (%s: %s): the next turn cannot pull it (%d unrecorded turns)",
                            turn.id, exc.code().name, exc.details(), self.degraded["record_failed"])
                self._free_unrecorded(turn, output, final)

    async def run(self, req: TurnRequest) -> tuple[PreparedTurn, Finished]:
        turn = await self.prepare(req)
        finished = None
        async for event in self.decode(turn):
            if isinstance(event, Finished):
                finished = event
        assert finished is not None
        return turn, finished


def _request_attributes(req: TurnRequest, model: str) -> dict[str, Any]:
    """The turn span's request attributes: OpenTelemetry's GenAI ones, the tenant and the session id (hashed)."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if req.messages is not None else "text_completion",
        "gen_ai.provider.name": "vllm", "gen_ai.request.max_tokens": req.max_tokens,
        "gen_ai.request.temperature": req.temperature, "gen_ai.request.top_p": req.top_p,
        "kvshuttle.tenant": req.tenant, "kvshuttle.session": hashed(req.session_id) if req.session_id else "",
    }
    if model:
        attrs["gen_ai.request.model"] = model
    if req.seed is not None:
        attrs["gen_ai.request.seed"] = req.seed
    # The other GenAI request attributes the conventions define, when the request sets them.
    if req.top_k > 0:
        attrs["gen_ai.request.top_k"] = float(req.top_k)  # a double in the conventions
    if req.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = req.frequency_penalty
    if req.stop:
        attrs["gen_ai.request.stop_sequences"] = list(req.stop)
    if req.disable_pull:
        attrs["kvshuttle.disable_pull"] = True
    return attrs


def _predicted_ttft(plan: scheduler_pb2.PlanTurnResponse) -> dict[str, float]:
    """The scheduler's predicted time from the plan to P's first token (its wait at P + the chosen option's prefill),
    when it predicted one."""
    fig = plan.figures
    prefill_ms = fig.predicted_pull_ms if plan.decision == scheduler_pb2.DECISION_PULL else fig.predicted_recompute_ms
    return {"kvshuttle.predicted_ttft_ms": round(fig.predicted_wait_ms + prefill_ms, 3)} if prefill_ms > 0 else {}


def _finished_attributes(turn: PreparedTurn, finished: Finished, model: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.response.id": turn.id, "gen_ai.response.finish_reasons": [finished.finish_reason],
        "gen_ai.usage.output_tokens": len(finished.output_ids), "kvshuttle.decode_worker": finished.kv.decode_worker_id,
        "kvshuttle.ttft_ms": finished.timings.get("ttft_ms", 0.0),
    }
    if model:
        attrs["gen_ai.response.model"] = model
    return attrs


def record_failure(span, exc: BaseException) -> None:
    """A turn that failed: the exception as an event and ``error.type``; the status is ERROR unless the caller's
    request was at fault (a TurnError under 500, e.g. a prompt over the context length)."""
    if isinstance(exc, TurnError):
        kind = exc.code.name
    elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        kind = "cancelled"  # the client went away
    else:
        kind = type(exc).__qualname__
    span.set_attribute("error.type", kind)
    span.record_exception(exc)
    if not (isinstance(exc, TurnError) and exc.http_status < 500):
        span.set_status(trace.StatusCode.ERROR, exc.message if isinstance(exc, TurnError) else f"{kind}: {exc}")


async def _release_span(freeing: Awaitable[bool]) -> bool:
    """Freeing a session's unused KV handle, as a ``release`` span (claim + P's read of its first block)."""
    with tracer.start_as_current_span("release") as span:
        released = await freeing
        span.set_attribute("kvshuttle.released", released)
        return released


def _refused(exc: EngineError) -> TurnError:
    """The engine found the request itself invalid (a client error that the gateway's own checks let through)."""
    return TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"the prefill worker refused the request: {exc.message}")
