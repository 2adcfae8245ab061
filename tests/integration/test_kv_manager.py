"""The scheduler's decode-KV manager against a real etcd, a real registry and scheduler, and stand-in engines.

The decode worker's engine reports the KV usage the test sets (GetLoads); the prefill worker's engine records the
freeing reads it gets. Checked: nothing is freed under the high-water mark; past it, the least valuable handles are
freed (claimed with the reason, then read through P) down to the low-water mark; a session idle past the limit is
freed; a turn planned on a full decode worker gets room first; a second scheduler replica reads the same view but
frees nothing while the first one leads.
"""

from __future__ import annotations

import json
import uuid

import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.fake_engine import FakeEngineServer
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)
BS = 16
CAPACITY = 100 * BS  # the decode worker's KV cache: 100 blocks


def worker(worker_id: str, role: int, address: str, port: int) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"engine-{worker_id}", grpc_address=address,
                             nixl_host="127.0.0.1", nixl_port=port, block_size=BS, kv_blocks_ttl_s=600, model="tiny",
                             kv_bytes_per_token=4096)


def handle_for(w: common_pb2.Worker, covered: int) -> str:
    return json.dumps({"do_remote_decode": True, "remote_engine_id": w.engine_id, "remote_host": w.nixl_host,
                       "remote_port": w.nixl_port, "remote_num_tokens": covered,
                       "remote_block_ids": [list(range(100, 100 + -(-covered // BS)))]})


class Cluster:
    """A registry, P and D stand-ins registered, and schedulers on them (``add_scheduler``)."""

    def __init__(self, etcd: str):
        self.etcd, self.prefix = etcd, f"/kvm-{uuid.uuid4().hex[:6]}/"
        self.p_engine, self.d_engine = FakeEngineServer(), FakeEngineServer()
        self.schedulers: list[SchedulerService] = []
        self.channels = []

    async def start(self) -> None:
        for e in (self.p_engine, self.d_engine):
            await e.start()
        self.d_engine.engine.capacity_tokens = CAPACITY
        self.registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=self.etcd,
                                                   key_prefix=self.prefix, expiry_margin_s=5))
        self.reg = registry_pb2_grpc.SessionRegistryStub(self._channel(self.registry.address))
        self.p = worker("p0", common_pb2.WORKER_ROLE_PREFILL, self.p_engine.address, 7901)
        self.d = worker("d0", common_pb2.WORKER_ROLE_DECODE, self.d_engine.address, 7902)
        for w in (self.p, self.d):
            await self.reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))

    def _channel(self, address: str):
        channel = client_channel(address)
        self.channels.append(channel)
        return channel

    async def add_scheduler(self, **settings) -> scheduler_pb2_grpc.TransferSchedulerStub:
        settings = {"kv_idle_limit_s": 0, "kv_held_budget": 0, **settings}
        cfg = SchedulerConfig(listen="127.0.0.1:0", registry=self.registry.address, etcd_endpoints=self.etcd,
                              key_prefix=self.prefix, load_poll_interval_s=0.1, kv_interval_s=0.2, policy="threshold",
                              **settings)
        cfg.validate()
        service = SchedulerService(cfg)
        await service.start()
        self.schedulers.append(service)
        return scheduler_pb2_grpc.TransferSchedulerStub(self._channel(service.address))

    async def record(self, session: str, tokens: int, turns: int = 1) -> common_pb2.Session:
        history = list(range(1, tokens + 2))
        for t in range(turns):
            rec = await self.reg.RecordTurn(registry_pb2.RecordTurnRequest(
                session_id=session, decode_worker_id="d0", token_ids=history[: tokens + 1 - (turns - 1 - t)],
                kv_transfer_params_json=handle_for(self.d, tokens - (turns - 1 - t))))
        return rec.session

    async def get(self, session: str) -> common_pb2.Session:
        """The record, with its history's ids (the history store's)."""
        return (await self.reg.GetSession(registry_pb2.GetSessionRequest(session_id=session,
                                                                          include_token_ids=True))).session

    def freeing_reads(self) -> list:
        return [r for r in self.p_engine.engine.requests if r.request_id.startswith("kv-free-")]

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        for s in self.schedulers:
            await s.stop()
        await self.registry.stop(grace=0.5)
        for e in (self.p_engine, self.d_engine):
            await e.stop()


@pytest.fixture
async def cluster(etcd):
    c = Cluster(etcd)
    await c.start()
    yield c
    await c.stop()


async def stats(sched) -> scheduler_pb2.DecodeKvStats | None:
    resp = await sched.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    return next((row for row in resp.decode_kv if row.worker_id == "d0"), None)


def count_rounds(service: SchedulerService) -> list[int]:
    """Count the KV manager's completed rounds (the scheduler runs in this process): ``[n]``, kept up to date."""
    rounds, run_once = [0], service.kv.run_once

    async def counted() -> None:
        await run_once()
        rounds[0] += 1

    service.kv.run_once = counted  # the manager's loop looks it up each round
    return rounds


async def more_rounds(rounds: list[int], n: int = 3) -> None:
    """Wait until the KV manager has completed ``n`` more rounds (each one would have freed what it was going to)."""
    start = rounds[0]
    await until(lambda: rounds[0] >= start + n, what=f"{n} more KV manager rounds")


async def test_pressure_frees_the_least_valuable_handles_down_to_the_low_water_mark(cluster):
    # 8 sessions of 10 blocks each: 80 of 100 blocks held. One of them is an old, long-silent one-turn session.
    sessions = [f"s{i}" for i in range(8)]
    for sid in sessions:
        await cluster.record(sid, 10 * BS - 1, turns=3)
    sched = await cluster.add_scheduler()
    rounds = count_rounds(cluster.schedulers[-1])
    cluster.d_engine.engine.used_tokens = 70 * BS  # under the 80% high-water mark: nothing to do
    await until(lambda: _held(sched, 8), what="the 8 sessions held")
    await until(lambda: _used(sched, 70 * BS), what="the engine's usage sampled")
    await more_rounds(rounds)  # rounds that saw 70% in use: nothing freed
    row = await stats(sched)
    assert not cluster.freeing_reads() and sum(row.evictions.values()) == 0
    assert (row.held_tokens, row.held_blocks, row.held_bytes) == (80 * BS, 80, 80 * BS * 4096)
    assert row.capacity_tokens == CAPACITY

    cluster.d_engine.engine.used_tokens = 85 * BS  # past it: free down to 60% = 60 blocks, i.e. 3 handles
    row = await until(lambda: _evicted(sched, "pressure", 3), what="3 handles freed under pressure")
    reads = cluster.freeing_reads()
    assert len(reads) == 3
    for read in reads:  # each read is of the handle's first block only (then D frees the whole handle)
        params = json.loads(read.kv_transfer_params_json)
        assert params["remote_num_tokens"] == BS and params["remote_block_ids"] == [[100]]
        assert list(read.tokenized.input_ids) == list(range(1, BS + 2))
    freed = [sid for sid in sessions if (await cluster.get(sid)).kv_freed]
    assert len(freed) == 3
    for sid in freed:  # the records stay (exact ids for the next turn), marked and claimed
        rec = await cluster.get(sid)
        assert rec.claimed and rec.kv_freed == "pressure" and rec.token_ids
    # The engine still reports 85%: the rounds after count the frees it has not shown yet, and free no more.
    await more_rounds(rounds)
    assert len(cluster.freeing_reads()) == 3
    assert (await stats(sched)).held_sessions == 5

    # The next turn of a freed session recomputes and says why; it counts as a pull lost.
    plan = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=freed[0],
                                                              prompt_token_ids=list(range(1, 10 * BS + 20))))
    assert plan.decision == scheduler_pb2.DECISION_RECOMPUTE and plan.reason_code == "kv_freed_pressure", plan.reason
    assert plan.reason.startswith("KV freed under pressure")
    assert dict((await stats(sched)).pulls_lost) == {"pressure": 1}


