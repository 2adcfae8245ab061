from google.api import annotations_pb2 as _annotations_pb2
from kvshuttle.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("deleted", "kv_released")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    KV_RELEASED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    kv_released: bool
    def __init__(self, deleted: _Optional[bool] = ..., kv_released: _Optional[bool] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("session_id", "model", "prompt", "prompt_token_ids", "sampling", "disable_pull", "policy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PULL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    disable_pull: bool
    policy: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., disable_pull: _Optional[bool] = ..., policy: _Optional[str] = ...) -> None: ...

class ChatCompleteRequest(_message.Message):
    __slots__ = ("session_id", "model", "messages", "sampling", "disable_pull", "policy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PULL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingOptions
    disable_pull: bool
    policy: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., disable_pull: _Optional[bool] = ..., policy: _Optional[str] = ...) -> None: ...

class KvReport(_message.Message):
    __slots__ = ("decision", "reason", "pulled_tokens", "computed_tokens", "retried_as_recompute", "prefill_worker_id", "decode_worker_id", "figures", "worker_failures", "reason_code", "session_source", "session_id", "record", "record_error")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRIED_AS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    WORKER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    RECORD_ERROR_FIELD_NUMBER: _ClassVar[int]
    decision: _scheduler_pb2.Decision
    reason: str
    pulled_tokens: int
    computed_tokens: int
    retried_as_recompute: bool
    prefill_worker_id: str
    decode_worker_id: str
    figures: _scheduler_pb2.PlanFigures
    worker_failures: _containers.RepeatedScalarFieldContainer[str]
    reason_code: str
    session_source: str
    session_id: str
    record: str
    record_error: str
    def __init__(self, decision: _Optional[_Union[_scheduler_pb2.Decision, str]] = ..., reason: _Optional[str] = ..., pulled_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., retried_as_recompute: _Optional[bool] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., figures: _Optional[_Union[_scheduler_pb2.PlanFigures, _Mapping]] = ..., worker_failures: _Optional[_Iterable[str]] = ..., reason_code: _Optional[str] = ..., session_source: _Optional[str] = ..., session_id: _Optional[str] = ..., record: _Optional[str] = ..., record_error: _Optional[str] = ...) -> None: ...

class TurnTimings(_message.Message):
    __slots__ = ("plan_ms", "prefill_ms", "ttft_ms", "decode_ms", "record_ms", "total_ms", "prompt_ms", "session_ms", "find_ms")
    PLAN_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    RECORD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_MS_FIELD_NUMBER: _ClassVar[int]
    FIND_MS_FIELD_NUMBER: _ClassVar[int]
    plan_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms: float
    record_ms: float
    total_ms: float
    prompt_ms: float
    session_ms: float
    find_ms: float
    def __init__(self, plan_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., record_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prompt_ms: _Optional[float] = ..., session_ms: _Optional[float] = ..., find_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("id", "model", "text", "token_ids", "prompt_token_ids", "finish_reason", "usage", "kv", "timings", "max_tokens", "max_tokens_source")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    kv: KvReport
    timings: TurnTimings
    max_tokens: int
    max_tokens_source: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., kv: _Optional[_Union[KvReport, _Mapping]] = ..., timings: _Optional[_Union[TurnTimings, _Mapping]] = ..., max_tokens: _Optional[int] = ..., max_tokens_source: _Optional[str] = ...) -> None: ...

class ChatCompleteResponse(_message.Message):
    __slots__ = ("id", "model", "message", "token_ids", "prompt_token_ids", "finish_reason", "usage", "kv", "timings", "max_tokens", "max_tokens_source")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    message: ChatMessage
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    kv: KvReport
    timings: TurnTimings
    max_tokens: int
    max_tokens_source: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., message: _Optional[_Union[ChatMessage, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., kv: _Optional[_Union[KvReport, _Mapping]] = ..., timings: _Optional[_Union[TurnTimings, _Mapping]] = ..., max_tokens: _Optional[int] = ..., max_tokens_source: _Optional[str] = ...) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("started", "delta", "finished")
    class Started(_message.Message):
        __slots__ = ("id", "model", "kv", "prompt_tokens", "max_tokens", "max_tokens_source")
        ID_FIELD_NUMBER: _ClassVar[int]
        MODEL_FIELD_NUMBER: _ClassVar[int]
        KV_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
        MAX_TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
        id: str
        model: str
        kv: KvReport
        prompt_tokens: int
        max_tokens: int
        max_tokens_source: str
        def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., kv: _Optional[_Union[KvReport, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_tokens_source: _Optional[str] = ...) -> None: ...
    class Delta(_message.Message):
        __slots__ = ("text", "token_ids", "content", "reasoning_content")
        TEXT_FIELD_NUMBER: _ClassVar[int]
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        CONTENT_FIELD_NUMBER: _ClassVar[int]
        REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
        text: str
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        content: str
        reasoning_content: str
        def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...
    class Finished(_message.Message):
        __slots__ = ("finish_reason", "usage", "kv", "timings")
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        USAGE_FIELD_NUMBER: _ClassVar[int]
        KV_FIELD_NUMBER: _ClassVar[int]
        TIMINGS_FIELD_NUMBER: _ClassVar[int]
        finish_reason: str
        usage: Usage
        kv: KvReport
        timings: TurnTimings
        def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., kv: _Optional[_Union[KvReport, _Mapping]] = ..., timings: _Optional[_Union[TurnTimings, _Mapping]] = ...) -> None: ...
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: TurnEvent.Started
    delta: TurnEvent.Delta
    finished: TurnEvent.Finished
    def __init__(self, started: _Optional[_Union[TurnEvent.Started, _Mapping]] = ..., delta: _Optional[_Union[TurnEvent.Delta, _Mapping]] = ..., finished: _Optional[_Union[TurnEvent.Finished, _Mapping]] = ...) -> None: ...
