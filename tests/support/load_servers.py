"""Stand-ins for vLLM's GetLoads: a real gRPC VllmEngine server on loopback answering with numbers a test sets,
and helpers that feed a WorkerView (tests of the scheduler's load monitor and of the load feed)."""

from __future__ import annotations

import asyncio

import grpc
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.v1 import common_pb2, registry_pb2
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

Event = registry_pb2.WatchWorkersResponse


class Loads(vllm_engine_pb2_grpc.VllmEngineServicer):
    """GetLoads with numbers the test sets; ``delay_s`` makes every answer late."""

    def __init__(self, **numbers):
        self.numbers = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                        "max_total_num_tokens": 10_000, "num_waiting_uncached_tokens": 0, "cache_hit_rate": 0.0,
                        **numbers}
        self.delay_s = 0.0
        self.calls = 0

    async def GetLoads(self, request, context):
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return vllm_engine_pb2.GetLoadsResponse(version="test", dp_rank_count=1,
                                                loads=[vllm_engine_pb2.SchedulerLoad(dp_rank=0, **self.numbers)])


class LoadServer:
    """A VllmEngine server on a fixed loopback port that can be stopped and started again on the same port."""

    def __init__(self, **numbers):
        self.servicer = Loads(**numbers)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.servicer, self.server)
        assert self.server.add_insecure_port(self.address) == self.port
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


def worker(worker_id: str, address: str, role: int = common_pb2.WORKER_ROLE_PREFILL) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, grpc_address=address)


def put(view: WorkerView, *workers: common_pb2.Worker) -> None:
    view.apply(Event(type=Event.EVENT_TYPE_PUT, workers=list(workers)))


def delete(view: WorkerView, *workers: common_pb2.Worker) -> None:
    view.apply(Event(type=Event.EVENT_TYPE_DELETE, workers=list(workers)))
