import datetime

from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvshuttle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker", "lease_ttl_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    lease_ttl_s: int
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., lease_ttl_s: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker", "lease_id", "lease_ttl_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    lease_id: int
    lease_ttl_s: int
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: int
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: int
    def __init__(self, lease_ttl_s: _Optional[int] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: int
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.Worker, _Mapping]]] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchWorkersResponse(_message.Message):
    __slots__ = ("type", "workers")
    class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EVENT_TYPE_UNSPECIFIED: _ClassVar[WatchWorkersResponse.EventType]
        EVENT_TYPE_SNAPSHOT: _ClassVar[WatchWorkersResponse.EventType]
        EVENT_TYPE_PUT: _ClassVar[WatchWorkersResponse.EventType]
        EVENT_TYPE_DELETE: _ClassVar[WatchWorkersResponse.EventType]
    EVENT_TYPE_UNSPECIFIED: WatchWorkersResponse.EventType
    EVENT_TYPE_SNAPSHOT: WatchWorkersResponse.EventType
    EVENT_TYPE_PUT: WatchWorkersResponse.EventType
    EVENT_TYPE_DELETE: WatchWorkersResponse.EventType
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    type: WatchWorkersResponse.EventType
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.Worker]
    def __init__(self, type: _Optional[_Union[WatchWorkersResponse.EventType, str]] = ..., workers: _Optional[_Iterable[_Union[_common_pb2.Worker, _Mapping]]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "include_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    include_token_ids: bool
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., include_token_ids: _Optional[bool] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session", "expires_in_s", "history_missing")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    HISTORY_MISSING_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.Session
    expires_in_s: float
    history_missing: str
    def __init__(self, session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ..., expires_in_s: _Optional[float] = ..., history_missing: _Optional[str] = ...) -> None: ...

class RecordTurnRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "decode_worker_id", "kv_transfer_params_json", "token_ids", "text", "finished_at", "text_key", "base_tokens", "base_turn", "prefix_digest", "checkpoints", "text_chars", "text_boundaries", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    TEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    BASE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_TURN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    TEXT_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    decode_worker_id: str
    kv_transfer_params_json: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished_at: _timestamp_pb2.Timestamp
    text_key: bytes
    base_tokens: int
    base_turn: int
    prefix_digest: bytes
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.PrefixCheckpoint]
    text_chars: int
    text_boundaries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TextBoundary]
    model: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., kv_transfer_params_json: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., text_key: _Optional[bytes] = ..., base_tokens: _Optional[int] = ..., base_turn: _Optional[int] = ..., prefix_digest: _Optional[bytes] = ..., checkpoints: _Optional[_Iterable[_Union[_common_pb2.PrefixCheckpoint, _Mapping]]] = ..., text_chars: _Optional[int] = ..., text_boundaries: _Optional[_Iterable[_Union[_common_pb2.TextBoundary, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class RecordTurnResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.Session
    def __init__(self, session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ...) -> None: ...

class ClaimSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "revision", "free_reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FREE_REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    revision: int
    free_reason: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., revision: _Optional[int] = ..., free_reason: _Optional[str] = ...) -> None: ...

class ClaimSessionResponse(_message.Message):
    __slots__ = ("claimed", "reason", "session")
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    claimed: bool
    reason: str
    session: _common_pb2.Session
    def __init__(self, claimed: _Optional[bool] = ..., reason: _Optional[str] = ..., session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ...) -> None: ...

class FindSessionRequest(_message.Message):
    __slots__ = ("tenant", "text_keys", "include_token_ids", "model")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEXT_KEYS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    text_keys: _containers.RepeatedScalarFieldContainer[bytes]
    include_token_ids: bool
    model: str
    def __init__(self, tenant: _Optional[str] = ..., text_keys: _Optional[_Iterable[bytes]] = ..., include_token_ids: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class FindSessionResponse(_message.Message):
    __slots__ = ("session", "expires_in_s", "matched_key", "history_missing")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    MATCHED_KEY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_MISSING_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.Session
    expires_in_s: float
    matched_key: int
    history_missing: str
    def __init__(self, session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ..., expires_in_s: _Optional[float] = ..., matched_key: _Optional[int] = ..., history_missing: _Optional[str] = ...) -> None: ...

class StoredResponse(_message.Message):
    __slots__ = ("response_id", "tenant", "session_id", "body_json", "created_at", "expires_at", "previous_response_id", "chain_id", "chain_length", "chain_bytes", "body_in_history_store", "body_bytes")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    BODY_IN_HISTORY_STORE_FIELD_NUMBER: _ClassVar[int]
    BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    tenant: str
    session_id: str
    body_json: bytes
    created_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    previous_response_id: str
    chain_id: str
    chain_length: int
    chain_bytes: int
    body_in_history_store: bool
    body_bytes: int
    def __init__(self, response_id: _Optional[str] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., body_json: _Optional[bytes] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., previous_response_id: _Optional[str] = ..., chain_id: _Optional[str] = ..., chain_length: _Optional[int] = ..., chain_bytes: _Optional[int] = ..., body_in_history_store: _Optional[bool] = ..., body_bytes: _Optional[int] = ...) -> None: ...

class PutResponseRequest(_message.Message):
    __slots__ = ("response", "ttl_s")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    response: StoredResponse
    ttl_s: int
    def __init__(self, response: _Optional[_Union[StoredResponse, _Mapping]] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class PutResponseResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: StoredResponse
    def __init__(self, response: _Optional[_Union[StoredResponse, _Mapping]] = ...) -> None: ...

class GetResponseRequest(_message.Message):
    __slots__ = ("response_id", "tenant")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    tenant: str
    def __init__(self, response_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class GetResponseResponse(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: StoredResponse
    def __init__(self, response: _Optional[_Union[StoredResponse, _Mapping]] = ...) -> None: ...

class GetResponseChainRequest(_message.Message):
    __slots__ = ("response_id", "tenant", "max_responses", "max_bytes")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    tenant: str
    max_responses: int
    max_bytes: int
    def __init__(self, response_id: _Optional[str] = ..., tenant: _Optional[str] = ..., max_responses: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class GetResponseChainResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[StoredResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[StoredResponse, _Mapping]]] = ...) -> None: ...

class DeleteResponseRequest(_message.Message):
    __slots__ = ("response_id", "tenant")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    tenant: str
    def __init__(self, response_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteResponseResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...
