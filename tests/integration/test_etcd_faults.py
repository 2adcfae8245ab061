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

from tests.integration.test_scheduler import handle_for, worker

pytestmark = pytest.mark.timeout(240)
ETCD_TIMEOUT_S = 5.0  # the registry's default etcd deadline


@pytest.fixture(scope="module")
async def cluster():
    c = EtcdCluster(3)
    await c.astart()
    yield c
    await c.astop()


@pytest.fixture(scope="module")
async def planes(cluster):
    """Registry and scheduler (claiming in etcd directly), both given all three endpoints; their stubs."""
    prefix = f"/faults-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=cluster.endpoints, key_prefix=prefix,
                                          expiry_margin_s=5, etcd_timeout_s=ETCD_TIMEOUT_S))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 policy="threshold", pull_threshold_tokens=16,
                                                 load_poll_interval_s=0, etcd_endpoints=cluster.endpoints))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    yield (registry, scheduler, registry_pb2_grpc.SessionRegistryStub(channels[0]),
           scheduler_pb2_grpc.TransferSchedulerStub(channels[1]), prefix)
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def _registered_pair(reg, scheduler: SchedulerService, port: int):
    p, d = worker(f"p-{port}", common_pb2.WORKER_ROLE_PREFILL, port), worker(f"d-{port}",
                                                                             common_pb2.WORKER_ROLE_DECODE, port + 100)
    for w in (p, d):
        resp = await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60), timeout=10)
        w.lease_id = resp.lease_id
    await _until(lambda: scheduler.workers.get(p.worker_id) and scheduler.workers.get(d.worker_id), 20,
                 "the scheduler's worker view never showed the pair")
    return p, d


async def _until(pred, timeout_s: float, what: str) -> float:
    """Poll ``pred`` (sync or async) until true; returns the seconds it took."""
    t = time.monotonic()
    while True:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - t
        assert time.monotonic() - t < timeout_s, what
        await asyncio.sleep(0.1)


async def _record(reg, session: str, d, history: list[int]) -> registry_pb2.RecordTurnResponse:
    return await reg.RecordTurn(registry_pb2.RecordTurnRequest(
        session_id=session, decode_worker_id=d.worker_id, kv_transfer_params_json=handle_for(d, len(history) - 1),
        token_ids=history), timeout=15)


async def _plan(sched, session: str, prompt: list[int], **kw) -> scheduler_pb2.PlanTurnResponse:
    return await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=prompt, **kw),
                                timeout=15)


