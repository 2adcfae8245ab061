from google.api import annotations_pb2 as _annotations_pb2
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
    DECISION_LOCAL: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
DECISION_PULL: Decision
DECISION_RECOMPUTE: Decision
DECISION_LOCAL: Decision

class PlanTurnRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "prompt_token_ids", "prompt_ids_packed", "disable_pull", "exclude_worker_ids", "session_snapshot", "session_not_found", "policy", "max_tokens", "history_match_tokens", "cache_salt", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PULL_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SESSION_NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_MATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids_packed: bytes
    disable_pull: bool
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    session_snapshot: _registry_pb2.GetSessionResponse
    session_not_found: bool
    policy: str
    max_tokens: int
    history_match_tokens: int
    cache_salt: str
    model: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_ids_packed: _Optional[bytes] = ..., disable_pull: _Optional[bool] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., session_snapshot: _Optional[_Union[_registry_pb2.GetSessionResponse, _Mapping]] = ..., session_not_found: _Optional[bool] = ..., policy: _Optional[str] = ..., max_tokens: _Optional[int] = ..., history_match_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class PlanFigures(_message.Message):
    __slots__ = ("prompt_tokens", "session_found", "covered_tokens", "matched_tokens", "reusable_tokens", "compute_tokens", "block_size", "expires_in_s", "pull_threshold_tokens", "source_worker_alive", "snapshot_stale", "policy", "predicted_pull_ms", "predicted_recompute_ms", "pullable_tokens", "predicted_wait_ms", "worker_choice", "cached_tokens_estimate", "predicted_local_ms", "predicted_itl_delay_ms", "decode_streams")
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
    PULLABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LOCAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITL_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STREAMS_FIELD_NUMBER: _ClassVar[int]
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
    pullable_tokens: int
    predicted_wait_ms: float
    worker_choice: str
    cached_tokens_estimate: int
    predicted_local_ms: float
    predicted_itl_delay_ms: float
    decode_streams: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., session_found: _Optional[bool] = ..., covered_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., reusable_tokens: _Optional[int] = ..., compute_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., pull_threshold_tokens: _Optional[int] = ..., source_worker_alive: _Optional[bool] = ..., snapshot_stale: _Optional[bool] = ..., policy: _Optional[str] = ..., predicted_pull_ms: _Optional[float] = ..., predicted_recompute_ms: _Optional[float] = ..., pullable_tokens: _Optional[int] = ..., predicted_wait_ms: _Optional[float] = ..., worker_choice: _Optional[str] = ..., cached_tokens_estimate: _Optional[int] = ..., predicted_local_ms: _Optional[float] = ..., predicted_itl_delay_ms: _Optional[float] = ..., decode_streams: _Optional[int] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "prompt_tokens", "pulled_tokens", "computed_tokens", "prefill_ms", "decision", "source_worker_id", "pullable_tokens", "policy", "cached_tokens_estimate", "session_id", "tenant", "decode_streams", "model")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PULLABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    prompt_tokens: int
    pulled_tokens: int
    computed_tokens: int
    prefill_ms: float
    decision: Decision
    source_worker_id: str
    pullable_tokens: int
    policy: str
    cached_tokens_estimate: int
    session_id: str
    tenant: str
    decode_streams: int
    model: str
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., decision: _Optional[_Union[Decision, str]] = ..., source_worker_id: _Optional[str] = ..., pullable_tokens: _Optional[int] = ..., policy: _Optional[str] = ..., cached_tokens_estimate: _Optional[int] = ..., session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., decode_streams: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class OutcomeBatch(_message.Message):
    __slots__ = ("replica", "outcomes", "seq")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    replica: str
    outcomes: _containers.RepeatedCompositeFieldContainer[ReportOutcomeRequest]
    seq: int
    def __init__(self, replica: _Optional[str] = ..., outcomes: _Optional[_Iterable[_Union[ReportOutcomeRequest, _Mapping]]] = ..., seq: _Optional[int] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ("learned",)
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    learned: bool
    def __init__(self, learned: _Optional[bool] = ...) -> None: ...

class PlanTurnResponse(_message.Message):
    __slots__ = ("decision", "reason", "prefill", "decode", "prefill_kv_transfer_params_json", "source", "figures", "reason_code")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    reason: str
    prefill: _common_pb2.Worker
    decode: _common_pb2.Worker
    prefill_kv_transfer_params_json: str
    source: _common_pb2.Worker
    figures: PlanFigures
    reason_code: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., reason: _Optional[str] = ..., prefill: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., prefill_kv_transfer_params_json: _Optional[str] = ..., source: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., figures: _Optional[_Union[PlanFigures, _Mapping]] = ..., reason_code: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyStats(_message.Message):
    __slots__ = ("name", "kind", "is_default", "judged_turns", "regret_turns", "regret")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    JUDGED_TURNS_FIELD_NUMBER: _ClassVar[int]
    REGRET_TURNS_FIELD_NUMBER: _ClassVar[int]
    REGRET_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    is_default: bool
    judged_turns: int
    regret_turns: int
    regret: float
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., is_default: _Optional[bool] = ..., judged_turns: _Optional[int] = ..., regret_turns: _Optional[int] = ..., regret: _Optional[float] = ...) -> None: ...

