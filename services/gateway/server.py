"""`kvshuttle gateway`, wired: its configuration (GatewayConfig) and the process (GatewayService) that puts the turn
runner (turns/), the HTTP APIs and the REST bridge (apis/, behind edge/) and the kvshuttle.v1.Gateway gRPC API
together."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import secrets
from pathlib import Path
from typing import Protocol

import grpc
from fastapi import FastAPI
from google.protobuf.message import Message
from kvshuttle.control_plane.reasoning import REASONING_PARSERS
from kvshuttle.control_plane.response_chain import MAX_CHAIN_RESPONSES
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import ConfigError, TelemetryConfig, require, setting
from kvshuttle.services.common.grpc_server import Server, client_channel
from kvshuttle.services.common.http_server import HttpServer
from kvshuttle.services.common.metrics_http import PATH as METRICS_PATH
from kvshuttle.services.common.metrics_http import MetricsServer, check_listen, metrics_route
from kvshuttle.services.common.telemetry import tracing_enabled
from kvshuttle.services.common.tls import TlsConfig, read_pem
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.grpc_api import BRIDGED, GatewayServicer, add_gateway_servicer
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.request_model import SESSION_ID_PATTERN
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.services.gateway.apis.rest_bridge.errors import BridgeError
from kvshuttle.services.gateway.apis.rest_bridge.openapi import install_openapi
from kvshuttle.services.gateway.apis.rest_bridge.routes import DEFAULT_FORWARD_HEADERS, BridgeOptions, bridge_routes
from kvshuttle.services.gateway.apis.rest_bridge.specs import RouteSpec
from kvshuttle.services.gateway.apis.state import DEFAULT_CHAIN_MAX_BYTES, DEFAULT_CHAIN_MAX_RESPONSES
from kvshuttle.services.gateway.edge.auth import OPEN, KeyRing
from kvshuttle.services.gateway.edge.http_guard import HttpGuard, principal
from kvshuttle.services.gateway.edge.http_metrics import HttpMetrics
from kvshuttle.services.gateway.edge.http_tracing import HttpTracing
from kvshuttle.services.gateway.edge.keys_reload import KeysFileWatcher
from kvshuttle.services.gateway.edge.tenant_limits import TenantQuotas
from kvshuttle.services.gateway.model_specs import ModelSpec, ModelSpecError, parse_models
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.services.gateway.turns import TurnRunner
from kvshuttle.services.gateway.turns.adapters import RegisteredAdapters
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.catalog import ServedModel
from kvshuttle.services.gateway.turns.parsers import Parsers
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc, scheduler_pb2_grpc
from starlette.requests import Request

SERVICE_NAME = "kvshuttle.v1.Gateway"
log = logging.getLogger(__name__)
REGISTRY_SERVICE = "kvshuttle.v1.SessionRegistry"
# A scheduler address naming several replicas (ipv4:a,b,c or a DNS name with several records): plans round robin.
ROUND_ROBIN = (("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),)
SCHEDULER_SERVICE = "kvshuttle.v1.TransferScheduler"  # its GetStats is bridged: GET /v1/scheduler/stats (admin)

_SESSION_ID = {"maxLength": 256, "pattern": SESSION_ID_PATTERN}
_TEXT, _IDS = {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}
# What the bridged methods check beyond the proto's types, for the OpenAPI document (tests/e2e/test_fuzz_openapi.py
# sends requests that break each of these and expects a 4xx).
OPENAPI_CONSTRAINTS = {
    **{f"kvshuttle.v1.{m}.session_id": _SESSION_ID for m in ("CompleteRequest", "ChatCompleteRequest")},
    **{f"kvshuttle.v1.{m}.session_id": {**_SESSION_ID, "minLength": 1}
       for m in ("GetSessionRequest", "DeleteSessionRequest", "EndSessionRequest")},
    "kvshuttle.v1.ChatCompleteRequest": {"required": ["messages"]},
    "kvshuttle.v1.ChatCompleteRequest.messages": {"minItems": 1},
    "kvshuttle.v1.ChatMessage": {"required": ["role"]},
    "kvshuttle.v1.ChatMessage.role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    # A prompt as text or as token ids: one of them, not both (proto3: empty is the same as absent).
    "kvshuttle.v1.CompleteRequest": {
        "anyOf": [{"required": ["prompt"], "properties": {"prompt": _TEXT}},
                  {"required": ["promptTokenIds"], "properties": {"promptTokenIds": _IDS}}],
        "not": {"required": ["prompt", "promptTokenIds"], "properties": {"prompt": _TEXT, "promptTokenIds": _IDS}}},
    "kvshuttle.v1.SamplingOptions.max_tokens": {"minimum": 0},
    "kvshuttle.v1.SamplingOptions.temperature": {"minimum": 0, "maximum": 2},
    "kvshuttle.v1.SamplingOptions.top_p": {"minimum": 0, "maximum": 1},
    "kvshuttle.v1.CompleteRequest.prompt_token_ids": {"items": {"minimum": 0}},
    # vLLM's ranges (TurnRunner.validate checks them; token ids are checked against the vocabulary there too)
    "kvshuttle.v1.SamplingOptions.top_k": {"minimum": -1},
    "kvshuttle.v1.SamplingOptions.min_p": {"minimum": 0, "maximum": 1},
    "kvshuttle.v1.SamplingOptions.presence_penalty": {"minimum": -2, "maximum": 2},
    "kvshuttle.v1.SamplingOptions.frequency_penalty": {"minimum": -2, "maximum": 2},
    "kvshuttle.v1.SamplingOptions.repetition_penalty": {"exclusiveMinimum": 0},
    "kvshuttle.v1.SamplingOptions.min_tokens": {"minimum": 0},
    "kvshuttle.v1.SamplingOptions.stop_token_ids": {"items": {"minimum": 0}},
}


@dataclasses.dataclass
class GatewayConfig(TelemetryConfig, TlsConfig):
    """Gateway: runs each turn through the chosen prefill and decode workers."""

    ENV_PREFIX = "KVSHUTTLE_GATEWAY_"
    http_listen: str = setting("127.0.0.1:8000", "HTTP listen address (OpenAI API + REST bridge)")
    grpc_listen: str = setting("127.0.0.1:50053", "gRPC listen address")
    registry: str = setting("127.0.0.1:50051", "Session registry gRPC address", env="KVSHUTTLE_REGISTRY_ADDRESS")
    scheduler: str = setting("127.0.0.1:50052", "Transfer scheduler gRPC address (a gRPC target: "
                                                "ipv4:HOST:PORT,HOST:PORT,... or dns:///NAME:PORT spreads plans over "
                                                "several scheduler replicas, round robin), or 'local': plan in this "
                                                "process (no hop per decision; see --scheduler-args)",
                             env="KVSHUTTLE_SCHEDULER_ADDRESS")
    scheduler_args: str = setting("", "With --scheduler local: the embedded scheduler's flags, as `kvshuttle "
                                      "scheduler` takes them (e.g. '--etcd-endpoints 127.0.0.1:2379 --history-store "
                                      "...'); its KVSHUTTLE_SCHEDULER_* environment applies too. Registry and TLS "
                                      "default to the gateway's; its gRPC API (GetStats) listens on a free loopback "
                                      "port unless --listen is given")
    model_dir: str = setting("", "Model directory (tokenizer + chat template); the workers serve the same model",
                             env="KVSHUTTLE_MODEL_DIR")
    chat_template: str = setting("", "A chat template file (Jinja) to render chats with instead of the model "
                                     "directory's (as vLLM's --chat-template): give the workers' reference server "
                                     "the same one", env="KVSHUTTLE_CHAT_TEMPLATE")
    served_model_name: str = setting("", "Model name clients use (default: the model directory's name)",
                                     env="KVSHUTTLE_SERVED_MODEL_NAME")
    max_model_len: int = setting(0, "Context length in tokens (0: the model's max_position_embeddings)",
                                 env="KVSHUTTLE_MAX_MODEL_LEN")
    models: str = setting("", "More models this gateway serves besides --model-dir's (which stays the default of a "
                              "request that names none): NAME=DIR entries separated by commas, each optionally with "
                              "?tool_call_parser=..&reasoning_parser=..&chat_template=FILE&max_model_len=N, e.g. "
                              "'agent=/models/agent?tool_call_parser=hermes&reasoning_parser=qwen3'. Each needs "
                              "prefill and decode workers serving NAME (docs/models.md)",
                          env="KVSHUTTLE_GATEWAY_MODELS")
    default_max_tokens: int = setting(0, "The limit of an answer whose request sets none (max_tokens, "
                                         "max_completion_tokens, max_output_tokens; Anthropic's is required), when "
                                         "less than what the context leaves after the prompt; the answer then says "
                                         "so (finish_reason length, the Responses object's max_output_tokens, the "
                                         "kvshuttle object's max_tokens_source 'default'). 0: no default, up to the "
                                         "context left, as vLLM and OpenAI do")
    answer_room_tokens: int = setting(1024, "KV room the scheduler makes on the decode worker (freeing held KV) for "
                                            "an answer that only the context limits; the answer may grow past it")
    tool_call_parser: str = setting("", "How the model writes tool calls (vLLM's parser names); empty: requests with "
                                        "tools are refused unless tool_choice is 'none'",
                                    choices=["", *TOOL_CALL_PARSERS])
    reasoning_parser: str = setting("", "How the model marks its reasoning (vLLM's parser names): answers then carry "
                                        "reasoning_content apart from content; empty: not parsed",
                                    choices=["", *REASONING_PARSERS])
    event_loop: str = setting("uvloop", "The gateway's event loop: uvloop (cheaper per streamed token: "
                                        "docs/performance.md) or asyncio (Python's own)", choices=("uvloop", "asyncio"))
    engine_timeout_s: float = setting(300.0, "Deadline for each call to a vLLM worker")
    engine_streams: str = setting("h2", "How Generate calls (P's prefill, D's token streams) go: h2 (kvshuttle's "
                                        "lean HTTP/2 client, services/engine/h2_streams.py) or grpcio (grpc.aio, as "
                                        "every other call)",
                                  choices=("h2", "grpcio"))
    control_timeout_s: float = setting(5.0, "Deadline for each registry/scheduler call")
    prefill_timeout_s: float = setting(120.0, "Deadline for one prefill call; past it the prefill worker counts as "
                                              "failed and the turn is recomputed on another")
    decode_stall_timeout_s: float = setting(120.0, "Longest wait for each token from the decode worker (the first "
                                                   "included); past it the worker counts as failed and the answer "
                                                   "resumes on another")
    worker_retries: int = setting(2, "Failed workers one turn may move away from before it fails with a 503")
    first_token_from_prefill: bool = setting(True, "Stream the prefill worker's sampled token as the answer's first "
                                                   "token; the decode worker continues after it (requests with stop "
                                                   "strings always let the decode worker sample it)")
    response_ttl_s: int = setting(86400, "How long the Responses API keeps a stored response (and so can continue "
                                         "it with previous_response_id), in seconds")
    response_chain_max_responses: int = setting(DEFAULT_CHAIN_MAX_RESPONSES, "Most stored responses a conversation "
                                                "read back (previous_response_id, input_items) may have; longer: 400 "
                                                "naming the bound")
    response_chain_max_bytes: int = setting(DEFAULT_CHAIN_MAX_BYTES, "Most bytes of stored items (plus about 512 "
                                            "per response) a conversation read back may have; more: 400 naming the "
                                            "bound. At most --grpc-max-message-mb less 64 KiB (one registry answer)")
    find_sessions: bool = setting(True, "A chat sent without a session id (X-Session-ID / conversation_id) continues "
                                        "the session whose recorded text its prompt extends, found by content key in "
                                        "the registry (the answer's X-Session-ID names it), or starts a new one that "
                                        "the next turn can find; off: such turns are not recorded")
    free_unrecorded_kv: bool = setting(True, "Free a turn's KV on its decode worker right after the answer when "
                                             "nothing records it (no session id, or the registry refused the record):"
                                             " the decode worker would otherwise keep it until its TTL, where no "
                                             "turn can pull it and the scheduler cannot see it")
    session_cache_mb: int = setting(64, "Keep the session records this gateway wrote (up to this many MiB) so the "
                                        "next turn needs no registry read; 0: always read")
    api_keys_file: str = setting("", "API keys file (JSON: SHA-256 of each key -> tenant, admin; `kvshuttle "
                                     "hash-key` makes entries). Set: every request needs 'Authorization: Bearer "
                                     "<key>' and runs as the key's tenant; empty: open gateway, one default tenant")
    max_prompt_tokens: int = setting(0, "Longest prompt in tokens (history included) a request may have; longer: "
                                        "400. 0: only the context length limits it")
    max_body_bytes: int = setting(8 << 20, "Largest HTTP request body in bytes; larger: 413 (a declared "
                                           "Content-Length over it is refused before the body is read)")
    http_tls_cert: str = setting("", "Certificate (PEM) for HTTPS on --http-listen; empty: plain HTTP")
    http_tls_key: str = setting("", "Private key (PEM) of --http-tls-cert")
    http_receipt_timeout_s: float = setting(15.0, "Longest wait for a request to arrive whole on --http-listen: its "
                                                  "headers from the connection's start, its body from the headers' "
                                                  "end; later: 408 and the connection is closed")
    http_keep_alive_s: float = setting(75.0, "How long a kept-alive connection on --http-listen may stay idle "
                                             "between requests before the gateway closes it; longer than clients "
                                             "keep idle connections (httpx and the OpenAI and Anthropic SDKs: 5 s), "
                                             "so a client never sends a request on a connection the gateway is "
                                             "closing")
    http_max_connections: int = setting(1024, "Most open connections on --http-listen; more are answered 503 and "
                                              "closed at once. 0: no cap")
    api_keys_reload_s: float = setting(5.0, "How often to check the API keys file for changes, in seconds (a changed "
                                            "file is loaded without a restart; an invalid one keeps the keys in "
                                            "force). 0: never")
    metrics_listen: str = setting("", "Serve Prometheus metrics at http://HOST:PORT/metrics instead of on "
                                      "--http-listen (port 0: a free one, logged at start-up); empty: GET /metrics "
                                      "on --http-listen, open like /health")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        check_listen(self.metrics_listen)
        require(bool(self.model_dir), "--model-dir (KVSHUTTLE_MODEL_DIR) is required")
        require(Path(self.model_dir, "tokenizer.json").is_file(), f"no tokenizer.json in {self.model_dir}")
        require(not self.chat_template or Path(self.chat_template).is_file(),
                f"--chat-template {self.chat_template!r} is not a file")
        require(self.default_max_tokens >= 0, "--default-max-tokens must be >= 0 (0: the context left)")
        require(self.answer_room_tokens >= 0, "--answer-room-tokens must be >= 0")
        require(1 <= self.response_ttl_s <= 30 * 86400, "--response-ttl-s must be between 1 and 2592000 (30 days)")
        require(1 <= self.response_chain_max_responses <= MAX_CHAIN_RESPONSES,
                f"--response-chain-max-responses must be between 1 and {MAX_CHAIN_RESPONSES}")
        require(1 <= self.response_chain_max_bytes <= self.max_message_bytes - (64 << 10),
                "--response-chain-max-bytes must be between 1 and --grpc-max-message-mb less 64 KiB "
                f"({self.max_message_bytes - (64 << 10)})")
        require(self.max_prompt_tokens >= 0, "--max-prompt-tokens must be >= 0")
        require(self.max_body_bytes >= 1024, "--max-body-bytes must be >= 1024")
        require(self.http_receipt_timeout_s > 0, "--http-receipt-timeout-s must be > 0")
        require(self.http_keep_alive_s > 0, "--http-keep-alive-s must be > 0")
        require(self.http_max_connections >= 0, "--http-max-connections must be >= 0 (0: no cap)")
        require(self.api_keys_reload_s >= 0, "--api-keys-reload-s must be >= 0 (0: never)")
        require(bool(self.http_tls_cert) == bool(self.http_tls_key), "--http-tls-cert and --http-tls-key go together")
        for path in (self.http_tls_cert, self.http_tls_key):
            if path:
                read_pem(path, "--http-tls-cert/--http-tls-key")
        self.validate_tls()
        # The REST bridge calls this gateway's own gRPC API: over TLS that needs the CA (and a client certificate).
        require(not self.tls_cert or bool(self.tls_ca),
                "with --tls-cert the gateway needs --tls-ca (KVSHUTTLE_TLS_CA): its REST bridge calls its own gRPC API")
        require(not self.tls_client_ca or bool(self.tls_client_cert),
                "with --tls-client-ca the gateway needs --tls-client-cert: its REST bridge calls its own gRPC API")
        self.key_ring()  # the keys file is read and checked here
        require(min(self.engine_timeout_s, self.control_timeout_s, self.prefill_timeout_s,
                    self.decode_stall_timeout_s) > 0, "timeouts must be > 0")
        require(self.worker_retries >= 0, "--worker-retries must be >= 0")
        try:
            specs = self.model_specs()
        except ModelSpecError as exc:
            raise ConfigError(str(exc)) from None
        names = [spec.name for spec in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        require(not twice, f"--models: model {twice[0]!r} is served twice" if twice else "")
        for spec in specs:
            problem = Parsers(spec.tool_call_parser, spec.reasoning_parser).problem() or spec.problem()
            require(problem is None, f"model {spec.name!r}: {problem}" if spec is not specs[0] else problem or "")
        require(not self.scheduler_args or self.scheduler == "local",
                "--scheduler-args configures the embedded scheduler: it needs --scheduler local")

    def key_ring(self) -> KeyRing:
        return KeyRing.load(self.api_keys_file) if self.api_keys_file else KeyRing()

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    def model_specs(self) -> list[ModelSpec]:
        """Every model served: --model-dir's first (the default), then --models'."""
        first = ModelSpec(self.model_name(), self.model_dir, self.tool_call_parser, self.reasoning_parser,
                          self.chat_template, self.max_model_len)
        return [first, *parse_models(self.models)]


class EmbeddedScheduler(Protocol):
    """A transfer scheduler running in the gateway's process (``--scheduler local``; the command builds it):
    ``stub`` answers like TransferSchedulerStub without a hop, ``address`` serves its gRPC API (GetStats)."""

    stub: object
    address: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class GatewayService:
    def __init__(self, cfg: GatewayConfig, scheduler: EmbeddedScheduler | None = None):
        """``scheduler``: the embedded scheduler with ``--scheduler local`` (required then; None otherwise)."""
        if (scheduler is not None) != (cfg.scheduler == "local"):
            raise ValueError("an embedded scheduler goes with --scheduler local, and only with it")
        self.cfg = cfg
        tls, max_message = cfg.client_tls(), cfg.max_message_bytes
        # This process's own gRPC servers (its API; an embedded scheduler's, configured alike) speak TLS only with
        # --tls-cert: calls to them use TLS then, whatever TLS the calls to the registry and the scheduler use.
        own_tls = tls if cfg.tls_cert else None
        self.keys = cfg.key_ring()
        # Limits come from the keys file (an open gateway has none); a changed file is loaded while running.
        self.quotas = TenantQuotas(self.keys) if self.keys.enabled else None
        self.keys_watcher = (KeysFileWatcher(self.keys, cfg.api_keys_file, cfg.api_keys_reload_s)
                             if self.keys.enabled and cfg.api_keys_reload_s else None)
        self.registry_channel = client_channel(cfg.registry, tls, max_message_bytes=max_message)
        # The scheduler in this process (--scheduler local): turns call it directly; its gRPC API still serves
        # GetStats (the REST bridge, grpcurl) on its own port.
        self.scheduler = scheduler
        self.scheduler_channel = client_channel(scheduler.address if scheduler else cfg.scheduler,
                                                own_tls if scheduler else tls,
                                                max_message_bytes=max_message,
                                                options=() if scheduler else ROUND_ROBIN)
        scheduler_stub = (scheduler.stub if scheduler is not None
                          else scheduler_pb2_grpc.TransferSchedulerStub(self.scheduler_channel))
        specs = cfg.model_specs()
        self.runner = self._turn_runner(scheduler_stub, specs[0])  # the default model's
        # the other models, each with its own runner (tokenizer, context length, workers) and builder (parsers)
        # the LoRA adapters live workers of these models have registered, served under their names as they come
        self.workers = WorkerView(registry_pb2_grpc.SessionRegistryStub(self.registry_channel))
        self.adapters = RegisteredAdapters(self.workers)
        self.more_models = [ServedModel(spec.name, self._turn_runner(scheduler_stub, spec), TurnBuilder(
            spec.name, cfg.default_max_tokens, tool_call_parser=spec.tool_call_parser,
            reasoning_parser=spec.reasoning_parser)) for spec in specs[1:]]
        bridge_token = secrets.token_urlsafe(24)  # marks the REST bridge's calls: the HTTP guard counted them
        servicer = GatewayServicer(self.runner, cfg.model_name(), cfg.default_max_tokens, self.keys, self.quotas,
                                   bridge_token, reasoning_parser=cfg.reasoning_parser, more_models=self.more_models,
                                   adapters=self.adapters)
        self.grpc = Server(cfg.grpc_listen, [SERVICE_NAME],
                           [lambda s: add_gateway_servicer(servicer, s)],
                           tls=cfg.server_tls(), max_message_bytes=max_message)
        self.self_channel = client_channel(self.grpc.address, own_tls, max_message_bytes=max_message)
        routes = self._bridge_routes(bridge_token)
        for runner in (self.runner, *(m.runner for m in self.more_models)):
            metrics.GATEWAY_STATE.register(runner.metrics_state)
        metrics.declare_models(spec.name for spec in specs)
        registry = metrics.registry_for("gateway", extra=[  # and the embedded scheduler's, when it plans here
            *metrics.GROUPS["scheduler"], *metrics.GROUPS["etcd"]] if self.scheduler is not None else ())
        self.metrics = MetricsServer(cfg.metrics_listen, registry, name="gateway") if cfg.metrics_listen else None
        if self.metrics is None:  # on the HTTP port: with API keys, for admin keys only (tenants are labels)
            routes.insert(0, metrics_route(registry))
        self.app = self._http_app(routes)
        self.http = HttpServer(self._http_front(), cfg.http_listen,
                               tls=(cfg.http_tls_cert, cfg.http_tls_key) if cfg.http_tls_cert else None,
                               max_connections=cfg.http_max_connections, receipt_timeout_s=cfg.http_receipt_timeout_s,
                               keep_alive_s=cfg.http_keep_alive_s)
        self.grpc_address = self.grpc.address
        self.http_address = self.http.address

    def _turn_runner(self, scheduler_stub: object, spec: ModelSpec) -> TurnRunner:
        cfg = self.cfg
        tokenizer = GatewayTokenizer(spec.model_dir, spec.chat_template_text())
        tokenizer.byte_table()  # made here, at start, not in the first turn's detokenizer (a vocabulary's decode)
        runner = TurnRunner(
            tokenizer,
            registry_pb2_grpc.SessionRegistryStub(self.registry_channel),
            scheduler_stub, max_model_len=spec.context_len(),
            engine_timeout_s=cfg.engine_timeout_s, control_timeout_s=cfg.control_timeout_s,
            session_cache_bytes=cfg.session_cache_mb << 20, first_token_from_prefill=cfg.first_token_from_prefill,
            prefill_timeout_s=cfg.prefill_timeout_s, decode_stall_timeout_s=cfg.decode_stall_timeout_s,
            worker_retries=cfg.worker_retries)
        runner.max_prompt_tokens = cfg.max_prompt_tokens
        runner.free_unrecorded_kv = cfg.free_unrecorded_kv
        runner.answer_room_tokens = cfg.answer_room_tokens
        runner.find_sessions = cfg.find_sessions
        runner.lean_streams = cfg.engine_streams == "h2"
        runner.served_model, runner.kv_bytes_per_token = spec.name, spec.kv_bytes_per_token()
        runner.quotas = self.quotas
        runner.cache_group_of = self.keys.cache_group  # a tenant's prefix-cache salt follows its cache group
        return runner

    def _bridge_routes(self, bridge_token: str) -> list:
        """The REST bridge's routes: the registry's and the scheduler's methods, and this gateway's own gRPC API."""
        cfg = self.cfg
        turn_deadline = 2 * cfg.engine_timeout_s + 4 * cfg.control_timeout_s
        # The caller's API key goes on to the gateway's own gRPC API (which checks it again), never to the registry.
        common = dict(timeout=cfg.control_timeout_s, max_body_bytes=cfg.max_body_bytes, authorize=bridge_policy,
                      redact=bridge_redact)
        to_registry = BridgeOptions(**common, forward_headers=tuple(
            h for h in DEFAULT_FORWARD_HEADERS if h != "authorization"))
        to_gateway = BridgeOptions(**common, metadata=((BRIDGED, bridge_token),), method_timeouts={
            f"/{SERVICE_NAME}/{m}": turn_deadline for m in ("Complete", "ChatComplete")})
        return [*bridge_routes({REGISTRY_SERVICE: self.registry_channel,
                                SCHEDULER_SERVICE: self.scheduler_channel}, to_registry),
                *bridge_routes({SERVICE_NAME: self.self_channel}, to_gateway)]

    def _http_app(self, routes: list) -> FastAPI:
        """The HTTP APIs on one app: OpenAI's, Anthropic's, the Responses API, and ``routes`` (the REST bridge's,
        /metrics) with the bridged methods in the OpenAPI document."""
        cfg = self.cfg
        app = create_app(self.runner, cfg.model_name(), cfg.default_max_tokens, extra_routes=routes,
                         tool_call_parser=cfg.tool_call_parser, reasoning_parser=cfg.reasoning_parser,
                         more_models=self.more_models, adapters=self.adapters)
        add_anthropic_routes(app)
        add_responses_routes(app, response_ttl_s=cfg.response_ttl_s,
                             chain_max_responses=cfg.response_chain_max_responses,
                             chain_max_bytes=cfg.response_chain_max_bytes)
        install_openapi(app, [REGISTRY_SERVICE, SCHEDULER_SERVICE, SERVICE_NAME], constraints=OPENAPI_CONSTRAINTS)
        return app

    def _http_front(self) -> object:
        """The app behind the HTTP edge: the guard (keys, limits, bodies), metrics, tracing."""
        cfg = self.cfg
        front: object = HttpGuard(self.app, self.keys, cfg.max_body_bytes, open_paths=("/health",),
                                  quotas=self.quotas, admin_paths=() if self.metrics else (METRICS_PATH,),
                                  receipt_timeout_s=cfg.http_receipt_timeout_s)
        front = HttpMetrics(front, self.app.routes)  # outside the guard: refusals are counted too
        if tracing_enabled():  # one SERVER span per HTTP request, continuing the caller's traceparent
            front = HttpTracing(front)
        return front

    async def start(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.start()
            log.info("planning in this process (--scheduler local); its scheduler API on %s", self.scheduler.address)
        if self.keys.enabled:
            log.info("API keys required: %d configured", len(self.keys))
        else:
            log.warning("no API keys configured (--api-keys-file): the gateway is open, every caller is tenant "
                        "%r with admin rights", OPEN.tenant)
        unserved = sorted(self.keys.models_named() - {spec.name for spec in self.cfg.model_specs()})
        if unserved:
            log.warning("--api-keys-file names models this gateway serves no base model of: %s; they are served once "
                        "a live worker of a served model registers an adapter of that name", ", ".join(unserved))
        self.workers.start()
        await self.grpc.start()
        await self.http.start()
        if self.keys_watcher is not None:
            self.keys_watcher.start()
        if self.metrics is not None:
            await self.metrics.start()
        else:
            log.info("gateway metrics on %s://%s%s", "https" if self.cfg.http_tls_cert else "http", self.http.address,
                     METRICS_PATH)
        # What start built (the models' tokenizers and templates, the app, the stubs) lives as long as the process:
        # frozen out of the collector's generations, a full collection no longer walks it (measured on the token
        # path: docs/performance.md).
        gc.collect()
        gc.freeze()

    async def stop(self) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
        if self.keys_watcher is not None:
            await self.keys_watcher.stop()
        await self.http.stop()
        await self.grpc.stop()
        await self.workers.stop()
        for runner in (self.runner, *(m.runner for m in self.more_models)):
            await runner.close()
        if self.scheduler is not None:
            await self.scheduler.stop()
        for channel in (self.registry_channel, self.scheduler_channel, self.self_channel):
            await channel.close()


def bridge_policy(request: Request, spec: RouteSpec, message: Message) -> None:
    """Who may call what through the REST bridge: a request naming a tenant runs as the caller's tenant, whatever
    it sent (``?tenant=`` included); the gateway's own API checks the forwarded key itself; every other bridged
    method (e.g. listing workers) needs an admin key."""
    caller = principal(request)
    if caller is None:
        raise BridgeError("no caller identity", grpc.StatusCode.UNAUTHENTICATED)
    if "tenant" in message.DESCRIPTOR.fields_by_name:
        message.tenant = caller.tenant
    elif spec.method.containing_service.full_name != SERVICE_NAME and not caller.admin:
        raise BridgeError(f"{spec.http_method} {spec.template.template} needs an admin API key",
                          grpc.StatusCode.PERMISSION_DENIED)


def bridge_redact(request: Request, spec: RouteSpec, reply: Message) -> None:
    """What a tenant's key reads through the REST bridge holds no worker address: a session's KV handle (the decode
    worker's NIXL host, port, engine id and block ids) is shown to admin keys only."""
    caller = principal(request)
    if caller is not None and caller.admin:
        return
    if isinstance(reply, registry_pb2.GetSessionResponse):
        reply.session.ClearField("kv_transfer_params_json")


# `kvshuttle gateway` runs it (services/commands/gateway.py: with the scheduler inside it on --scheduler local).
