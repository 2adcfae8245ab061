"""The scheduler's PlanningService on stand-ins (worker view, claims, KV manager): the steps of a plan in order, its
typed refusals, and its two adapters (the gRPC servicer's abort, the in-process stub's AioRpcError)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from kvshuttle.control_plane.prefix import prefix_digest
from kvshuttle.services.scheduler.claims import Claim, ClaimsError
from kvshuttle.services.scheduler.errors import (
    InvalidRequest,
    NoLiveWorker,
    PlanningError,
    Unavailable,
    WorkersNotReady,
)
from kvshuttle.services.scheduler.in_process import InProcessScheduler
from kvshuttle.services.scheduler.planning import PlanningService
from kvshuttle.services.scheduler.servicer import TransferSchedulerServicer
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

from tests.support.planning import planner
from tests.support.scheduler import handle_for, worker

PREFILL = worker("p0", common_pb2.WORKER_ROLE_PREFILL, 7000)
DECODE = worker("d0", common_pb2.WORKER_ROLE_DECODE, 7100)
HISTORY = list(range(1000, 1100))
PROMPT = HISTORY + [1, 2, 3]


def record(revision: int = 7) -> common_pb2.Session:
    """d0's record of HISTORY: its handle covers all but the last token, unclaimed."""
    covered = len(HISTORY) - 1
    return common_pb2.Session(tenant="default", session_id="s1", revision=revision, lease_id=3,
                              decode_worker_id="d0", kv_transfer_params_json=handle_for(DECODE, covered),
                              covered_tokens=covered, block_size=16, prefix_digest=prefix_digest(HISTORY, covered))


class Workers:
    """The worker view: ``ready`` or not, ``listed`` workers; ``after_refresh`` replaces them when refreshed."""

    def __init__(self, log: list, listed=(PREFILL, DECODE), ready: bool = True, after_refresh=None):
        self.log, self.listed, self.after_refresh = log, list(listed), after_refresh
        self.ready = asyncio.Event()
        if ready:
            self.ready.set()

    async def wait_ready(self, timeout_s: float) -> bool:
        self.log.append("wait_ready")
        return False

    def get(self, worker_id: str):
        return next((w for w in self.listed if w.worker_id == worker_id), None)

    def by_role(self, role: int, model: str | None = None):
        return [w for w in self.listed if w.role == role and (model is None or w.model == model)]

    async def refresh(self, timeout_s: float) -> None:
        self.log.append("refresh")
        if self.after_refresh is not None:
            self.listed = list(self.after_refresh)


class Claims:
    via = "etcd"

    def __init__(self, log: list, found=None, read_error: ClaimsError | None = None, claimed: bool = True):
        self.log, self.found, self.read_error, self.claimed = log, found, read_error, claimed

    async def get_session(self, tenant: str, session_id: str):
        self.log.append("get_session")
        if self.read_error is not None:
            raise self.read_error
        return self.found

    async def claim(self, tenant, session_id, revision, known=None, free_reason=""):
        self.log.append("claim")
        if not self.claimed:
            return Claim(False, "already claimed", None)
        won = common_pb2.Session()
        won.CopyFrom(known)
        won.claimed = True
        return Claim(True, "", won)


class Kv:
    def __init__(self, log: list):
        self.log = log

    async def make_room(self, worker, need_tokens: int, keep) -> int:
        self.log.append(("make_room", worker.worker_id, need_tokens, keep))
        return 0

    def note_pull_lost(self, worker_id: str, reason: str) -> None:
        self.log.append("note_pull_lost")


def service(log: list, workers: Workers | None = None, claims: Claims | None = None, kv: bool = True):
    return PlanningService(workers or Workers(log), planner(default="t16"), claims or Claims(log),
                           kv=Kv(log) if kv else None)


async def test_a_pulling_turn_reads_the_session_plans_claims_then_makes_room():
    log: list = []
    answer = await service(log, claims=Claims(log, found=(record(), 300.0))).plan_turn(
        scheduler_pb2.PlanTurnRequest(session_id="s1", prompt_token_ids=PROMPT, max_tokens=8))
    assert log == ["get_session", "claim", ("make_room", "d0", len(PROMPT) + 8, ("default", "s1"))]
    assert answer.decision == scheduler_pb2.DECISION_PULL and answer.source.worker_id == "d0"
    assert (answer.prefill.worker_id, answer.decode.worker_id) == ("p0", "d0")
    assert answer.figures.session_found and answer.figures.reusable_tokens > 0


async def test_a_refused_claim_recomputes_and_a_snapshot_needs_no_read():
    log: list = []
    snapshot = registry_pb2.GetSessionResponse(session=record(), expires_in_s=300.0)
    answer = await service(log, claims=Claims(log, claimed=False)).plan_turn(
        scheduler_pb2.PlanTurnRequest(session_id="s1", prompt_token_ids=PROMPT, session_snapshot=snapshot))
    assert log == ["claim", ("make_room", "d0", len(PROMPT), None)]
    assert answer.decision == scheduler_pb2.DECISION_RECOMPUTE and "claimed by a concurrent turn" in answer.reason


