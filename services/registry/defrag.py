"""Defragments etcd on a schedule: compaction frees pages inside etcd's database file, only defragmentation gives
them back (:mod:`kvshuttle.services.store.etcd_maintenance`).

Every ``interval_s`` the registry replica that leads (the etcd key ``leaders/etcd-defrag``, on a lease it renews every
``tick_s``: one replica at a time, and another takes over within a few ticks when it goes) reads each member's
status and defragments, one at a time and the leader last, the members whose file holds more than ``min_free_bytes``
(or more than ``min_free_ratio`` of the file, and at least 1 MiB) of freed pages. A run is skipped when a member does
not answer (defragmenting another could then cost the quorum). Defragmentation blocks the member while it runs
(seconds for hundreds of MB): with one member, etcd itself.

Each run is logged and counted (``kvshuttle_etcd_defrag_runs_total{result}``: defragmented, not_needed, skipped,
failed); the members' file sizes are gauges (``kvshuttle_etcd_db_size_bytes``, ``kvshuttle_etcd_db_in_use_bytes``),
set by the leading replica at each run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine

from kvshuttle.services.common import metrics
from kvshuttle.services.store.etcd_maintenance import EtcdMaintenance, MemberStatus
from kvshuttle.services.store.etcd_store import EtcdStore, StoreError

log = logging.getLogger(__name__)

LEADER = "etcd-defrag"  # the etcd leader key's name: the registry replica that defragments
RATIO_FLOOR_BYTES = 1 << 20  # the ratio rule never defragments for less than this
DEFRAGMENTED, NOT_NEEDED, SKIPPED, FAILED = metrics.DEFRAG_RESULTS


def should_defragment(db_size: int, in_use: int, *, min_free_bytes: int, min_free_ratio: float = 0.5) -> bool:
    """Whether a member whose database file is ``db_size`` bytes, ``in_use`` of them holding data, is worth
    defragmenting: more than ``min_free_bytes`` free, or more than ``min_free_ratio`` of the file (at least
    ``RATIO_FLOOR_BYTES``)."""
    free = db_size - in_use
    if free <= 0 or db_size <= 0:
        return False
    return free > min_free_bytes or (free >= RATIO_FLOOR_BYTES and free / db_size > min_free_ratio)


class Defragmenter:
    def __init__(self, store: EtcdStore, interval_s: float = 3600.0, *, min_free_bytes: int = 64 << 20,
                 min_free_ratio: float = 0.5, timeout_s: float = 60.0, tick_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        """``timeout_s``: each member's defragmentation; ``tick_s``: how often the leadership is renewed (at most
        ``interval_s``)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0 (0 disables: make no Defragmenter)")
        self.store = store
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.min_free_ratio = min_free_ratio
        self.timeout_s = timeout_s
        self.tick_s = min(tick_s, interval_s)
        self.clock = clock
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.leading = False
        self.runs: dict[str, int] = dict.fromkeys(metrics.DEFRAG_RESULTS, 0)  # by result, since start (tests, logs)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="etcd-defrag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def needs(self, member: MemberStatus) -> bool:
        return should_defragment(member.db_size, member.db_size_in_use, min_free_bytes=self.min_free_bytes,
                                 min_free_ratio=self.min_free_ratio)

    async def campaign(self) -> bool | None:
        """Whether this replica leads; None when etcd did not say (unreachable: e.g. its only member is being
        defragmented)."""
        ttl = max(5, math.ceil(3 * self.tick_s))
        try:
            self.leading = await self.store.elections.campaign(LEADER, self.holder, ttl)
        except StoreError as exc:
            log.debug("etcd defrag: could not campaign for leadership (%s)", exc)
            return None
        return self.leading

    async def _run(self) -> None:
        due = self.clock() + self.interval_s
        while True:
            if await self.campaign() and self.clock() >= due:
                due = self.clock() + self.interval_s
                try:
                    await self._while_leading(self.run_once())
                except Exception:  # a bug must not end the schedule
                    log.exception("etcd defragmentation run failed")
            await asyncio.sleep(min(self.tick_s, max(0.0, due - self.clock())) or self.tick_s)

    async def _while_leading(self, run: Coroutine) -> None:
        """Run ``run`` while renewing the leadership every tick; when another replica leads (this one's lease ended),
        stop it (before its next member)."""
        task = asyncio.create_task(run, name="etcd-defrag-run")
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.tick_s)
                if done:
                    task.result()
                    return
                if await self.campaign() is False:
                    log.warning("etcd defrag: another registry replica leads now; this run stops")
                    return
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def run_once(self) -> str:
        """Check every member now and defragment those that need it; the run's result (counted)."""
        result = await self._check()
        self.runs[result] += 1
        metrics.ETCD_DEFRAG_RUNS.labels(result).inc()
        return result

    async def _check(self) -> str:
        started = time.perf_counter()
        async with EtcdMaintenance.of(self.store, defrag_timeout_s=self.timeout_s) as maintenance:
            try:
                members, problems = await maintenance.statuses()
            except StoreError as exc:
                log.warning("etcd defrag: could not read the members' status: %s", exc)
                return FAILED
            for member in members:
                _gauges(member)
            if problems:
                log.warning("etcd defrag: skipped, %s (defragmenting another member could cost the quorum)",
                            "; ".join(problems))
                return SKIPPED
            todo = [m for m in members if self.needs(m)]
            if not todo:
                log.info("etcd defrag: not needed (%s)", ", ".join(
                    f"{m.name}: {m.free_bytes >> 20} of {m.db_size >> 20} MiB free" for m in members))
                return NOT_NEEDED
            done = await maintenance.defragment(todo)
        for item in done:
            if item.after is not None:
                _gauges(item.after)
        reclaimed = sum(d.before.db_size - d.after.db_size for d in done if d.after is not None)
        failed = [d for d in done if d.error]
        log.log(logging.WARNING if failed else logging.INFO,
                "etcd defrag: %d of %d member(s) defragmented in %.1fs, %.1f MiB given back%s",
                len(done) - len(failed), len(todo), time.perf_counter() - started, reclaimed / (1 << 20),
                f"; {failed[0].before.name} failed: {failed[0].error}" if failed else "")
        return FAILED if failed else DEFRAGMENTED


def _gauges(member: MemberStatus) -> None:
    metrics.ETCD_DB_SIZE.labels(member.name).set(member.db_size)
    metrics.ETCD_DB_IN_USE.labels(member.name).set(member.db_size_in_use)
