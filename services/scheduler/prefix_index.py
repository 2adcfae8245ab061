"""What each prefill worker's prefix cache holds, for the planner: the KV feed followed into a KvIndex.

Built once the worker view shows a prefill worker that publishes its KV events (``Worker.kv_events``): its block
size, hash algorithm and seed make the index's hash scheme. Workers hashing otherwise are not indexed (the planner
falls back to its per-session hints for them), nor are views the index distrusts (control_plane/kv_index/index.py).
Workers gone from the view are forgotten after ``forget_after_s``.

:meth:`PrefixIndex.hits` is the planning path's read: one pass of block hashing over the prompt (with the turn's
cache salt, as vLLM hashes it), then one lookup per candidate worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

from kvshuttle.control_plane.kv_index.feed import FeedFollower
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.store.kv_feed import KvFeedReader
from kvshuttle.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)


def worker_scheme(worker: common_pb2.Worker) -> HashScheme | None:
    """How ``worker`` hashes its blocks, when it publishes KV events and its settings are ones the index can
    reproduce."""
    if not worker.kv_events or worker.block_size < 1:
        return None
    try:
        return HashScheme(block_size=worker.block_size, algo=worker.prefix_hash_algo or "sha256",
                          seed=worker.prefix_hash_seed or None)
    except ValueError:
        return None


class PrefixIndex:
    def __init__(self, workers: WorkerView, url: str, key_prefix: str, *, max_blocks_per_worker: int = 1_000_000,
                 max_blocks_total: int = 8_000_000, forget_after_s: float = 60.0):
        self.workers = workers
        self.url, self.key_prefix = url, key_prefix
        self.max_blocks_per_worker, self.max_blocks_total = max_blocks_per_worker, max_blocks_total
        self.forget_after_s = forget_after_s
        self.index: KvIndex | None = None
        self.follower: FeedFollower | None = None
        self.reader: KvFeedReader | None = None
        self._task: asyncio.Task | None = None
        self._absent_since: dict[str, float] = {}
        self.lookups = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="prefix-index")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.reader is not None:
            await self.reader.stop()

    async def _run(self) -> None:
        while self.index is None:
            scheme = next((s for w in self.workers.by_role(common_pb2.WORKER_ROLE_PREFILL)
                           if (s := worker_scheme(w)) is not None), None)
            if scheme is not None:
                self.index = KvIndex(scheme, self.max_blocks_per_worker, self.max_blocks_total)
                self.follower = FeedFollower(self.index)
                self.reader = KvFeedReader(self.url, self.key_prefix, self.follower)
                self.reader.start()
                log.info("following the KV feed at %s: %d-token blocks, %s, seed %s", self.url, scheme.block_size,
                         scheme.algo, scheme.seed or "unset")
                break
            await asyncio.sleep(0.5)
        while True:
            await asyncio.sleep(min(10.0, self.forget_after_s / 2))
            self._forget_departed(time.monotonic())

    def _forget_departed(self, now: float) -> None:
        for worker_id in self.index.workers:
            if self.workers.get(worker_id) is not None:
                self._absent_since.pop(worker_id, None)
            elif now - self._absent_since.setdefault(worker_id, now) >= self.forget_after_s:
                self.follower.forget(worker_id)
                self._absent_since.pop(worker_id, None)

    def hits(self, prompt: Sequence[int], salt: str, prefill: Sequence[common_pb2.Worker],
             adapter: str | None = None) -> Mapping[str, int] | None:
        """Per prefill worker the index knows (same hash scheme, trusted view): the prompt's tokens its prefix
        cache holds, from the first on. None when it knows none of them. ``adapter``: the LoRA adapter the turn
        runs under: vLLM hashes its blocks under the adapter's name and path, as each worker registered them."""
        index = self.index
        if index is None or not prefill:
            return None
        known = [w for w in prefill
                 if self.follower.followed(w.worker_id) and worker_scheme(w) == index.scheme
                 and not index.stale_reason(w.worker_id)]
        if not known:
            return None
        self.lookups += 1
        if adapter is None:
            hashes = index.scheme.hashes(prompt, salt)
            return {w.worker_id: index.cached_prefix_tokens(w.worker_id, hashes) for w in known}
        by_path: dict[str, list] = {}  # one hashing per path the workers loaded the adapter from
        hits = {}
        for w in known:
            path = next((a.path for a in w.adapters if a.name == adapter), None)
            if path is None:
                continue
            hashes = by_path.get(path)
            if hashes is None:
                hashes = by_path[path] = index.scheme.hashes(prompt, salt, (adapter, path))
            hits[w.worker_id] = index.cached_prefix_tokens(w.worker_id, hashes)
        return hits or None

    def fill_stats(self, out: scheduler_pb2.KvIndexStats) -> None:
        reader, follower, index = self.reader, self.follower, self.index
        out.lookups = self.lookups
        if reader is None or follower is None or index is None:
            return
        out.following, out.entries, out.bad_entries = reader.connected, reader.entries, reader.bad_entries
        out.breaks, out.resyncs = follower.stats.breaks, follower.stats.resyncs
        waiting = set(follower.waiting())
        for worker_id in sorted(index.workers):
            out.workers.add(worker_id=worker_id, blocks=index.blocks(worker_id),
                            stale_reason=index.stale_reason(worker_id), awaiting_snapshot=worker_id in waiting)
