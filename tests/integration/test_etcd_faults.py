"""etcd faults against a real 3-member etcd cluster, the real registry and scheduler on loopback, and the worker
agent's registry link (no vLLM): the leader killed under load, the whole cluster down and back, a worker's lease
revoked. The same cases on the whole stack with vLLM are in tests/e2e/test_etcd_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import pytest
from kvshuttle.control_plane.session import STORE_UNAVAILABLE
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.devtools.etcd_process import EtcdCluster
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvshuttle.workers.agent import RegistryLink

from tests.support.scheduler import handle_for, worker
from tests.support.waits import until

pytestmark = pytest.mark.timeout(240)
ETCD_TIMEOUT_S = 5.0  # the registry's default etcd deadline
# The leader-kill test's registry waits this long for etcd (each operation, retries included): far longer than an
# election takes (etcd's election timeout here is 1 s; a few seconds on a loaded machine), so that no call can fail
# while the survivors elect a new leader. The test checks that the election did end within it.
PATIENT_ETCD_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = PATIENT_ETCD_TIMEOUT_S + 10  # the test's own gRPC deadlines: never the first to give up


@pytest.fixture(scope="module")
async def cluster():
    c = EtcdCluster(3)
    await c.astart()
    yield c
    await c.astop()


@contextlib.asynccontextmanager
async def control_plane(cluster: EtcdCluster, etcd_timeout_s: float):
    """Registry and scheduler (claiming in etcd directly) on their own key prefix, both given all three endpoints;
    yields them, their stubs and the prefix."""
    prefix = f"/faults-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=cluster.endpoints, key_prefix=prefix,
                                          expiry_margin_s=5, etcd_timeout_s=etcd_timeout_s))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 policy="threshold", pull_threshold_tokens=16,
                                                 load_poll_interval_s=0, etcd_endpoints=cluster.endpoints))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    try:
        yield (registry, scheduler, registry_pb2_grpc.SessionRegistryStub(channels[0]),
               scheduler_pb2_grpc.TransferSchedulerStub(channels[1]), prefix)
    finally:
        for channel in channels:
            await channel.close()
        await scheduler.stop()
        await registry.stop(grace=0.5)


@pytest.fixture(scope="module")
async def planes(cluster):
    """The control plane with the registry's default etcd deadline (ETCD_TIMEOUT_S)."""
    async with control_plane(cluster, ETCD_TIMEOUT_S) as planes:
        yield planes


async def _registered_pair(reg, scheduler: SchedulerService, port: int):
    p, d = worker(f"p-{port}", common_pb2.WORKER_ROLE_PREFILL, port), worker(f"d-{port}",
                                                                             common_pb2.WORKER_ROLE_DECODE, port + 100)
    for w in (p, d):
        resp = await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60), timeout=10)
        w.lease_id = resp.lease_id
    await until(lambda: scheduler.workers.get(p.worker_id) and scheduler.workers.get(d.worker_id), 20,
                "the scheduler's worker view to show the pair")
    return p, d


async def _timed(check, timeout_s: float, what: str) -> float:
    """``until(check)``; returns the seconds it took."""
    t = time.monotonic()
    await until(check, timeout_s, what, interval_s=0.1)
    return time.monotonic() - t


async def _record(reg, session: str, d, history: list[int], timeout: float = 15) -> registry_pb2.RecordTurnResponse:
    return await reg.RecordTurn(registry_pb2.RecordTurnRequest(
        session_id=session, decode_worker_id=d.worker_id, kv_transfer_params_json=handle_for(d, len(history) - 1),
        token_ids=history), timeout=timeout)


async def _plan(sched, session: str, prompt: list[int], timeout: float = 15, **kw) -> scheduler_pb2.PlanTurnResponse:
    return await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=prompt, **kw),
                                timeout=timeout)


