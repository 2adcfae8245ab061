"""TransferScheduler over loopback against a real registry and etcd: worker choice, the prefix check, the claim.

The scheduler reads and claims sessions either through the registry or in etcd directly (``--etcd-endpoints``); the
shared tests run both ways.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import grpc
import pytest
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.prefix import prefix_digest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.claims import ClaimsError, EtcdClaims
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.scheduler import digests, first_plan, handle_for, plan, record, register_pair, worker
from tests.support.waits import until

# These tests check the pulls' mechanics (claims, snapshots, handles): their default policy never continues on D; the
# direct fixture's ON_D policy always does (test_direct_claims_hand_a_turn_continued_on_d_the_handle_once).
PULLS_ONLY = "continue_on_decode=never"
ON_D = "on-d"


@pytest.fixture(scope="module", params=["registry", "etcd", "etcd+handles outside"])
async def planes(etcd, request, tmp_path_factory):
    """A registry with its own key prefix (no other test's workers), a scheduler on it that claims through the
    registry or in etcd directly, and their stubs. "handles outside": every KV handle is kept in the registry's
    history store (an SQLite file), which the scheduler reads too, as long sessions' handles are."""
    prefix = f"/sched-{uuid.uuid4().hex[:6]}/"
    outside = request.param == "etcd+handles outside"
    history = f"sqlite:{tmp_path_factory.mktemp('history') / 'history.db'}" if outside else "sqlite::memory:"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                          expiry_margin_s=5, history_store=history,
                                          handle_inline_bytes=0 if outside else 1024))
    # the workers here are registry records without engines: no load polls (they would mark them unreachable)
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", policy_params=PULLS_ONLY, registry=registry.address,
                                                 pull_threshold_tokens=16, key_prefix=prefix, load_poll_interval_s=0,
                                                 etcd_endpoints=etcd if request.param != "registry" else "",
                                                 history_store=history if outside else ""))
    assert scheduler.claims.via == request.param.partition("+")[0]
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    yield registry_pb2_grpc.SessionRegistryStub(channels[0]), scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def test_a_handle_kept_outside_the_record_is_read_by_the_scheduler_and_only_the_claimer_gets_it(etcd, tmp_path):
    """Handles in the history store: the etcd record holds only their digest; a plan without a snapshot reads the
    handle from the store, pulls it once, and a scheduler not given the store recomputes (never a wrong pull)."""
    prefix = f"/sched-{uuid.uuid4().hex[:6]}/"
    history = f"sqlite:{tmp_path / 'history.db'}"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                          expiry_margin_s=5, history_store=history, handle_inline_bytes=0))
    schedulers = [SchedulerService(SchedulerConfig(listen="127.0.0.1:0", policy_params=PULLS_ONLY, registry=registry.address,
                                                   pull_threshold_tokens=16, key_prefix=prefix,
                                                   load_poll_interval_s=0, etcd_endpoints=etcd, history_store=store))
                  for store in (history, "")]
    for s in schedulers:
        await s.start()
    channels = [client_channel(registry.address), *(client_channel(s.address) for s in schedulers)]
    try:
        reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
        with_store, without = (scheduler_pb2_grpc.TransferSchedulerStub(c) for c in channels[1:])
        d = worker("d0", common_pb2.WORKER_ROLE_DECODE, 7100)
        for w in (worker("p0", common_pb2.WORKER_ROLE_PREFILL, 7000), d):
            await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
        history_ids, session = list(range(1000, 1100)), f"s-{uuid.uuid4().hex[:8]}"
        for sched in (with_store, without):
            await first_plan(sched, scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=[1, 2]))
        recorded = await reg.RecordTurn(registry_pb2.RecordTurnRequest(
            session_id=session, decode_worker_id="d0", kv_transfer_params_json=handle_for(d, 99),
            token_ids=history_ids))
        assert recorded.session.handle_digest and not recorded.session.kv_transfer_params_json  # not echoed back
        stored = await EtcdStore(etcd, prefix).__aenter__()
        try:
            bare = await stored.sessions.get(session_rules.DEFAULT_TENANT, session, with_handle=False)
            assert bare.handle_digest and not bare.kv_transfer_params_json  # etcd holds only the digest
        finally:
            await stored.close()
        read = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))
        assert json.loads(read.session.kv_transfer_params_json)["remote_num_tokens"] == 99  # filled in on reads

        blind = await plan(without, session, history_ids + [1, 2, 3])
        assert blind.decision == scheduler_pb2.DECISION_RECOMPUTE, blind.reason  # cannot read it: no pull
        pulled = await plan(with_store, session, history_ids + [1, 2, 3])
        assert pulled.decision == scheduler_pb2.DECISION_PULL, pulled.reason
        assert json.loads(pulled.prefill_kv_transfer_params_json)["remote_num_tokens"] == 99
        again = await plan(with_store, session, history_ids + [1, 2, 3])
        assert again.decision == scheduler_pb2.DECISION_RECOMPUTE and "already" in again.reason

        # The next turn's record replaces the handle; the old one is dropped from the store.
        await reg.RecordTurn(registry_pb2.RecordTurnRequest(
            session_id=session, decode_worker_id="d0", kv_transfer_params_json=handle_for(d, 98),
            token_ids=history_ids))
        snap = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))
        assert snap.session.handle_digest != recorded.session.handle_digest
        with_snapshot = await with_store.PlanTurn(scheduler_pb2.PlanTurnRequest(
            session_id=session, prompt_token_ids=history_ids + [4], session_snapshot=snap))
        assert with_snapshot.decision == scheduler_pb2.DECISION_PULL and with_snapshot.figures.reusable_tokens == 98
    finally:
        for c in channels:
            await c.close()
        for s in schedulers:
            await s.stop()
        await registry.stop(grace=0.5)


