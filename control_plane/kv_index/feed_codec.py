"""The KV feed's wire form (``kvshuttle.v1.KvFeedBatch``) to and from the index's events (pure).

Only what a prefix index needs crosses the feed: stored chains (hashes, parent, block size, and for a prompt's first
block its tokens and salt, so a reader can check it hashes as the worker did), removals and clears. Blocks outside
the engine's own cache (offload tiers, other KV-cache groups) are left out by the publisher.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshuttle.control_plane.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvshuttle.control_plane.kv_index.hashing import EventHash
from kvshuttle.v1 import kv_feed_pb2


class BadFeedEntry(ValueError):
    """A feed entry that no publisher of this version writes."""


def to_feed(worker_id: str, epoch: int, seq: int, batch: EventBatch) -> kv_feed_pb2.KvFeedBatch:
    """``batch`` (engine-cache events only: the caller filters) as the feed carries it."""
    out = kv_feed_pb2.KvFeedBatch(worker_id=worker_id, epoch=epoch, seq=seq, ts=batch.ts)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = kv_feed_pb2.KvFeedStored(block_hashes=[_int(h) for h in event.block_hashes],
                                              block_size=event.block_size)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = _int(event.parent_block_hash)
            elif event.token_ids and event.lora_name is None and _checkable(event):
                stored.first_block_tokens.extend(event.token_ids[:event.block_size])
                salt = _salt(event)
                if salt:
                    stored.first_block_salt = salt
            out.events.add(stored=stored)
        elif isinstance(event, BlockRemoved):
            out.events.add(removed=kv_feed_pb2.KvFeedRemoved(block_hashes=[_int(h) for h in event.block_hashes]))
        elif isinstance(event, AllBlocksCleared):
            out.events.add(cleared=True)
    return out


def snapshot(worker_id: str, epoch: int, seq: int, ts: float, held: Sequence[EventHash],
             block_size: int) -> kv_feed_pb2.KvFeedBatch:
    """A worker's whole view as of its entry ``seq``: a clear, then every held block (``held`` least recently stored
    first; written most recent first, as the index stores a chain's blocks last to first)."""
    out = kv_feed_pb2.KvFeedBatch(worker_id=worker_id, epoch=epoch, seq=seq, ts=ts)
    out.events.add(cleared=True)
    if held:
        out.events.add(stored=kv_feed_pb2.KvFeedStored(block_hashes=[_int(h) for h in reversed(held)],
                                                       block_size=block_size))
    return out


def from_feed(entry: kv_feed_pb2.KvFeedBatch) -> EventBatch:
    """The index's events for one feed entry; BadFeedEntry for an event of no known kind."""
    events = []
    for event in entry.events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            s = event.stored
            if s.block_size < 1:
                raise BadFeedEntry(f"stored blocks of size {s.block_size} from {entry.worker_id!r}")
            tokens = tuple(s.first_block_tokens)
            events.append(BlockStored(
                block_hashes=tuple(s.block_hashes),
                parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                token_ids=tokens, block_size=s.block_size,
                extra_keys=((s.first_block_salt,),) if s.first_block_salt else None))
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=tuple(event.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise BadFeedEntry(f"a feed event of no known kind from {entry.worker_id!r}")
    return EventBatch(ts=entry.ts, events=tuple(events))


def _int(h: EventHash) -> int:
    if not isinstance(h, int):
        raise BadFeedEntry("the feed carries int block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)")
    return h & 0xFFFF_FFFF_FFFF_FFFF


def _checkable(event: BlockStored) -> bool:
    """Whether a reader can rebuild the first block's hash: no extra key, or only a salt (not multimodal)."""
    return not event.extra_keys or event.extra_keys[0] is None or bool(_salt(event))


def _salt(event: BlockStored) -> str:
    keys = event.extra_keys[0] if event.extra_keys else None
    if isinstance(keys, tuple) and len(keys) == 1 and isinstance(keys[0], str):
        return keys[0]
    return ""