async def test_leader_kill_under_load_has_no_client_visible_error(cluster):
    """Sessions record turns and claim their handles (through the scheduler and through the registry), and a worker
    keeps its lease alive, while the etcd leader is SIGKILLed: no call fails; claims resume once a new leader is
    elected. (The registry's etcd deadline, PATIENT_ETCD_TIMEOUT_S, outlasts the election.)"""
    async with control_plane(cluster, PATIENT_ETCD_TIMEOUT_S) as (_, scheduler, reg, sched, _):
        p, d = await _registered_pair(reg, scheduler, 7200)
        errors: list[str] = []
        outcomes: list[tuple[float, str, str]] = []  # (time, session, "pull" | "recompute: reason" | "refused: ...")
        stop = asyncio.Event()

        async def via_scheduler(session: str) -> None:
            history = list(range(1000, 1040))
            while not stop.is_set():
                try:
                    await _record(reg, session, d, history, timeout=CALL_TIMEOUT_S)
                    history = history + list(range(len(history), len(history) + 20))
                    plan = await _plan(sched, session, history, timeout=CALL_TIMEOUT_S)
                    outcomes.append((time.monotonic(), session, "pull" if plan.decision == scheduler_pb2.DECISION_PULL
                                     else f"recompute: {plan.reason}"))
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{session}: {exc.code().name} {exc.details()}")

        async def via_registry(session: str) -> None:
            history = list(range(2000, 2040))
            while not stop.is_set():
                try:
                    stored = (await _record(reg, session, d, history, timeout=CALL_TIMEOUT_S)).session
                    claim = await reg.ClaimSession(registry_pb2.ClaimSessionRequest(
                        session_id=session, revision=stored.revision), timeout=CALL_TIMEOUT_S)
                    outcomes.append((time.monotonic(), session, "pull" if claim.claimed
                                     else f"refused: {claim.reason}"))
                    history = history + [7] * 20
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{session}: {exc.code().name} {exc.details()}")

        async def keep_alive() -> None:
            while not stop.is_set():
                try:
                    await reg.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=d.worker_id, lease_id=d.lease_id),
                                        timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"keep-alive: {exc.code().name} {exc.details()}")
                await asyncio.sleep(0.3)  # a worker's keep-alive cadence (the load itself, not a wait)

        sessions = [f"ls-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)] + [f"lr-{i}-{uuid.uuid4().hex[:6]}"
                                                                          for i in range(2)]
        tasks = [asyncio.create_task(via_scheduler(s)) for s in sessions[:3]]
        tasks += [asyncio.create_task(via_registry(s)) for s in sessions[3:]]
        tasks.append(asyncio.create_task(keep_alive()))

        def pulled_since(t: float) -> set[str]:
            return {s for when, s, o in outcomes if when >= t and o == "pull"}

        leader = None
        try:
            # Under load: every session has pulled at least once before the kill.
            await until(lambda: pulled_since(0) == set(sessions), 30, "every session's first pull")
            leader = await asyncio.to_thread(cluster.leader)
            assert leader is not None
            cluster.kill(leader)
            killed_at = time.monotonic()

            async def elected() -> bool:
                return await asyncio.to_thread(cluster.leader) is not None

            await until(elected, 30, "a new etcd leader", interval_s=0.1)
            elected_after = time.monotonic() - killed_at
            # The claim holds for elections within the registry's etcd deadline (else calls may fail, clearly:
            # tests/integration/test_etcd_faults.py's outage test): this one must have been.
            assert elected_after < PATIENT_ETCD_TIMEOUT_S - 2, f"the election took {elected_after:.1f} s"
            # Claims resume: every session pulls again after the election.
            elected_at = time.monotonic()
            await until(lambda: pulled_since(elected_at) == set(sessions), 30, "every session pulling again")
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            if leader is not None:
                await cluster.arestart(leader)
        before = [o for t, _, o in outcomes if t < killed_at]
        after = [(t - killed_at, o) for t, _, o in outcomes if t >= killed_at]
        first_pull = next(dt for dt, o in after if o == "pull")
        demoted = [o for _, o in after if o != "pull"]
        print(f"\nleader kill: {len(before)} plans/claims before, {len(after)} after; first pull {first_pull:.2f} s "
              f"after the kill; new leader {elected_after:.2f} s after it; not pulled after: {len(demoted)} "
              f"{sorted(set(demoted))[:4]}")
        assert errors == [], errors
        assert await asyncio.to_thread(cluster.healthy)


