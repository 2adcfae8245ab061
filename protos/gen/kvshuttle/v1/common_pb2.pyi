import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class Worker(_message.Message):
    __slots__ = ("worker_id", "role", "engine_id", "grpc_address", "nixl_host", "nixl_port", "block_size", "kv_blocks_ttl_s", "model", "registered_at", "lease_id", "kv_bytes_per_token", "prefix_hash_algo", "prefix_hash_seed", "kv_events", "load_feed", "adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_HOST_FIELD_NUMBER: _ClassVar[int]
    NIXL_PORT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    engine_id: str
    grpc_address: str
    nixl_host: str
    nixl_port: int
    block_size: int
    kv_blocks_ttl_s: int
    model: str
    registered_at: _timestamp_pb2.Timestamp
    lease_id: int
    kv_bytes_per_token: int
    prefix_hash_algo: str
    prefix_hash_seed: str
    kv_events: bool
    load_feed: bool
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., engine_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., nixl_host: _Optional[str] = ..., nixl_port: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_blocks_ttl_s: _Optional[int] = ..., model: _Optional[str] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_id: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., prefix_hash_algo: _Optional[str] = ..., prefix_hash_seed: _Optional[str] = ..., kv_events: _Optional[bool] = ..., load_feed: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "id", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    path: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "tenant", "decode_worker_id", "kv_transfer_params_json", "covered_tokens", "block_size", "token_ids", "expires_at", "updated_at", "turn", "claimed", "revision", "prefix_digest", "lease_id", "created_at", "kv_freed", "text_key", "checkpoints", "history_tokens", "history_generation", "text_chars", "head_token_ids", "handle_digest", "text_boundaries", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    COVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_FREED_FIELD_NUMBER: _ClassVar[int]
    TEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    HEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TEXT_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    decode_worker_id: str
    kv_transfer_params_json: str
    covered_tokens: int
    block_size: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    expires_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    turn: int
    claimed: bool
    revision: int
    prefix_digest: bytes
    lease_id: int
    created_at: _timestamp_pb2.Timestamp
    kv_freed: str
    text_key: bytes
    checkpoints: _containers.RepeatedCompositeFieldContainer[PrefixCheckpoint]
    history_tokens: int
    history_generation: int
    text_chars: int
    head_token_ids: _containers.RepeatedScalarFieldContainer[int]
    handle_digest: bytes
    text_boundaries: _containers.RepeatedCompositeFieldContainer[TextBoundary]
    model: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., kv_transfer_params_json: _Optional[str] = ..., covered_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., turn: _Optional[int] = ..., claimed: _Optional[bool] = ..., revision: _Optional[int] = ..., prefix_digest: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kv_freed: _Optional[str] = ..., text_key: _Optional[bytes] = ..., checkpoints: _Optional[_Iterable[_Union[PrefixCheckpoint, _Mapping]]] = ..., history_tokens: _Optional[int] = ..., history_generation: _Optional[int] = ..., text_chars: _Optional[int] = ..., head_token_ids: _Optional[_Iterable[int]] = ..., handle_digest: _Optional[bytes] = ..., text_boundaries: _Optional[_Iterable[_Union[TextBoundary, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class TextBoundary(_message.Message):
    __slots__ = ("key", "chars", "tokens", "loop_start")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHARS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOP_START_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    chars: int
    tokens: int
    loop_start: bool
    def __init__(self, key: _Optional[bytes] = ..., chars: _Optional[int] = ..., tokens: _Optional[int] = ..., loop_start: _Optional[bool] = ...) -> None: ...

class PrefixCheckpoint(_message.Message):
    __slots__ = ("tokens", "digest")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    digest: bytes
    def __init__(self, tokens: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...
