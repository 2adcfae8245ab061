"""Several scheduler replicas learn one world: outcomes reported to any replica go through etcd, and every replica
applies all of them in etcd's order (services/scheduler/learning.py). Real etcd, a real registry, real gRPC.

Three replicas get outcomes reported round robin and must end with exactly the same learned state; a replica in
"local" mode, given the same reports, must not (so the comparison can fail); a fourth replica started later begins
from the leader's snapshot and agrees too; a planner inside another process (the gateway's --scheduler local, here
an ``InProcessScheduler``) is one more replica of the same log.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid

import grpc
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.tls import TlsConfig
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.in_process import InProcessScheduler, embedded_config
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.scheduler import first_plan, worker
from tests.support.waits import until

PREFILL, DECODE = ("p0", "p1", "p2"), ("d0", "d1")


def outcomes(n: int, seed: int) -> list[scheduler_pb2.ReportOutcomeRequest]:
    """A varied stream: pulls and recomputes of many sizes over 3 prefill workers and 2 decode sources."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, d = rng.choice(PREFILL), rng.choice(DECODE)
        prompt = rng.choice((64, 300, 1200, 4000)) + rng.randrange(50)
        speed = 1.0 + PREFILL.index(p) * 0.5
        if rng.random() < 0.5:
            pulled = prompt - rng.randrange(1, 40)
            out.append(scheduler_pb2.ReportOutcomeRequest(
                prefill_worker_id=p, decode_worker_id=d, prompt_tokens=prompt, pulled_tokens=pulled,
                computed_tokens=prompt - pulled, prefill_ms=8 + 0.01 * pulled + speed * 0.05 * (prompt - pulled),
                source_worker_id=d, decision=scheduler_pb2.DECISION_PULL, policy="threshold",
                session_id=f"s{i % 17}"))
        else:
            out.append(scheduler_pb2.ReportOutcomeRequest(
                prefill_worker_id=p, decode_worker_id=d, prompt_tokens=prompt, computed_tokens=prompt,
                prefill_ms=10 + speed * 0.05 * prompt + rng.random(), pullable_tokens=prompt // 2,
                source_worker_id=d, decision=scheduler_pb2.DECISION_RECOMPUTE, policy="threshold",
                session_id=f"s{i % 17}"))
    return out


class Replicas:
    def __init__(self, etcd: str):
        self.etcd = etcd
        self.prefix = f"/learn-{uuid.uuid4().hex[:6]}/"
        self.services: list[SchedulerService] = []
        self.channels: list[grpc.aio.Channel] = []

    async def start_registry(self) -> None:
        self.registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=self.etcd,
                                                   key_prefix=self.prefix, expiry_margin_s=5))
        self.channels.append(client_channel(self.registry.address))
        self.reg = registry_pb2_grpc.SessionRegistryStub(self.channels[-1])
        for i, name in enumerate((*PREFILL, *DECODE)):
            role = common_pb2.WORKER_ROLE_PREFILL if name.startswith("p") else common_pb2.WORKER_ROLE_DECODE
            await self.reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                worker=worker(name, role, 8100 + i), lease_ttl_s=60))

    def config(self, **settings) -> SchedulerConfig:
        return SchedulerConfig(**{"listen": "127.0.0.1:0", "registry": self.registry.address, "etcd_endpoints": self.etcd,
                                  "key_prefix": self.prefix, "load_poll_interval_s": 0, "policy": "threshold",
                                  "kv_manage": False, "learning_snapshot_interval_s": 0.3, **settings})

    async def add(self, **settings) -> tuple[SchedulerService, scheduler_pb2_grpc.TransferSchedulerStub]:
        service = SchedulerService(self.config(**settings))
        await service.start()
        self.services.append(service)
        self.channels.append(client_channel(service.address))
        return service, scheduler_pb2_grpc.TransferSchedulerStub(self.channels[-1])

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        for service in self.services:
            await service.stop()
        await self.registry.stop(grace=0.5)


@pytest.fixture
async def replicas(etcd):
    r = Replicas(etcd)
    await r.start_registry()
    yield r
    await r.stop()


def applied(service: SchedulerService) -> int:
    return service.learning.applied


async def report_all(stubs, reports) -> list[bool]:
    """Each report to the next replica (round robin), eight at a time, as several gateways would send them."""
    results: list[bool] = []
    for start in range(0, len(reports), 8):
        chunk = reports[start:start + 8]
        answers = await asyncio.gather(*(stubs[(start + i) % len(stubs)].ReportOutcome(r, timeout=10)
                                         for i, r in enumerate(chunk)))
        results.extend(a.learned for a in answers)
    return results