class ComputeEstimate(_message.Message):
    __slots__ = ("prefill_worker_id", "fixed_ms", "ms_per_ktoken", "ms_per_ktoken_per_kcontext", "observations")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    MS_PER_KTOKEN_FIELD_NUMBER: _ClassVar[int]
    MS_PER_KTOKEN_PER_KCONTEXT_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    fixed_ms: float
    ms_per_ktoken: float
    ms_per_ktoken_per_kcontext: float
    observations: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., fixed_ms: _Optional[float] = ..., ms_per_ktoken: _Optional[float] = ..., ms_per_ktoken_per_kcontext: _Optional[float] = ..., observations: _Optional[int] = ...) -> None: ...

class TransferEstimate(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "ms_per_transfer", "ms_per_kpulled", "observations")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MS_PER_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    MS_PER_KPULLED_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    ms_per_transfer: float
    ms_per_kpulled: float
    observations: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., ms_per_transfer: _Optional[float] = ..., ms_per_kpulled: _Optional[float] = ..., observations: _Optional[int] = ...) -> None: ...

class WorkerLoadStats(_message.Message):
    __slots__ = ("worker_id", "running", "waiting", "pending", "used_tokens", "capacity_tokens", "age_s", "reachable", "assigned_turns", "source")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_TURNS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running: int
    waiting: int
    pending: int
    used_tokens: int
    capacity_tokens: int
    age_s: float
    reachable: bool
    assigned_turns: int
    source: str
    def __init__(self, worker_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., pending: _Optional[int] = ..., used_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., age_s: _Optional[float] = ..., reachable: _Optional[bool] = ..., assigned_turns: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class LocalEstimate(_message.Message):
    __slots__ = ("decode_worker_id", "fixed_ms", "ms_per_ktoken", "ms_per_ktoken_per_kcontext", "ms_per_decode_stream", "observations")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    MS_PER_KTOKEN_FIELD_NUMBER: _ClassVar[int]
    MS_PER_KTOKEN_PER_KCONTEXT_FIELD_NUMBER: _ClassVar[int]
    MS_PER_DECODE_STREAM_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    fixed_ms: float
    ms_per_ktoken: float
    ms_per_ktoken_per_kcontext: float
    ms_per_decode_stream: float
    observations: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., fixed_ms: _Optional[float] = ..., ms_per_ktoken: _Optional[float] = ..., ms_per_ktoken_per_kcontext: _Optional[float] = ..., ms_per_decode_stream: _Optional[float] = ..., observations: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("policies", "compute", "transfers", "local", "loads", "reported_turns", "decode_kv", "kv_managed", "kv_eviction_policy", "kv_leading", "learning", "kv_index", "load_feed")
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_TURNS_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_FIELD_NUMBER: _ClassVar[int]
    KV_MANAGED_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_LEADING_FIELD_NUMBER: _ClassVar[int]
    LEARNING_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOAD_FEED_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[PolicyStats]
    compute: _containers.RepeatedCompositeFieldContainer[ComputeEstimate]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferEstimate]
    local: _containers.RepeatedCompositeFieldContainer[LocalEstimate]
    loads: _containers.RepeatedCompositeFieldContainer[WorkerLoadStats]
    reported_turns: int
    decode_kv: _containers.RepeatedCompositeFieldContainer[DecodeKvStats]
    kv_managed: bool
    kv_eviction_policy: str
    kv_leading: bool
    learning: LearningStats
    kv_index: KvIndexStats
    load_feed: LoadFeedStats
    def __init__(self, policies: _Optional[_Iterable[_Union[PolicyStats, _Mapping]]] = ..., compute: _Optional[_Iterable[_Union[ComputeEstimate, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[TransferEstimate, _Mapping]]] = ..., local: _Optional[_Iterable[_Union[LocalEstimate, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[WorkerLoadStats, _Mapping]]] = ..., reported_turns: _Optional[int] = ..., decode_kv: _Optional[_Iterable[_Union[DecodeKvStats, _Mapping]]] = ..., kv_managed: _Optional[bool] = ..., kv_eviction_policy: _Optional[str] = ..., kv_leading: _Optional[bool] = ..., learning: _Optional[_Union[LearningStats, _Mapping]] = ..., kv_index: _Optional[_Union[KvIndexStats, _Mapping]] = ..., load_feed: _Optional[_Union[LoadFeedStats, _Mapping]] = ...) -> None: ...

class LoadFeedStats(_message.Message):
    __slots__ = ("following", "samples", "bad_entries", "fed_workers", "polled_workers")
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BAD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLLED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    following: bool
    samples: int
    bad_entries: int
    fed_workers: int
    polled_workers: int
    def __init__(self, following: _Optional[bool] = ..., samples: _Optional[int] = ..., bad_entries: _Optional[int] = ..., fed_workers: _Optional[int] = ..., polled_workers: _Optional[int] = ...) -> None: ...

class KvIndexStats(_message.Message):
    __slots__ = ("following", "entries", "bad_entries", "workers", "breaks", "resyncs", "lookups")
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BAD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BREAKS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    following: bool
    entries: int
    bad_entries: int
    workers: _containers.RepeatedCompositeFieldContainer[KvIndexWorker]
    breaks: int
    resyncs: int
    lookups: int
    def __init__(self, following: _Optional[bool] = ..., entries: _Optional[int] = ..., bad_entries: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[KvIndexWorker, _Mapping]]] = ..., breaks: _Optional[int] = ..., resyncs: _Optional[int] = ..., lookups: _Optional[int] = ...) -> None: ...

