"""Stand-ins for the scheduler, registry, tokenizer and engines around a TurnRunner (the gateway's turn logic), and
whole runners for the HTTP front ends alone (CapturingRunner, AnsweringRunner)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.services.engine.client import Chunk, EngineClient, EngineError, Final, TokenLogprob
from kvshuttle.services.gateway.turns import Delta, Finished, KvOutcome, TurnError, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns.context import ExpressLane
from kvshuttle.services.gateway.turns.parsers import AnswerEvents
from kvshuttle.services.scheduler.servicer import prompt_of
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

PULL_PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_num_tokens": 3}


class Tokenizer:
    """Characters are tokens (id = code point): exact and easy to reason about."""

    vocab_size = 65536

    def render_chat(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                           else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


BLOCK = 4  # the fake decode worker's KV block size


class Engine:
    def __init__(self, fail_prefills: int = 0, answer: str = "ok", tight_blocks: bool = False,
                 fail_code: grpc.StatusCode = grpc.StatusCode.INTERNAL, die_after: int | None = None,
                 hang_after: int | None = None, ends: bool = False, cached: int = 0):
        """``tight_blocks``: the handle P returns lists only the prompt's blocks (vLLM with prefix caching), not one
        for the token P generated. ``die_after`` / ``hang_after``: a decode stream that fails (UNAVAILABLE) or stops
        answering after that many tokens. ``ends``: the answer ends where its text does (finish_reason stop, as a
        model's end-of-sequence token), unless max_tokens cuts it first; else every answer finishes with length.
        ``cached``: the prompt tokens a decode stream's final message says its prefix cache held."""
        self.fail_prefills, self.answer, self.prefills, self.calls = fail_prefills, answer, [], []
        self.tight_blocks, self.fail_code = tight_blocks, fail_code
        self.die_after, self.hang_after, self.ends, self.cached = die_after, hang_after, ends, cached

    async def prefill(self, request_id, prompt_ids, *, kv_transfer_params, **sampling):
        self.prefills.append(kv_transfer_params)
        self.sampling = sampling
        if self.fail_prefills:
            self.fail_prefills -= 1
            raise EngineError(self.fail_code, "engine said no")
        first = self.answer[0] if self.answer else "!"
        tokens = len(prompt_ids) + (0 if self.tight_blocks else 1)
        handle = {"for": "decode", "remote_block_ids": [list(range(-(-tokens // BLOCK)))]}
        return Final([ord(first)], "stop" if first == "$" else "length", len(prompt_ids), 1, 0, handle)

    read_to_free = EngineClient.read_to_free  # the real freeing read, over this fake's generate

    async def generate(self, request_id, prompt_ids, **kw):
        self.calls.append((list(prompt_ids), kw))
        ids = [ord(c) for c in self.answer][:kw.get("max_tokens", len(self.answer))]
        for n, i in enumerate(ids):
            if n == self.die_after:
                raise EngineError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            if n == self.hang_after:
                await asyncio.sleep(3600)
            yield Chunk([i], len(prompt_ids), 0)
        ended = self.ends and len(ids) == len(self.answer) < kw.get("max_tokens", len(self.answer) + 1)
        yield Final(ids, "stop" if ended else "length", len(prompt_ids), len(ids), self.cached,
                    {"do_remote_decode": True, "handle": 1})

    async def close(self):
        pass


def recorded(text: str, ids, **fields) -> common_pb2.Session:
    """A session record as the registry keeps it (the text as its length and key), with the history's ``ids``
    (as a read with include_token_ids returns them): turn 1 of lineage 1."""
    fields = {"session_id": "s", "text_chars": len(text), "text_key": text_key(text) if text else b"",
              "history_tokens": len(ids), "history_generation": 1, "turn": 1, **fields}
    return common_pb2.Session(token_ids=ids, **fields)


class Registry:
    """The session registry: a record without the ids or the text, the ids kept aside in the history store (filled
    in by reads that ask for them, unless ``history_missing`` says why not), RecordTurn's append mode (only the ids
    after ``base_tokens``; FAILED_PRECONDITION when the record is no longer at ``base_turn`` with that many ids)."""

    def __init__(self, session=None):
        self.recorded, self.reads, self.history_missing = [], 0, ""
        self.histories: list[list[int]] = []  # the whole history of each recorded turn
        self.session, self.history = None, []
        if session is not None:
            self.session = common_pb2.Session()
            self.session.CopyFrom(session)
            self.history = list(session.token_ids)
            self.session.ClearField("token_ids")
            self.session.history_tokens = self.session.history_tokens or len(self.history)

    async def GetSession(self, request, timeout=None):
        self.reads += 1
        if self.session is None:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND)
        out = registry_pb2.GetSessionResponse(session=self.session, expires_in_s=100)
        if request.include_token_ids:
            if self.history_missing:
                out.history_missing = self.history_missing
            else:
                out.session.token_ids.extend(self.history)
        return out

    async def FindSession(self, request, timeout=None):
        """The record, when it is the request's model's and one of the keys is its whole text's or one of its text
        boundaries' (the first that is)."""
        self.reads += 1
        s = self.session
        known = ({s.text_key, *(b.key for b in s.text_boundaries)} - {b""}
                 if s is not None and s.model == request.model else set())
        for i, key in enumerate(request.text_keys):
            if key in known:
                out = registry_pb2.FindSessionResponse(session=s, expires_in_s=100, matched_key=i)
                if request.include_token_ids:
                    out.session.token_ids.extend(self.history)
                return out
        raise _rpc_error(grpc.StatusCode.NOT_FOUND)

    async def RecordTurn(self, request, timeout=None):
        kept = registry_pb2.RecordTurnRequest()
        kept.CopyFrom(request)  # as sent: the caller may change and send its request again
        self.recorded.append(kept)
        base, previous = request.base_tokens, self.session
        if base and (previous is None or previous.turn != request.base_turn or previous.history_tokens < base):
            raise _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "the session's recorded history changed: send "
                                                                  "the whole history (base_tokens 0)")
        if base and not request.prefix_digest:
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prefix_digest is required with base_tokens > 0")
        ids = [*self.history[:base], *request.token_ids]
        stored = common_pb2.Session(
            session_id=request.session_id, tenant=request.tenant, decode_worker_id=request.decode_worker_id,
            kv_transfer_params_json=request.kv_transfer_params_json, prefix_digest=request.prefix_digest,
            checkpoints=request.checkpoints, history_tokens=len(ids), history_generation=1,
            head_token_ids=ids[:BLOCK + 1], text_key=request.text_key or (text_key(request.text) if request.text else b""),
            text_chars=len(request.text) if request.text else request.text_chars,
            text_boundaries=request.text_boundaries, model=request.model,
            turn=(previous.turn if previous is not None else 0) + 1, revision=len(self.recorded) + 10)
        self.session, self.history = stored, ids
        self.histories.append(ids)
        return registry_pb2.RecordTurnResponse(session=stored)


class Scheduler:
    def __init__(self, decision, prefills=("p",), decodes=("d",)):
        """Plans on the first of ``prefills`` / ``decodes`` (worker ids; their engines listen at '<id>:1') that the
        request does not exclude; UNAVAILABLE when none is left, as the real scheduler answers."""
        self.decision, self.prompts, self.requests, self.stale, self.outcomes = decision, [], [], 0, []
        self.prefills, self.decodes = prefills, decodes

    async def ReportOutcome(self, request, timeout=None):
        self.outcomes.append(request)
        return scheduler_pb2.ReportOutcomeResponse()

    async def PlanTurn(self, request, timeout=None):
        self.prompts.append(list(prompt_of(request)))  # the ids as the real scheduler reads them (packed or not)
        self.requests.append(request)
        if self.stale:  # the caller's snapshot is out of date
            self.stale -= 1
            return scheduler_pb2.PlanTurnResponse(decision=scheduler_pb2.DECISION_RECOMPUTE, reason="stale",
                                                  figures=scheduler_pb2.PlanFigures(snapshot_stale=True))
        live_p = [w for w in self.prefills if w not in request.exclude_worker_ids]
        live_d = [w for w in self.decodes if w not in request.exclude_worker_ids]
        if not live_p or not live_d:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE)
        if self.decision == scheduler_pb2.DECISION_LOCAL and not request.disable_pull:  # on the session's D, "d"
            return scheduler_pb2.PlanTurnResponse(
                decision=scheduler_pb2.DECISION_LOCAL, reason="test", reason_code="local_always",
                prefill_kv_transfer_params_json=json.dumps(kv_params.prefill_request_params()),
                prefill=common_pb2.Worker(worker_id=live_p[0], grpc_address=f"{live_p[0]}:1"),
                decode=common_pb2.Worker(worker_id="d", grpc_address="d:1", block_size=BLOCK),
                source=common_pb2.Worker(worker_id="d", grpc_address="d:1", block_size=BLOCK),
                figures=scheduler_pb2.PlanFigures(reusable_tokens=BLOCK, pullable_tokens=5, decode_streams=2,
                                                  predicted_local_ms=12.5, source_worker_alive=True, policy="on_d"))
        pull = self.decision == scheduler_pb2.DECISION_PULL and not request.disable_pull
        params = PULL_PARAMS if pull else kv_params.prefill_request_params()
        return scheduler_pb2.PlanTurnResponse(
            decision=scheduler_pb2.DECISION_PULL if pull else scheduler_pb2.DECISION_RECOMPUTE, reason="test",
            prefill_kv_transfer_params_json=json.dumps(params),
            prefill=common_pb2.Worker(worker_id=live_p[0], grpc_address=f"{live_p[0]}:1"),
            decode=common_pb2.Worker(worker_id=live_d[0], grpc_address=f"{live_d[0]}:1", block_size=BLOCK),
            figures=scheduler_pb2.PlanFigures(reusable_tokens=3 if pull else 0))


def _rpc_error(code, details: str = "x"):
    class Err(grpc.aio.AioRpcError):
        def __init__(self):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    return Err()


def runner(decision, prefill: Engine, registry=None, decode: Engine | None = None,
           first_token_from_prefill: bool = False) -> tuple[TurnRunner, Scheduler, Registry]:
    scheduler, registry = Scheduler(decision), registry or Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000,
                   first_token_from_prefill=first_token_from_prefill)
    r._engines = {"p:1": prefill, "d:1": decode or Engine()}
    return r, scheduler, registry


async def run(r: TurnRunner, req: TurnRequest):
    turn = await r.prepare(req)
    events = [e async for e in r.decode(turn)]
    return turn, events


def resume_runner(first: Engine, second: Engine | None, *, stall_s: float = 120.0, first_token: bool = False):
    decodes = ("d", "d2") if second is not None else ("d",)
    scheduler, registry = Scheduler(scheduler_pb2.DECISION_RECOMPUTE, decodes=decodes), Registry()
    r = TurnRunner(Tokenizer(), registry, scheduler, max_model_len=1000, first_token_from_prefill=first_token,
                   decode_stall_timeout_s=stall_s)
    r._engines = {"p:1": Engine(answer="a"), "d:1": first, **({"d2:1": second} if second else {})}
    return r, scheduler, registry


class DownRegistry(Registry):
    """The registry with etcd down: every call is UNAVAILABLE."""

    async def GetSession(self, request, timeout=None):
        raise _rpc_error(grpc.StatusCode.UNAVAILABLE)

    async def RecordTurn(self, request, timeout=None):
        raise _rpc_error(grpc.StatusCode.UNAVAILABLE)


class RefusingRegistry(Registry):
    """A registry that refuses every record, as the real one refuses a record over its size limit."""

    async def RecordTurn(self, request, timeout=None):
        raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "the session record would be 1400001 bytes; the registry "
                                                           "takes at most 1400000")


class CapturingRunner:
    """For the HTTP API alone: takes the turn the API built and stops there (503), keeping the requests."""

    def __init__(self):
        self.requests: list[TurnRequest] = []

    async def prepare(self, req: TurnRequest):
        self.requests.append(req)
        raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "captured")


