from kvshuttle.v1 import common_pb2 as _common_pb2
from kvshuttle.v1 import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_PULL: _ClassVar[Decision]
    DECISION_RECOMPUTE: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
DECISION_PULL: Decision
DECISION_RECOMPUTE: Decision

class PlanTurnRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "prompt_token_ids", "disable_pull", "exclude_worker_ids", "session_snapshot", "session_not_found")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PULL_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SESSION_NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    disable_pull: bool
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    session_snapshot: _registry_pb2.GetSessionResponse
    session_not_found: bool
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., disable_pull: _Optional[bool] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., session_snapshot: _Optional[_Union[_registry_pb2.GetSessionResponse, _Mapping]] = ..., session_not_found: _Optional[bool] = ...) -> None: ...

class PlanFigures(_message.Message):
    __slots__ = ("prompt_tokens", "session_found", "covered_tokens", "matched_tokens", "reusable_tokens", "compute_tokens", "block_size", "expires_in_s", "pull_threshold_tokens", "source_worker_alive", "snapshot_stale", "policy", "predicted_pull_ms", "predicted_recompute_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FOUND_FIELD_NUMBER: _ClassVar[int]
    COVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    PULL_THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ALIVE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STALE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RECOMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    session_found: bool
    covered_tokens: int
    matched_tokens: int
    reusable_tokens: int
    compute_tokens: int
    block_size: int
    expires_in_s: float
    pull_threshold_tokens: int
    source_worker_alive: bool
    snapshot_stale: bool
    policy: str
    predicted_pull_ms: float
    predicted_recompute_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., session_found: _Optional[bool] = ..., covered_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., reusable_tokens: _Optional[int] = ..., compute_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., pull_threshold_tokens: _Optional[int] = ..., source_worker_alive: _Optional[bool] = ..., snapshot_stale: _Optional[bool] = ..., policy: _Optional[str] = ..., predicted_pull_ms: _Optional[float] = ..., predicted_recompute_ms: _Optional[float] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "prompt_tokens", "pulled_tokens", "computed_tokens", "prefill_ms", "decision")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    prompt_tokens: int
    pulled_tokens: int
    computed_tokens: int
    prefill_ms: float
    decision: Decision
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., decision: _Optional[_Union[Decision, str]] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanTurnResponse(_message.Message):
    __slots__ = ("decision", "reason", "prefill", "decode", "prefill_kv_transfer_params_json", "source", "figures")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    reason: str
    prefill: _common_pb2.Worker
    decode: _common_pb2.Worker
    prefill_kv_transfer_params_json: str
    source: _common_pb2.Worker
    figures: PlanFigures
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., reason: _Optional[str] = ..., prefill: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., prefill_kv_transfer_params_json: _Optional[str] = ..., source: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., figures: _Optional[_Union[PlanFigures, _Mapping]] = ...) -> None: ...
