"""Load-aware worker choice on the real stack: a second prefill worker, one of the two kept busy.

The test starts one more prefill worker next to the shared stack's (the same ``kvshuttle worker`` command line the
stack uses, registered with the stack's registry), keeps it busy with long generations sent straight to its vLLM
gRPC server, and asks the scheduler for plans: while it is busy they go to the other prefill worker; once it is idle
a burst of plans uses both. It also checks that vLLM's ``GetLoads`` shows the load, and prints what it reports.
The extra worker is stopped at the end. Its start-up (~40-85 s on 2 cores) is most of the test's time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import subprocess
import time

import pytest
from kvshuttle.control_plane.load import parse_get_loads
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.e2e import EXTRA_STARTUP_TIMEOUT_S, start_prefill_worker, wait_registered
from tests.support.waits import until

pytestmark = pytest.mark.e2e
CONCURRENCY, MAX_TOKENS = 8, 256
PLANS = 10


class BackgroundLoad:
    """``CONCURRENCY`` loops, each sending one long generation after the other straight to a worker's vLLM."""

    def __init__(self, address: str, concurrency: int = CONCURRENCY, max_tokens: int = MAX_TOKENS):
        self.client = EngineClient(address, timeout_s=300)
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.tasks: list[asyncio.Task] = []
        self.finished = 0

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop(i), name=f"busy-{i}") for i in range(self.concurrency)]

    async def _loop(self, i: int) -> None:
        n = 0
        while True:
            prompt = [(7 * i + 13 * n + k) % 3000 + 10 for k in range(64)]  # no prefix shared between requests
            async for _ in self.client.generate(f"busy-{i}-{n}", prompt, max_tokens=self.max_tokens, ignore_eos=True,
                                                stream=False):
                pass
            self.finished += 1
            n += 1

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()  # cancels the RPCs: the server aborts the requests
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        errors = [r for r in results if not isinstance(r, asyncio.CancelledError | type(None))]
        self.tasks = []
        await self.client.close()
        assert not errors, f"background generations failed: {errors}"


async def visibility_lag(client: EngineClient, prompt_tokens: int, max_tokens: int) -> str:
    """How long after a request is sent GetLoads counts it, against when its first token arrives (for the record)."""
    seen: dict[str, float] = {}
    t0 = time.monotonic()

    async def poll() -> None:
        while True:
            if parse_get_loads(await client.get_loads()).running and "running" not in seen:
                seen["running"] = time.monotonic() - t0
            await asyncio.sleep(0.01)

    poller = asyncio.create_task(poll())
    try:
        prompt = [(k * 7) % 3000 + 10 for k in range(prompt_tokens)]
        async for _ in client.generate(f"lag-probe-{prompt_tokens}", prompt, max_tokens=max_tokens, ignore_eos=True):
            seen.setdefault("first token", time.monotonic() - t0)
        seen["done"] = time.monotonic() - t0
        await asyncio.sleep(0.1)  # the poller's last look (a measurement that is only printed)
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    return ", ".join(f"{k} at {v * 1000:.0f} ms" for k, v in seen.items()) + ("" if "running" in seen
                                                                                 else ", never counted as running")


def summary(raw: dict) -> str:
    r = (raw.get("loads") or [{}])[0]
    keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage",
            "num_waiting_uncached_tokens", "gen_throughput", "cache_hit_rate", "max_running_requests")
    return " ".join(f"{k}={r.get(k)}" for k in keys)


async def scheduler_sees(scheduler: scheduler_pb2_grpc.TransferSchedulerStub, worker_id: str, check) -> bool:
    """Whether the scheduler's load view of ``worker_id`` (GetStats) passes ``check``."""
    stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5.0)
    return any(check(row) for row in stats.loads if row.worker_id == worker_id)


async def plan_prefill_ids(scheduler: scheduler_pb2_grpc.TransferSchedulerStub, n: int, spacing_s: float,
                           seen: str = "") -> list[str]:
    """``n`` plans' prefill workers. ``seen``: each plan waits until the scheduler's load view has that worker
    reachable (on 2 loaded cores a vLLM worker's GetLoads can miss its deadline twice in a row; the scheduler then
    rightly avoids it, and the plan says nothing about load-awareness)."""
    picks, waited = [], 0
    for i in range(n):
        if seen and not await scheduler_sees(scheduler, seen, lambda row: row.reachable):
            waited += 1
            await until(lambda: scheduler_sees(scheduler, seen, lambda row: row.reachable), 30,
                        f"the scheduler to see {seen} reachable again")
        resp = await scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[11, 12, 13, 14 + i]),
                                        timeout=10.0)
        assert resp.decision == scheduler_pb2.DECISION_RECOMPUTE
        picks.append(resp.prefill.worker_id)
        if seen and resp.prefill.worker_id != seen:  # the scheduler's view when it did not pick ``seen``
            stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5.0)
            print(f"  plan {i} went to {resp.prefill.worker_id} ({resp.figures.worker_choice}); loads: "
                  + "; ".join(f"{r.worker_id} reachable={r.reachable} running={r.running} waiting={r.waiting} "
                              f"pending={r.pending} age={r.age_s:.2f}s" for r in stats.loads), flush=True)
        if i == 0:  # the scheduler's own account of its choice, where it gives one
            print(f"  first plan: {getattr(resp.figures, 'worker_choice', '') or resp.prefill.worker_id}", flush=True)
        await asyncio.sleep(spacing_s)
    if waited:
        print(f"  waited {waited} time(s) for the scheduler to see {seen} reachable", flush=True)
    return picks


