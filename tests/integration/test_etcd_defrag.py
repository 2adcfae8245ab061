"""etcd defragmentation against real etcd: compaction leaves etcd's database file at its size, defragmentation gives
the freed pages back (services/store/etcd_maintenance.py), on every member one at a time, and the registry's
Defragmenter does it on its schedule, on one replica, counted in its metrics (services/registry/defrag.py).

Each test runs its own etcd (the measurements need a database nobody else writes to)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kvshuttle.services.devtools.etcd_process import EtcdCluster, EtcdProcess
from kvshuttle.services.registry.defrag import DEFRAGMENTED, NOT_NEEDED, Defragmenter
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.store.etcd_maintenance import EtcdMaintenance, defragment
from kvshuttle.services.store.etcd_store import EtcdStore

from tests.support.metrics import scrape, value
from tests.support.waits import until

log = logging.getLogger(__name__)
PREFIX = "/defrag-test/"
BLOB = b"x" * (256 << 10)


@pytest.fixture
async def etcd_alone():
    proc = EtcdProcess("defrag")
    await proc.astart()
    try:
        yield proc.endpoints
    finally:
        await proc.astop()


async def churn(store: EtcdStore, n: int) -> int:
    """Write ``n`` large keys, delete them and compact (physically): pages freed inside the file. Their bytes."""
    for i in range(n):
        await store.kv.put(f"{PREFIX}big/{i:04d}", BLOB)
    resp = await store.kv.delete(f"{PREFIX}big/", f"{PREFIX}big0".encode())
    assert resp.deleted == n
    await store.kv.compact(resp.header.revision, physical=True)
    return n * len(BLOB)


async def freed(store: EtcdStore, maintenance: EtcdMaintenance, at_least: int):
    """The members' statuses once each reports ``at_least`` free bytes. (The compaction's pages are pending until a
    later write transaction frees them: a small write each poll, as a live cluster's traffic does.)"""
    async def check():
        await store.kv.put(f"{PREFIX}tick", b"")
        members, problems = await maintenance.statuses()
        assert not problems
        return members if all(m.free_bytes >= at_least for m in members) else None

    return await until(check, 10, "the compaction's pages to show as free")


async def test_defragment_gives_back_what_compaction_freed(etcd_alone):
    ops = []
    async with EtcdStore(etcd_alone, PREFIX, on_op=lambda op, seconds, error: ops.append((op, error))) as store:
        written = await churn(store, 80)
        async with EtcdMaintenance.of(store) as maintenance:
            (before,) = await freed(store, maintenance, written // 2)
        assert before.leader and before.db_size >= written and before.db_size_in_use <= before.db_size
        (result,) = await defragment(store)
    assert not result.error and result.before == before
    after = result.after
    assert after is not None and after.member_id == before.member_id
    assert after.db_size < before.db_size // 4 and after.db_size_in_use <= after.db_size
    log.warning("defragmented: db %d -> %d bytes, in use %d -> %d, in %.2fs", before.db_size, after.db_size,
                before.db_size_in_use, after.db_size_in_use, result.seconds)
    assert ("defragment", "") in ops and ("member status", "") in ops and ("member list", "") in ops


async def test_each_member_of_a_cluster_is_defragmented_once_the_leader_last():
    cluster = EtcdCluster(3)
    await cluster.astart()
    try:
        async with EtcdStore(cluster.endpoints, PREFIX) as store:
            written = await churn(store, 24)
            async with EtcdMaintenance.of(store) as maintenance:
                members = await freed(store, maintenance, written // 2)
            # Reached through one endpoint only: the members are found from the member list.
            done = await defragment(cluster.members[0].endpoints)
    finally:
        await cluster.astop()
    assert sorted(m.name for m in members) == ["m0", "m1", "m2"]
    assert [d.before.name for d in done] == [m.name for m in members] and done[-1].before.leader
    assert sorted(d.before.endpoint for d in done) == sorted(cluster.endpoints.split(","))
    for d in done:
        assert not d.error and d.after is not None and d.after.db_size < d.before.db_size


async def test_a_member_that_does_not_need_it_is_left_alone(etcd_alone):
    async with EtcdStore(etcd_alone, PREFIX) as store:
        defragmenter = Defragmenter(store, 3600, min_free_bytes=64 << 20)
        assert await defragmenter.run_once() == NOT_NEEDED
        await churn(store, 8)
        async with EtcdMaintenance.of(store) as maintenance:
            await freed(store, maintenance, 1 << 20)
        small = Defragmenter(store, 3600, min_free_bytes=1 << 20)
        assert await small.run_once() == DEFRAGMENTED
        assert await small.run_once() == NOT_NEEDED  # nothing left to give back


async def test_one_replica_defragments_on_the_schedule(etcd_alone):
    """Two defragmenters on one etcd, a tiny interval: one leads and runs, the other never does."""
    async with EtcdStore(etcd_alone, PREFIX) as store_a, EtcdStore(etcd_alone, PREFIX) as store_b:
        a = Defragmenter(store_a, 0.2, min_free_bytes=0)
        b = Defragmenter(store_b, 0.2, min_free_bytes=0)
        a.start()
        await until(lambda: a.leading, 5, "the first defragmenter to lead")
        b.start()
        try:
            await until(lambda: sum(a.runs.values()) >= 3, 10, "three runs of the leader")
        finally:
            await a.stop()
            await b.stop()
    assert not b.leading and sum(b.runs.values()) == 0


async def test_the_registry_defragments_on_its_schedule_and_counts_each_run(etcd_alone):
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd_alone, key_prefix=PREFIX,
                         metrics_listen="127.0.0.1:0", etcd_defrag_interval_s=0.3, etcd_defrag_min_free_mb=1)
    cfg.validate()
    async with EtcdStore(etcd_alone, PREFIX) as store:
        await churn(store, 16)
        async with EtcdMaintenance.of(store) as maintenance:
            (member,) = await freed(store, maintenance, 2 << 20)
    registry = await serve(cfg)
    try:
        assert registry.defragmenter is not None and registry.defragmenter.interval_s == 0.3
        before = await scrape(registry.metrics.url)
        await until(lambda: registry.defragmenter.runs[DEFRAGMENTED], 10, "a defragmentation run")
        after = await scrape(registry.metrics.url)
    finally:
        await registry.stop(grace=0.2)
    assert (value(after, "kvshuttle_etcd_defrag_runs_total", result="defragmented")
            - value(before, "kvshuttle_etcd_defrag_runs_total", result="defragmented")) >= 1
    size = value(after, "kvshuttle_etcd_db_size_bytes", member=member.name)
    in_use = value(after, "kvshuttle_etcd_db_in_use_bytes", member=member.name)
    assert 0 < size < member.db_size and in_use <= size


async def test_interval_zero_means_no_defragmenter(etcd):
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, etcd_defrag_interval_s=0)
    cfg.validate()
    registry = await serve(cfg)
    try:
        assert registry.defragmenter is None
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "etcd-defrag"]
    finally:
        await registry.stop(grace=0.2)
