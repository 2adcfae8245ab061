from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvFeedBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "ts", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvFeedEvent]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvFeedEvent, _Mapping]]] = ...) -> None: ...

class KvFeedEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KvFeedStored
    removed: KvFeedRemoved
    cleared: bool
    def __init__(self, stored: _Optional[_Union[KvFeedStored, _Mapping]] = ..., removed: _Optional[_Union[KvFeedRemoved, _Mapping]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class KvFeedStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "block_size", "first_block_tokens", "first_block_salt")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_SALT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    block_size: int
    first_block_tokens: _containers.RepeatedScalarFieldContainer[int]
    first_block_salt: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., block_size: _Optional[int] = ..., first_block_tokens: _Optional[_Iterable[int]] = ..., first_block_salt: _Optional[str] = ...) -> None: ...

class KvFeedRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerLoadSample(_message.Message):
    __slots__ = ("worker_id", "polled_at", "interval_s", "error", "running", "waiting", "used_tokens", "capacity_tokens", "waiting_uncached_tokens", "cache_hit_rate")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLLED_AT_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    polled_at: float
    interval_s: float
    error: str
    running: int
    waiting: int
    used_tokens: int
    capacity_tokens: int
    waiting_uncached_tokens: int
    cache_hit_rate: float
    def __init__(self, worker_id: _Optional[str] = ..., polled_at: _Optional[float] = ..., interval_s: _Optional[float] = ..., error: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., used_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., waiting_uncached_tokens: _Optional[int] = ..., cache_hit_rate: _Optional[float] = ...) -> None: ...
