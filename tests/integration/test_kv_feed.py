"""The KV feed through a real Redis: a worker agent's publisher (workers/kv_feed.py) and planners' readers
(services/store/kv_feed.py) keep every reader's index equal to the worker's own view: a reader that follows from the
start, one that starts late (from the snapshot), and one that falls behind a capped stream (resync from the next
snapshot). The engine's event stream is a stand-in here (its relay is checked against vLLM in tests/e2e)."""

from __future__ import annotations

import asyncio

import pytest
from kvshuttle.control_plane.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvshuttle.control_plane.kv_index.feed import FeedFollower
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.services.engine.client import EngineError
from kvshuttle.services.store.kv_feed import KvFeedPublisher, KvFeedReader
from kvshuttle.workers.kv_feed import KvFeedAgent

from tests.support.waits import until

BS = 16
SCHEME = HashScheme(block_size=BS)
W = "prefill-7"


class Engine:
    """The engine's relayed events: batches put on ``queue``; ``None`` breaks the stream (as a lost connection)."""

    def __init__(self):
        self.queue: asyncio.Queue[EventBatch | None] = asyncio.Queue()
        self.subscriptions = 0

    async def kv_events(self):
        self.subscriptions += 1
        yield EventBatch(ts=0.0, events=(AllBlocksCleared(),))  # the relay's snapshot starts with a clear
        while (batch := await self.queue.get()) is not None:
            if batch == "cancel":  # grpc.aio raises CancelledError when the server cancels the stream
                raise asyncio.CancelledError
            yield batch
        raise EngineError(None, "stream broke")

    async def close(self):
        pass


async def put(engine: Engine, batch: EventBatch) -> None:
    """One engine batch, after the agent published the last (coalescing off: one entry each)."""
    await engine.queue.put(batch)
    await asyncio.sleep(0.02)


def stored(*hashes: int, ts: float = 1.0) -> EventBatch:
    return EventBatch(ts=ts, events=(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(),
                                                 block_size=BS),))


def reader(redis_url: str, prefix: str) -> tuple[KvFeedReader, KvIndex]:
    index = KvIndex(SCHEME)
    return KvFeedReader(redis_url, prefix, FeedFollower(index), block_ms=100, snapshot_retry_s=0.1), index


@pytest.fixture
def prefix(request) -> str:
    return f"/kvfeed-{request.node.name[:40]}/"


async def test_readers_early_late_and_behind_all_end_with_the_workers_view(redis_url, prefix):
    engine = Engine()
    agent = KvFeedAgent(W, engine, KvFeedPublisher(redis_url, prefix, max_len=5, exact_trim=True), SCHEME, coalesce_s=0, snapshot_interval_s=0.2,
                        ttl_s=30, retry_s=0.05)
    early, early_index = reader(redis_url, prefix)
    early.start()
    await early.ready.wait()
    task = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.seq == 1, 5, "the relay's opening clear")
        for i in range(3):
            await put(engine, stored(100 + i, 200 + i))
        await put(engine, EventBatch(ts=2.0, events=(BlockRemoved(block_hashes=(200,)),)))
        await until(lambda: agent.seq == 5, 5, "the agent to publish each batch (they came apart)")
        await until(lambda: set(early_index.held(W)) == set(agent.index.held(W)) != set(), 5,
                    "the early reader to follow")
        assert set(agent.index.held(W)) == {100, 101, 102, 201, 202}

        # a reader starting now: the stream keeps ~5 entries, the snapshot has the rest
        await until(lambda: agent.snapshots >= 1, 5, "a snapshot")
        late, late_index = reader(redis_url, prefix)
        late.start()
        await until(lambda: set(late_index.held(W)) == set(agent.index.held(W)), 5, "the late reader")

        # the early reader falls behind a capped stream (stopped), then resyncs from the next snapshot
        await early.stop()
        behind, behind_index = reader(redis_url, prefix)
        behind.follower = early.follower  # the same index, resumed from where it stopped
        behind.last_id = early.last_id
        for i in range(20):
            await put(engine, stored(300 + i))
        await put(engine, EventBatch(ts=3.0, events=(BlockRemoved(block_hashes=(100, 300)),)))
        await until(lambda: agent.seq == 26, 5, "the agent to publish")
        behind.start()
        await until(lambda: set(early_index.held(W)) == set(agent.index.held(W)), 5, "the reader behind to resync")
        assert early.follower.stats.breaks >= 1 and early.follower.stats.resyncs >= 1
        assert 100 not in early_index.held(W) and 319 in early_index.held(W)
        await until(lambda: set(late_index.held(W)) == set(agent.index.held(W)), 5, "the late reader follows")

        # the engine's stream breaks: the agent resubscribes, the relay's snapshot (a clear, then the cache) follows
        await engine.queue.put(None)
        await until(lambda: engine.subscriptions == 2, 5, "a resubscription")
        await engine.queue.put("cancel")  # the server cancels the stream: the agent resubscribes too
        await until(lambda: engine.subscriptions == 3, 5, "a resubscription after a cancelled stream")
        await put(engine, stored(400))
        await until(lambda: set(late_index.held(W)) == {400}, 5, "the clear and the new block")
        assert agent.published_failures == 0

        # batches close together go out as one entry
        agent.coalesce_s, entries = 0.3, agent.seq
        for i in range(5):
            await engine.queue.put(stored(500 + i))
        await until(lambda: set(late_index.held(W)) == {400, 500, 501, 502, 503, 504}, 5, "the coalesced entry")
        assert agent.seq == entries + 1
        await late.stop()
        await behind.stop()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await agent.close()


