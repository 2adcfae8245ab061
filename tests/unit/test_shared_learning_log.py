"""SharedLearning's own rules against an in-memory stand-in for etcd (the real etcd path: tests/integration/
test_shared_learning.py): outcomes wait while the store is away, the oldest are dropped past the bound and counted,
a batch written twice is applied once, a gap is counted, and a caller learns whether its outcome was applied."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import make_policy, make_prior
from kvshuttle.control_plane.selection import make_selector
from kvshuttle.services.common import metrics
from kvshuttle.services.scheduler.learning import SharedLearning, outcome_of
from kvshuttle.services.store.interface import StoreUnavailable
from kvshuttle.v1 import scheduler_pb2

from tests.support.waits import until


class MemoryLog:
    """put / read / watch of outcome batches with revisions, and an `up` switch, as the store's parts SharedLearning
    uses: ``leases``, ``outcomes``, ``snapshots`` and ``elections``."""

    def __init__(self):
        self.up = True
        self.revision = 0
        self.written: list[tuple[int, bytes]] = []
        self.leases = SimpleNamespace(grant=self._grant)
        self.outcomes = SimpleNamespace(put_batch=self._put_batch, batches=self._batches, watch=self._watch)
        self.snapshots = SimpleNamespace(get=self._get_snapshot)
        self.elections = SimpleNamespace(campaign=self._campaign)

    def _check(self):
        if not self.up:
            raise StoreUnavailable("etcd away (test)")

    async def _grant(self, ttl_s: int):
        self._check()
        return 1, ttl_s

    async def _put_batch(self, replica, seq, batch, lease_id):
        self._check()
        self.revision += 1
        self.written.append((self.revision, batch))
        return self.revision

    async def _batches(self, after_revision):
        self._check()
        return [b for b in self.written if b[0] > after_revision], self.revision

    async def _watch(self, from_revision):
        seen = from_revision - 1
        while True:
            self._check()
            for revision, value in list(self.written):
                if revision > seen:
                    seen = revision
                    yield revision, value
            await asyncio.sleep(0.01)

    async def _get_snapshot(self):
        self._check()
        return None

    async def _campaign(self, name, holder, ttl_s):
        self._check()
        return False


def planner() -> Planner:
    model = PrefillCostModel(make_prior({}))
    return Planner({"threshold": make_policy("threshold", {}, model=model)}, "threshold", model,
                   make_selector("load"))


def report(i: int) -> scheduler_pb2.ReportOutcomeRequest:
    return scheduler_pb2.ReportOutcomeRequest(prefill_worker_id="p0", prompt_tokens=100 + i, computed_tokens=100 + i,
                                              prefill_ms=10.0 + i, decision=scheduler_pb2.DECISION_RECOMPUTE,
                                              session_id=f"s{i}")


def dropped_total() -> float:
    return metrics.LEARNED_OUTCOMES.labels("dropped")._value.get()


async def test_outcomes_wait_while_etcd_is_away_the_oldest_past_the_bound_are_dropped_then_the_rest_learned():
    store, p = MemoryLog(), planner()
    store.up = False
    learning = SharedLearning(store, p, replica="r1", flush_interval_s=0.01, max_pending=3)
    await learning.start()
    before = dropped_total()
    try:
        answers = [await learning.learn(report(i), wait_s=0.02) for i in range(5)]
        assert answers == [False] * 5  # not learned: etcd away
        stats = scheduler_pb2.LearningStats()
        learning.fill_stats(stats)
        assert (stats.pending_outcomes, stats.dropped_outcomes, stats.applied_outcomes) == (3, 2, 0)
        assert dropped_total() - before == 2
        assert p.reported == 0

        store.up = True
        await until(lambda: learning.applied == 3, 5, "the three that waited applied once etcd is back")
        assert await learning.learn(report(5), wait_s=5.0)  # its own, read back: learned
        assert learning.applied == 4
        assert [p.cache_hints.worker_of(("default", f"s{i}")) for i in range(6)] == \
            [None, None, "p0", "p0", "p0", "p0"]  # the dropped ones (0, 1) never reached the planner
        assert p.reported == 4 and not learning._pending
    finally:
        await learning.stop()


async def test_a_batch_written_twice_is_applied_once_and_a_gap_is_counted():
    p = planner()
    learning = SharedLearning(MemoryLog(), p, replica="me")

    def batch(replica: str, seq: int, n: int) -> bytes:
        return scheduler_pb2.OutcomeBatch(replica=replica, seq=seq,
                                          outcomes=[report(i) for i in range(n)]).SerializeToString()

    learning._apply_batch(1, batch("other", 0, 2))
    learning._apply_batch(2, batch("other", 0, 2))  # a retried put: a new revision, the same batch
    assert learning.applied == 2 and learning.missed == 0
    learning._apply_batch(3, batch("other", 3, 1))  # 1 and 2 were gone before they were read
    assert learning.applied == 3 and learning.missed == 2
    learning._apply_batch(3, batch("third", 0, 1))  # not after the revision applied: ignored
    learning._apply_batch(4, b"\xff not a batch")  # skipped alike by every replica
    assert learning.applied == 3 and learning.applied_revision == 4


def test_invalid_outcomes_are_refused_before_they_are_shared():
    for bad in (dict(prefill_ms=float("nan")), dict(prefill_ms=-1.0), dict(prompt_tokens=0),
                dict(pulled_tokens=-5), dict(decision=scheduler_pb2.DECISION_UNSPECIFIED),
                dict(session_id="bad id with spaces")):
        request = report(0)
        for key, value in bad.items():
            setattr(request, key, value)
        try:
            outcome_of(request)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
