"""One way to run a kvshuttle gRPC server: grpc.aio with health, reflection, metrics and trace propagation.

Trace context travels only in a process that traces (``kvshuttle.services.common.telemetry.tracing_enabled()`` when the server or
channel is built, i.e. after ``setup_tracing``): otherwise the OpenTelemetry interceptors are left out.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvshuttle.services.common.caller_check import CallerCheck
from kvshuttle.services.common.metrics import GrpcMetricsInterceptor
from kvshuttle.services.common.telemetry import client_interceptors, tracing_enabled
from kvshuttle.services.common.tls import ClientTls, ServerTls
from opentelemetry.instrumentation.grpc import aio_server_interceptor

log = logging.getLogger(__name__)


class Server:
    """A grpc.aio server bound to ``address`` that serves the given services plus health and reflection.

    ``register`` callbacks add servicers (e.g. ``registry_pb2_grpc.add_SessionRegistryServicer_to_server``).
    ``service_names`` are full names (``kvshuttle.v1.SessionRegistry``) reported SERVING and listed by reflection.
    ``tls`` serves TLS only (mutual TLS when it has a client CA, and then each call of the registry's and the
    scheduler's APIs is authorized by the caller's certificate: caller_check.py); ``max_message_bytes`` caps received and sent
    messages (gRPC's default: 4 MiB received; larger ones fail with RESOURCE_EXHAUSTED).
    """

    def __init__(self, address: str, service_names: Iterable[str],
                 register: Iterable[Callable[[grpc.aio.Server], None]], *, tls: ServerTls | None = None,
                 max_message_bytes: int | None = None, options: Sequence[tuple[str, object]] = ()):
        """``options``: more gRPC channel arguments of the server."""
        self.service_names = list(service_names)
        options = [*_message_options(max_message_bytes), *options]
        # Metrics last (innermost): they get the registered handler itself, instrumented once per method.
        interceptors = [*([aio_server_interceptor()] if tracing_enabled() else []), GrpcMetricsInterceptor()]
        if tls is not None and tls.client_ca is not None and tls.check_callers:
            # innermost: the metrics interceptor counts a refused call under PERMISSION_DENIED
            interceptors.append(CallerCheck())
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        for add in register:
            add(self.server)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.tls = tls
        if tls is not None:
            self.port = self.server.add_secure_port(address, tls.credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        for name in [*self.service_names, ""]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        security = "plaintext" if self.tls is None else "mutual TLS" if self.tls.client_ca else "TLS"
        log.info("serving %s on %s (%s)", ", ".join(self.service_names), self.address, security)

    async def stop(self, grace: float = 2.0) -> None:
        for name in [*self.service_names, ""]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        await self.server.stop(grace)


async def _maybe_await(value: object) -> None:
    if isinstance(value, Awaitable):
        await value


def _message_options(max_message_bytes: int | None) -> list[tuple[str, int]]:
    if not max_message_bytes:
        return []
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def client_channel(address: str, tls: ClientTls | None = None, *, max_message_bytes: int | None = None,
                   options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel (TLS when ``tls`` is given, else plaintext) that propagates the current trace context
    (when this process traces)."""
    interceptors = client_interceptors(address)
    opts = [*options, *_message_options(max_message_bytes)]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*opts, *tls.options()],
                                   interceptors=interceptors)


def service_main(config_cls: type, argv, prog: str, trace_name: str, make_service) -> None:
    """The life of a service process: typed config from flags/env, logging, tracing, run until SIGINT/SIGTERM.

    ``make_service(cfg)`` returns an object with async ``start()`` and ``stop()``; it is built inside the loop,
    uvloop's when the config says ``event_loop = "uvloop"`` (the gateway's default), else asyncio's own.
    """
    from kvshuttle.services.common.config import load
    from kvshuttle.services.common.telemetry import setup_tracing, shutdown_tracing

    cfg = load(config_cls, argv, prog=prog)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing(trace_name, cfg)

    async def run() -> None:
        service = make_service(cfg)
        await run_until_signal(service.start, service.stop)

    loop_factory = None
    if getattr(cfg, "event_loop", "asyncio") == "uvloop":
        import uvloop  # a dependency of the base install: never silently missing

        loop_factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(run())
    finally:
        shutdown_tracing()


async def run_until_signal(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """Start, then wait for SIGINT/SIGTERM, then stop (the usual life of a service process)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await start()
    try:
        await done.wait()
    finally:
        await stop()