async def test_plans_pulls_only_for_verified_unclaimed_history(planes):
    reg, sched = planes
    p, d = worker("p0", common_pb2.WORKER_ROLE_PREFILL, 7000), worker("d0", common_pb2.WORKER_ROLE_DECODE, 7100)
    for w in (p, d):
        await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
    history = list(range(1000, 1100))  # 100 ids: last turn's prompt + answer
    session = f"s-{uuid.uuid4().hex[:8]}"

    # the scheduler learns about workers through WatchWorkers
    first = await first_plan(sched, scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=history[:60]))
    assert first.decision == scheduler_pb2.DECISION_RECOMPUTE and "no recorded KV" in first.reason
    assert (first.prefill.worker_id, first.decode.worker_id) == ("p0", "d0")

    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id="d0",
                                                        kv_transfer_params_json=handle_for(d, 99),
                                                        token_ids=history))
    edited = history.copy()
    edited[40] = 7  # third block (32..47) differs, after the checkpoint at 37 (an earlier turn's end)
    partial = await plan(sched, session, edited + [1, 2], disable_pull=True)
    assert partial.decision == scheduler_pb2.DECISION_RECOMPUTE and "disabled" in partial.reason

    pulled = await plan(sched, session, history + [1, 2, 3])
    assert pulled.decision == scheduler_pb2.DECISION_PULL, pulled.reason
    assert pulled.figures.reusable_tokens == 99 and pulled.source.worker_id == "d0"
    params = json.loads(pulled.prefill_kv_transfer_params_json)
    assert params["remote_num_tokens"] == 99 and len(params["remote_block_ids"][0]) == 7
    # The plan claimed the handle: a second turn on the same session cannot pull it again.
    again = await plan(sched, session, history + [1, 2, 3])
    assert again.decision == scheduler_pb2.DECISION_RECOMPUTE and "already" in again.reason

    # A new record, then a prompt that diverges in block 2: only the two whole blocks of the last checkpoint
    # before it are pulled. Without checkpoints, only a prompt that extends all the covered ids can pull.
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id="d0",
                                                        kv_transfer_params_json=handle_for(d, 99),
                                                        token_ids=history))
    whole_only = await plan(sched, session, edited + [1, 2])
    assert whole_only.decision == scheduler_pb2.DECISION_RECOMPUTE and whole_only.reason_code == "diverged", \
        whole_only.reason
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id="d0",
                                                        kv_transfer_params_json=handle_for(d, 99),
                                                        token_ids=history, **digests(history, 99, (10, 37, 70))))
    diverged = await plan(sched, session, edited + [1, 2])
    assert diverged.decision == scheduler_pb2.DECISION_PULL and diverged.figures.reusable_tokens == 32
    assert json.loads(diverged.prefill_kv_transfer_params_json)["remote_block_ids"] == [[100, 101]]

    # The decode worker that holds the KV goes away: recompute, never a pull from a dead address.
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id="d0",
                                                        kv_transfer_params_json=handle_for(d, 99),
                                                        token_ids=history))
    d1 = worker("d1", common_pb2.WORKER_ROLE_DECODE, 7200)
    await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=d1, lease_ttl_s=30))
    await reg.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id="d0"))
    async def only_d1() -> bool:  # the scheduler learns it through WatchWorkers: then only d1 is picked
        return {(await plan(sched, session, history + [5], disable_pull=True)).decode.worker_id
                for _ in range(2)} == {"d1"}

    await until(only_d1, what="plans on d1 only (d0 gone from the scheduler's view)")
    gone = await plan(sched, session, history + [5])
    # "not alive" while the record stands; "no recorded KV" once the registry has dropped it (its worker is gone)
    assert gone.decision == scheduler_pb2.DECISION_RECOMPUTE, gone.reason
    assert "not alive" in gone.reason or "no recorded KV" in gone.reason, gone.reason
    assert gone.decode.worker_id == "d1"