@dataclass
class AnsweredTurn:
    """What AnsweringRunner.prepare returns: the TurnContext fields the front ends read."""

    request: TurnRequest
    id: str = "kvs-test"
    prompt_text: str = "<prompt>"
    prompt_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    kv: KvOutcome = field(default_factory=lambda: KvOutcome("pull", "pulled", pulled_tokens=30, computed_tokens=10))
    express: ExpressLane = field(default_factory=ExpressLane)


class AnsweringRunner:
    """For the HTTP front ends alone: answers every turn with ``answer``, streamed in ``pieces``-character deltas
    (40 prompt tokens, 10 of them computed; 7 output ids); keeps the requests. The session id of the answer is the
    request's, or ``new_session`` when it has none."""

    control_timeout_s = 5.0
    max_model_len = 4096

    def __init__(self, answer: str, pieces: int = 3, finish: str = "stop", registry=None,
                 new_session: str = "auto-1"):
        self.answer, self.pieces, self.finish, self.registry = answer, pieces, finish, registry
        self.new_session = new_session
        self.requests: list[TurnRequest] = []
        self.tokenizer = Tokenizer()

    async def prepare(self, req: TurnRequest) -> AnsweredTurn:
        self.requests.append(req)
        # Each turn its own id (the first keeps the plain one): stored responses chain by id.
        turn = AnsweredTurn(req) if len(self.requests) == 1 else AnsweredTurn(req, id=f"kvs-test{len(self.requests)}")
        turn.kv.session_id = req.session_id or self.new_session
        req.session_id = turn.kv.session_id
        return turn

    def hidden_token_ids(self, req: TurnRequest) -> set[int]:
        return set()

    @staticmethod
    def logprob(position: int, char: str, top: int) -> TokenLogprob:
        """The stand-in's logprob of the answer's ``position``-th character (token id = code point)."""
        value = -0.25 * position
        return TokenLogprob(ord(char), value, ((ord(char), value), (ord("?"), value - 1.0))[:top])

    async def decode(self, turn: AnsweredTurn):
        """Token ids are the answer's code points; with logprobs asked for, each token gets ``logprob``'s."""
        top = turn.request.logprobs
        lps = [self.logprob(i, c, top) for i, c in enumerate(self.answer)] if top is not None else None
        answer = AnswerEvents(turn.request.parsing, turn.prompt_text)  # the real parse stage
        for i in range(0, len(self.answer), self.pieces):
            piece = self.answer[i:i + self.pieces]
            yield Delta(piece, [ord(c) for c in piece], lps[i:i + self.pieces] if lps else None, answer.feed(piece))
        held = answer.finish()
        yield Finished(self.finish, self.answer, [ord(c) for c in self.answer], 40, turn.kv, {}, lps, held,
                       answer)