async def test_busy_prefill_worker_is_avoided(stack):
    if stack.cfg.gpu_list:
        pytest.skip("starts an extra CPU worker")
    t_test = time.monotonic()
    name = f"prefill-{len(stack.workers)}"
    idle_ids = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
    assert len(idle_ids) == 1, "the stack has one prefill worker of its own"
    reg_channel = stack.channel(stack.registry_address)
    sched_channel = stack.channel(stack.scheduler_address)
    registry = registry_pb2_grpc.SessionRegistryStub(reg_channel)
    scheduler = scheduler_pb2_grpc.TransferSchedulerStub(sched_channel)
    child = await start_prefill_worker(stack, name)
    background: BackgroundLoad | None = None
    probe: EngineClient | None = None
    port = ""
    try:
        t0 = time.monotonic()
        extra = await wait_registered(registry, child, name, EXTRA_STARTUP_TIMEOUT_S)
        port = extra.grpc_address.rsplit(":", 1)[1]
        print(f"\n{name} registered {time.monotonic() - t0:.1f} s after its start ({extra.grpc_address})", flush=True)
        busy_id, idle_id = name, idle_ids[0]

        probe = EngineClient(extra.grpc_address, timeout_s=5)
        print(f"GetLoads idle:  {summary(await probe.get_loads())}", flush=True)
        for prompt_tokens, max_tokens in ((64, 64), (3000, 1)):
            print(f"one request ({prompt_tokens} prompt tokens, max_tokens {max_tokens}) on the idle worker: "
                  f"{await visibility_lag(probe, prompt_tokens, max_tokens)}", flush=True)
        background = BackgroundLoad(extra.grpc_address)
        background.start()
        t_load = time.monotonic()
        # vLLM's GetLoads numbers are its scheduler's last stats: they show the load once the engine has stepped.
        deadline, samples, first = t_load + 30, [], None
        while True:
            raw = await probe.get_loads()
            samples.append(raw)
            load = parse_get_loads(raw)
            if load.running + load.waiting and first is None:
                first = time.monotonic() - t_load
            if load.running + load.waiting >= CONCURRENCY // 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        print(f"GetLoads shows load {first or 0:.2f} s and {load.running} running, {load.waiting} waiting "
              f"{time.monotonic() - t_load:.2f} s after the load started", flush=True)
        for _ in range(5):  # a few more samples, to see the numbers move
            await asyncio.sleep(0.2)
            samples.append(await probe.get_loads())
        print("GetLoads busy:\n  " + "\n  ".join(summary(s) for s in samples[-6:]), flush=True)
        busiest = max((parse_get_loads(s) for s in samples), key=lambda x: x.running + x.waiting)
        assert busiest.running + busiest.waiting > 0, f"GetLoads never showed the load: {samples[-1]}"
        assert busiest.capacity_tokens > 0 and busiest.used_tokens > 0, samples[-1]

        # the scheduler's load monitor (a sample every 0.5 s) sees the busy worker's load
        await until(lambda: scheduler_sees(scheduler, busy_id, lambda row: row.running + row.waiting > 0), 10,
                    f"the scheduler to see {busy_id} busy")
        busy_picks = await plan_prefill_ids(scheduler, PLANS, spacing_s=0.25, seen=idle_id)
        counts = collections.Counter(busy_picks)
        print(f"plans while {busy_id} is busy: {dict(counts)}; GetLoads after: "
              f"{summary(await probe.get_loads())}", flush=True)
        assert background.tasks and not any(t.done() for t in background.tasks), "the load lasted through the plans"

        await background.stop()
        background = None
        async def idle_now() -> bool:
            load = parse_get_loads(await probe.get_loads())
            return load.running + load.waiting == 0

        await until(idle_now, 30, f"{busy_id} to report no load after the requests were aborted", interval_s=0.2)
        print(f"GetLoads after the load: {summary(await probe.get_loads())}", flush=True)
        # the scheduler sees both idle, with no turn of its own pending on either
        for worker_id in (busy_id, idle_id):
            await until(lambda: scheduler_sees(scheduler, worker_id, lambda row: row.reachable and row.running
                                               + row.waiting + row.pending == 0), 10, f"the scheduler to see {worker_id} idle")
        # A burst, faster than the monitor samples: the turns the scheduler itself sent must spread it.
        idle_picks = collections.Counter(await plan_prefill_ids(scheduler, PLANS, spacing_s=0.0))
        print(f"plans with both idle: {dict(idle_picks)}", flush=True)

        assert counts[idle_id] >= PLANS - 1, f"a busy prefill worker got plans: {dict(counts)}"
        # Not an even split: the selector weighs each worker's predicted prefill time too.
        assert set(idle_picks) == {busy_id, idle_id} and min(idle_picks.values()) >= 2, \
            f"a burst on idle prefill workers is not spread: {dict(idle_picks)}"
    finally:
        if background is not None:
            await background.stop()
        if probe is not None:
            await probe.close()
        t1 = time.monotonic()
        await child.stop()
        with contextlib.suppress(ValueError):
            stack.children.remove(child)
        print(f"{name} stopped in {time.monotonic() - t1:.1f} s; test took {time.monotonic() - t_test:.1f} s",
              flush=True)
        left = await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5.0)
        await reg_channel.close()
        await sched_channel.close()
        assert name not in [w.worker_id for w in left.workers], f"{name} still registered after it stopped"
        if port:
            strays = subprocess.run(["pgrep", "-af", f"grpc_server.*--port {port}"], capture_output=True,
                                    text=True).stdout.strip()
            assert not strays, f"{name}'s vLLM left running:\n{strays}"