async def test_a_session_snapshot_saves_a_read_but_never_makes_a_wrong_pull(planes):
    """The gateway hands PlanTurn the record it just read. A stale or altered snapshot must not cause a pull the
    registry's record does not allow: the claim is at the snapshot's revision and the plan is re-checked."""
    reg, sched = planes
    _, d = await register_pair(reg, "p9", "d9", 7400)
    history = list(range(2000, 2100))
    session = f"s-{uuid.uuid4().hex[:8]}"

    async def plan_with(snapshot, prompt, **kw) -> scheduler_pb2.PlanTurnResponse:
        async def on_d9():  # the scheduler learns about the workers through WatchWorkers
            got = await plan(sched, session, prompt, session_snapshot=snapshot, exclude_worker_ids=["p0", "d0", "d1"],
                             **kw)
            return got if got.decode.worker_id == "d9" and "not alive" not in got.reason else None

        return await until(on_d9, what="a plan on d9 (the scheduler's worker view)")

    snapshot = await record(reg, session, d, history)
    pulled = await plan_with(snapshot, history + [1])
    assert pulled.decision == scheduler_pb2.DECISION_PULL and pulled.figures.reusable_tokens == 99, pulled.reason

    # The caller compared the prompt with the record's ids: 70 are equal, past any checkpoint (it has none). Its
    # count is pulled in whole blocks; without it, the digests prove nothing short of the whole history.
    counted = await record(reg, session, d, history)
    diverging = [*history[:70], 5, *history[71:], 1]
    alone = await plan_with(counted, diverging)
    assert alone.decision == scheduler_pb2.DECISION_RECOMPUTE and alone.reason_code == "diverged", alone.reason
    told = await plan_with(counted, diverging, history_match_tokens=70)
    assert told.decision == scheduler_pb2.DECISION_PULL and told.reason_code == "pull_prefix", told.reason
    assert (told.figures.matched_tokens, told.figures.reusable_tokens) == (70, 64)
    assert json.loads(told.prefill_kv_transfer_params_json)["remote_num_tokens"] == 64
    for bad in ({"history_match_tokens": -1, "session_snapshot": counted},
                {"history_match_tokens": 3}):  # a count without the snapshot it was counted against
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plan(sched, session, diverging, **bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "history_match_tokens" in err.value.details()

    stale = await record(reg, session, d, history)
    await record(reg, session, d, history)  # the record changes after the caller read it
    late = await plan_with(stale, history + [1])
    assert late.decision == scheduler_pb2.DECISION_RECOMPUTE and "changed" in late.reason, late.reason
    assert late.figures.snapshot_stale and not pulled.figures.snapshot_stale

    forged = await record(reg, session, d, history)
    edited = history.copy()
    edited[20] = 5  # differs from the real record in block 1; the snapshot claims the record holds these tokens
    forged.session.checkpoints.add(tokens=80, digest=prefix_digest(edited, 80))
    wrong = await plan_with(forged, edited + [1])
    assert wrong.decision == scheduler_pb2.DECISION_RECOMPUTE and "differs" in wrong.reason, wrong.reason

    forged = await record(reg, session, d, history)  # the real record, but a digest vouching for the edited tokens
    assert forged.session.prefix_digest
    forged.session.prefix_digest = prefix_digest(edited, 99)
    wrong = await plan_with(forged, edited + [1])
    assert wrong.decision == scheduler_pb2.DECISION_RECOMPUTE and "differs" in wrong.reason, wrong.reason

    await record(reg, session, d, history)
    absent = await plan(sched, session, history + [1], session_not_found=True)
    assert absent.decision == scheduler_pb2.DECISION_RECOMPUTE and "no recorded KV" in absent.reason


async def test_bad_plans_are_rejected_with_a_status(planes):
    _, sched = planes
    for request, words in [
        (scheduler_pb2.PlanTurnRequest(session_id="s"), "must not be empty"),
        (scheduler_pb2.PlanTurnRequest(session_id="x" * 300, prompt_token_ids=[1]), "at most 256"),
        (scheduler_pb2.PlanTurnRequest(session_id="a b", prompt_token_ids=[1]), "characters"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sched.PlanTurn(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


async def test_a_turn_plans_on_its_models_workers_and_never_reuses_another_models_kv(planes):
    """PlanTurnRequest.model (issue #37): the turn's prefill and decode workers serve its model (the base model or
    one of its adapters), and a session recorded for another model or adapter is recomputed (other_model), not pulled
    or continued; an unserved model has no live worker; no model named: any worker, as before."""
    reg, sched = planes
    tag = uuid.uuid4().hex[:6]
    workers = {}
    for model, port in (("big", 7400), ("small", 7500)):
        for role, shift in ((common_pb2.WORKER_ROLE_PREFILL, 0), (common_pb2.WORKER_ROLE_DECODE, 50)):
            w = worker(f"{model}-{role}-{tag}", role, port + shift)
            w.model = model
            if model == "big":
                w.adapters.add(name="big-sql", id=1, path="/adapters/sql")
            resp = await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
            workers[(model, role)] = (w, resp.lease_id)
    try:
        history = list(range(2000, 2100))
        for model in ("big", "small"):
            request = scheduler_pb2.PlanTurnRequest(session_id=f"m-{tag}-{model}", prompt_token_ids=history[:40],
                                                    model=model)
            got = await until(lambda r=request: _planned_on(sched, r, model), what=f"a plan on {model}'s workers")
            assert {got.prefill.worker_id, got.decode.worker_id} == {
                workers[(model, common_pb2.WORKER_ROLE_PREFILL)][0].worker_id,
                workers[(model, common_pb2.WORKER_ROLE_DECODE)][0].worker_id}
        held_on = workers[("big", common_pb2.WORKER_ROLE_DECODE)][0]
        session = f"m-{tag}"
        for recorded in ("big", "big-sql"):
            await reg.RecordTurn(registry_pb2.RecordTurnRequest(
                session_id=session, decode_worker_id=held_on.worker_id, kv_transfer_params_json=handle_for(held_on, 99),
                token_ids=history, model=recorded))
            for model in sorted(("small", "big", "big-sql"), key=lambda m: m == recorded):  # a pull claims: last
                got = await plan(sched, session, history + [1, 2, 3], model=model)
                if model == recorded:
                    assert got.decision == scheduler_pb2.DECISION_PULL, got.reason
                    assert got.source.worker_id == held_on.worker_id
                else:
                    assert got.decision == scheduler_pb2.DECISION_RECOMPUTE, (recorded, model, got.reason)
                    assert got.reason_code == "other_model", got.reason
                served = "big" if model == "big-sql" else model
                assert got.decode.model == got.prefill.model == served
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plan(sched, session, history, model="none-such")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "serving model 'none-such'" in err.value.details()
    finally:
        for w, lease in workers.values():
            await reg.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=w.worker_id, lease_id=lease))


async def _planned_on(sched, request, model: str):
    """The plan once the scheduler's worker view holds ``model``'s workers (None until then)."""
    try:
        got = await sched.PlanTurn(request)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        return None
    return got if got.prefill.model == model and got.decode.model == model else None


async def test_cost_policy_learns_from_reported_outcomes(etcd):
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd,
                                          key_prefix=f"/cost-{uuid.uuid4().hex[:6]}/", expiry_margin_s=5))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", policy_params=PULLS_ONLY, registry=registry.address, policy="cost",
                                                 load_poll_interval_s=0))  # fake workers: nothing to poll
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
    sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    try:
        _, d = await register_pair(reg, "p0", "d0", 7600)
        history = list(range(3000, 3400))
        session = f"s-{uuid.uuid4().hex[:8]}"

        async def plan_next() -> scheduler_pb2.PlanTurnResponse:
            await record(reg, session, d, history)
            return await first_plan(sched, scheduler_pb2.PlanTurnRequest(session_id=session,
                                                                         prompt_token_ids=history + [1, 2]))

        first = await plan_next()  # priors: pulling 399 tokens beats computing them
        assert first.decision == scheduler_pb2.DECISION_PULL and first.figures.policy == "cost", first.reason
        assert 0 < first.figures.predicted_pull_ms < first.figures.predicted_recompute_ms

        for _ in range(6):  # but on this link pulls are slow, and recomputes fast
            for decision, pulled, ms in ((scheduler_pb2.DECISION_PULL, 399, 400.0),
                                         (scheduler_pb2.DECISION_RECOMPUTE, 0, 30.0)):
                await sched.ReportOutcome(scheduler_pb2.ReportOutcomeRequest(
                    prefill_worker_id="p0", decode_worker_id="d0", prompt_tokens=401, pulled_tokens=pulled,
                    computed_tokens=401 - pulled, prefill_ms=ms, decision=decision))
        second = await plan_next()
        assert second.decision == scheduler_pb2.DECISION_RECOMPUTE and "cost model" in second.reason, second.reason
        assert second.figures.predicted_pull_ms > second.figures.predicted_recompute_ms

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sched.ReportOutcome(scheduler_pb2.ReportOutcomeRequest(prefill_worker_id="p0", prompt_tokens=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decision" in err.value.details()
    finally:
        for channel in channels:
            await channel.close()
        await scheduler.stop()
        await registry.stop(grace=0.5)


# ------------------------------------------------------------------------------------------- claims in etcd directly

@pytest.fixture(scope="module")
async def direct(etcd):
    """A registry and a scheduler that claims in etcd itself (same key prefix), their stubs, and a pair of workers."""
    prefix = f"/direct-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                          expiry_margin_s=5))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", policy_params=PULLS_ONLY, registry=registry.address,
                                                 etcd_endpoints=etcd, key_prefix=prefix, load_poll_interval_s=0,
                                                 policies=f"{ON_D}=cost:continue_on_decode=always"))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
    sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    _, d = await register_pair(reg, "p0", "d0", 7800)
    async def on_d0() -> bool:
        warm_up = scheduler_pb2.PlanTurnRequest(session_id="warm-up", prompt_token_ids=[1, 2, 3], disable_pull=True)
        return (await first_plan(sched, warm_up)).decode.worker_id == "d0"

    await until(on_d0, what="the scheduler's worker view of the pair")
    yield reg, sched, d, prefix
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def test_direct_claims_pull_once_and_concurrent_plans_recompute(direct):
    reg, sched, d, _ = direct
    history = list(range(4000, 4200))
    for with_snapshot in (True, False):
        session = f"s-{uuid.uuid4().hex[:8]}"
        snapshot = await record(reg, session, d, history)
        extra = {"session_snapshot": snapshot} if with_snapshot else {}
        plans = await asyncio.gather(*(plan(sched, session, history + [1], **extra) for _ in range(8)))
        pulls = [p for p in plans if p.decision == scheduler_pb2.DECISION_PULL]
        assert len(pulls) == 1, [p.reason for p in plans]
        assert pulls[0].figures.reusable_tokens == 199 and pulls[0].source.worker_id == "d0"
        for other in plans:
            if other is not pulls[0]:
                assert other.decision == scheduler_pb2.DECISION_RECOMPUTE
                assert "claimed" in other.reason or "already" in other.reason, other.reason
        # The claim is in etcd, where the registry sees it: the record has no handle any more.
        after = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))
        assert after.session.claimed and not after.session.kv_transfer_params_json
        again = await plan(sched, session, history + [1])
        assert again.decision == scheduler_pb2.DECISION_RECOMPUTE and "already" in again.reason, again.reason