async def test_etcd_down_fails_fast_recomputes_and_recovers(cluster, planes):
    """All members down: the registry answers UNAVAILABLE with a message (the first call within its etcd timeout,
    later ones at once), the scheduler plans a recompute that says why; all members back on their data dirs: reads,
    records and claims work again and the scheduler's worker view follows new registrations, without any restart."""
    registry, scheduler, reg, sched, _ = planes
    p, d = await _registered_pair(reg, scheduler, 7300)
    session = f"down-{uuid.uuid4().hex[:6]}"
    history = list(range(3000, 3060))
    await _record(reg, session, d, history)
    snapshot = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session), timeout=10)
    snapshot.session.ClearField("token_ids")
    late = worker("p-late-7300", common_pb2.WORKER_ROLE_PREFILL, 7400)
    cluster.kill_all()
    try:
        timings = []
        for _ in range(3):
            t = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session),
                                     timeout=ETCD_TIMEOUT_S + 5)
            timings.append(time.monotonic() - t)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "session store unavailable" in info.value.details()
        print(f"\netcd down: GetSession answered UNAVAILABLE in {[round(x, 3) for x in timings]} s "
              f"({info.value.details()})")
        assert registry.store.unreachable_since is not None
        assert max(timings[1:]) < ETCD_TIMEOUT_S  # known down: one attempt, not the whole timeout again
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _record(reg, session, d, history + [1] * 20)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        # The gateway's own copy of the record: the plan wants to pull, the claim cannot reach etcd -> recompute.
        t = time.monotonic()
        with_copy = await _plan(sched, session, history + [5] * 20, session_snapshot=snapshot)
        took_copy = time.monotonic() - t
        t = time.monotonic()
        without = await _plan(sched, session, history + [5] * 20)
        took_without = time.monotonic() - t
        print(f"etcd down: PlanTurn {took_copy:.3f} s -> {with_copy.reason!r}; without a snapshot "
              f"{took_without:.3f} s -> {without.reason!r}")
        for plan in (with_copy, without):
            assert plan.decision == scheduler_pb2.DECISION_RECOMPUTE
            assert plan.reason.startswith(STORE_UNAVAILABLE), plan.reason
            assert plan.prefill.worker_id and plan.decode.worker_id  # workers still known from before the outage
    finally:
        t = time.monotonic()
        await cluster.arestart_all()
        print(f"etcd back: all members healthy in {time.monotonic() - t:.1f} s")

    t0 = time.monotonic()

    async def reads_again() -> bool:
        try:
            await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session), timeout=5)
            return True
        except grpc.aio.AioRpcError:
            return False

    took = await _timed(reads_again, 30, "the registry to read from etcd again")
    fresh = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session), timeout=10)
    assert fresh.session.revision == snapshot.session.revision  # the record survived the outage
    pulled = await _plan(sched, session, history + [5] * 20)
    pulled_after = time.monotonic() - t0
    assert pulled.decision == scheduler_pb2.DECISION_PULL, pulled.reason
    await _record(reg, session, d, history + [5] * 20 + [6])
    await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=late, lease_ttl_s=60), timeout=10)
    watch = await _timed(lambda: scheduler.workers.get(late.worker_id) is not None, 30,
                         "the scheduler's worker view to show a registration made after etcd came back")
    print(f"etcd back: registry reads after {took:.2f} s, scheduler claims (pull) after "
          f"{pulled_after:.2f} s, a new registration reached the scheduler's view {watch:.2f} s after "
          "it was made")
    assert registry.store.unreachable_since is None