async def test_leader_kill_under_load_has_no_client_visible_error(cluster, planes):
    """Sessions record turns and claim their handles (through the scheduler and through the registry), and a worker
    keeps its lease alive, while the etcd leader is SIGKILLed: no call fails; claims resume once a new leader is
    elected."""
    _, scheduler, reg, sched, _ = planes
    p, d = await _registered_pair(reg, scheduler, 7200)
    errors: list[str] = []
    outcomes: list[tuple[float, str]] = []  # (time, "pull" | "recompute: reason" | "claimed" | ...)
    killed_at: list[float] = []
    elected_after: list[float] = []
    stop = asyncio.Event()

    async def via_scheduler(session: str) -> None:
        history = list(range(1000, 1040))
        while not stop.is_set():
            try:
                await _record(reg, session, d, history)
                history = history + list(range(len(history), len(history) + 20))
                plan = await _plan(sched, session, history)
                outcomes.append((time.monotonic(), "pull" if plan.decision == scheduler_pb2.DECISION_PULL
                                 else f"recompute: {plan.reason}"))
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{session}: {exc.code().name} {exc.details()}")

    async def via_registry(session: str) -> None:
        history = list(range(2000, 2040))
        while not stop.is_set():
            try:
                stored = (await _record(reg, session, d, history)).session
                claim = await reg.ClaimSession(registry_pb2.ClaimSessionRequest(
                    session_id=session, revision=stored.revision), timeout=15)
                outcomes.append((time.monotonic(), "pull" if claim.claimed else f"refused: {claim.reason}"))
                history = history + [7] * 20
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{session}: {exc.code().name} {exc.details()}")

    async def keep_alive() -> None:
        while not stop.is_set():
            try:
                await reg.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=d.worker_id, lease_id=d.lease_id),
                                    timeout=15)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"keep-alive: {exc.code().name} {exc.details()}")
            await asyncio.sleep(0.3)

    tasks = [asyncio.create_task(via_scheduler(f"ls-{i}-{uuid.uuid4().hex[:6]}")) for i in range(3)]
    tasks += [asyncio.create_task(via_registry(f"lr-{i}-{uuid.uuid4().hex[:6]}")) for i in range(2)]
    tasks.append(asyncio.create_task(keep_alive()))
    leader = None
    try:
        await asyncio.sleep(1.5)
        leader = await asyncio.to_thread(cluster.leader)
        assert leader is not None
        cluster.kill(leader)
        killed_at.append(time.monotonic())
        while time.monotonic() - killed_at[0] < 30:  # how long the survivors take to elect a new leader
            if await asyncio.to_thread(cluster.leader) is not None:
                break
            await asyncio.sleep(0.1)
        elected_after.append(time.monotonic() - killed_at[0])
        await asyncio.sleep(max(0.0, 6.0 - elected_after[0]))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if leader is not None:
            await cluster.arestart(leader)
    before = [o for t, o in outcomes if t < killed_at[0]]
    after = [(t - killed_at[0], o) for t, o in outcomes if t >= killed_at[0]]
    first_pull = next((dt for dt, o in after if o == "pull"), None)
    demoted = [o for _, o in after if o != "pull"]
    print(f"\nleader kill: {len(before)} plans/claims before, {len(after)} after; first pull "
          f"{first_pull if first_pull is None else round(first_pull, 2)} s after the kill; not pulled after: "
          f"{len(demoted)} {sorted(set(demoted))[:4]}")
    print(f"new leader {elected_after[0]:.2f} s after the kill; errors: {errors}")
    if elected_after[0] < ETCD_TIMEOUT_S - 2:  # an election within the calls' budget: nothing may fail
        assert errors == []
    else:  # a loaded machine elected slower than the registry's etcd deadline: such calls fail clearly, then resume
        assert all("UNAVAILABLE" in e and "etcd" in e for e in errors), errors
        assert after, "nothing succeeded after the new leader was elected"
    assert before and after and first_pull is not None
    # A new leader is serving: the turns at the end pull again.
    assert after[-1][1] == "pull" or any(o == "pull" for dt, o in after if dt > after[-1][0] - 2.0)
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
        await asyncio.sleep(1.0)
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

    took = await _until(reads_again, 30, "the registry never read from etcd again")
    fresh = await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session), timeout=10)
    assert fresh.session.revision == snapshot.session.revision  # the record survived the outage
    pulled = await _plan(sched, session, history + [5] * 20)
    pulled_after = time.monotonic() - t0
    assert pulled.decision == scheduler_pb2.DECISION_PULL, pulled.reason
    await _record(reg, session, d, history + [5] * 20 + [6])
    await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=late, lease_ttl_s=60), timeout=10)
    watch = await _until(lambda: scheduler.workers.get(late.worker_id) is not None, 30,
                         "the scheduler's worker view never saw a registration made after etcd came back")
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
        await _until(lambda: all(scheduler.workers.get(w.worker_id) for w in (p, d)), 20, "view never had the pair")
        session = f"lease-{uuid.uuid4().hex[:6]}"
        history = list(range(4000, 4060))
        await _record(reg, session, d, history)

        old = links[1].lease_id
        t = time.monotonic()
        assert await store.revoke_lease(old)  # the record goes with the lease
        await _until(lambda: scheduler.workers.get(d.worker_id) is None, 10, "the revoked worker stayed in view")
        await _until(lambda: links[1].lease_id != old and links[1].registered.is_set(), 20,
                     "the link never registered again")
        await _until(lambda: (w := scheduler.workers.get(d.worker_id)) is not None and w.lease_id == links[1].lease_id,
                     20, "the scheduler never saw the new registration")
        back = time.monotonic() - t
        assert (await store.get_worker(d.worker_id)).lease_id == links[1].lease_id
        # The registry's janitor may have dropped the session (its decode worker's record was deleted): then the
        # turn recomputes; a record still there is pulled from the worker as registered again.
        kept = await store.get_session("default", session)
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
            await asyncio.sleep(3 * 2)  # twice the lease TTL without a keep-alive
        finally:
            await cluster.arestart_all()
        t = time.monotonic()
        await _until(lambda: all(link.registrations > n and link.registered.is_set()
                                 for link, n in zip(links, before)), 30, "a link did not register again")
        again = time.monotonic() - t
        for link, w in zip(links, (p, d)):
            assert (await store.get_worker(w.worker_id)).lease_id == link.lease_id
            assert await store.keep_alive_once(link.lease_id) is not None
        await _until(lambda: all((w2 := scheduler.workers.get(w.worker_id)) is not None and w2.lease_id == link.lease_id
                                 for link, w in zip(links, (p, d))), 30, "the view never caught up")
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