async def test_direct_claims_hand_a_turn_continued_on_d_the_handle_once(direct):
    """A turn continued on D claims the session's handle as a pull does: of concurrent forks, one continues on the
    decode worker that holds the KV, the others recompute (never two turns on one handle)."""
    reg, sched, d, _ = direct
    history = list(range(4000, 4200))
    session = f"s-{uuid.uuid4().hex[:8]}"
    snapshot = await record(reg, session, d, history)
    plans = await asyncio.gather(*(plan(sched, session, history + [1], session_snapshot=snapshot, policy=ON_D)
                                   for _ in range(6)))
    local = [p for p in plans if p.decision == scheduler_pb2.DECISION_LOCAL]
    assert len(local) == 1, [p.reason for p in plans]
    (on_d,) = local
    assert on_d.decode.worker_id == on_d.source.worker_id == "d0" and on_d.reason_code == "local_always"
    assert on_d.figures.predicted_local_ms > 0 and on_d.figures.pullable_tokens == 199
    assert all(p.decision == scheduler_pb2.DECISION_RECOMPUTE for p in plans if p is not on_d)
    after = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))
    assert after.session.claimed and not after.session.kv_transfer_params_json


async def test_direct_claims_refuse_a_stale_revision_and_agree_with_the_registry(direct, etcd):
    reg, sched, d, prefix = direct
    history = list(range(5000, 5100))
    session = f"s-{uuid.uuid4().hex[:8]}"
    stale = await record(reg, session, d, history)
    fresh = await record(reg, session, d, history)
    assert fresh.session.revision > stale.session.revision

    late = await plan(sched, session, history + [1], session_snapshot=stale)
    assert late.decision == scheduler_pb2.DECISION_RECOMPUTE and "changed" in late.reason, late.reason
    assert late.figures.snapshot_stale

    claims = EtcdClaims(EtcdStore(etcd, prefix))
    await claims.start()
    try:
        refused = await claims.claim("", session, stale.session.revision)
        assert not refused.claimed and refused.reason.startswith(session_rules.CHANGED)
        assert not refused.session.kv_transfer_params_json  # a refusal never hands out the handle
        with pytest.raises(ClaimsError) as err:
            await claims.claim("", session, 0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ClaimsError) as err:
            await claims.get_session("", "a/b")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        found, expires_in = await claims.get_session("", session)
        assert found.revision == fresh.session.revision and 0 < expires_in <= 60
        assert await claims.get_session("", "never-recorded") is None

        # The registry claims the fresh record first: a direct claim of the same revision is refused, and back.
        won = await reg.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=session,
                                                                      revision=fresh.session.revision))
        assert won.claimed
        lost = await claims.claim("", session, fresh.session.revision)
        assert not lost.claimed and lost.reason.startswith((session_rules.CHANGED, session_rules.CLAIMED))
        newest = await record(reg, session, d, history)
        mine = await claims.claim("", session, newest.session.revision)
        assert mine.claimed and mine.session.kv_transfer_params_json == handle_for(d, 99)
        theirs = await reg.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=session,
                                                                          revision=newest.session.revision))
        assert not theirs.claimed
    finally:
        await claims.close()


