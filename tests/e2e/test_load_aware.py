"""Load- and cache-aware worker choice on the real stack: a second prefill worker next to the stack's.

The module starts one more prefill worker (the same ``kvshuttle worker`` command line the stack uses, registered with
the stack's registry, publishing its KV events to the stack's KV feed) and shares it between its tests:

- load: one of the two is kept busy with long generations sent straight to its vLLM gRPC server; while it is busy
  the scheduler's plans go to the other; once it is idle a burst of plans uses both. It also checks that vLLM's
  ``GetLoads`` shows the load, and prints what it reports;
- cache: sessions that share a system prompt go to the prefill worker whose prefix cache holds it, and the
  scheduler's predicted hit equals what that worker's vLLM counted.

The extra worker is stopped at the end. Its start-up (~40-85 s on 2 cores) is most of the module's time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import subprocess
import time

import pytest
from kvshuttle.control_plane.load import parse_get_loads
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.e2e import (
    EXTRA_STARTUP_TIMEOUT_S,
    chat,
    new_session,
    start_prefill_worker,
    user_turn,
    wait_registered,
)
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


@dataclasses.dataclass
class Extra:
    """The second prefill worker the module's tests share."""

    name: str
    worker: common_pb2.Worker
    child: object


@pytest.fixture(scope="module")
async def extra(stack):
    """One more prefill worker next to the stack's, for the module; stopped (and checked gone) at its end."""
    if stack.cfg.gpu_list:
        pytest.skip("starts an extra CPU worker")
    name = f"prefill-{len(stack.workers)}"
    assert len([w for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]) == 1, \
        "the stack has one prefill worker of its own"
    reg_channel = stack.channel(stack.registry_address)
    registry = registry_pb2_grpc.SessionRegistryStub(reg_channel)
    child = await start_prefill_worker(stack, name)
    port = ""
    try:
        t0 = time.monotonic()
        worker = await wait_registered(registry, child, name, EXTRA_STARTUP_TIMEOUT_S)
        port = worker.grpc_address.rsplit(":", 1)[1]
        print(f"\n{name} registered {time.monotonic() - t0:.1f} s after its start ({worker.grpc_address})", flush=True)
        yield Extra(name, worker, child)
    finally:
        t1 = time.monotonic()
        await child.stop()
        with contextlib.suppress(ValueError):
            stack.children.remove(child)
        print(f"{name} stopped in {time.monotonic() - t1:.1f} s", flush=True)
        left = await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5.0)
        await reg_channel.close()
        assert name not in [w.worker_id for w in left.workers], f"{name} still registered after it stopped"
        if port:
            strays = subprocess.run(["pgrep", "-af", f"grpc_server.*--port {port}"], capture_output=True,
                                    text=True).stdout.strip()
            assert not strays, f"{name}'s vLLM left running:\n{strays}"


async def test_busy_prefill_worker_is_avoided(stack, extra):
    t_test = time.monotonic()
    idle_ids = [w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
    sched_channel = stack.channel(stack.scheduler_address)
    scheduler = scheduler_pb2_grpc.TransferSchedulerStub(sched_channel)
    background: BackgroundLoad | None = None
    probe: EngineClient | None = None
    try:
        busy_id, idle_id = extra.name, idle_ids[0]

        probe = EngineClient(extra.worker.grpc_address, timeout_s=5)
        print(f"GetLoads idle:  {summary(await probe.get_loads())}", flush=True)
        for prompt_tokens, max_tokens in ((64, 64), (3000, 1)):
            print(f"one request ({prompt_tokens} prompt tokens, max_tokens {max_tokens}) on the idle worker: "
                  f"{await visibility_lag(probe, prompt_tokens, max_tokens)}", flush=True)
        background = BackgroundLoad(extra.worker.grpc_address)
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
        # every worker's load reaches the scheduler through the load feed (its agent polls it): none is polled
        stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5.0)
        sources = {r.worker_id: r.source for r in stats.loads}
        live = [w.worker_id for w in stack.workers] + [busy_id]  # (workers of other tests may be gone: polled)
        assert all(sources.get(w) == "feed" for w in live), sources
        assert stats.load_feed.following and stats.load_feed.fed_workers >= len(live), stats.load_feed
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
        await sched_channel.close()
        print(f"test took {time.monotonic() - t_test:.1f} s", flush=True)


# -- cache-aware first turns: the KV feed's index on the real stack ---------------------------------------------------

def system_prompt(n: int) -> dict:
    """A shared system prompt several KV blocks long (128-token blocks on vLLM-CPU), different for each ``n``."""
    source = inspect.getsource(collections)
    return {"role": "system", "content": f"Agent profile {n}. Follow this reference:\n"
                                         f"{source[n * 2400:(n + 1) * 2400]}"}


def worker_counters(stack, worker_id: str) -> dict[str, float]:
    """vLLM's own prompt-token counter on one prefill worker, by source (local_cache_hit, local_compute, ...)."""
    return stack.prefill_prompt_tokens_by_source([worker_id])


async def index_blocks(scheduler: scheduler_pb2_grpc.TransferSchedulerStub) -> dict[str, int]:
    stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5.0)
    assert stats.HasField("kv_index"), "the stack's scheduler follows the KV feed"
    stale = {w.worker_id: w.stale_reason for w in stats.kv_index.workers if w.stale_reason}
    assert not stale, f"the index distrusts a worker: {stale}"
    return {w.worker_id: w.blocks for w in stats.kv_index.workers}


