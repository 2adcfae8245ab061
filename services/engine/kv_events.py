"""vLLM's KV-cache events as the worker's gRPC servicer relays them (smg ``KvEventBatch``) into the index's events.

The relay reduces each block hash to a signed int64 (its low 64 bits); vLLM's own int event hashes are the same low
64 bits, unsigned (control_plane/kv_index/hashing.py ``event_hash``): converted back here. Only the engine's own
cache counts: blocks the relay places in another tier (host, disk, external) or another KV-cache group, or marks
remote, are left out, as is any event the relay could not map to whole blocks.
"""

from __future__ import annotations

from kvshuttle.control_plane.kv_index.events import (
    MEDIUM_ENGINE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from smg_grpc_proto.generated import common_pb2

_U64 = 0xFFFF_FFFF_FFFF_FFFF
_DEVICE_TIERS = (common_pb2.KV_CACHE_TIER_UNSPECIFIED, common_pb2.KV_CACHE_TIER_DEVICE)


def relay_events(batch: common_pb2.KvEventBatch) -> EventBatch:
    """One relayed batch (or snapshot chunk) as the index's events; load-only batches give none."""
    events: list = []
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = _stored(event.stored)
            if stored is not None:
                events.append(stored)
        elif kind == "removed":
            removed = event.removed
            if _engine_cache(removed):
                events.append(BlockRemoved(block_hashes=tuple(h & _U64 for h in removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return EventBatch(ts=batch.timestamp, events=tuple(events),
                      data_parallel_rank=batch.dp_rank if batch.HasField("dp_rank") else None)


def _engine_cache(msg) -> bool:
    fields = {f.name for f, _ in msg.ListFields()}
    if "tier" in fields and msg.tier != common_pb2.KV_CACHE_TIER_UNSPECIFIED:
        if msg.tier not in _DEVICE_TIERS:
            return False
    elif "medium" in fields and msg.medium and msg.medium != MEDIUM_ENGINE:
        return False
    if "group_idx" in fields and msg.group_idx != 0:
        return False
    return not ("locality" in fields and msg.locality == common_pb2.KV_CACHE_LOCALITY_REMOTE)


def _stored(stored: common_pb2.KvBlocksStored) -> BlockStored | None:
    if not stored.blocks or not _engine_cache(stored):
        return None
    block_size = stored.blocks[0].block_size
    tokens: tuple[int, ...] = ()
    parent = stored.parent_block_hash & _U64 if stored.HasField("parent_block_hash") else None
    if parent is None:
        tokens = tuple(stored.blocks[0].token_ids)
    salt = stored.cache_salt if stored.HasField("cache_salt") else ""
    return BlockStored(
        block_hashes=tuple(b.block_hash & _U64 for b in stored.blocks), parent_block_hash=parent,
        token_ids=tokens, block_size=block_size,
        lora_name=stored.lora_name if stored.HasField("lora_name") and stored.lora_name else None,
        extra_keys=((salt,),) if salt else None)
