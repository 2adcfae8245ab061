"""The history store in an embedded SQLite file: the local stack's default (one registry process owns the file).

One connection (WAL, ``synchronous=NORMAL``: a crash loses at most the last commits, never the file) guarded by a
lock; every call runs in a thread (``asyncio.to_thread``) so the event loop never waits on the disk. Expiry is kept
per lineage: reads ignore an expired lineage, and a background sweep deletes expired lineages and their segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvshuttle.services.store.history import HistoryGone, HistoryUnavailable, assemble, truncated

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    tenant TEXT NOT NULL, session TEXT NOT NULL, gen INTEGER NOT NULL, start INTEGER NOT NULL, ids BLOB NOT NULL,
    PRIMARY KEY (tenant, session, gen, start));
CREATE TABLE IF NOT EXISTS lineages (
    tenant TEXT NOT NULL, session TEXT NOT NULL, gen INTEGER NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, session, gen));
CREATE INDEX IF NOT EXISTS lineages_by_expiry ON lineages (expires_at);
CREATE TABLE IF NOT EXISTS handles (
    tenant TEXT NOT NULL, session TEXT NOT NULL, gen INTEGER NOT NULL, digest BLOB NOT NULL, handle BLOB NOT NULL,
    PRIMARY KEY (tenant, session, gen, digest));
CREATE TABLE IF NOT EXISTS response_chains (
    tenant TEXT NOT NULL, chain TEXT NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (tenant, chain));
CREATE INDEX IF NOT EXISTS response_chains_by_expiry ON response_chains (expires_at);
CREATE TABLE IF NOT EXISTS response_bodies (
    tenant TEXT NOT NULL, chain TEXT NOT NULL, id TEXT NOT NULL, previous TEXT NOT NULL, body BLOB NOT NULL,
    PRIMARY KEY (tenant, chain, id));
"""
_EXPIRED = "SELECT tenant, session, gen FROM lineages WHERE expires_at <= ?"
_EXPIRED_CHAINS = "SELECT tenant, chain FROM response_chains WHERE expires_at <= ?"
_READ_BATCH = 500  # ids per SELECT (SQLite's bound-parameter limit is larger; this keeps statements small)


