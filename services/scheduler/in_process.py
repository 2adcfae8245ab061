"""The transfer scheduler inside another process (the gateway's ``--scheduler local``): its stub, answered in-process.

``InProcessScheduler`` has the generated stub's ``PlanTurn``, ``ReportOutcome`` and ``GetStats`` over the
scheduler's PlanningService (same requests, responses, ``timeout`` and errors: a refusal raises
``grpc.aio.AioRpcError`` with the servicer's status and details, built from the typed error by ``rpc_error``), so the
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
from collections.abc import Awaitable
from typing import TypeVar

import grpc
import grpc.aio
from kvshuttle.services.common.config import ConfigError, add_arguments, env_name, from_namespace
from kvshuttle.services.common.tls import TlsConfig
from kvshuttle.services.scheduler.errors import PlanningError
from kvshuttle.services.scheduler.planning import PlanningService
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import scheduler_pb2

Resp = TypeVar("Resp")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a client of the gRPC servicer gets for a refusal with ``code`` and ``details``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class InProcessScheduler:
    """The TransferScheduler stub, answered by a PlanningService in this process."""

    def __init__(self, planning: PlanningService):
        self._planning = planning

    async def PlanTurn(self, request: scheduler_pb2.PlanTurnRequest,  # noqa: N802 - the stub's names
                       timeout: float | None = None) -> scheduler_pb2.PlanTurnResponse:
        return await _call(self._planning.plan_turn(request), timeout)

    async def ReportOutcome(self, request: scheduler_pb2.ReportOutcomeRequest,  # noqa: N802
                            timeout: float | None = None) -> scheduler_pb2.ReportOutcomeResponse:
        return await _call(self._planning.report_outcome(request), timeout)

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest,  # noqa: N802
                       timeout: float | None = None) -> scheduler_pb2.GetStatsResponse:
        return self._planning.stats()


async def _call(answer: Awaitable[Resp], timeout: float | None) -> Resp:
    """``answer`` awaited as the servicer would be, within ``timeout``: a refusal or the deadline raise the
    ``grpc.aio.AioRpcError`` the stub would."""
    try:
        async with asyncio.timeout(timeout):
            return await answer
    except PlanningError as exc:
        raise rpc_error(exc.code, exc.message) from None
    except TimeoutError:
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded (in-process scheduler)") from None


class EmbeddedScheduler:
    """A whole scheduler service in this process (worker view, claims, load polls, KV manager, shared learning, its
    gRPC API on ``address``) with ``stub`` to call it without a hop."""

    def __init__(self, cfg: SchedulerConfig):
        self.service = SchedulerService(cfg)
        self.stub = InProcessScheduler(self.service.planning)
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
