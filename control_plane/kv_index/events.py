"""vLLM's KV-cache events, decoded into kvshuttle's own types (pure).

A vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}'`` publishes every change to its prefix cache
(``vllm/distributed/kv_events.py``, vLLM 0.32). Each ZMQ message is three frames: the topic, an 8-byte big-endian
sequence number (0, 1, 2... per publisher process: a restarted engine starts again at 0; its replay socket answers
a request for "everything from seq N" from a bounded buffer and ends with seq -1), and the payload: one
``KVEventBatch`` as MessagePack (msgspec). The batch is an array ``[ts, events, data_parallel_rank]`` (``ts``: the
engine's wall-clock seconds; the rank may be nil or absent); each event is a map tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (blocks now cached, in prompt order), ``parent_block_hash`` (the block before
  the first of them; nil for a prompt's first block), ``token_ids`` (all their tokens), ``block_size``,
  ``lora_id``, ``medium`` (``"GPU"`` for the engine's own KV cache, also on CPU vLLM; offload tiers say ``"CPU"``),
  ``lora_name``, ``extra_keys`` (one entry per block: untagged LoRA name, cache salt... or nil), ``group_idx``;
  also re-sent for blocks a request reuses from the cache.
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``: evicted (one event per block in 0.32).
- ``AllBlocksCleared``: the prefix cache was reset.

Hashes are ints (the digest's low 64 bits) or bytes (:mod:`.hashing`). Fields this module does not use are kept
out; fields vLLM omits take their defaults. Anything malformed raises :class:`BadEventPayload`; an event type this
module does not know decodes to :class:`UnknownEvent` (a newer vLLM: the index treats it as a reason to distrust
its view, never guesses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshuttle.control_plane.kv_index.hashing import EventHash
from kvshuttle.control_plane.kv_index.msgpack_reader import MsgpackError, unpackb

REPLAY_END = -1  # the sequence number of the replay socket's end marker
MEDIUM_ENGINE = "GPU"  # vLLM's name for the engine's own KV cache (block_pool.py's default medium)


class BadEventPayload(ValueError):
    """A KV-event message that is not a batch vLLM's publisher would send."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[EventHash, ...]
    parent_block_hash: EventHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[EventHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class UnknownEvent:
    kind: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def _hash(value: Any, where: str) -> EventHash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise BadEventPayload(f"{where}: a block hash must be an int or bytes, got {type(value).__name__}")
    return value


def _hashes(event: dict, where: str) -> tuple[EventHash, ...]:
    value = event.get("block_hashes")
    if not isinstance(value, list):
        raise BadEventPayload(f"{where}: block_hashes must be a list")
    return tuple(_hash(h, f"{where}.block_hashes") for h in value)


def _optional(event: dict, field: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = event.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise BadEventPayload(f"{where}: {field} has type {type(value).__name__}")
    return value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _event(raw: Any, where: str) -> Event:
    if not isinstance(raw, dict):
        raise BadEventPayload(f"{where}: an event must be a map, got {type(raw).__name__}")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise BadEventPayload(f"{where}: an event needs a string 'type'")
    where = f"{where} ({kind})"
    if kind == "BlockStored":
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadEventPayload(f"{where}: token_ids must be a list of ints")
        size = raw.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise BadEventPayload(f"{where}: block_size must be a positive int")
        parent = raw.get("parent_block_hash")
        extra = _optional(raw, "extra_keys", list, where)
        return BlockStored(
            block_hashes=_hashes(raw, where),
            parent_block_hash=None if parent is None else _hash(parent, f"{where}.parent_block_hash"),
            token_ids=tuple(tokens), block_size=size,
            medium=_optional(raw, "medium", str, where), lora_name=_optional(raw, "lora_name", str, where),
            extra_keys=None if extra is None else _tupled(extra), group_idx=_optional(raw, "group_idx", int, where))
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(raw, where), medium=_optional(raw, "medium", str, where),
                            group_idx=_optional(raw, "group_idx", int, where))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(kind)


def decode_batch(payload: bytes) -> EventBatch:
    """One ``KVEventBatch`` payload (the message's last frame)."""
    try:
        raw = unpackb(payload)
    except MsgpackError as exc:
        raise BadEventPayload(f"not MessagePack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise BadEventPayload("a batch must be an array [ts, events, data_parallel_rank?]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise BadEventPayload(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise BadEventPayload("batch events must be an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise BadEventPayload(f"batch data_parallel_rank must be an int, got {type(rank).__name__}")
    return EventBatch(ts=float(ts), events=tuple(_event(e, f"event {i}") for i, e in enumerate(events)),
                      data_parallel_rank=rank)


def decode_sequence(frame: bytes) -> int:
    """A message's sequence-number frame: 8 bytes, big-endian, signed (the replay end marker is -1)."""
    if not isinstance(frame, (bytes, bytearray)) or len(frame) != 8:
        raise BadEventPayload("the sequence frame must be 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: list[bytes] | tuple[bytes, ...]) -> tuple[int, EventBatch]:
    """A published message ``(topic, seq, payload)`` as its sequence number and batch."""
    if len(frames) != 3:
        raise BadEventPayload(f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_sequence(frames[1]), decode_batch(frames[2])
