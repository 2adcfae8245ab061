"""Snapshots of the shared learned state in etcd: a manifest (``learned/snapshot``) naming its chunks, written by
the replica that leads ``learning`` (see services/scheduler/learning.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

from etcd3aio import prefix_range_end
from kvshuttle.services.store.etcd_connection import EtcdConnection
from kvshuttle.services.store.interface import StoreError


class LearnedSnapshots:
    def __init__(self, conn: EtcdConnection):
        self._conn = conn
        self._keys = conn.keys

    async def put(self, manifest: dict, blob: bytes, chunk_bytes: int = 1 << 20) -> None:
        """Store a snapshot of the learned state: ``blob`` in chunks under a new id, then the manifest naming them
        (``manifest`` plus id, chunks, bytes, sha256) in one put, then the previous snapshot's chunks go. A reader
        sees the old snapshot or the new one, whole."""
        call, kv, keys = self._conn.call, self._conn.kv, self._keys
        snapshot_id = f"{manifest.get('revision', 0):016x}-{os.urandom(4).hex()}"
        chunks = [blob[i:i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)] or [b""]
        prefix = keys.learned_snapshot_chunks(snapshot_id)
        for i, chunk in enumerate(chunks):
            await call("put snapshot", kv.put, f"{prefix}{i:06d}", chunk)
        previous = await call("get snapshot", kv.get, keys.learned_snapshot)
        full = {**manifest, "id": snapshot_id, "chunks": len(chunks), "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest()}
        await call("put snapshot", kv.put, keys.learned_snapshot, json.dumps(full).encode())
        old_ids = {snapshot_id}
        if previous.kvs:
            with contextlib.suppress(ValueError, AttributeError):
                old_ids.add(json.loads(previous.kvs[0].value).get("id", snapshot_id))
        for old in old_ids - {snapshot_id}:
            old_prefix = keys.learned_snapshot_chunks(str(old))
            await call("delete snapshot", kv.delete, old_prefix, prefix_range_end(old_prefix))

    async def get(self) -> tuple[dict, bytes] | None:
        """The latest snapshot's manifest and blob (checked against its sha256), or None when there is none.
        Raises StoreError when it is unreadable (chunks missing or corrupt)."""
        resp = await self._conn.call("get snapshot", self._conn.kv.get, self._keys.learned_snapshot)
        if not resp.kvs:
            return None
        try:
            manifest = json.loads(resp.kvs[0].value)
            prefix = self._keys.learned_snapshot_chunks(str(manifest["id"]))
            count, digest = int(manifest["chunks"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"learned snapshot manifest unreadable: {exc}") from None
        parts = []
        for i in range(count):  # one chunk per read: a whole snapshot may exceed a gRPC message
            chunk = await self._conn.call("get snapshot", self._conn.kv.get, f"{prefix}{i:06d}",
                                          revision=resp.header.revision)
            if not chunk.kvs:
                break
            parts.append(chunk.kvs[0].value)
        blob = b"".join(parts)
        if len(parts) != count or hashlib.sha256(blob).hexdigest() != digest:
            raise StoreError(f"learned snapshot {manifest['id']} is incomplete or corrupt")
        return manifest, blob