async def test_first_turns_land_on_the_prefill_worker_that_caches_their_prefix(stack, extra):
    """Two prefill workers with their prefix caches on, the KV feed on (the stack's default). Sessions with one of a
    few shared system prompts: each prompt's first session lands wherever the load says; every later session's first
    turn with that system prompt must land on the prefill worker holding it, and the scheduler's predicted cache hit
    must equal what that worker's vLLM counted as cache hits for the turn (its own Prometheus counter) and reported
    (``cached_tokens``)."""
    import httpx

    prefill_ids = sorted(w.worker_id for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL)
    prefill_ids.append(extra.name)
    sched_channel = stack.channel(stack.scheduler_address)
    scheduler = scheduler_pb2_grpc.TransferSchedulerStub(sched_channel)
    try:
        await until(lambda: scheduler_sees(scheduler, extra.name, lambda row: row.reachable), 30,
                    f"the scheduler to see {extra.name}")
        addresses = {w.worker_id: w.grpc_address for w in stack.workers} | {extra.name: extra.worker.grpc_address}
        await index_shows_flushed(scheduler, {w: addresses[w] for w in prefill_ids})
        holder: dict[int, str] = {}
        checked = 0
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
            for n in range(2):
                background = None
                if n == 1:  # the first holder is kept busy, so this system prompt's first session goes to the other
                    background = BackgroundLoad(addresses[holder[0]], concurrency=4)
                    background.start()
                    await until(lambda: scheduler_sees(scheduler, holder[0],
                                                       lambda row: row.running + row.waiting > 0), 30,
                                f"the scheduler to see {holder[0]} busy")
                try:
                    before = await index_blocks(scheduler)
                    body = (await chat(client, new_session("cache-first"), [system_prompt(n), user_turn(1)])).json()
                finally:
                    if background is not None:
                        await background.stop()
                kv = body["kvshuttle"]
                holder[n] = kv["prefill_worker"]
                print(f"system prompt {n}: first session on {holder[n]} ({kv['worker_choice']}); predicted hit "
                      f"{kv['predicted_cached_tokens']}, cached {body['usage']['prompt_tokens_details']['cached_tokens']}",
                      flush=True)
                # the worker's new blocks reach the scheduler's index through the feed
                await until(lambda: _grew(scheduler, before, holder[n]), 15,
                            f"the index to show {holder[n]}'s new blocks")
            assert holder[0] != holder[1], f"the busy worker got the second system prompt: {holder}"
            for worker_id in prefill_ids:  # both idle again before the next sessions
                await until(lambda: scheduler_sees(scheduler, worker_id, lambda row: row.reachable and row.running
                                                   + row.waiting + row.pending == 0), 30,
                            f"the scheduler to see {worker_id} idle")
            for n, worker_id in holder.items():
                counters_before = worker_counters(stack, worker_id)
                stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5.0)
                view = ("index: " + ", ".join(f"{w.worker_id} {w.blocks} blocks" for w in stats.kv_index.workers)
                        + "; loads: " + ", ".join(f"{r.worker_id} {r.running}+{r.waiting}+{r.pending}"
                                                  for r in stats.loads))
                print(f"before system prompt {n}'s next session: {view}", flush=True)
                body = (await chat(client, new_session("cache-next"), [system_prompt(n), user_turn(2)])).json()
                kv, usage = body["kvshuttle"], body["usage"]
                counted = worker_counters(stack, worker_id).get("local_cache_hit", 0.0) \
                    - counters_before.get("local_cache_hit", 0.0)
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                print(f"system prompt {n}: next session on {kv['prefill_worker']} ({kv['worker_choice']}); "
                      f"predicted {kv['predicted_cached_tokens']}, reported {cached}, vLLM counted {counted:.0f} of "
                      f"{usage['prompt_tokens']} prompt tokens", flush=True)
                assert kv["prefill_worker"] == worker_id, f"system prompt {n} is cached on {worker_id} ({view}): {kv}"
                assert kv["decision"] == "recompute" and kv["pulled_tokens"] == 0
                assert kv["predicted_cached_tokens"] >= 512, "the system prompt spans several blocks"
                assert kv["predicted_cached_tokens"] == cached == counted
                checked += 1
        assert checked == len(holder) >= 2
    finally:
        await sched_channel.close()


async def index_shows_flushed(scheduler, addresses: dict[str, str]) -> None:
    """Flush each prefill worker's prefix cache and wait until the scheduler's index shows it empty. vLLM publishes KV
    events only when its engine steps, so the ``AllBlocksCleared`` of a flush on an idle engine waits for its next
    request: each worker gets one prompt shorter than a block (it stores no block) to step once."""
    from kvshuttle.services.engine.client import EngineClient

    for worker_id, address in addresses.items():
        client = EngineClient(address, timeout_s=60)
        try:
            await until(client.flush_cache, 40, f"{worker_id} to accept FlushCache", interval_s=0.5)
            async for _ in client.generate(f"index-settle-{worker_id}", [11, 12, 13, 14], max_tokens=1, stream=False):
                pass
        finally:
            await client.close()
        await until(lambda: _blocks_of(scheduler, worker_id, 0), 15, f"the index to show {worker_id} flushed")


async def _blocks_of(scheduler, worker_id: str, blocks: int) -> bool:
    return (await index_blocks(scheduler)).get(worker_id, 0) == blocks


async def _grew(scheduler, before: dict[str, int], worker_id: str) -> bool:
    return (await index_blocks(scheduler)).get(worker_id, 0) > before.get(worker_id, 0)