async def test_three_replicas_fit_the_same_model_from_outcomes_reported_to_any_of_them(replicas):
    trio = [await replicas.add() for _ in range(3)]
    loner, loner_stub = await replicas.add(learning="local")
    services, stubs = [s for s, _ in trio], [stub for _, stub in trio]
    reports = outcomes(240, seed=7)

    learned = await report_all([*stubs, loner_stub], reports)
    assert all(learned)  # each answer came after its replica had read its own outcome back from etcd
    for service in services:
        await until(lambda s=service: applied(s) == 180, 10, "every shared outcome applied on every replica")
    assert applied(loner) == 60  # "local": only what was reported to it

    states = [s.planner.learned_state() for s in services]
    assert states[0] == states[1] == states[2]
    assert states[0]["reported"] == 180
    assert loner.planner.learned_state() != states[0]
    stats = [await stub.GetStats(scheduler_pb2.GetStatsRequest()) for stub in stubs]
    for s in stats:
        assert s.learning.mode == "shared" and s.learning.applied_outcomes == 180
        assert s.learning.pending_outcomes == s.learning.dropped_outcomes == s.learning.missed_batches == 0
        assert list(s.compute) == list(stats[0].compute) and list(s.transfers) == list(stats[0].transfers)
    assert len(stats[0].compute) == 3 and len(stats[0].transfers) == 6
    assert len({s.learning.replica for s in stats}) == 3
    assert (await loner_stub.GetStats(scheduler_pb2.GetStatsRequest())).learning.mode == "local"

    # Identical fits give identical predictions: every replica prices a turn the same.
    model = [s.planner.model for s in services]
    for p in (*PREFILL, "p-new"):
        for d in (*DECODE, "d-new"):
            predictions = {m.predict(p, prompt_tokens=3000, reusable_tokens=2900, source=d) for m in model}
            assert len(predictions) == 1

    # Where a session's prefix lives is shared too: the replica that plans its next turn knows it, whoever heard.
    last = {}
    for i, r in enumerate(reports):
        if i % 4 != 3:  # the shared ones (the fourth went to the local replica)
            last[r.session_id] = r.prefill_worker_id
    for service in services:
        for session, prefill in last.items():
            assert service.planner.cache_hints.worker_of(("default", session)) == prefill

    # A replica started now begins from the leader's snapshot and the batches after it, and agrees exactly.
    await until(lambda: any(s.learning.written_snapshot >= s.learning.applied_revision for s in services), 10,
                "a snapshot of the current state")
    late, late_stub = await replicas.add()
    await until(lambda: late.learning.synced.is_set(), 10, "the late replica caught up")
    assert late.learning.loaded_snapshot > 0
    more = outcomes(40, seed=8)
    assert all(await report_all([late_stub, *stubs], more))
    for service in (*services, late):
        await until(lambda s=service: s.learning.applied_revision == max(x.learning.applied_revision
                                                                         for x in (*services, late)), 10,
                    "the same revision applied everywhere")
    assert late.learning.missed == 0
    final = [s.planner.learned_state() for s in (*services, late)]
    assert all(state == final[0] for state in final)
    assert final[0]["reported"] == 220


async def test_an_in_process_planner_is_one_more_replica_and_bad_outcomes_are_never_shared(replicas):
    (standalone, stub) = await replicas.add()
    cfg = embedded_config(f"--etcd-endpoints {replicas.etcd} --key-prefix {replicas.prefix} "
                          "--load-poll-interval-s 0 --policy threshold --no-kv-manage "
                          "--learning-snapshot-interval-s 0.3",
                          registry=replicas.registry.address, tls=TlsConfig(), environ={})
    assert cfg.listen == "127.0.0.1:0" and cfg.registry == replicas.registry.address
    embedded = SchedulerService(cfg)
    await embedded.start()
    replicas.services.append(embedded)
    local = InProcessScheduler(embedded.planning)

    # Plans in-process: the same answer type as over gRPC, and a refusal is the same AioRpcError.
    plan = await first_plan(local, scheduler_pb2.PlanTurnRequest(session_id="s-in", prompt_token_ids=[1, 2, 3]))
    assert plan.prefill.worker_id in PREFILL and plan.decode.worker_id in DECODE
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await local.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    reports = outcomes(60, seed=3)
    assert all(await report_all([local, stub], reports))
    for service in (standalone, embedded):
        await until(lambda s=service: applied(s) == 60, 10, "every outcome applied on both")
    assert standalone.planner.learned_state() == embedded.planner.learned_state()

    # An outcome no replica could learn from is refused where it is reported, before it is shared.
    bad = scheduler_pb2.ReportOutcomeRequest(prefill_worker_id="p0", prompt_tokens=10, computed_tokens=10,
                                             prefill_ms=math.nan, decision=scheduler_pb2.DECISION_RECOMPUTE)
    for target in (stub, local):
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await target.ReportOutcome(bad, timeout=5)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_ms" in invalid.value.details()
    assert (await stub.GetStats(scheduler_pb2.GetStatsRequest())).learning.applied_outcomes == 60


async def test_a_replica_closes_old_client_connections_so_gateways_resolve_its_name_again(replicas):
    """--max-connection-age-s: the scheduler closes each client connection after that age (GOAWAY), so a gateway
    dialing dns:///peers resolves the name again and finds replicas added since; 0 keeps connections open."""
    aged, aged_stub = await replicas.add(max_connection_age_s=1.0)
    kept, kept_stub = await replicas.add(max_connection_age_s=0.0)
    for stub in (aged_stub, kept_stub):
        await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    aged_channel, kept_channel = replicas.channels[-2], replicas.channels[-1]
    assert aged_channel.get_state() == kept_channel.get_state() == grpc.ChannelConnectivity.READY
    await until(lambda: aged_channel.get_state() == grpc.ChannelConnectivity.IDLE, 10, "the aged connection closed")
    assert kept_channel.get_state() == grpc.ChannelConnectivity.READY
    await aged_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)  # and the next call simply reconnects