class SqliteHistoryStore:
    """:class:`~kvshuttle.services.store.history.HistoryStore` in the SQLite file at ``path`` (``":memory:"``: in
    memory, for tests). ``connect()`` opens it and starts the sweep (every ``sweep_interval_s``)."""

    def __init__(self, path: str | Path, *, sweep_interval_s: float = 60.0):
        self.path = str(path)
        self.sweep_interval_s = sweep_interval_s
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._sweeper: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self._run(self._open)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="history-sweep")

    def _open(self) -> None:
        if self._db is not None:
            return
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        self._db = db

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    async def __aenter__(self) -> SqliteHistoryStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a thread, holding the lock; SQLite's errors become HistoryUnavailable."""
        return await asyncio.to_thread(self._locked, fn, *args)

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            try:
                return fn(*args)
            except sqlite3.Error as exc:
                raise HistoryUnavailable(f"sqlite history {self.path}: {exc}") from exc

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("SqliteHistoryStore is not connected")
        return self._db

    @contextlib.contextmanager
    def _transaction(self):
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- the interface ---------------------------------------------------------------------------------------

    async def append(self, tenant: str, session_id: str, generation: int, start: int, ids: bytes,
                     ttl_s: int, handle: tuple[bytes, bytes] | None = None, copy_from: int = 0) -> None:
        await self._run(self._append, (tenant, session_id, generation), start, ids, ttl_s, handle, copy_from)

    def _append(self, lineage: tuple[str, str, int], start: int, ids: bytes, ttl_s: int,
                handle: tuple[bytes, bytes] | None, copy_from: int = 0) -> None:
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT expires_at FROM lineages WHERE tenant=? AND session=? AND gen=?",
                             lineage).fetchone()
            if row is not None and row[0] <= now:  # expired, not yet swept: start afresh, as if it were gone
                db.execute("DELETE FROM segments WHERE tenant=? AND session=? AND gen=?", lineage)
                db.execute("DELETE FROM handles WHERE tenant=? AND session=? AND gen=?", lineage)
            if copy_from and start:
                source = (*lineage[:2], copy_from)
                alive = db.execute("SELECT expires_at FROM lineages WHERE tenant=? AND session=? AND gen=?",
                                   source).fetchone()
                kept = truncated(db.execute("SELECT start, ids FROM segments WHERE tenant=? AND session=? AND gen=? "
                                            "AND start < ?", (*source, start)).fetchall(), start) \
                    if alive is not None and alive[0] > now else []
                if not kept:
                    raise HistoryGone(f"lineage {copy_from} no longer holds the {start} ids to continue")
                db.executemany("INSERT INTO segments VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, session, gen, "
                               "start) DO UPDATE SET ids=excluded.ids", [(*lineage, s, b) for s, b in kept])
            db.execute("INSERT INTO segments VALUES (?, ?, ?, ?, ?) "
                       "ON CONFLICT (tenant, session, gen, start) DO UPDATE SET ids=excluded.ids",
                       (*lineage, start, ids))
            if handle is not None:
                db.execute("INSERT OR REPLACE INTO handles VALUES (?, ?, ?, ?, ?)", (*lineage, *handle))
            db.execute("INSERT INTO lineages VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (tenant, session, gen) DO UPDATE SET expires_at=excluded.expires_at",
                       (*lineage, now + ttl_s))

    async def read(self, tenant: str, session_id: str, generation: int, length: int) -> bytes | None:
        return await self._run(self._read, (tenant, session_id, generation), length)

    def _read(self, lineage: tuple[str, str, int], length: int) -> bytes | None:
        db = self.db  # one connection per process, under the lock; other processes only read (WAL)
        row = db.execute("SELECT expires_at FROM lineages WHERE tenant=? AND session=? AND gen=?",
                         lineage).fetchone()
        if row is None or row[0] <= time.time():
            return None
        segments = db.execute("SELECT start, ids FROM segments WHERE tenant=? AND session=? AND gen=? "
                              "AND start < ? ORDER BY start", (*lineage, length)).fetchall()
        return assemble(segments, length)

    async def read_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> bytes | None:
        return await self._run(self._read_handle, (tenant, session_id, generation), digest)

    def _read_handle(self, lineage: tuple[str, str, int], digest: bytes) -> bytes | None:
        row = self.db.execute("SELECT h.handle FROM handles h JOIN lineages l USING (tenant, session, gen) WHERE "
                              "tenant=? AND session=? AND gen=? AND digest=? AND l.expires_at > ?",
                              (*lineage, digest, time.time())).fetchone()
        return None if row is None else bytes(row[0])

    async def drop_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> None:
        await self._run(self._drop_handle, (tenant, session_id, generation), digest)

    def _drop_handle(self, lineage: tuple[str, str, int], digest: bytes) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM handles WHERE tenant=? AND session=? AND gen=? AND digest=?", (*lineage, digest))

    async def drop(self, tenant: str, session_id: str, generation: int) -> None:
        await self._run(self._drop, (tenant, session_id, generation))

    def _drop(self, lineage: tuple[str, str, int]) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM segments WHERE tenant=? AND session=? AND gen=?", lineage)
            db.execute("DELETE FROM handles WHERE tenant=? AND session=? AND gen=?", lineage)
            db.execute("DELETE FROM lineages WHERE tenant=? AND session=? AND gen=?", lineage)

    # -- stored responses' bodies -----------------------------------------------------------------------------

    async def put_response_body(self, tenant: str, chain_id: str, response_id: str, body: bytes,
                                ttl_s: int, previous: str = "") -> None:
        await self._run(self._put_response_body, (tenant, chain_id), response_id, body, ttl_s, previous)

    def _put_response_body(self, chain: tuple[str, str], response_id: str, body: bytes, ttl_s: int,
                           previous: str) -> None:
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT expires_at FROM response_chains WHERE tenant=? AND chain=?", chain).fetchone()
            if row is not None and row[0] <= now:  # expired, not yet swept: start afresh
                db.execute("DELETE FROM response_bodies WHERE tenant=? AND chain=?", chain)
            db.execute("INSERT INTO response_bodies VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, chain, id) "
                       "DO UPDATE SET previous=excluded.previous, body=excluded.body",
                       (*chain, response_id, previous, body))
            db.execute("INSERT INTO response_chains VALUES (?, ?, ?) ON CONFLICT (tenant, chain) "
                       "DO UPDATE SET expires_at=excluded.expires_at", (*chain, now + ttl_s))

    async def read_response_bodies(self, tenant: str, chain_id: str,
                                   response_ids: Sequence[str]) -> dict[str, bytes]:
        return await self._run(self._read_response_bodies, (tenant, chain_id), list(response_ids))

    def _read_response_bodies(self, chain: tuple[str, str], ids: list[str]) -> dict[str, bytes]:
        db = self.db
        row = db.execute("SELECT expires_at FROM response_chains WHERE tenant=? AND chain=?", chain).fetchone()
        if row is None or row[0] <= time.time():
            return {}
        out: dict[str, bytes] = {}
        for i in range(0, len(ids), _READ_BATCH):
            batch = ids[i:i + _READ_BATCH]
            marks = ", ".join("?" * len(batch))
            out.update((rid, bytes(body)) for rid, body in db.execute(
                f"SELECT id, body FROM response_bodies WHERE tenant=? AND chain=? AND id IN ({marks})",
                (*chain, *batch)))
        return out

    async def read_response_links(self, tenant: str, chain_id: str) -> dict[str, str]:
        return await self._run(self._read_response_links, (tenant, chain_id))

    def _read_response_links(self, chain: tuple[str, str]) -> dict[str, str]:
        db = self.db
        row = db.execute("SELECT expires_at FROM response_chains WHERE tenant=? AND chain=?", chain).fetchone()
        if row is None or row[0] <= time.time():
            return {}
        return dict(db.execute("SELECT id, previous FROM response_bodies WHERE tenant=? AND chain=?", chain))

    async def drop_response_body(self, tenant: str, chain_id: str, response_id: str) -> None:
        await self._run(self._drop_response_body, (tenant, chain_id), response_id)

    def _drop_response_body(self, chain: tuple[str, str], response_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM response_bodies WHERE tenant=? AND chain=? AND id=?", (*chain, response_id))

    # -- expiry ----------------------------------------------------------------------------------------------

    async def sweep(self, now: float | None = None) -> int:
        """Delete the lineages and response groups expired at ``now`` (default: the current time) and what they hold;
        how many."""
        return await self._run(self._sweep, time.time() if now is None else now)

    def _sweep(self, now: float) -> int:
        with self._transaction() as db:
            db.execute(f"DELETE FROM segments WHERE (tenant, session, gen) IN ({_EXPIRED})", (now,))
            db.execute(f"DELETE FROM handles WHERE (tenant, session, gen) IN ({_EXPIRED})", (now,))
            db.execute(f"DELETE FROM response_bodies WHERE (tenant, chain) IN ({_EXPIRED_CHAINS})", (now,))
            chains = db.execute("DELETE FROM response_chains WHERE expires_at <= ?", (now,)).rowcount
            return db.execute("DELETE FROM lineages WHERE expires_at <= ?", (now,)).rowcount + chains

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                removed = await self.sweep()
            except HistoryUnavailable as exc:
                log.warning("history sweep failed: %s", exc)
                continue
            if removed:
                log.debug("history sweep removed %d expired lineages", removed)

