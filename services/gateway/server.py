"""`kvshuttle gateway`: OpenAI-compatible HTTP + REST bridge, and the kvshuttle.v1.Gateway gRPC API."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from kvshuttle.v1 import gateway_pb2_grpc, registry_pb2_grpc, scheduler_pb2_grpc

from services.config import TelemetryConfig, require, setting
from services.gateway.grpc_api import GatewayServicer
from services.gateway.openai_api import create_app
from services.gateway.rest_bridge import BridgeOptions, bridge_routes, install_openapi
from services.gateway.tokenizer import GatewayTokenizer
from services.gateway.turns import TurnRunner
from services.grpc_server import Server, client_channel, service_main
from services.http_server import HttpServer

SERVICE_NAME = "kvshuttle.v1.Gateway"
REGISTRY_SERVICE = "kvshuttle.v1.SessionRegistry"


@dataclasses.dataclass
class GatewayConfig(TelemetryConfig):
    """Gateway: runs each turn through the chosen prefill and decode workers."""

    ENV_PREFIX = "KVSHUTTLE_GATEWAY_"
    http_listen: str = setting("127.0.0.1:8000", "HTTP listen address (OpenAI API + REST bridge)")
    grpc_listen: str = setting("127.0.0.1:50053", "gRPC listen address")
    registry: str = setting("127.0.0.1:50051", "Session registry gRPC address", env="KVSHUTTLE_REGISTRY_ADDRESS")
    scheduler: str = setting("127.0.0.1:50052", "Transfer scheduler gRPC address",
                             env="KVSHUTTLE_SCHEDULER_ADDRESS")
    model_dir: str = setting("", "Model directory (tokenizer + chat template); the workers serve the same model",
                             env="KVSHUTTLE_MODEL_DIR")
    served_model_name: str = setting("", "Model name clients use (default: the model directory's name)",
                                     env="KVSHUTTLE_SERVED_MODEL_NAME")
    max_model_len: int = setting(0, "Context length in tokens (0: the model's max_position_embeddings)",
                                 env="KVSHUTTLE_MAX_MODEL_LEN")
    default_max_tokens: int = setting(128, "max_tokens when a request gives none")
    engine_timeout_s: float = setting(300.0, "Deadline for each call to a vLLM worker")
    control_timeout_s: float = setting(5.0, "Deadline for each registry/scheduler call")
    first_token_from_prefill: bool = setting(True, "Stream the prefill worker's sampled token as the answer's first "
                                                   "token; the decode worker continues after it (requests with stop "
                                                   "strings always let the decode worker sample it)")
    session_cache_mb: int = setting(64, "Keep the session records this gateway wrote (up to this many MiB) so the "
                                        "next turn needs no registry read; 0: always read")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        require(bool(self.model_dir), "--model-dir (KVSHUTTLE_MODEL_DIR) is required")
        require(Path(self.model_dir, "tokenizer.json").is_file(), f"no tokenizer.json in {self.model_dir}")
        require(self.default_max_tokens >= 1, "--default-max-tokens must be >= 1")
        require(self.engine_timeout_s > 0 and self.control_timeout_s > 0, "timeouts must be > 0")

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    def context_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        config = json.loads(Path(self.model_dir, "config.json").read_text())
        return int(config.get("max_position_embeddings", 2048))


class GatewayService:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.registry_channel = client_channel(cfg.registry)
        self.scheduler_channel = client_channel(cfg.scheduler)
        self.runner = TurnRunner(
            GatewayTokenizer(cfg.model_dir), registry_pb2_grpc.SessionRegistryStub(self.registry_channel),
            scheduler_pb2_grpc.TransferSchedulerStub(self.scheduler_channel), max_model_len=cfg.context_len(),
            engine_timeout_s=cfg.engine_timeout_s, control_timeout_s=cfg.control_timeout_s,
            session_cache_bytes=cfg.session_cache_mb << 20, first_token_from_prefill=cfg.first_token_from_prefill)
        servicer = GatewayServicer(self.runner, cfg.model_name(), cfg.default_max_tokens)
        self.grpc = Server(cfg.grpc_listen, [SERVICE_NAME],
                           [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)])
        self.self_channel = client_channel(self.grpc.address)
        turn_deadline = 2 * cfg.engine_timeout_s + 4 * cfg.control_timeout_s
        options = BridgeOptions(timeout=cfg.control_timeout_s, method_timeouts={
            f"/{SERVICE_NAME}/{m}": turn_deadline for m in ("Complete", "ChatComplete")})
        bridged = {REGISTRY_SERVICE: self.registry_channel, SERVICE_NAME: self.self_channel}
        self.app = create_app(self.runner, cfg.model_name(), cfg.default_max_tokens,
                              extra_routes=bridge_routes(bridged, options))
        install_openapi(self.app, list(bridged))
        self.http = HttpServer(self.app, cfg.http_listen)
        self.grpc_address = self.grpc.address
        self.http_address = self.http.address

    async def start(self) -> None:
        await self.grpc.start()
        await self.http.start()

    async def stop(self) -> None:
        await self.http.stop()
        await self.grpc.stop()
        await self.runner.close()
        for channel in (self.registry_channel, self.scheduler_channel, self.self_channel):
            await channel.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(GatewayConfig, argv, "kvshuttle gateway", "kvshuttle-gateway", GatewayService)
