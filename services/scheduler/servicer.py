"""TransferScheduler servicer: adapts PlanTurn to kvshuttle.control_plane.planner, then claims the handle for a pull."""

from __future__ import annotations

import json
import logging
import sys
import time
from array import array
from collections.abc import Mapping, Sequence

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.decision import Choice, HandleView, Plan, decide
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.planner import Planner, TurnPlan
from kvshuttle.control_plane.policies import Policy, PolicyError
from kvshuttle.control_plane.selection import UNKNOWN
from kvshuttle.services.common import metrics
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.scheduler.claims import ClaimsError, RegistryClaims, SessionClaims
from kvshuttle.services.scheduler.kv_manager import KvManager
from kvshuttle.services.scheduler.learning import InvalidOutcome, LocalLearning, SharedLearning, outcome_of
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.services.scheduler.worker_view import WorkerView
from kvshuttle.v1 import common_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kvshuttle.scheduler")


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


class TransferSchedulerServicer(scheduler_pb2_grpc.TransferSchedulerServicer):
    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub, workers: WorkerView, planner: Planner,
                 registry_timeout_s: float = 2.0, claims: SessionClaims | None = None,
                 loads: LoadMonitor | None = None, kv: KvManager | None = None,
                 learning: LocalLearning | SharedLearning | None = None):
        """``claims`` reads records and claims handles (default: through ``registry``; see claims.py); ``loads``
        gives the workers' live load (None: every worker counts as idle); ``kv`` manages the decode workers' held KV
        (None: it is left to their TTL); ``learning`` takes the reported outcomes to the planner (default: this
        replica's alone; see learning.py)."""
        self._kv = kv
        self._learning = learning or LocalLearning(planner)
        self._claims = claims or RegistryClaims(registry, registry_timeout_s)
        self._workers = workers
        self._planner = planner
        self._loads = loads
        self._timeout = registry_timeout_s
        self._assigned: dict[str, int] = {}  # turns assigned per worker (stats)

    async def PlanTurn(self, request: scheduler_pb2.PlanTurnRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        try:
            prompt = prompt_of(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.session_id:
            try:
                session_rules.session_ref(request.tenant, request.session_id)
            except session_rules.InvalidArgument as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.history_match_tokens and (request.history_match_tokens < 0
                                             or request.WhichOneof("known_session") != "session_snapshot"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "history_match_tokens must be positive and comes "
                                "with the session_snapshot whose ids it was counted against")
        try:
            self._planner.policy(request.policy)
        except PolicyError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self._workers.ready.is_set() and not await self._workers.wait_ready(5.0):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker list from the registry yet")

        with tracer.start_as_current_span("scheduler.plan_turn") as span:
            exclude = set(request.exclude_worker_ids)
            session, expires_in = None, 0.0
            reason_override = None
            known = request.WhichOneof("known_session")
            if request.session_id and not request.disable_pull:
                if known == "session_snapshot":
                    session, expires_in = request.session_snapshot.session, request.session_snapshot.expires_in_s
                elif known is None:
                    try:
                        session, expires_in, reason_override = await self._get_session(request)
                    except ClaimsError as exc:
                        await context.abort(exc.code, exc.details or "invalid session")
            source = self._workers.get(session.decode_worker_id) if session is not None else None
            loads = self._loads.loads() if self._loads is not None else {}
            verified = request.history_match_tokens if known == "session_snapshot" else 0
            handle = self._handle_view(session, expires_in, source, exclude, loads, verified)
            turn = self._plan(prompt, handle, session, loads, exclude, request)
            if turn is None:  # the watch may lag behind a registration: ask once, and look at the source again
                try:
                    await self._workers.refresh(self._timeout)
                except grpc.aio.AioRpcError as exc:
                    log.warning("could not refresh the worker list (%s)", exc.code().name)
                source = self._workers.get(session.decode_worker_id) if session is not None else None
                handle = self._handle_view(session, expires_in, source, exclude, loads, verified)
                turn = self._plan(prompt, handle, session, loads, exclude, request)
            if turn is None:
                missing = "prefill" if not [w for w in self._workers.by_role(common_pb2.WORKER_ROLE_PREFILL)
                                            if w.worker_id not in exclude] else "decode"
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no live {missing} worker")
            plan, policy, prefill, decode, predicted = turn.plan, turn.policy, turn.prefill, turn.decode, turn.prediction
            if reason_override and plan.choice is Choice.RECOMPUTE and handle is None:
                plan.code, plan.reason = reason_override
            stale = False
            if plan.choice is Choice.PULL:
                plan, refusal = await self._claim(request, session, plan, prompt, expires_in, source, exclude,
                                                  policy)
                stale = known == "session_snapshot" and refusal.startswith(
                    (session_rules.CHANGED, session_rules.MISSING))
            if plan.code in (why.KV_FREED_IDLE, why.KV_FREED_PRESSURE):
                freed_for = "idle" if plan.code == why.KV_FREED_IDLE else "pressure"  # room counts as pressure
                metrics.pull_lost(freed_for)
                if self._kv is not None:
                    self._kv.note_pull_lost(session.decode_worker_id, freed_for)
            if self._kv is not None:  # never a turn waiting for blocks that only held KV takes: room first
                freed = await self._kv.make_room(
                    decode, len(prompt) + max(0, request.max_tokens),
                    keep=(request.tenant or session_rules.DEFAULT_TENANT, request.session_id)
                    if plan.choice is Choice.PULL else None)
                if freed and span.is_recording():
                    span.set_attribute("kvshuttle.kv_room_freed", freed)

            figures = scheduler_pb2.PlanFigures(
                prompt_tokens=len(prompt), session_found=session is not None,
                covered_tokens=session.covered_tokens if session else 0, matched_tokens=plan.matched_tokens,
                reusable_tokens=plan.reusable_tokens, compute_tokens=plan.compute_tokens,
                block_size=session.block_size if session else 0, expires_in_s=expires_in if session else 0.0,
                pull_threshold_tokens=policy.safety.pull_threshold_tokens,
                source_worker_alive=bool(handle and handle.source_alive), snapshot_stale=stale,
                policy=policy.name, predicted_pull_ms=(predicted.pull_ms or 0.0) if predicted else 0.0,
                predicted_recompute_ms=predicted.recompute_ms if predicted else 0.0,
                pullable_tokens=plan.pullable_tokens, predicted_wait_ms=turn.wait_ms, worker_choice=turn.worker_choice,
                cached_tokens_estimate=turn.cached_tokens,
            )
            self._note_assigned(prefill.worker_id, plan.compute_tokens)
            self._note_assigned(decode.worker_id, len(prompt))
            decision = scheduler_pb2.DECISION_PULL if plan.choice is Choice.PULL else scheduler_pb2.DECISION_RECOMPUTE
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
                })
            metrics.plan_made(policy=policy.name, decision=plan.choice.value, reason_code=plan.code,
                              seconds=time.perf_counter() - started)
            return scheduler_pb2.PlanTurnResponse(
                decision=decision, reason=plan.reason, reason_code=plan.code, prefill=prefill, decode=decode,
                prefill_kv_transfer_params_json=json.dumps(plan.prefill_params),
                source=source if plan.choice is Choice.PULL or plan.pullable_tokens else None, figures=figures,
            )

    async def ReportOutcome(self, request: scheduler_pb2.ReportOutcomeRequest, context: grpc.aio.ServicerContext):
        try:
            outcome_of(request)  # refused here, before it is shared: no replica could learn from it
        except InvalidOutcome as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        learned = await self._learning.learn(request, wait_s=self._timeout)
        if self._loads is not None:
            self._loads.note_finished(request.prefill_worker_id)
        return scheduler_pb2.ReportOutcomeResponse(learned=learned)

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext):
        planner = self._planner
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
        loads = self._loads.loads() if self._loads is not None else {}
        for worker_id in sorted(set(loads) | set(self._assigned)):
            load = loads.get(worker_id)
            row = out.loads.add(worker_id=worker_id, assigned_turns=self._assigned.get(worker_id, 0))
            if load is not None:
                row.running, row.waiting, row.pending = load.running, load.waiting, load.pending
                row.used_tokens, row.capacity_tokens = load.used_tokens, load.capacity_tokens
                row.age_s, row.reachable = load.age_s, load.reachable
        if self._kv is not None:
            out.kv_managed, out.kv_eviction_policy, out.kv_leading = True, self._kv.ranking.name, self._kv.leading
            self._kv.fill_stats(out)
        self._learning.fill_stats(out.learning)
        return out

    def _plan(self, prompt: list[int], handle: HandleView | None, session: common_pb2.Session | None, loads,
              exclude: set[str], request: scheduler_pb2.PlanTurnRequest) -> TurnPlan | None:
        return self._planner.plan(
            prompt, handle, prefill=self._workers.by_role(common_pb2.WORKER_ROLE_PREFILL),
            decode=self._workers.by_role(common_pb2.WORKER_ROLE_DECODE), loads=loads,
            source_worker=session.decode_worker_id if session is not None else "", exclude=exclude,
            disable_pull=request.disable_pull, policy=request.policy,
            session=(request.tenant or "default", request.session_id) if request.session_id else None)

    def _note_assigned(self, worker_id: str, tokens: int) -> None:
        self._assigned[worker_id] = self._assigned.get(worker_id, 0) + 1
        if self._loads is not None:
            self._loads.note_assigned(worker_id, tokens)

    async def _get_session(self, request) -> tuple[common_pb2.Session | None, float, tuple[str, str] | None]:
        try:
            found = await self._claims.get_session(request.tenant, request.session_id)
        except ClaimsError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise
            log.warning("session read via %s failed (%s); recomputing", self._claims.via, exc.code.name)
            return None, 0.0, _store_failure(exc, f"could not read the session via {self._claims.via}")
        return (None, 0.0, None) if found is None else (*found, None)

    @staticmethod
    def _handle_view(session: common_pb2.Session | None, expires_in: float, source: common_pb2.Worker | None,
                     exclude: set[str], loads: Mapping[str, WorkerLoad] | None = None,
                     verified: int = 0) -> HandleView | None:
        """The record as the decision sees it. Its decode worker counts as alive only while registered at the address
        the handle names, not excluded, and (when loads are polled) answering. ``verified``: the caller's count of
        prompt ids equal to the record's (PlanTurnRequest.history_match_tokens)."""
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
        )

    async def _claim(self, request, session: common_pb2.Session, plan: Plan, prompt: list[int], expires_in: float,
                     source: common_pb2.Worker | None, exclude: set[str], policy: Policy) -> tuple[Plan, str]:
        """Take the handle at the planned revision; the pull goes ahead only if the claimed record (the registry's,
        not the caller's snapshot) gives the very same plan. Returns the plan and the registry's refusal ('')."""
        started = time.perf_counter()
        try:
            resp = await self._claims.claim(request.tenant, request.session_id, session.revision, known=session)
        except ClaimsError as exc:
            log.warning("claim via %s failed (%s); recomputing", self._claims.via, exc.code.name)
            return _demote(plan, *_store_failure(exc, "could not claim the KV handle")), ""
        if not resp.claimed:
            if resp.session is not None and resp.session.kv_freed:  # the caller's snapshot predates the free
                freed = decide(prompt, self._handle_view(resp.session, expires_in, source, exclude), policy.safety)
                return _demote(plan, freed.code, freed.reason), resp.reason
            return _demote(plan, why.CLAIM_REFUSED, f"KV handle claimed by a concurrent turn ({resp.reason}): "
                                                    "recompute"), resp.reason
        if not _same_kv(resp.session, session):  # never the case unless the snapshot was wrong
            claimed = common_pb2.Session()
            claimed.CopyFrom(resp.session)
            claimed.claimed = False  # judge the record as it was before our claim
            check = decide(prompt, self._handle_view(claimed, expires_in, source, exclude), policy.safety)
        else:
            check = plan
        if (check.choice, check.reusable_tokens, check.prefill_params) != (
                plan.choice, plan.reusable_tokens, plan.prefill_params):
            log.warning("session %s: the claimed record disagrees with the planned one; recomputing",
                        hashed(request.session_id))
            return _demote(plan, why.CLAIM_MISMATCH,
                           "the claimed record differs from the one planned with: recompute"), ""
        log.debug("claimed session in %.2f ms", (time.perf_counter() - started) * 1000)
        return plan, ""


def _same_kv(a: common_pb2.Session, b: common_pb2.Session) -> bool:
    """Whether two records describe the same KV: handle, holder, covered tokens, digests."""
    return (a.kv_transfer_params_json == b.kv_transfer_params_json and a.decode_worker_id == b.decode_worker_id
            and a.covered_tokens == b.covered_tokens and a.block_size == b.block_size
            and a.prefix_digest == b.prefix_digest and a.checkpoints == b.checkpoints)


def _store_failure(exc: ClaimsError, what: str) -> tuple[str, str]:
    """The reason (code, text) of a turn that recomputes because a session read or claim failed (the text prefixed
    STORE_UNAVAILABLE when the registry or etcd could not be reached, which the gateway counts)."""
    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return why.STORE_UNAVAILABLE, f"{session_rules.STORE_UNAVAILABLE} ({exc.code.name}): {what}: recompute"
    return why.STORE_ERROR, f"{what} ({exc.code.name}): recompute"


def _demote(plan: Plan, code: str, reason: str) -> Plan:
    return Plan(Choice.RECOMPUTE, reason, plan.prompt_tokens, matched_tokens=plan.matched_tokens, code=code)