async def test_a_failed_session_read_is_no_refusal_the_turn_recomputes_and_says_why():
    log: list = []
    claims = Claims(log, read_error=ClaimsError(grpc.StatusCode.UNAVAILABLE, "etcd away"))
    answer = await service(log, claims=claims).plan_turn(
        scheduler_pb2.PlanTurnRequest(session_id="s1", prompt_token_ids=PROMPT))
    assert answer.decision == scheduler_pb2.DECISION_RECOMPUTE
    assert answer.reason_code == "store_unavailable" and "could not read the session via etcd" in answer.reason


@pytest.mark.parametrize("request_fields, message", [
    ({}, "prompt_token_ids (or prompt_ids_packed) must not be empty"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must be non-negative token ids"),
    ({"prompt_token_ids": [1], "session_id": "a/b"}, None),
    ({"prompt_token_ids": [1], "history_match_tokens": 4},
     "history_match_tokens must be positive and comes with the session_snapshot whose ids it was counted against"),
    ({"prompt_token_ids": [1], "policy": "nope"}, "unknown policy 'nope'; this scheduler has cost, t16"),
])
async def test_an_invalid_request_is_refused_before_any_other_step(request_fields, message):
    log: list = []
    with pytest.raises(InvalidRequest) as refused:
        await service(log, workers=Workers(log, ready=False)).plan_turn(
            scheduler_pb2.PlanTurnRequest(**request_fields))
    assert log == [] and refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    if message is not None:
        assert refused.value.message == message == str(refused.value)


async def test_an_invalid_session_from_the_store_is_an_invalid_request():
    log: list = []
    claims = Claims(log, read_error=ClaimsError(grpc.StatusCode.INVALID_ARGUMENT, ""))
    with pytest.raises(InvalidRequest, match="^invalid session$"):
        await service(log, claims=claims).plan_turn(scheduler_pb2.PlanTurnRequest(session_id="s1",
                                                                                  prompt_token_ids=[1]))


async def test_no_worker_list_yet_is_unavailable():
    log: list = []
    with pytest.raises(WorkersNotReady) as refused:
        await service(log, workers=Workers(log, ready=False)).plan_turn(
            scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]))
    assert log == ["wait_ready"]
    assert (refused.value.code, refused.value.message) == (grpc.StatusCode.UNAVAILABLE,
                                                           "no worker list from the registry yet")


@pytest.mark.parametrize("listed, missing", [((DECODE,), "prefill"), ((PREFILL,), "decode")])
async def test_no_live_worker_after_one_refresh_names_the_missing_role(listed, missing):
    log: list = []
    with pytest.raises(NoLiveWorker) as refused:
        await service(log, workers=Workers(log, listed=listed)).plan_turn(
            scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]))
    assert log == ["refresh"] and isinstance(refused.value, Unavailable)
    assert (refused.value.role, refused.value.message) == (missing, f"no live {missing} worker")


async def test_a_worker_the_refresh_finds_is_planned_on():
    log: list = []
    workers = Workers(log, listed=(DECODE,), after_refresh=(PREFILL, DECODE))
    answer = await service(log, workers=workers, kv=False).plan_turn(
        scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]))
    assert log == ["refresh"] and answer.prefill.worker_id == "p0"


async def test_an_outcome_no_replica_could_learn_from_is_an_invalid_request():
    with pytest.raises(InvalidRequest, match="prefill_worker_id and prompt_tokens are required"):
        await service([]).report_outcome(scheduler_pb2.ReportOutcomeRequest())


class Context:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details=""):
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # as grpc.aio's abort, it never returns


async def test_the_servicer_aborts_with_the_typed_error_s_code_and_message():
    servicer = TransferSchedulerServicer(None, Workers([], ready=False), planner(), claims=Claims([]))
    context = Context()
    with pytest.raises(RuntimeError, match="aborted"):
        await servicer.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]), context)
    assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "no worker list from the registry yet")
    with pytest.raises(RuntimeError, match="aborted"):
        await servicer.ReportOutcome(scheduler_pb2.ReportOutcomeRequest(), context)
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "prefill_worker_id and prompt_tokens are required")


async def test_the_in_process_stub_raises_what_a_grpc_client_gets():
    log: list = []
    stub = InProcessScheduler(service(log, workers=Workers(log, listed=(DECODE,)), kv=False))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[]), timeout=5)
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids (or prompt_ids_packed) must not be empty")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]))
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no live prefill worker")
    stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
    assert stats.learning.mode == "local" and {p.name for p in stats.policies} == {"cost", "t16"}


async def test_the_in_process_stub_s_deadline_is_deadline_exceeded():
    class Slow(PlanningService):
        async def plan_turn(self, request):
            await asyncio.sleep(10)

    stub = InProcessScheduler(Slow(Workers([]), planner(), Claims([])))
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stub.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1]), timeout=0.01)
    assert (late.value.code(), late.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                         "Deadline Exceeded (in-process scheduler)")


def test_every_typed_error_carries_its_status():
    assert PlanningError.code == grpc.StatusCode.UNKNOWN
    assert [cls.code for cls in (InvalidRequest, Unavailable, WorkersNotReady, NoLiveWorker)] == [
        grpc.StatusCode.INVALID_ARGUMENT] + [grpc.StatusCode.UNAVAILABLE] * 3