async def test_an_idle_session_is_freed_and_its_next_turn_says_so(cluster):
    await cluster.record("quiet", 4 * BS - 1)
    sched = await cluster.add_scheduler(kv_idle_limit_s=1.5)
    await until(lambda: _evicted(sched, "idle", 1), 15, "the idle session freed")
    rec = await cluster.get("quiet")
    assert rec.kv_freed == "idle"
    plan = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id="quiet",
                                                              prompt_token_ids=list(range(1, 4 * BS + 20))))
    assert (plan.reason_code, plan.reason) == ("kv_freed_idle", "KV freed: idle")


async def test_a_turn_on_a_full_decode_worker_gets_room_first(cluster):
    for sid in ("a", "b", "c"):
        await cluster.record(sid, 20 * BS - 1)
    # pressure off (high water 100%): only room for the turn frees anything
    sched = await cluster.add_scheduler(kv_high_water=1.0, kv_low_water=0.9)
    cluster.d_engine.engine.used_tokens = CAPACITY - 5 * BS  # 5 blocks free
    await until(lambda: _held(sched, 3), what="the 3 sessions held")
    await until(lambda: _capacity_known(sched), what="the engine's capacity sampled")
    plan = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id="new", prompt_token_ids=list(range(200)),
                                                              max_tokens=8 * BS))  # 208 + 128 tokens: 21 blocks
    assert plan.decode.worker_id == "d0"
    row = await stats(sched)
    assert row.evictions["room"] == 1 and len(cluster.freeing_reads()) == 1, row  # one 20-block handle is enough