class KvIndexWorker(_message.Message):
    __slots__ = ("worker_id", "blocks", "stale_reason", "awaiting_snapshot")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STALE_REASON_FIELD_NUMBER: _ClassVar[int]
    AWAITING_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    blocks: int
    stale_reason: str
    awaiting_snapshot: bool
    def __init__(self, worker_id: _Optional[str] = ..., blocks: _Optional[int] = ..., stale_reason: _Optional[str] = ..., awaiting_snapshot: _Optional[bool] = ...) -> None: ...

class LearningStats(_message.Message):
    __slots__ = ("mode", "replica", "applied_revision", "applied_outcomes", "pending_outcomes", "dropped_outcomes", "loaded_snapshot_revision", "written_snapshot_revision", "leading", "missed_batches")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    APPLIED_REVISION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    PENDING_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    LOADED_SNAPSHOT_REVISION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SNAPSHOT_REVISION_FIELD_NUMBER: _ClassVar[int]
    LEADING_FIELD_NUMBER: _ClassVar[int]
    MISSED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    replica: str
    applied_revision: int
    applied_outcomes: int
    pending_outcomes: int
    dropped_outcomes: int
    loaded_snapshot_revision: int
    written_snapshot_revision: int
    leading: bool
    missed_batches: int
    def __init__(self, mode: _Optional[str] = ..., replica: _Optional[str] = ..., applied_revision: _Optional[int] = ..., applied_outcomes: _Optional[int] = ..., pending_outcomes: _Optional[int] = ..., dropped_outcomes: _Optional[int] = ..., loaded_snapshot_revision: _Optional[int] = ..., written_snapshot_revision: _Optional[int] = ..., leading: _Optional[bool] = ..., missed_batches: _Optional[int] = ...) -> None: ...

class DecodeKvStats(_message.Message):
    __slots__ = ("worker_id", "held_sessions", "held_tokens", "held_blocks", "held_bytes", "oldest_idle_s", "used_tokens", "capacity_tokens", "evictions", "evicted_tokens", "pulls_lost", "eviction_failures")
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PullsLostEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLS_LOST_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    held_sessions: int
    held_tokens: int
    held_blocks: int
    held_bytes: int
    oldest_idle_s: float
    used_tokens: int
    capacity_tokens: int
    evictions: _containers.ScalarMap[str, int]
    evicted_tokens: int
    pulls_lost: _containers.ScalarMap[str, int]
    eviction_failures: int
    def __init__(self, worker_id: _Optional[str] = ..., held_sessions: _Optional[int] = ..., held_tokens: _Optional[int] = ..., held_blocks: _Optional[int] = ..., held_bytes: _Optional[int] = ..., oldest_idle_s: _Optional[float] = ..., used_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., evicted_tokens: _Optional[int] = ..., pulls_lost: _Optional[_Mapping[str, int]] = ..., eviction_failures: _Optional[int] = ...) -> None: ...
