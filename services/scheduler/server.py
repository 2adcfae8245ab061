"""`kvshuttle scheduler`: the TransferScheduler gRPC service."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvshuttle.v1 import registry_pb2_grpc, scheduler_pb2_grpc

from control_plane.policies import POLICIES, PolicyError, make_policy, parse_params
from services.config import TelemetryConfig, require, setting
from services.grpc_server import Server, client_channel, service_main
from services.scheduler.servicer import TransferSchedulerServicer
from services.scheduler.worker_view import WorkerView

SERVICE_NAME = "kvshuttle.v1.TransferScheduler"


@dataclasses.dataclass
class SchedulerConfig(TelemetryConfig):
    """Transfer scheduler: plans each turn's prefill/decode workers and pull-vs-recompute."""

    ENV_PREFIX = "KVSHUTTLE_SCHEDULER_"
    listen: str = setting("127.0.0.1:50052", "gRPC listen address (host:port; port 0 picks a free one)")
    registry: str = setting("127.0.0.1:50051", "Session registry gRPC address", env="KVSHUTTLE_REGISTRY_ADDRESS")
    policy: str = setting("threshold", "Pull-vs-recompute policy: threshold (pull when enough tokens are "
                                       "reusable) or cost (experimental: pull when the learned model "
                                       "predicts it faster)",
                          choices=tuple(POLICIES))
    policy_params: str = setting("", "The policy's parameters as key=value,... (cost: min_pull_tokens, forgetting, "
                                     "fixed_ms, ms_per_ktoken, ms_per_ktoken_per_kcontext, ms_per_kpulled, "
                                     "ms_per_transfer, variance)")
    pull_threshold_tokens: int = setting(16, "threshold policy: fewest reusable tokens worth a pull")
    expiry_guard_s: float = setting(2.0, "Refuse a pull when the handle expires within this many seconds")
    registry_timeout_s: float = setting(2.0, "Deadline for each registry call on the planning path")
    log_level: str = setting("INFO", "Log level", env="KVSHUTTLE_LOG_LEVEL")

    def validate(self) -> None:
        require(self.pull_threshold_tokens >= 1, "--pull-threshold-tokens must be >= 1")
        require(self.expiry_guard_s >= 0, "--expiry-guard-s must be >= 0")
        require(self.registry_timeout_s > 0, "--registry-timeout-s must be > 0")
        try:
            self.make_policy()
        except PolicyError as exc:
            require(False, f"--policy/--policy-params: {exc}")

    def make_policy(self):
        params = parse_params(self.policy_params)
        if self.policy == "threshold":
            params.setdefault("pull_threshold_tokens", str(self.pull_threshold_tokens))
        return make_policy(self.policy, params, expiry_guard_s=self.expiry_guard_s)


class SchedulerService:
    """The scheduler with its registry channel and worker view; start()/stop() for in-process use."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.channel = client_channel(cfg.registry)
        registry = registry_pb2_grpc.SessionRegistryStub(self.channel)
        self.workers = WorkerView(registry)
        policy = cfg.make_policy()
        servicer = TransferSchedulerServicer(registry, self.workers, policy, cfg.registry_timeout_s)
        self.server = Server(cfg.listen, [SERVICE_NAME],
                             [lambda s: scheduler_pb2_grpc.add_TransferSchedulerServicer_to_server(servicer, s)])
        self.address = self.server.address

    async def start(self) -> None:
        self.workers.start()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
        await self.workers.stop()
        await self.channel.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(SchedulerConfig, argv, "kvshuttle scheduler", "kvshuttle-scheduler", SchedulerService)
