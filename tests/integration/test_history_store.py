"""The history store's backends against real servers: SQLite in a temporary file, Redis from ``redis_url``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from kvshuttle.control_plane.prefix import ids_bytes as ids_to_bytes
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.store.history import HistoryGone, HistoryStore, HistoryUnavailable, bytes_to_ids
from kvshuttle.services.store.history_redis import RedisHistoryStore
from kvshuttle.services.store.history_sqlite import SqliteHistoryStore

from tests.support.registry import uid

TTL = 600


@pytest.fixture(params=["sqlite", "redis"])
async def store(request, tmp_path) -> AsyncIterator[HistoryStore]:
    if request.param == "sqlite":
        s: HistoryStore = SqliteHistoryStore(tmp_path / "history.db")
    else:
        s = RedisHistoryStore(request.getfixturevalue("redis_url"), prefix=f"/{uid('history-test')}/")
    await s.connect()
    yield s
    await s.close()


@pytest.fixture
def lineage() -> tuple[str, str, int]:
    return uid("tenant"), uid("s"), 1


async def test_append_then_read_round_trips(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1, 2, 3]), TTL)
    await store.append(*lineage, 3, ids_to_bytes([4, 5]), TTL)
    assert bytes_to_ids(await store.read(*lineage, 5)) == [1, 2, 3, 4, 5]
    assert bytes_to_ids(await store.read(*lineage, 4)) == [1, 2, 3, 4]
    assert await store.read(*lineage, 0) == b""


async def test_an_append_at_the_same_offset_replaces_the_segment(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1, 2]), TTL)
    await store.append(*lineage, 2, ids_to_bytes([3]), TTL)
    await store.append(*lineage, 2, ids_to_bytes([30, 40]), TTL)
    assert bytes_to_ids(await store.read(*lineage, 4)) == [1, 2, 30, 40]


async def test_a_new_lineage_may_begin_as_part_of_another_copied_inside_the_store(store, lineage):
    """A turn that continued only part of the session's history (up to a text boundary): the new lineage starts as
    the previous one's first ids, copied by the store itself; the previous lineage is untouched (a reader of the
    record it belongs to still reads it)."""
    tenant, session, old = lineage
    await store.append(tenant, session, old, 0, ids_to_bytes([1, 2, 3, 4]), TTL)
    await store.append(tenant, session, old, 4, ids_to_bytes([5, 6, 7]), TTL)
    await store.append(tenant, session, 2, 5, ids_to_bytes([60, 70, 80]), TTL, copy_from=old)
    assert bytes_to_ids(await store.read(tenant, session, 2, 8)) == [1, 2, 3, 4, 5, 60, 70, 80]
    assert bytes_to_ids(await store.read(tenant, session, old, 7)) == [1, 2, 3, 4, 5, 6, 7]
    await store.append(tenant, session, 3, 2, ids_to_bytes([9]), TTL, copy_from=2)  # a copy of a copy
    assert bytes_to_ids(await store.read(tenant, session, 3, 3)) == [1, 2, 9]
    # a lineage that no longer holds the ids: nothing is written, and the caller learns it must send them all
    with pytest.raises(HistoryGone):
        await store.append(tenant, session, 4, 9, ids_to_bytes([1]), TTL, copy_from=old)
    with pytest.raises(HistoryGone):
        await store.append(tenant, session, 5, 2, ids_to_bytes([1]), TTL, copy_from=99)
    assert await store.read(tenant, session, 4, 1) is None and await store.read(tenant, session, 5, 1) is None


async def test_a_gap_or_too_few_ids_reads_none(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1, 2]), TTL)
    await store.append(*lineage, 3, ids_to_bytes([4]), TTL)
    assert await store.read(*lineage, 4) is None  # id 2 was never written
    assert await store.read(*lineage, 9) is None
    assert bytes_to_ids(await store.read(*lineage, 2)) == [1, 2]
    assert await store.read(uid("tenant"), "never-written", 1, 1) is None


async def test_handles_are_kept_with_the_lineage_under_their_digest(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1, 2]), TTL, handle=(b"d1" * 8, b'{"remote_block_ids": [[1]]}'))
    await store.append(*lineage, 2, ids_to_bytes([3]), TTL, handle=(b"d2" * 8, b'{"remote_block_ids": [[2]]}'))
    assert await store.read_handle(*lineage, b"d1" * 8) == b'{"remote_block_ids": [[1]]}'
    assert await store.read_handle(*lineage, b"d2" * 8) == b'{"remote_block_ids": [[2]]}'
    assert bytes_to_ids(await store.read(*lineage, 3)) == [1, 2, 3]  # handles are not segments
    await store.drop_handle(*lineage, b"d1" * 8)
    assert await store.read_handle(*lineage, b"d1" * 8) is None
    assert await store.read_handle(*lineage, b"d2" * 8) is not None
    assert await store.read_handle(lineage[0], lineage[1], 2, b"d2" * 8) is None  # another lineage
    await store.drop(*lineage)
    assert await store.read_handle(*lineage, b"d2" * 8) is None


async def test_handles_expire_with_their_lineage(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1]), 1, handle=(b"d" * 16, b"{}"))
    assert await store.read_handle(*lineage, b"d" * 16) == b"{}"
    await asyncio.sleep(1.5)
    assert await store.read_handle(*lineage, b"d" * 16) is None


async def test_lineages_are_isolated(store, lineage):
    tenant, session, gen = lineage
    await store.append(tenant, session, gen, 0, ids_to_bytes([1]), TTL)
    await store.append(tenant, session, gen + 1, 0, ids_to_bytes([2]), TTL)
    await store.append(uid("tenant"), session, gen, 0, ids_to_bytes([3]), TTL)
    assert bytes_to_ids(await store.read(tenant, session, gen, 1)) == [1]
    assert bytes_to_ids(await store.read(tenant, session, gen + 1, 1)) == [2]
    await store.drop(tenant, session, gen)
    assert await store.read(tenant, session, gen, 1) is None
    assert bytes_to_ids(await store.read(tenant, session, gen + 1, 1)) == [2]
    await store.drop(tenant, session, gen)  # absent: no error


async def test_concurrent_appends_all_land(store, lineage):
    await asyncio.gather(*(store.append(*lineage, i * 10, ids_to_bytes(range(i * 10, i * 10 + 10)), TTL)
                           for i in range(50)))
    assert bytes_to_ids(await store.read(*lineage, 500)) == list(range(500))


async def test_the_lineage_expires_as_a_whole_after_its_last_append(store, lineage):
    await store.append(*lineage, 0, ids_to_bytes([1, 2]), 1)
    await store.append(*lineage, 2, ids_to_bytes([3]), 1)
    assert bytes_to_ids(await store.read(*lineage, 3)) == [1, 2, 3]
    await asyncio.sleep(1.5)
    assert await store.read(*lineage, 1) is None
    await store.append(*lineage, 3, ids_to_bytes([4]), TTL)  # a new lineage: the expired segments stay gone
    assert await store.read(*lineage, 4) is None


async def test_a_million_ids_in_a_thousand_appends(store, lineage, capsys):
    ids = list(range(1_000_000))
    started = time.perf_counter()
    for start in range(0, len(ids), 1000):
        await store.append(*lineage, start, ids_to_bytes(ids[start:start + 1000]), TTL)
    appended = time.perf_counter() - started
    started = time.perf_counter()
    got = await store.read(*lineage, len(ids))
    read = time.perf_counter() - started
    assert got == ids_to_bytes(ids)
    with capsys.disabled():
        print(f"\n{type(store).__name__}: 1000 appends of 1000 ids {appended:.3f}s, read of 1M ids {read * 1e3:.1f}ms")


async def test_sqlite_sweep_removes_expired_lineages(tmp_path, lineage):
    async with SqliteHistoryStore(tmp_path / "h.db") as store:
        await store.append(*lineage, 0, ids_to_bytes([1]), 60)
        await store.append(lineage[0], lineage[1], 2, 0, ids_to_bytes([2]), 600)
        assert await store.sweep() == 0
        assert await store.sweep(now=time.time() + 120) == 1
        assert await store.read(*lineage, 1) is None
        assert bytes_to_ids(await store.read(lineage[0], lineage[1], 2, 1)) == [2]
        rows = store.db.execute("SELECT count(*) FROM segments").fetchone()[0]
        assert rows == 1


async def test_sqlite_background_sweep_and_memory_path(lineage):
    async with SqliteHistoryStore(":memory:", sweep_interval_s=0.05) as store:
        await store.append(*lineage, 0, ids_to_bytes([1]), 0)
        await asyncio.sleep(0.3)
        assert store.db.execute("SELECT count(*) FROM lineages").fetchone()[0] == 0
        await store.append(*lineage, 0, ids_to_bytes([1]), TTL)
        assert bytes_to_ids(await store.read(*lineage, 1)) == [1]


async def test_sqlite_errors_are_unavailable(tmp_path):
    with pytest.raises(HistoryUnavailable, match="unable to open"):
        await SqliteHistoryStore(tmp_path).connect()  # a directory, not a file


async def test_redis_unreachable_is_unavailable(lineage):
    async with RedisHistoryStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5) as store:
        with pytest.raises(HistoryUnavailable):
            await store.append(*lineage, 0, ids_to_bytes([1]), TTL)
        with pytest.raises(HistoryUnavailable):
            await store.read(*lineage, 1)
        with pytest.raises(HistoryUnavailable):
            await store.drop(*lineage)


async def test_response_bodies_and_links_are_kept_per_conversation(store):
    """Stored responses' bodies (issue #27): per tenant and conversation, with their links; read in one call."""
    tenant, chain = uid("tenant"), uid("resp")
    await store.put_response_body(tenant, chain, "r1", b'{"n": 1}', TTL)
    await store.put_response_body(tenant, chain, "r2", b'{"n": 2}', TTL, previous="r1")
    await store.put_response_body(tenant, chain, "r2b", b'{"n": 3}', TTL, previous="r1")
    assert await store.read_response_links(tenant, chain) == {"r1": "", "r2": "r1", "r2b": "r1"}
    assert await store.read_response_bodies(tenant, chain, ["r1", "r2", "nope"]) == {"r1": b'{"n": 1}',
                                                                                     "r2": b'{"n": 2}'}
    assert await store.read_response_bodies(uid("other-tenant"), chain, ["r1"]) == {}
    assert await store.read_response_links(uid("other-tenant"), chain) == {}
    await store.put_response_body(tenant, chain, "r2", b'{"n": 22}', TTL, previous="r1")  # replaced
    await store.drop_response_body(tenant, chain, "r2b")
    assert await store.read_response_links(tenant, chain) == {"r1": "", "r2": "r1"}
    assert await store.read_response_bodies(tenant, chain, ["r2", "r2b"]) == {"r2": b'{"n": 22}'}
    assert await store.read_response_bodies(tenant, chain, []) == {}


async def test_a_conversations_bodies_expire_together_after_its_last_put(store):
    tenant, chain = uid("tenant"), uid("resp")
    await store.put_response_body(tenant, chain, "r1", b"1", 2)
    await asyncio.sleep(1.2)
    await store.put_response_body(tenant, chain, "r2", b"2", 2, previous="r1")  # keeps r1 too
    await asyncio.sleep(1.2)
    assert set(await store.read_response_bodies(tenant, chain, ["r1", "r2"])) == {"r1", "r2"}
    await asyncio.sleep(1.3)
    assert await store.read_response_bodies(tenant, chain, ["r1", "r2"]) == {}
    assert await store.read_response_links(tenant, chain) == {}


async def test_sqlite_sweep_removes_expired_conversations(tmp_path):
    async with SqliteHistoryStore(tmp_path / "h.db") as store:
        await store.put_response_body("t", "c1", "r1", b"1", 60)
        await store.put_response_body("t", "c2", "r2", b"2", 600)
        assert await store.sweep(now=time.time() + 120) == 1
        assert store.db.execute("SELECT id FROM response_bodies").fetchall() == [("r2",)]