async def test_one_replica_frees_while_another_only_reads(cluster):
    for i in range(6):
        await cluster.record(f"r{i}", 10 * BS - 1)
    first = await cluster.add_scheduler()
    await until(lambda: _leading(first), what="the first replica leading")
    second = await cluster.add_scheduler()
    cluster.d_engine.engine.used_tokens = 90 * BS
    await until(lambda: _evicted(first, "pressure", 3), what="3 handles freed under pressure")
    resp = await second.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert resp.kv_managed and not resp.kv_leading
    row = await until(lambda: stats(second), what="the second replica's view")  # may come after the first's frees
    assert sum(row.evictions.values()) == 0
    assert len(cluster.freeing_reads()) == 3


async def _held(sched, n: int) -> bool:
    row = await stats(sched)
    return row is not None and row.held_sessions == n


async def _used(sched, tokens: int) -> bool:
    row = await stats(sched)
    return row is not None and row.used_tokens == tokens


async def _capacity_known(sched) -> bool:
    row = await stats(sched)
    return row is not None and row.capacity_tokens > 0


async def _evicted(sched, reason: str, n: int):
    row = await stats(sched)
    return row if row is not None and row.evictions[reason] >= n else None


async def _leading(sched) -> bool:
    return (await sched.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)).kv_leading


async def test_a_handle_is_read_free_by_a_prefill_worker_of_its_decode_workers_model(cluster):
    """Issue #37: with several models' workers in the fleet, a freeing read goes to a prefill worker of the decode
    worker's model: another model's P must never pull D's KV (other shapes). Here the other model's idle P sorts
    first and would otherwise be the one asked."""
    other = FakeEngineServer()
    await other.start()
    try:
        await cluster.reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=common_pb2.Worker(
            worker_id="a-other", role=common_pb2.WORKER_ROLE_PREFILL, engine_id="engine-other",
            grpc_address=other.address, nixl_host="127.0.0.1", nixl_port=7903, block_size=BS, kv_blocks_ttl_s=600,
            model="other", kv_bytes_per_token=4096), lease_ttl_s=30))
        await cluster.record("quiet", 4 * BS - 1)
        sched = await cluster.add_scheduler(kv_idle_limit_s=1.5)
        await until(lambda: _evicted(sched, "idle", 1), 15, "the idle session freed")
        assert len(cluster.freeing_reads()) == 1
        assert not [r for r in other.engine.requests if r.request_id.startswith("kv-free-")]
    finally:
        await other.stop()
