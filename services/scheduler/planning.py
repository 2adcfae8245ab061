"""The scheduler's requests as plain code: PlanTurn, ReportOutcome, GetStats, with no gRPC context.

A plan goes through six steps, in this order:

1. **validate** the request (prompt ids, session reference, history_match_tokens, policy), then wait a little for the
   registry's worker list;
2. **session**: the caller's snapshot of the record, or the record read (via the registry or etcd: ``claims``);
3. **plan** with ``kvshuttle.control_plane.planner`` (once more after refreshing the worker list when no worker fits);
4. **claim** the KV handle when the plan pulls or continues on D: it goes ahead only if the claimed record gives the
   same plan;
5. **room**: the KV manager frees held KV on the decode worker for the turn's tokens;
6. **answer**: the PlanTurnResponse with its figures, span attributes and metrics.

Refusals raise :class:`~kvshuttle.services.scheduler.errors.PlanningError` subclasses (InvalidRequest,
WorkersNotReady, NoLiveWorker), which the adapters (servicer.py, in_process.py) turn into gRPC statuses. A failed
session read or claim is no refusal: the turn recomputes, its reason says why.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from kvshuttle.control_plane import kv_params, models
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.decision import Choice, HandleView, Plan, decide
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.planner import Planner, TurnPlan
from kvshuttle.control_plane.policies import Policy, PolicyError
from kvshuttle.control_plane.selection import UNKNOWN
from kvshuttle.services.common import metrics
from kvshuttle.services.common.telemetry import QuietTracer, hashed
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.scheduler.claims import ClaimsError, SessionClaims
from kvshuttle.services.scheduler.errors import InvalidRequest, NoLiveWorker, WorkersNotReady
from kvshuttle.services.scheduler.kv_manager import KvManager
from kvshuttle.services.scheduler.learning import InvalidOutcome, Learning, LocalLearning, outcome_of
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.services.scheduler.prefix_index import PrefixIndex
from kvshuttle.v1 import common_pb2, scheduler_pb2
from opentelemetry import trace

log = logging.getLogger(__name__)
tracer = QuietTracer("kvshuttle.scheduler")

WORKERS_READY_WAIT_S = 5.0  # how long a plan waits for the first worker list

_NON_NEGATIVE = bytes(range(128))  # top bytes of int32 ids >= 0 (little-endian: every 4th byte from the 4th)


def prompt_of(request: scheduler_pb2.PlanTurnRequest) -> Sequence[int]:
    """The prompt's ids: from ``prompt_ids_packed`` as an int32 array (no Python int per id until one is read;
    hashed as it is), else from ``prompt_token_ids``. ValueError names what is wrong."""
    packed = request.prompt_ids_packed
    if packed:
        if request.prompt_token_ids:
            raise ValueError("give the prompt as prompt_token_ids or prompt_ids_packed, not both")
        if len(packed) % 4:
            raise ValueError(f"prompt_ids_packed must hold 4 bytes per id (int32 little-endian), got {len(packed)} "
                             "bytes")
        if packed[3::4].translate(None, _NON_NEGATIVE):  # a top byte >= 0x80: a negative id
            raise ValueError("prompt_ids_packed must hold non-negative token ids")
        prompt = array("i")
        prompt.frombytes(packed)
        if sys.byteorder != "little":
            prompt.byteswap()
        return prompt
    prompt = request.prompt_token_ids[:]  # a list (slicing converts faster than list())
    if not prompt:
        raise ValueError("prompt_token_ids (or prompt_ids_packed) must not be empty")
    if min(prompt) < 0:  # int32 on the wire: never above 2**31 - 1
        raise ValueError("prompt_token_ids must be non-negative token ids")
    return prompt


def source_matches(worker: common_pb2.Worker | None, handle_json: str) -> bool:
    """The handle must point at a live, registered decode worker's NIXL side channel, nowhere else."""
    if worker is None or worker.role != common_pb2.WORKER_ROLE_DECODE:
        return False
    try:
        handle = kv_params.parse_handle(handle_json)
    except kv_params.HandleError:
        return True  # decide() reports the unusable handle itself
    return (handle.host, handle.port, handle.engine_id) == (worker.nixl_host, worker.nixl_port, worker.engine_id)