async def test_a_reader_survives_bad_entries_and_a_redis_outage(tmp_path, prefix):
    import redis.asyncio as aioredis
    from kvshuttle.services.devtools.redis_process import RedisProcess
    from kvshuttle.services.store.kv_feed import KvFeedPublisher

    server = RedisProcess(data_dir=tmp_path / "redis", persistent=True)
    await server.astart()
    follow, index = reader(server.url, prefix)
    follow.start()
    await follow.ready.wait()
    client = aioredis.from_url(server.url)
    publisher = KvFeedPublisher(server.url, prefix)
    try:
        await client.xadd(prefix + "kv-feed", {"b": b"\xff\x00not a proto"})
        await client.xadd(prefix + "kv-feed", {"x": b""})
        await until(lambda: follow.entries == 2, 5, "the reader to read both")
        assert follow.bad_entries == 2 and index.workers == [] and follow.connected

        server.kill()
        await until(lambda: not follow.connected, 10, "the reader to notice the outage")
        await server.astart()  # the same port and data
        from kvshuttle.control_plane.kv_index.feed_codec import to_feed

        await publisher.publish(to_feed(W, 1, 0, stored(5)))
        await until(lambda: index.held(W) == [5], 15, "the reader to follow again")
    finally:
        await client.aclose()
        await publisher.close()
        await follow.stop()
        server.stop()


async def test_bench_kv_feed_reads_a_synthetic_fleet_into_the_index():
    """`kvshuttle bench-kv-feed` at a small size: every entry read, every worker indexed with the blocks its entries
    left it (stored less removed), and the cost figures it prints."""
    from kvshuttle.services.devtools.bench.kv_feed_load import KvFeedBenchConfig, bench, report, synthetic_entries

    cfg = KvFeedBenchConfig(workers=20, entries=400, stored_blocks=8, removed_blocks=8, load_samples=200)
    held: dict[str, set[int]] = {}
    for entry in synthetic_entries(cfg):
        blocks = held.setdefault(entry.worker_id, set())
        for event in entry.events:
            if event.HasField("stored"):
                blocks.update(event.stored.block_hashes)
            else:
                blocks.difference_update(event.removed.block_hashes)
    result = await bench(cfg)
    assert result["indexed_workers"] == 20 and result["breaks"] == 0 and result["bad_entries"] == 0
    assert result["indexed_blocks"] == sum(len(b) for b in held.values()) < 400 * 8
    assert result["reader_us_per_entry"] > 0 and result["redis_us_per_entry_served"] > 0
    assert abs(result["replica_cores"] - 20 * 20.0 * result["reader_us_per_entry"] / 1e6) < 0.002
    assert "cores per planner replica" in report(result)
    # the load feed: every sample read into a load monitor that then has every worker's load from the feed
    assert result["load_workers_with_samples"] == 20 and result["load_bad_entries"] == 0
    assert result["load_reader_us_per_sample"] > 0 and result["load_samples_per_s"] == 20 / 0.5
    assert "load feed: 200 samples" in report(result)