async def test_direct_claims_recompute_when_etcd_is_unreachable():
    dead = EtcdClaims(EtcdStore("127.0.0.1:1", timeout_s=0.3, attempt_timeout_s=0.1))
    await dead.start()
    try:
        for call in (dead.get_session("", "s"), dead.claim("", "s", 5)):
            with pytest.raises(ClaimsError) as err:
                await call
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await dead.close()


def test_the_scheduler_claims_in_etcd_when_given_its_endpoints():
    assert SchedulerConfig().etcd_endpoints == ""  # default: through the registry
    cfg = from_namespace(SchedulerConfig, environ={"KVSHUTTLE_ETCD_ENDPOINTS": "127.0.0.1:2379,127.0.0.1:2380",
                                                   "KVSHUTTLE_REGISTRY_KEY_PREFIX": "/other"})
    assert cfg.etcd_endpoints == "127.0.0.1:2379,127.0.0.1:2380" and cfg.key_prefix == "/other/"
    with pytest.raises(ValueError, match="etcd-endpoints"):
        from_namespace(SchedulerConfig, environ={"KVSHUTTLE_ETCD_ENDPOINTS": " , "})


_TRACED = textwrap.dedent("""
    import asyncio, sys, uuid
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from kvshuttle.v1 import registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
    from kvshuttle.services.common.config import TelemetryConfig
    from kvshuttle.services.common.grpc_server import client_channel
    from kvshuttle.services.registry.server import RegistryConfig, serve
    from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
    from kvshuttle.services.common.telemetry import setup_tracing, tracing_enabled
    from tests.support.scheduler import first_plan, register_pair

    async def main(etcd):
        assert not tracing_enabled()
        spans = InMemorySpanExporter()
        setup_tracing("kvshuttle-test", TelemetryConfig(), exporter=spans)
        assert tracing_enabled()
        prefix = f"/traced-{uuid.uuid4().hex[:6]}/"
        registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
        scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", policy_params="continue_on_decode=never", registry=registry.address,
                                                     etcd_endpoints=etcd, key_prefix=prefix, load_poll_interval_s=0))
        await scheduler.start()
        channels = [client_channel(registry.address), client_channel(scheduler.address)]
        await register_pair(registry_pb2_grpc.SessionRegistryStub(channels[0]), "p0", "d0", 7900)
        sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
        with trace.get_tracer("test").start_as_current_span("caller") as caller:
            await first_plan(sched, scheduler_pb2.PlanTurnRequest(session_id="s1", prompt_token_ids=[1, 2]))
        trace.get_tracer_provider().force_flush()
        plans = [s for s in spans.get_finished_spans() if s.name == "scheduler.plan_turn"]
        assert plans and plans[-1].context.trace_id == caller.get_span_context().trace_id, plans
        assert plans[-1].attributes["kvshuttle.decision"] == "recompute"
        for channel in channels:
            await channel.close()
        await scheduler.stop()
        await registry.stop(grace=0.5)
        print("traced")

    asyncio.run(main(sys.argv[1]))
""")


def test_a_traced_process_carries_trace_context_into_the_scheduler(etcd):
    """The OpenTelemetry gRPC interceptors are installed only where tracing is set up; there the caller's trace
    reaches the scheduler's span. (A subprocess: the tracer provider is process-wide and set once.)"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _TRACED, etcd], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "traced" in done.stdout, done.stderr[-3000:]