@dataclass
class KnownSession:
    """Step 2's answer: the record the turn is planned with (None: none), as the caller sent it or as read."""

    session: common_pb2.Session | None = None
    expires_in_s: float = 0.0
    reason_override: tuple[str, str] | None = None  # (code, reason) of a RECOMPUTE because the read failed
    snapshot: bool = False  # the caller sent session_snapshot
    verified_tokens: int = 0  # the caller's history_match_tokens (snapshot only)


@dataclass
class PlannedTurn:
    """Step 3's answer: the planner's plan, with the handle and source worker it was made with."""

    turn: TurnPlan
    handle: HandleView | None
    source: common_pb2.Worker | None
    loads: Mapping[str, WorkerLoad]
    exclude: set[str]


class PlanningService:
    """PlanTurn, ReportOutcome and GetStats over the planner, the worker view, the claims, the load polls, the KV
    manager and the learning; refusals raise PlanningError (see the module docstring)."""

    def __init__(self, workers: WorkerView, planner: Planner, claims: SessionClaims, *,
                 registry_timeout_s: float = 2.0, loads: LoadMonitor | None = None, kv: KvManager | None = None,
                 learning: Learning | None = None, prefix: PrefixIndex | None = None):
        self.workers = workers
        self.prefix = prefix
        self.planner = planner
        self.claims = claims
        self.loads = loads
        self.kv = kv
        self.learning: Learning = learning or LocalLearning(planner)
        self.timeout_s = registry_timeout_s
        self.assigned: dict[str, int] = {}  # turns assigned per worker (stats)

    # -- PlanTurn ----------------------------------------------------------------------------------------------------

    async def plan_turn(self, request: scheduler_pb2.PlanTurnRequest) -> scheduler_pb2.PlanTurnResponse:
        started = time.perf_counter()
        prompt = self.validate(request)
        await self.wait_for_workers()
        with tracer.start_as_current_span("scheduler.plan_turn") as span:
            known = await self.read_session(request)
            planned = await self.plan(request, prompt, known)
            plan, stale = await self.claim(request, prompt, known, planned)
            await self.make_room(request, prompt, known, planned, plan, span)
            return self.answer(request, prompt, known, planned, plan, stale, span, started)

    def validate(self, request: scheduler_pb2.PlanTurnRequest) -> Sequence[int]:
        """Step 1: the prompt's ids, once the whole request is checked; InvalidRequest says what is wrong."""
        try:
            prompt = prompt_of(request)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if request.session_id:
            try:
                session_rules.session_ref(request.tenant, request.session_id)
            except session_rules.InvalidArgument as exc:
                raise InvalidRequest(str(exc)) from None
        if request.history_match_tokens and (request.history_match_tokens < 0
                                             or request.WhichOneof("known_session") != "session_snapshot"):
            raise InvalidRequest("history_match_tokens must be positive and comes with the session_snapshot whose "
                                 "ids it was counted against")
        try:
            self.planner.policy(request.policy)
        except PolicyError as exc:
            raise InvalidRequest(str(exc)) from None
        return prompt

    async def wait_for_workers(self) -> None:
        """WorkersNotReady unless the registry's worker list arrives within WORKERS_READY_WAIT_S."""
        if not self.workers.ready.is_set() and not await self.workers.wait_ready(WORKERS_READY_WAIT_S):
            raise WorkersNotReady()

    async def read_session(self, request: scheduler_pb2.PlanTurnRequest) -> KnownSession:
        """Step 2: the caller's snapshot, or the record read (a failed read: none, and the reason to recompute)."""
        which = request.WhichOneof("known_session")
        known = KnownSession(snapshot=which == "session_snapshot")
        if known.snapshot:
            known.verified_tokens = request.history_match_tokens
        if not request.session_id or request.disable_pull:
            return known
        if known.snapshot:
            known.session, known.expires_in_s = request.session_snapshot.session, \
                request.session_snapshot.expires_in_s
        elif which is None:
            try:
                found = await self.claims.get_session(request.tenant, request.session_id)
            except ClaimsError as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(exc.details or "invalid session") from None
                log.warning("session read via %s failed (%s); recomputing", self.claims.via, exc.code.name)
                known.reason_override = store_failure(exc, f"could not read the session via {self.claims.via}")
            else:
                if found is not None:
                    known.session, known.expires_in_s = found
        return known

    async def plan(self, request: scheduler_pb2.PlanTurnRequest, prompt: Sequence[int],
                   known: KnownSession) -> PlannedTurn:
        """Step 3: the planner's plan; when no worker fits, once more after refreshing the worker list (its watch may
        lag behind a registration); NoLiveWorker names the role still missing."""
        exclude = set(request.exclude_worker_ids)
        loads = self.loads.loads() if self.loads is not None else {}
        planned = self._plan_once(request, prompt, known, loads, exclude)
        if planned is None:
            try:
                await self.workers.refresh(self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("could not refresh the worker list (%s)", exc.code().name)
            planned = self._plan_once(request, prompt, known, loads, exclude)
        if planned is None:
            missing = "prefill" if not [w for w in self.workers.by_role(common_pb2.WORKER_ROLE_PREFILL,
                                                                        request.model or None)
                                        if w.worker_id not in exclude] else "decode"
            raise NoLiveWorker(missing, request.model)
        plan = planned.turn.plan
        if known.reason_override and plan.choice is Choice.RECOMPUTE and planned.handle is None:
            plan.code, plan.reason = known.reason_override
        return planned

    def _plan_once(self, request: scheduler_pb2.PlanTurnRequest, prompt: Sequence[int], known: KnownSession,
                   loads: Mapping[str, WorkerLoad], exclude: set[str]) -> PlannedTurn | None:
        session, model = known.session, request.model or None
        source = self.workers.get(session.decode_worker_id) if session is not None else None
        handle = handle_view(session, known.expires_in_s, source, exclude, loads, known.verified_tokens, model)
        prefill = self.workers.by_role(common_pb2.WORKER_ROLE_PREFILL, model)
        # An adapter's turn (its workers' base model is another name) is looked up under the adapter: vLLM hashes
        # its blocks under it, so the base model's cached blocks never count for it.
        hits = (self.prefix.hits(prompt, request.cache_salt, prefill, models.adapter_turn(model, prefill))
                if self.prefix is not None else None)
        turn = self.planner.plan(
            prompt, handle, prefill=prefill, prefix_hits=hits,
            decode=self.workers.by_role(common_pb2.WORKER_ROLE_DECODE, model), loads=loads,
            source_worker=session.decode_worker_id if session is not None else "", exclude=exclude,
            disable_pull=request.disable_pull, policy=request.policy,
            session=(request.tenant or "default", request.session_id) if request.session_id else None,
            model=request.model)
        return None if turn is None else PlannedTurn(turn, handle, source, loads, exclude)

    async def claim(self, request: scheduler_pb2.PlanTurnRequest, prompt: Sequence[int], known: KnownSession,
                    planned: PlannedTurn) -> tuple[Plan, bool]:
        """Step 4: when the plan pulls or continues on D, take the handle at the planned revision (one turn uses
        it: a concurrent fork of the session recomputes); it goes ahead only if the claimed record (the store's, not
        the caller's snapshot) gives the very same safe plan, else the turn recomputes. Returns the plan and whether
        the caller's snapshot was stale (changed or gone)."""
        plan = planned.turn.plan
        if plan.choice is Choice.RECOMPUTE:
            return plan, False
        plan, refusal = await self._claim(request, known.session, plan, prompt, known.expires_in_s, planned.source,
                                          planned.exclude, planned.turn.policy)
        stale = known.snapshot and refusal.startswith((session_rules.CHANGED, session_rules.MISSING))
        return plan, stale

    async def _claim(self, request, session: common_pb2.Session, plan: Plan, prompt: Sequence[int],
                     expires_in: float, source: common_pb2.Worker | None, exclude: set[str],
                     policy: Policy) -> tuple[Plan, str]:
        """The plan after the claim, and the store's refusal ('')."""
        started = time.perf_counter()
        try:
            resp = await self.claims.claim(request.tenant, request.session_id, session.revision, known=session)
        except ClaimsError as exc:
            log.warning("claim via %s failed (%s); recomputing", self.claims.via, exc.code.name)
            return demote(plan, *store_failure(exc, "could not claim the KV handle")), ""
        if not resp.claimed:
            if resp.session is not None and resp.session.kv_freed:  # the caller's snapshot predates the free
                freed = decide(prompt, handle_view(resp.session, expires_in, source, exclude), policy.safety)
                return demote(plan, freed.code, freed.reason), resp.reason
            return demote(plan, why.CLAIM_REFUSED, f"KV handle claimed by a concurrent turn ({resp.reason}): "
                                                   "recompute"), resp.reason
        if not same_kv(resp.session, session):  # never the case unless the snapshot was wrong
            claimed = common_pb2.Session()
            claimed.CopyFrom(resp.session)
            claimed.claimed = False  # judge the record as it was before our claim
            check = decide(prompt, handle_view(claimed, expires_in, source, exclude), policy.safety)
            planned_safe = decide(prompt, handle_view(session, expires_in, source, exclude), policy.safety)
        else:
            check = planned_safe = plan
        if (check.choice, check.reusable_tokens, check.prefill_params) != (
                planned_safe.choice, planned_safe.reusable_tokens, planned_safe.prefill_params):
            log.warning("session %s: the claimed record disagrees with the planned one; recomputing",
                        hashed(request.session_id))
            return demote(plan, why.CLAIM_MISMATCH,
                          "the claimed record differs from the one planned with: recompute"), ""
        log.debug("claimed session in %.2f ms", (time.perf_counter() - started) * 1000)
        return plan, ""

    async def make_room(self, request: scheduler_pb2.PlanTurnRequest, prompt: Sequence[int], known: KnownSession,
                        planned: PlannedTurn, plan: Plan, span: trace.Span) -> None:
        """Step 5: count a pull lost to freed KV, and have the KV manager free held KV on the decode worker for this
        turn's tokens (never a turn waiting for blocks that only held KV takes)."""
        if plan.code in (why.KV_FREED_IDLE, why.KV_FREED_PRESSURE):
            freed_for = "idle" if plan.code == why.KV_FREED_IDLE else "pressure"  # room counts as pressure
            metrics.pull_lost(freed_for)
            if self.kv is not None:
                self.kv.note_pull_lost(known.session.decode_worker_id, freed_for)
        if self.kv is None:
            return
        freed = await self.kv.make_room(
            planned.turn.decode, len(prompt) + max(0, request.max_tokens),
            keep=(request.tenant or session_rules.DEFAULT_TENANT, request.session_id)
            if plan.choice is not Choice.RECOMPUTE else None)
        if freed and span.is_recording():
            span.set_attribute("kvshuttle.kv_room_freed", freed)

    def answer(self, request: scheduler_pb2.PlanTurnRequest, prompt: Sequence[int], known: KnownSession,
               planned: PlannedTurn, plan: Plan, stale: bool, span: trace.Span,
               started: float) -> scheduler_pb2.PlanTurnResponse:
        """Step 6: the response, the assigned-turn counts, the span's attributes and the plan metrics."""
        turn, session, handle = planned.turn, known.session, planned.handle
        policy, prefill, decode, predicted, local = turn.policy, turn.prefill, turn.decode, turn.prediction, turn.local
        figures = scheduler_pb2.PlanFigures(
            prompt_tokens=len(prompt), session_found=session is not None,
            covered_tokens=session.covered_tokens if session else 0, matched_tokens=plan.matched_tokens,
            reusable_tokens=plan.reusable_tokens, compute_tokens=plan.compute_tokens,
            block_size=session.block_size if session else 0, expires_in_s=known.expires_in_s if session else 0.0,
            pull_threshold_tokens=policy.safety.pull_threshold_tokens,
            source_worker_alive=bool(handle and handle.source_alive), snapshot_stale=stale,
            policy=policy.name, predicted_pull_ms=(predicted.pull_ms or 0.0) if predicted else 0.0,
            predicted_recompute_ms=predicted.recompute_ms if predicted else 0.0,
            pullable_tokens=plan.pullable_tokens, predicted_wait_ms=turn.wait_ms, worker_choice=turn.worker_choice,
            cached_tokens_estimate=turn.cached_tokens,
            predicted_local_ms=local.ms if local else 0.0, predicted_itl_delay_ms=local.itl_delay_ms if local else 0.0,
            decode_streams=local.streams if local else 0,
        )
        if plan.choice is not Choice.LOCAL:
            self._note_assigned(prefill.worker_id, plan.compute_tokens)
        self._note_assigned(decode.worker_id, len(prompt))
        decision = DECISIONS[plan.choice]
        if span.is_recording():
            span.set_attributes({
                "kvshuttle.decision": plan.choice.value, "kvshuttle.reason": plan.reason,
                "kvshuttle.reason_code": plan.code, "kvshuttle.tenant": request.tenant,
                "kvshuttle.session": hashed(request.session_id) if request.session_id else "",
                "kvshuttle.prompt_tokens": len(prompt), "kvshuttle.reusable_tokens": plan.reusable_tokens,
                "kvshuttle.prefill_worker": prefill.worker_id, "kvshuttle.decode_worker": decode.worker_id,
                "kvshuttle.policy": policy.name, "kvshuttle.pullable_tokens": plan.pullable_tokens,
                "kvshuttle.predicted_pull_ms": figures.predicted_pull_ms,
                "kvshuttle.predicted_recompute_ms": figures.predicted_recompute_ms,
                "kvshuttle.predicted_wait_ms": turn.wait_ms, "kvshuttle.worker_choice": turn.worker_choice,
                "kvshuttle.predicted_local_ms": figures.predicted_local_ms,
                "kvshuttle.predicted_itl_delay_ms": figures.predicted_itl_delay_ms,
                "kvshuttle.decode_streams": figures.decode_streams,
            })
        metrics.plan_made(policy=policy.name, decision=plan.choice.value, reason_code=plan.code,
                          seconds=time.perf_counter() - started, model=request.model)
        return scheduler_pb2.PlanTurnResponse(
            decision=decision, reason=plan.reason, reason_code=plan.code, prefill=prefill, decode=decode,
            prefill_kv_transfer_params_json=json.dumps(plan.prefill_params),
            source=planned.source if plan.choice is not Choice.RECOMPUTE or plan.pullable_tokens else None,
            figures=figures,
        )

    def _note_assigned(self, worker_id: str, tokens: int) -> None:
        self.assigned[worker_id] = self.assigned.get(worker_id, 0) + 1
        if self.loads is not None:
            self.loads.note_assigned(worker_id, tokens)

    # -- ReportOutcome, GetStats ------------------------------------------------------------------------------------

    async def report_outcome(self, request: scheduler_pb2.ReportOutcomeRequest) -> scheduler_pb2.ReportOutcomeResponse:
        try:
            outcome_of(request)  # refused here, before it is shared: no replica could learn from it
        except InvalidOutcome as exc:
            raise InvalidRequest(str(exc)) from None
        learned = await self.learning.learn(request, wait_s=self.timeout_s)
        if self.loads is not None:
            self.loads.note_finished(request.prefill_worker_id)
        return scheduler_pb2.ReportOutcomeResponse(learned=learned)

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        planner = self.planner
        out = scheduler_pb2.GetStatsResponse(reported_turns=planner.reported)
        for name, policy in planner.policies.items():
            judged, regrets = planner.regret.turns.get(name, 0), planner.regret.regrets.get(name, 0)
            out.policies.add(name=name, kind=policy.kind, is_default=name == planner.default, judged_turns=judged,
                             regret_turns=regrets, regret=regrets / judged if judged else 0.0)
        for worker, fit in planner.model.compute_fits().items():
            out.compute.add(prefill_worker_id=worker, fixed_ms=fit.theta[0], ms_per_ktoken=fit.theta[1],
                            ms_per_ktoken_per_kcontext=fit.theta[2], observations=fit.observations)
        for (worker, source), fit in planner.model.link_fits().items():
            out.transfers.add(prefill_worker_id=worker, decode_worker_id=source, ms_per_transfer=fit.theta[0],
                              ms_per_kpulled=fit.theta[1], observations=fit.observations)
        for worker, fit in planner.model.local_fits().items():
            fixed, per_k, per_k_kctx, per_stream = fit.theta
            out.local.add(decode_worker_id=worker, fixed_ms=fixed, ms_per_ktoken=per_k,
                          ms_per_ktoken_per_kcontext=per_k_kctx, ms_per_decode_stream=per_stream,
                          observations=fit.observations)
        loads = self.loads.loads() if self.loads is not None else {}
        for worker_id in sorted(set(loads) | set(self.assigned)):
            load = loads.get(worker_id)
            row = out.loads.add(worker_id=worker_id, assigned_turns=self.assigned.get(worker_id, 0))
            if load is not None:
                row.running, row.waiting, row.pending = load.running, load.waiting, load.pending
                row.used_tokens, row.capacity_tokens = load.used_tokens, load.capacity_tokens
                row.age_s, row.reachable = load.age_s, load.reachable
                row.source = self.loads.source(worker_id)
        if self.kv is not None:
            out.kv_managed, out.kv_eviction_policy, out.kv_leading = True, self.kv.ranking.name, self.kv.leading
            self.kv.fill_stats(out)
        self.learning.fill_stats(out.learning)
        if self.prefix is not None:
            self.prefix.fill_stats(out.kv_index)
        if self.loads is not None and self.loads.feed is not None:
            self.loads.fill_feed_stats(out.load_feed)
        return out


def handle_view(session: common_pb2.Session | None, expires_in: float, source: common_pb2.Worker | None,
                exclude: set[str], loads: Mapping[str, WorkerLoad] | None = None,
                verified: int = 0, model: str | None = None) -> HandleView | None:
    """The record as the decision sees it. Its decode worker counts as alive only while registered at the address the
    handle names, not excluded, and (when loads are polled) answering. ``verified``: the caller's count of prompt ids
    equal to the record's (PlanTurnRequest.history_match_tokens). ``model``: the turn's (PlanTurnRequest.model);
    KV of a session recorded for another model, or held by a decode worker serving another, is never reused."""
    if session is None:
        return None
    if not session.kv_transfer_params_json:
        return HandleView("", session.covered_tokens, session.block_size, expires_in, True, False,
                          kv_freed=session.kv_freed)
    return HandleView(
        kv_transfer_params_json=session.kv_transfer_params_json,
        covered_tokens=session.covered_tokens, block_size=session.block_size,
        expires_in_s=expires_in, claimed=session.claimed,
        source_alive=source_matches(source, session.kv_transfer_params_json)
        and session.decode_worker_id not in exclude
        and (loads or {}).get(session.decode_worker_id, UNKNOWN).reachable,
        prefix_digest=session.prefix_digest, kv_freed=session.kv_freed,
        checkpoints=[(cp.tokens, cp.digest) for cp in session.checkpoints], verified_tokens=verified,
        other_model=model is not None and (session.model != model
                                           or (source is not None and not models.serves(source, model))),
    )


def same_kv(a: common_pb2.Session, b: common_pb2.Session) -> bool:
    """Whether two records describe the same KV: handle, holder, covered tokens, digests."""
    return (a.kv_transfer_params_json == b.kv_transfer_params_json and a.decode_worker_id == b.decode_worker_id
            and a.covered_tokens == b.covered_tokens and a.block_size == b.block_size
            and a.prefix_digest == b.prefix_digest and a.checkpoints == b.checkpoints)


def store_failure(exc: ClaimsError, what: str) -> tuple[str, str]:
    """The reason (code, text) of a turn that recomputes because a session read or claim failed (the text prefixed
    STORE_UNAVAILABLE when the registry or etcd could not be reached, which the gateway counts)."""
    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return why.STORE_UNAVAILABLE, f"{session_rules.STORE_UNAVAILABLE} ({exc.code.name}): {what}: recompute"
    return why.STORE_ERROR, f"{what} ({exc.code.name}): recompute"


DECISIONS = {Choice.PULL: scheduler_pb2.DECISION_PULL, Choice.RECOMPUTE: scheduler_pb2.DECISION_RECOMPUTE,
             Choice.LOCAL: scheduler_pb2.DECISION_LOCAL}


def demote(plan: Plan, code: str, reason: str) -> Plan:
    return Plan(Choice.RECOMPUTE, reason, plan.prompt_tokens, matched_tokens=plan.matched_tokens, code=code)
