"""`kvshuttle bench-kv-feed`: what following the KV feed costs a planner replica, with a synthetic fleet's events.

It starts a Redis, fills the feed's stream with ``--entries`` entries from ``--workers`` synthetic prefill workers
(each entry as a worker's agent publishes one: a stored chain of ``--stored-blocks`` hashes and a removal of
``--removed-blocks``, the steady state of a full prefix cache; every worker's first entry starts its epoch), then runs
one reader (the planners' own :class:`~kvshuttle.services.store.kv_feed.KvFeedReader` into a real index) that
reads the whole stream as fast as it can, alone in this process. It prints the reader's CPU per entry and per block hash, and
Redis's CPU per entry served, then what that makes at a given fleet event rate: ``--workers`` workers each publishing
``--entries-per-worker-s`` entries a second (at most 1 / the agents' coalescing window, 20/s, when busy), for one
replica and for ``--replicas`` replicas sharing the one Redis.

The load feed too (``--load-samples``): the stream of the workers' load samples (every worker's agent publishes one
each ``--load-interval-s``), read by the planners' :class:`~kvshuttle.services.store.load_feed.LoadFeedReader` into a
real :class:`~kvshuttle.services.scheduler.load_monitor.LoadMonitor` that knows every synthetic worker: CPU per
sample, and what the fleet's sample rate makes per replica (what the planners no longer spend polling).

Figures are CPU seconds (``getrusage`` of this process while only the reader runs; Redis's ``INFO cpu``), not wall time: a loaded machine
changes them little.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import resource
import sys
import time

import redis.asyncio as aioredis
from kvshuttle.control_plane.kv_index.events import BlockRemoved, BlockStored, EventBatch
from kvshuttle.control_plane.kv_index.feed import FeedFollower
from kvshuttle.control_plane.kv_index.feed_codec import to_feed
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.load_feed import to_feed as load_to_feed
from kvshuttle.services.common.config import TelemetryConfig, load, require, setting
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.devtools.redis_process import RedisProcess
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.services.store import load_feed
from kvshuttle.services.store.kv_feed import STREAM, KvFeedReader
from kvshuttle.v1 import common_pb2, registry_pb2

PREFIX = "/bench-kv-feed/"


@dataclasses.dataclass
class KvFeedBenchConfig(TelemetryConfig):
    """`kvshuttle bench-kv-feed`: one planner replica's CPU to follow the KV feed of a synthetic fleet."""

    workers: int = setting(1000, "Synthetic prefill workers publishing to the feed")
    entries: int = setting(100_000, "Feed entries to fill the stream with and read back")
    stored_blocks: int = setting(64, "Block hashes stored per entry (a 1k-token prefill at 16-token blocks)")
    removed_blocks: int = setting(64, "Block hashes removed per entry (evictions of a full cache)")
    block_size: int = setting(16, "Block size of the synthetic workers (tokens)")
    entries_per_worker_s: float = setting(20.0, "Entries a busy worker's agent publishes a second (at most 1 / its "
                                                "coalescing window, 0.05 s by default), for the projection")
    replicas: int = setting(50, "Planner replicas reading the one feed, for the projection of Redis's load")
    load_samples: int = setting(20_000, "Load-feed samples to fill its stream with and read back (0: skip)")
    load_interval_s: float = setting(0.5, "Seconds between a worker's load samples (the workers' "
                                          "--load-feed-interval-s), for the projection")
    json_out: str = setting("", "Also write the result as JSON to this file")
    log_level: str = setting("WARNING", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        require(self.workers >= 1 and self.entries >= self.workers, "--entries must be >= --workers >= 1")
        require(self.stored_blocks >= 1 and self.removed_blocks >= 0 and self.block_size >= 1,
                "--stored-blocks >= 1, --removed-blocks >= 0, --block-size >= 1")
        require(self.entries_per_worker_s > 0 and self.replicas >= 1, "--entries-per-worker-s > 0, --replicas >= 1")
        require(self.load_samples >= 0 and self.load_interval_s > 0, "--load-samples >= 0, --load-interval-s > 0")


def synthetic_entries(cfg: KvFeedBenchConfig, seed: int = 7):
    """The fleet's entries, round-robin over workers: each stores a fresh chain, and removes blocks it stored
    earlier once its cache is "full" (after its first entries)."""
    rng = random.Random(seed)
    held: list[list[int]] = [[] for _ in range(cfg.workers)]
    seqs = [0] * cfg.workers
    epoch = time.time_ns()
    for i in range(cfg.entries):
        w = i % cfg.workers
        chain = [rng.getrandbits(64) for _ in range(cfg.stored_blocks)]
        events: list = [BlockStored(block_hashes=tuple(chain), parent_block_hash=None, token_ids=(),
                                    block_size=cfg.block_size)]
        if cfg.removed_blocks and len(held[w]) >= cfg.removed_blocks * 4:
            gone, held[w] = held[w][:cfg.removed_blocks], held[w][cfg.removed_blocks:]
            events.append(BlockRemoved(block_hashes=tuple(gone)))
        held[w].extend(chain)
        yield to_feed(f"synthetic-{w}", epoch, seqs[w], EventBatch(ts=float(i), events=tuple(events)))
        seqs[w] += 1


async def fill(url: str, cfg: KvFeedBenchConfig) -> int:
    """Write the entries (pipelined); the stream's bytes."""
    client = aioredis.from_url(url)
    stream, pipe, n = PREFIX + STREAM, None, 0
    try:
        for entry in synthetic_entries(cfg):
            if pipe is None:
                pipe = client.pipeline(transaction=False)
            pipe.xadd(stream, {"b": entry.SerializeToString()})
            n += 1
            if n % 500 == 0:
                await pipe.execute()
                pipe = None
        if pipe is not None:
            await pipe.execute()
        return int(await client.memory_usage(stream) or 0)
    finally:
        await client.aclose()


async def read_all(url: str, cfg: KvFeedBenchConfig) -> dict:
    """One reader, from the stream's start to its end, in this process (the stream is full: nothing else runs
    here meanwhile); its CPU seconds and what its index holds."""
    index = KvIndex(HashScheme(block_size=cfg.block_size), max_blocks_per_worker=10_000_000,
                    max_blocks_total=100_000_000)
    reader = KvFeedReader(url, PREFIX, FeedFollower(index), block_ms=200, count=1000)
    reader.last_id = "0-0"  # the whole stream, from its first entry (no snapshots in this bench)
    usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    reader.start()
    try:
        while reader.entries < cfg.entries:
            if reader._task is not None and reader._task.done():
                raise RuntimeError(f"the reader stopped: {reader._task.exception()!r}")
            await asyncio.sleep(0.05)
    finally:
        wall = time.perf_counter() - t0
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        await reader.stop()
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {"reader_cpu_s": cpu, "reader_wall_s": wall, "indexed_workers": len(index.workers),
            "indexed_blocks": index.total_blocks, "breaks": reader.follower.stats.breaks,
            "bad_entries": reader.bad_entries, "max_rss_mib": usage1.ru_maxrss / 1024}


class _NoClient:
    """The monitor's per-worker client: never called (the synthetic workers are fed, not polled)."""

    async def close(self) -> None:
        pass


async def fill_loads(url: str, cfg: KvFeedBenchConfig) -> None:
    client = aioredis.from_url(url)
    stream, pipe, now = PREFIX + load_feed.STREAM, client.pipeline(transaction=False), time.time()
    try:
        for i in range(cfg.load_samples):
            w = i % cfg.workers
            numbers = WorkerLoad(running=i % 7, waiting=i % 3, used_tokens=1000 * (i % 50), capacity_tokens=262_144,
                              waiting_uncached_tokens=128 * (i % 5), cache_hit_rate=0.5)
            sample = load_to_feed(f"synthetic-{w}", now + i * cfg.load_interval_s / cfg.workers, cfg.load_interval_s,
                                  numbers)
            pipe.xadd(stream, {"b": sample.SerializeToString()})
            if (i + 1) % 500 == 0:
                await pipe.execute()
                pipe = client.pipeline(transaction=False)
        await pipe.execute()
    finally:
        await client.aclose()


async def read_loads(url: str, cfg: KvFeedBenchConfig) -> dict:
    """One LoadFeedReader into a LoadMonitor that knows every synthetic worker, from the stream's start."""
    view = WorkerView(registry=None)
    view.apply(registry_pb2.WatchWorkersResponse(
        type=registry_pb2.WatchWorkersResponse.EVENT_TYPE_SNAPSHOT,
        workers=[common_pb2.Worker(worker_id=f"synthetic-{w}", role=common_pb2.WORKER_ROLE_PREFILL,
                                   grpc_address=f"10.0.{w // 250}.{w % 250}:50051") for w in range(cfg.workers)]))
    monitor = LoadMonitor(view, client_factory=lambda address, timeout: _NoClient(), feed_url=url,
                          feed_key_prefix=PREFIX)
    monitor._sync()  # the workers, without the poller (nothing here is polled)
    reader = monitor.feed
    reader.last_id = "0-0"
    usage0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    reader.start()
    try:
        while reader.samples + reader.bad_entries < cfg.load_samples:
            if reader._task is not None and reader._task.done():
                raise RuntimeError(f"the load reader stopped: {reader._task.exception()!r}")
            await asyncio.sleep(0.05)
        fed = sum(1 for worker_id in monitor.loads() if monitor.source(worker_id) == "feed")
    finally:
        wall = time.perf_counter() - t0
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        await monitor.stop()
    return {"load_reader_cpu_s": (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime),
            "load_reader_wall_s": wall, "load_workers_with_samples": fed, "load_bad_entries": reader.bad_entries}


async def redis_cpu(url: str) -> float:
    client = aioredis.from_url(url)
    try:
        info = await client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    finally:
        await client.aclose()


async def bench(cfg: KvFeedBenchConfig) -> dict:
    server = RedisProcess("bench-kv-feed")
    await server.astart()
    try:
        t = time.perf_counter()
        stream_bytes = await fill(server.url, cfg)
        fill_s = time.perf_counter() - t
        redis0 = await redis_cpu(server.url)
        result = await read_all(server.url, cfg)
        redis_read_cpu = await redis_cpu(server.url) - redis0
        loads: dict = {}
        if cfg.load_samples:
            await fill_loads(server.url, cfg)
            redis0 = await redis_cpu(server.url)
            loads = await read_loads(server.url, cfg)
            loads["redis_load_read_cpu_s"] = await redis_cpu(server.url) - redis0
    finally:
        await server.astop()
    hashes = cfg.entries * (cfg.stored_blocks + cfg.removed_blocks)
    per_entry_us = result["reader_cpu_s"] / cfg.entries * 1e6
    rate = cfg.workers * cfg.entries_per_worker_s
    redis_per_entry_us = redis_read_cpu / cfg.entries * 1e6
    if loads:
        per_sample_us = loads["load_reader_cpu_s"] / cfg.load_samples * 1e6
        sample_rate = cfg.workers / cfg.load_interval_s
        loads.update(load_reader_us_per_sample=round(per_sample_us, 2), load_samples_per_s=sample_rate,
                     load_replica_cores=round(sample_rate * per_sample_us / 1e6, 3),
                     load_redis_cores_for_replicas=round(
                         sample_rate * loads["redis_load_read_cpu_s"] / cfg.load_samples * cfg.replicas, 3))
    return {
        **loads,
        "config": dataclasses.asdict(cfg), "fill_s": round(fill_s, 2), "stream_bytes": stream_bytes,
        "bytes_per_entry": round(stream_bytes / cfg.entries, 1), **result,
        "reader_us_per_entry": round(per_entry_us, 2), "reader_us_per_hash": round(result["reader_cpu_s"] / hashes * 1e6, 3),
        "reader_entries_per_cpu_s": round(cfg.entries / result["reader_cpu_s"]),
        "redis_us_per_entry_served": round(redis_per_entry_us, 2),
        "fleet_entries_per_s": rate,
        "replica_cores": round(rate * per_entry_us / 1e6, 3),
        "redis_cores_for_replicas": round(rate * redis_per_entry_us / 1e6 * cfg.replicas, 3),
    }


def report(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        f"KV feed: {c['entries']:,} entries from {c['workers']:,} synthetic workers, {c['stored_blocks']} stored + "
        f"{c['removed_blocks']} removed hashes each; {r['bytes_per_entry']:.0f} bytes/entry in the stream",
        f"one reader: {r['reader_cpu_s']:.2f} CPU s for all of them ({r['reader_wall_s']:.2f} s "
        f"wall): {r['reader_us_per_entry']:.1f} us per entry, {r['reader_us_per_hash']:.3f} us per hash, "
        f"{r['reader_entries_per_cpu_s']:,} entries per CPU second; index {r['indexed_workers']:,} workers, "
        f"{r['indexed_blocks']:,} blocks, {r['max_rss_mib']:.0f} MiB RSS; breaks {r['breaks']}",
        f"Redis: {r['redis_us_per_entry_served']:.1f} us CPU per entry served to a reader",
        f"at {c['workers']:,} workers x {c['entries_per_worker_s']:g} entries/s = {r['fleet_entries_per_s']:,.0f} "
        f"entries/s: {r['replica_cores']:.2f} cores per planner replica; Redis {r['redis_cores_for_replicas']:.2f} "
        f"cores to serve {c['replicas']} replicas",
    ] + ([
        f"load feed: {c['load_samples']:,} samples read into a load monitor of {c['workers']:,} workers in "
        f"{r['load_reader_cpu_s']:.2f} CPU s: {r['load_reader_us_per_sample']:.1f} us per sample; at one sample per "
        f"worker every {c['load_interval_s']:g} s ({r['load_samples_per_s']:,.0f}/s): {r['load_replica_cores']:.3f} "
        f"cores per planner replica, Redis {r['load_redis_cores_for_replicas']:.2f} cores for {c['replicas']} "
        f"replicas ({r['load_workers_with_samples']:,} workers with a sample, {r['load_bad_entries']} bad entries)",
    ] if "load_reader_cpu_s" in r else []))


def main(argv: list[str] | None = None) -> int:
    cfg = load(KvFeedBenchConfig, argv, prog="kvshuttle bench-kv-feed")
    result = asyncio.run(bench(cfg))
    print(report(result))
    if cfg.json_out:
        with open(cfg.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