class StoredResponses:
    """The registry's stored responses in memory, per tenant, as it keeps them (each with its own turn's items, linked
    to the one it continues; tests/integration/test_response_chains.py runs the real one)."""

    def __init__(self):
        self.stored = {}

    async def GetResponseChain(self, request, timeout=None):
        self.chain_requests = [*getattr(self, "chain_requests", []), request]
        found = self.stored.get((request.tenant, request.response_id))
        if found is None:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, "no stored response")
        chain = [found]
        while chain[-1].previous_response_id and len(chain) <= request.max_responses:
            earlier = self.stored.get((request.tenant, chain[-1].previous_response_id))
            if earlier is None:
                raise _rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"response {chain[-1].previous_response_id!r}, "
                                 f"which response {chain[-1].response_id!r} continues, is gone")
            chain.append(earlier)
        if len(chain) > request.max_responses:
            raise _rpc_error(grpc.StatusCode.OUT_OF_RANGE, f"{len(chain)} stored responses")
        return type("R", (), {"responses": chain[::-1]})()

    async def PutResponse(self, request, timeout=None):
        self.stored[(request.response.tenant, request.response.response_id)] = request.response
        return request

    async def GetResponse(self, request, timeout=None):
        found = self.stored.get((request.tenant, request.response_id))
        if found is None:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, "no stored response")
        return type("R", (), {"response": found})()

    async def DeleteResponse(self, request, timeout=None):
        gone = self.stored.pop((request.tenant, request.response_id), None)
        return type("R", (), {"deleted": gone is not None})()
