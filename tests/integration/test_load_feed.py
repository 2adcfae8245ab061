"""The load feed through a real Redis: a worker's agent (workers/load_feed.py) polls its engine's GetLoads (a real
gRPC server on loopback) and publishes each sample; a LoadMonitor reading the feed takes the fed workers' loads from
it and stops polling them, keeps polling the workers that do not publish, and polls a worker again once its samples
stop. A fed worker whose engine stops answering turns unreachable from its agent's samples alone."""

from __future__ import annotations

import asyncio

import pytest
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.scheduler.load_monitor import FEED_STALE_MIN_S, LoadMonitor
from kvshuttle.services.store.load_feed import LoadFeedPublisher
from kvshuttle.v1 import scheduler_pb2
from kvshuttle.workers.load_feed import LoadFeedAgent

from tests.support.load_servers import Event, LoadServer, put, worker
from tests.support.waits import until

INTERVAL = 0.05


class CountingClients:
    """The monitor's client factory: counts the monitor's own GetLoads polls per address."""

    def __init__(self):
        self.polls: dict[str, int] = {}

    def __call__(self, address: str, timeout_s: float) -> EngineClient:
        client = EngineClient(address, timeout_s=timeout_s)
        get_loads = client.get_loads

        async def counted() -> dict:
            self.polls[address] = self.polls.get(address, 0) + 1
            return await get_loads()

        client.get_loads = counted  # type: ignore[method-assign]
        return client


@pytest.fixture
def prefix(request) -> str:
    return f"/loadfeed-{request.node.name[:40]}/"


async def test_fed_workers_are_not_polled_and_a_silent_one_is_polled_again(redis_url, prefix):
    fed_server, polled_server = LoadServer(num_running_reqs=3, num_used_tokens=4000), LoadServer(num_waiting_reqs=1)
    for s in (fed_server, polled_server):
        await s.start()
    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[]))
    clients = CountingClients()
    monitor = LoadMonitor(view, interval_s=INTERVAL, timeout_s=0.3, pending_grace_s=0.0, client_factory=clients,
                          feed_url=redis_url, feed_key_prefix=prefix)
    agent = LoadFeedAgent("p-fed", EngineClient(fed_server.address, timeout_s=1.0),
                          LoadFeedPublisher(redis_url, prefix), interval_s=INTERVAL, timeout_s=0.3)
    monitor.start()
    agent_task = None
    try:
        put(view, worker("p-fed", fed_server.address), worker("p-polled", polled_server.address))
        await until(lambda: monitor.feed.connected, what="the monitor to follow the feed")
        agent_task = asyncio.create_task(agent.run())
        await until(lambda: monitor.source("p-fed") == "feed", what="p-fed's load from the feed")
        fed = monitor.loads()["p-fed"]
        assert (fed.running, fed.used_tokens, fed.capacity_tokens, fed.reachable) == (3, 4000, 10_000, True)
        assert monitor.source("p-polled") == "poll" and monitor.loads()["p-polled"].waiting == 1

        # the fed worker is not polled by the monitor any more; the other one is, every interval
        before = dict(clients.polls)
        fed_server.servicer.numbers["num_running_reqs"] = 5
        await until(lambda: monitor.loads()["p-fed"].running == 5, what="the new number through the feed")
        await asyncio.sleep(10 * INTERVAL)
        assert clients.polls.get(fed_server.address, 0) == before.get(fed_server.address, 0), clients.polls
        assert clients.polls[polled_server.address] > before[polled_server.address] + 3
        stats = scheduler_pb2.LoadFeedStats()
        monitor.fill_feed_stats(stats)
        assert stats.following and stats.samples >= 2 and (stats.fed_workers, stats.polled_workers) == (1, 1)

        # its engine stops answering: the agent publishes the failures, the worker turns unreachable (still fed)
        await fed_server.stop()
        await until(lambda: not monitor.loads()["p-fed"].reachable, what="p-fed unreachable from its agent's samples")
        assert monitor.healthy("p-fed") is False and agent.engine_failures >= 2
        assert clients.polls.get(fed_server.address, 0) == before.get(fed_server.address, 0)
        await fed_server.start()
        await until(lambda: monitor.loads()["p-fed"].reachable, what="p-fed back, through the feed")

        # the agent stops (the worker's pod is gone, or its Redis path): the monitor polls the worker again
        agent_task.cancel()
        await asyncio.gather(agent_task, return_exceptions=True)
        agent_task = None
        await until(lambda: monitor.source("p-fed") == "poll", timeout_s=FEED_STALE_MIN_S + 3,
                    what="p-fed polled again after its samples stopped")
    finally:
        if agent_task is not None:
            agent_task.cancel()
            await asyncio.gather(agent_task, return_exceptions=True)
        await agent.close()
        await monitor.stop()
        for s in (fed_server, polled_server):
            await s.stop()


async def test_without_redis_every_worker_is_polled(prefix):
    """The feed's Redis unreachable: the monitor polls every worker (its loads never depend on the feed)."""
    server = LoadServer(num_running_reqs=2)
    await server.start()
    view = WorkerView(registry=None)
    view.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=[]))
    monitor = LoadMonitor(view, interval_s=INTERVAL, timeout_s=0.3, pending_grace_s=0.0,
                          feed_url="redis://127.0.0.1:1/0", feed_key_prefix=prefix)
    monitor.start()
    try:
        put(view, worker("p", server.address))
        await until(lambda: monitor.loads().get("p") is not None and monitor.loads()["p"].running == 2,
                    what="p's load, polled")
        assert monitor.source("p") == "poll" and not monitor.feed.connected
    finally:
        await monitor.stop()
        await server.stop()
