"""The transfer scheduler inside another process (the gateway's ``--scheduler local``): its stub, answered in-process.

``InProcessScheduler`` has the generated stub's ``PlanTurn``, ``ReportOutcome`` and ``GetStats`` (same requests,
responses, ``timeout`` and errors: a refusal raises ``grpc.aio.AioRpcError`` with the servicer's status), so the
gateway's turn code does not know which it talks to. A plan then costs no serialization, no network hop and no
second process's CPU; the planner's learned state is shared with the other replicas through etcd
(services/scheduler/learning.py), and claims go to etcd itself, so several gateways each planning in-process
agree with each other and with standalone scheduler replicas.

``embedded_config`` reads the embedded scheduler's flags (the gateway's ``--scheduler-args``, and the scheduler's
own KVSHUTTLE_SCHEDULER_* environment) with the gateway's registry address and TLS settings unless they are given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
from kvshuttle.services.common.config import ConfigError, add_arguments, env_name, from_namespace
from kvshuttle.services.common.tls import TlsConfig
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.scheduler.servicer import TransferSchedulerServicer
from kvshuttle.v1 import scheduler_pb2

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _Context:
    """The part of grpc.aio.ServicerContext the servicer uses: ``abort`` raises what a client would see."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class InProcessScheduler:
    """The TransferScheduler stub, answered by a servicer in this process."""

    def __init__(self, servicer: TransferSchedulerServicer):
        self._servicer = servicer

    async def PlanTurn(self, request: scheduler_pb2.PlanTurnRequest,  # noqa: N802 - the stub's names
                       timeout: float | None = None) -> scheduler_pb2.PlanTurnResponse:
        return await _call(self._servicer.PlanTurn, request, timeout)

    async def ReportOutcome(self, request: scheduler_pb2.ReportOutcomeRequest,  # noqa: N802
                            timeout: float | None = None) -> scheduler_pb2.ReportOutcomeResponse:
        return await _call(self._servicer.ReportOutcome, request, timeout)

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest,  # noqa: N802
                       timeout: float | None = None) -> scheduler_pb2.GetStatsResponse:
        return await _call(self._servicer.GetStats, request, timeout)


async def _call(method: Callable[[Req, _Context], Awaitable[Resp]], request: Req, timeout: float | None) -> Resp:
    try:
        async with asyncio.timeout(timeout):
            return await method(request, _Context())
    except TimeoutError:
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Deadline Exceeded (in-process scheduler)") from None


class EmbeddedScheduler:
    """A whole scheduler service in this process (worker view, claims, load polls, KV manager, shared learning, its
    gRPC API on ``address``) with ``stub`` to call it without a hop."""

    def __init__(self, cfg: SchedulerConfig):
        self.service = SchedulerService(cfg)
        self.stub = InProcessScheduler(self.service.servicer)
        self.address = self.service.address

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a config error, not an exit: the gateway reports it as its own flag's
        raise ConfigError(f"--scheduler-args: {message}")


def embedded_config(args: str, *, registry: str, tls: TlsConfig,
                    environ: dict[str, str] | None = None) -> SchedulerConfig:
    """The embedded scheduler's config: ``args`` (its command-line flags), then its environment, then these
    defaults: the gateway's ``registry`` address and TLS settings, and a free loopback port for its gRPC API
    (GetStats, grpcurl)."""
    environ = os.environ if environ is None else environ
    parser = _Parser(prog="kvshuttle gateway --scheduler-args", add_help=False)
    add_arguments(SchedulerConfig, parser)
    try:
        argv = shlex.split(args)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"--scheduler-args: {exc}") from None
    ns = parser.parse_args(argv)  # _Parser.error: ConfigError
    fields = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
    inherited = {"listen": "127.0.0.1:0", "registry": registry,
                 **{f.name: getattr(tls, f.name) for f in dataclasses.fields(TlsConfig)}}
    for name, value in inherited.items():
        if getattr(ns, name, None) is None and env_name(SchedulerConfig, fields[name]) not in environ:
            setattr(ns, name, value)
    try:
        return from_namespace(SchedulerConfig, ns, environ)
    except ConfigError as exc:
        raise ConfigError(f"--scheduler-args: {exc}") from None
