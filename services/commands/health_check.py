"""`kvshuttle health-check`: one grpc.health.v1 Check of a kvshuttle gRPC server, for Kubernetes exec probes.

Kubernetes' own gRPC probes cannot speak TLS; this one takes the same ``KVSHUTTLE_TLS_*`` client settings as the
services (CA, client certificate for mutual TLS, server name). It prints one line on stdout, the serving status
(``SERVING``, ``NOT_SERVING``, ...) or the error (``UNAVAILABLE: ...``), and exits 0 only when the status is SERVING.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

# Before gRPC is loaded: its own INFO lines (e.g. "Handshake failed") would repeat the one line this prints.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvshuttle.services.common.config import load, require, setting
from kvshuttle.services.common.tls import ClientTls, TlsClientConfig


@dataclasses.dataclass
class HealthCheckConfig(TlsClientConfig):
    """One grpc.health Check of a kvshuttle gRPC server; exit status 0 only when it answers SERVING."""

    ENV_PREFIX = "KVSHUTTLE_HEALTH_CHECK_"
    address: str = setting("", "gRPC address to check (host:port)")
    service: str = setting("", "Service to ask about (e.g. kvshuttle.v1.SessionRegistry); empty: the whole server")
    timeout_s: float = setting(3.0, "Deadline of the check in seconds (connecting included)")

    def validate(self) -> None:
        require(bool(self.address), "--address is required")
        require(self.timeout_s > 0, "--timeout-s must be > 0")
        self.validate_tls_client()


def channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    """A one-shot synchronous channel: TLS when ``tls`` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


def check(cfg: HealthCheckConfig) -> tuple[bool, str]:
    """(serving?, the line to print) for one Check within ``cfg.timeout_s``."""
    with channel(cfg.address, cfg.client_tls()) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=cfg.service),
                                                        timeout=cfg.timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load(HealthCheckConfig, argv, prog="kvshuttle health-check", description=HealthCheckConfig.__doc__)
    serving, line = check(cfg)
    print(line, flush=True)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
