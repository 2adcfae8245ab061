"""TransferScheduler servicer: the gRPC face of :class:`~kvshuttle.services.scheduler.planning.PlanningService`.

Each method hands its request to the planning service and maps a refusal (a typed
:class:`~kvshuttle.services.scheduler.errors.PlanningError`) to ``context.abort(code, message)``.
"""

from __future__ import annotations

import grpc
from kvshuttle.control_plane.planner import Planner
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.scheduler.claims import RegistryClaims, SessionClaims
from kvshuttle.services.scheduler.errors import PlanningError
from kvshuttle.services.scheduler.kv_manager import KvManager
from kvshuttle.services.scheduler.learning import Learning
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.services.scheduler.planning import PlanningService
from kvshuttle.services.scheduler.planning import prompt_of as prompt_of  # re-exported (tests.support.turn_fakes)
from kvshuttle.services.scheduler.prefix_index import PrefixIndex
from kvshuttle.v1 import registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class TransferSchedulerServicer(scheduler_pb2_grpc.TransferSchedulerServicer):
    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub, workers: WorkerView, planner: Planner,
                 registry_timeout_s: float = 2.0, claims: SessionClaims | None = None,
                 loads: LoadMonitor | None = None, kv: KvManager | None = None, learning: Learning | None = None,
                 prefix: PrefixIndex | None = None):
        """``claims`` reads records and claims handles (default: through ``registry``; see claims.py); ``loads``
        gives the workers' live load (None: every worker counts as idle); ``kv`` manages the decode workers' held KV
        (None: it is left to their TTL); ``learning`` takes the reported outcomes to the planner (default: this
        replica's alone; see learning.py); ``prefix`` says which prompt blocks each prefill worker caches (the KV
        feed; None: the planner's per-session hints only)."""
        self.planning = PlanningService(workers, planner, claims or RegistryClaims(registry, registry_timeout_s),
                                        registry_timeout_s=registry_timeout_s, loads=loads, kv=kv, learning=learning,
                                        prefix=prefix)

    async def PlanTurn(self, request: scheduler_pb2.PlanTurnRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.planning.plan_turn(request)
        except PlanningError as exc:
            await context.abort(exc.code, exc.message)

    async def ReportOutcome(self, request: scheduler_pb2.ReportOutcomeRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.planning.report_outcome(request)
        except PlanningError as exc:
            await context.abort(exc.code, exc.message)

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext):
        return self.planning.stats()
