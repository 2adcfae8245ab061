"""What the turn's stages use from the gateway (TurnServices): the tokenizer, the registry and scheduler stubs, the
engine clients, the limits, this gateway's copies of the records it wrote, and its counters. TurnRunner provides
it; a stage is typed against this protocol, never against the runner that calls it, so a stage can be run alone on a
hand-built context and services."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from kvshuttle.control_plane.prefix import PrefixHasher
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.gateway.turns.context import Tokenizer
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.v1 import common_pb2, registry_pb2_grpc, scheduler_pb2_grpc
from opentelemetry import trace


class TurnServices(Protocol):
    tokenizer: Tokenizer
    served_model: str  # the model the turns are for: the scheduler plans on its workers only
    registry: registry_pb2_grpc.SessionRegistryStub
    scheduler: scheduler_pb2_grpc.TransferSchedulerStub
    # limits and switches
    control_timeout_s: float
    prefill_timeout_s: float
    decode_stall_timeout_s: float
    worker_retries: int
    first_token_from_prefill: bool
    find_sessions: bool
    release_unused_handles: bool
    free_unrecorded_kv: bool
    answer_room_tokens: int
    kv_bytes_per_token: int
    # counters
    degraded: dict[str, int]
    released_handles: int
    sessions_found: int

    def engine(self, worker: common_pb2.Worker) -> EngineClient: ...

    def cache_salt(self, tenant: str) -> str: ...

    def check_length(self, req: TurnRequest, prompt_ids: list[int], span: trace.Span) -> None: ...

    def own_record(self, tenant: str, session_id: str) -> common_pb2.Session | None: ...

    def keep_record(self, tenant: str, session_id: str, record: common_pb2.Session) -> None: ...

    def forget_record(self, tenant: str, session_id: str) -> None: ...

    def history_hasher(self, tenant: str, session_id: str, base: common_pb2.Session) -> PrefixHasher | None: ...

    def keep_hasher(self, tenant: str, session_id: str, recorded: common_pb2.Session, hasher: PrefixHasher) -> None: ...

    def background(self, work: Coroutine[Any, Any, None]) -> None: ...
