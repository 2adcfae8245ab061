"""`kvshuttle gateway`: the gateway service, with the transfer scheduler inside it when ``--scheduler local``.

The gateway and the scheduler are independent services; this command is where they are put together in one process
(the gateway then plans each turn with no hop, and the embedded scheduler shares its learning with the other
replicas through etcd: services/scheduler/learning.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from kvshuttle.services.common.grpc_server import service_main
from kvshuttle.services.gateway.server import GatewayConfig, GatewayService
from kvshuttle.services.scheduler.in_process import EmbeddedScheduler, embedded_config


@dataclasses.dataclass
class GatewayCommandConfig(GatewayConfig):
    __doc__ = GatewayConfig.__doc__

    def validate(self) -> None:
        super().validate()
        if self.scheduler == "local":  # the embedded scheduler's flags fail here, as the gateway's own do
            embedded_config(self.scheduler_args, registry=self.registry, tls=self)


def make_gateway(cfg: GatewayConfig) -> GatewayService:
    if cfg.scheduler != "local":
        return GatewayService(cfg)
    return GatewayService(cfg, EmbeddedScheduler(embedded_config(cfg.scheduler_args, registry=cfg.registry, tls=cfg)))


PROFILE_ENV = "KVSHUTTLE_GATEWAY_PROFILE"  # a file: cProfile the event loop's thread, stats written there at exit
def main(argv: Sequence[str] | None = None) -> None:
    profile_to = os.environ.get(PROFILE_ENV, "")
    if not profile_to:
        service_main(GatewayCommandConfig, argv, "kvshuttle gateway", "kvshuttle-gateway", make_gateway)
        return
    import cProfile  # a developer's tool (`kvshuttle bench-gateway --profile`): never on in production

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        service_main(GatewayCommandConfig, argv, "kvshuttle gateway", "kvshuttle-gateway", make_gateway)
    finally:
        profiler.disable()
        profiler.dump_stats(profile_to)
