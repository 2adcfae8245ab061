"""The history store: sessions' exact token ids, kept outside etcd (etcd's record stays small).

A lineage ``(tenant, session_id, generation)`` holds its ids as segments, each stored at its offset (in ids). Turns
append segments, and may keep a turn's KV handle (vLLM's JSON lists every block: too big for etcd's record in long
sessions) under its digest; a lineage expires as a whole ``ttl_s`` seconds after its last append. It also keeps
the bodies of stored Responses API responses (etcd keeps their small index entries), per conversation. Ids travel as bytes: int32
little-endian, 4 bytes each (``control_plane.prefix.ids_bytes``, :func:`bytes_to_ids`). Backends: ``history_sqlite`` (embedded, one
registry process) and ``history_redis`` (shared by a cluster's replicas).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

ID_BYTES = 4
assert array("i").itemsize == ID_BYTES
_SWAP = sys.byteorder != "little"


class HistoryUnavailable(Exception):
    """The history's backing store cannot be reached, failed, or did not answer in time."""


class HistoryGone(Exception):
    """An append that continues part of another lineage (``copy_from``) found it no longer holding those ids
    (expired, dropped): the caller must send the whole history."""


class HistoryStore(Protocol):
    """Segments of token ids per lineage. Failures raise ``HistoryUnavailable``."""

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def append(self, tenant: str, session_id: str, generation: int, start: int, ids: bytes,
                     ttl_s: int, handle: tuple[bytes, bytes] | None = None, copy_from: int = 0) -> None:
        """Store ``ids`` (int32 little-endian, 4 bytes per id) as the segment at offset ``start`` (in ids) of the
        lineage; a segment already at that offset is replaced (upsert). With ``handle`` (digest, value), the
        lineage also keeps that KV handle under its digest, in the same write. The whole lineage (segments and
        handles) now expires ``ttl_s`` seconds from now.

        ``copy_from``: a new lineage that begins as the first ``start`` ids of lineage ``copy_from`` of the same
        session: they are copied inside the store, in the same write (a history that continues only part of the
        previous one; the previous lineage stays as it was for whoever still reads it). Raises ``HistoryGone``
        when that lineage no longer holds them (nothing is written then)."""
        ...

    async def read_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> bytes | None:
        """The KV handle kept under ``digest`` in the lineage, or None (dropped, expired, never written)."""
        ...

    async def drop_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> None:
        """Delete one handle of the lineage (no error when absent)."""
        ...

    async def read(self, tenant: str, session_id: str, generation: int, length: int) -> bytes | None:
        """The lineage's first ``length`` ids as bytes (4*length), assembled from its segments (:func:`assemble`);
        None when they are not all there (lost, expired, never written, a gap)."""
        ...

    async def drop(self, tenant: str, session_id: str, generation: int) -> None:
        """Delete the lineage, its handles included (no error when absent)."""
        ...

    # Stored responses' bodies (the Responses API): grouped per conversation (``chain_id``: its first response),
    # so that a conversation expires as a whole ``ttl_s`` after its last put, as its etcd lease does.

    async def put_response_body(self, tenant: str, chain_id: str, response_id: str, body: bytes,
                                ttl_s: int, previous: str = "") -> None:
        """Keep ``body`` under ``response_id`` in the conversation's group (replacing one there), with its link to
        the response it continues (``previous``, '' for the first), in one write; the whole group now expires
        ``ttl_s`` seconds from now."""
        ...

    async def read_response_links(self, tenant: str, chain_id: str) -> dict[str, str]:
        """Every link of the group: response id -> the id it continues ('' for the first). Empty when the group is
        gone."""
        ...

    async def read_response_bodies(self, tenant: str, chain_id: str,
                                   response_ids: Sequence[str]) -> dict[str, bytes]:
        """The bodies of ``response_ids`` in the group, by id; ids without one (dropped, expired, never put) are
        absent."""
        ...

    async def drop_response_body(self, tenant: str, chain_id: str, response_id: str) -> None:
        """Delete one body of the group, and its link (no error when absent)."""
        ...


def assemble(segments: Iterable[tuple[int, bytes]], length: int) -> bytes | None:
    """The first ``length`` ids of ``(start, ids bytes)`` segments, or None when they do not cover ``[0, length)``
    (:func:`truncated`'s segments, joined): exactly 4*length bytes."""
    kept = truncated(segments, length)
    return b"".join(ids for _, ids in kept) if kept or not length else None


def truncated(segments: Iterable[tuple[int, bytes]], length: int) -> list[tuple[int, bytes]]:
    """The segments that hold the first ``length`` ids, the last one cut at ``length``; [] when they do not cover
    ``[0, length)`` (or ``length`` is 0). In offset order from pos=0: a segment starting at pos extends it; one
    starting before pos is skipped (stale: a later, longer append covered it); one starting after pos leaves a gap.
    What a read assembles, and what a lineage copied from another starts with."""
    out: list[tuple[int, bytes]] = []
    pos, need = 0, length * ID_BYTES
    for start, ids in sorted(segments, key=lambda s: s[0]):
        if pos >= need:
            break
        begin = start * ID_BYTES
        if begin < pos:
            continue
        if begin > pos:
            return []
        out.append((start, ids if len(ids) <= need - pos else ids[:need - pos]))  # only the last one is cut
        pos += len(out[-1][1])
    return out if pos >= need else []


def bytes_to_ids(b: bytes) -> list[int]:
    """int32 little-endian bytes -> token ids."""
    if len(b) % ID_BYTES:
        raise ValueError(f"{len(b)} bytes is not a whole number of int32 ids")
    arr = array("i")
    arr.frombytes(b)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()