async def test_worker_re_registers_after_its_lease_is_lost(cluster, planes):
    """The agent's registry link: its lease revoked in etcd (as when it expired while etcd was unreachable) ->
    it registers again under a new lease and the scheduler plans with it; etcd down for longer than the lease TTL ->
    it registers again once etcd is back."""
    registry, scheduler, reg, sched, prefix = planes
    p = worker("p-agent-7500", common_pb2.WORKER_ROLE_PREFILL, 7500)
    d = worker("d-agent-7500", common_pb2.WORKER_ROLE_DECODE, 7600)
    links = [RegistryLink(registry.address, w, ttl_s=3, retry_s=0.2, max_retry_s=1.0) for w in (p, d)]
    tasks = [asyncio.create_task(link.run()) for link in links]
    store = EtcdStore(cluster.endpoints, prefix)
    await store.connect()
    try:
        for link in links:
            await asyncio.wait_for(link.registered.wait(), 20)
        await until(lambda: all(scheduler.workers.get(w.worker_id) for w in (p, d)), 20, "the view to have the pair")
        session = f"lease-{uuid.uuid4().hex[:6]}"
        history = list(range(4000, 4060))
        await _record(reg, session, d, history)

        old = links[1].lease_id
        t = time.monotonic()
        assert await store.leases.revoke(old)  # the record goes with the lease
        await until(lambda: scheduler.workers.get(d.worker_id) is None, 10, "the revoked worker to leave the view")
        await until(lambda: links[1].lease_id != old and links[1].registered.is_set(), 20,
                    "the link to register again")
        await until(lambda: (w := scheduler.workers.get(d.worker_id)) is not None and w.lease_id == links[1].lease_id,
                    20, "the scheduler to see the new registration")
        back = time.monotonic() - t
        assert (await store.workers.get(d.worker_id)).lease_id == links[1].lease_id
        # The registry's janitor may have dropped the session (its decode worker's record was deleted): then the
        # turn recomputes; a record still there is pulled from the worker as registered again.
        kept = await store.sessions.get("default", session)
        plan = await _plan(sched, session, history + [9] * 20)
        print(f"\nlease revoked: re-registered under a new lease and back in the scheduler's view in {back:.2f} s; "
              f"record kept: {kept is not None}; next plan: {scheduler_pb2.Decision.Name(plan.decision)} "
              f"({plan.reason})")
        if kept is not None:
            assert plan.decision == scheduler_pb2.DECISION_PULL and plan.source.worker_id == d.worker_id, plan.reason
        else:
            assert plan.decision == scheduler_pb2.DECISION_RECOMPUTE and "no recorded KV" in plan.reason
        # The worker serves new sessions again: a turn recorded on it now is pulled from it.
        history = list(range(4100, 4160))
        await _record(reg, session, d, history)
        plan = await _plan(sched, session, history + [9] * 20)
        assert plan.decision == scheduler_pb2.DECISION_PULL and plan.source.worker_id == d.worker_id, plan.reason

        before = [link.registrations for link in links]
        cluster.kill_all()
        try:
            # No keep-alive answered for the lease TTL (3 s): each link presumes its lease lost (and keeps trying
            # to register, which cannot succeed while etcd is down).
            await until(lambda: not any(link.registered.is_set() for link in links), 3 * 3,
                        "both links to give up their lease")
            assert [link.registrations for link in links] == before
        finally:
            await cluster.arestart_all()
        t = time.monotonic()
        await until(lambda: all(link.registrations > n and link.registered.is_set()
                                for link, n in zip(links, before)), 30, "both links to register again")
        again = time.monotonic() - t
        for link, w in zip(links, (p, d)):
            assert (await store.workers.get(w.worker_id)).lease_id == link.lease_id
            assert await store.leases.keep_alive_once(link.lease_id) is not None
        await until(lambda: all((w2 := scheduler.workers.get(w.worker_id)) is not None and w2.lease_id == link.lease_id
                                for link, w in zip(links, (p, d))), 30, "the view to catch up")
        print(f"etcd down > lease TTL: both links registered again {again:.2f} s after etcd was back "
              f"(registrations {[link.registrations for link in links]})")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            with contextlib.suppress(Exception):
                await link.deregister()
            await link.close()
        await store.close()
