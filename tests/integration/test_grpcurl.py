"""grpcurl against a loopback kvshuttle server: reflection lists and describes the services, health answers SERVING.

grpcurl runs in a thread (``asyncio.to_thread``): the grpc.aio server shares the test's event loop.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import pytest_asyncio
from kvshuttle.services.common.grpc_server import Server
from kvshuttle.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from tests.support.grpcurl import check_serving, describe, grpcurl, health_status, list_services

pytestmark = pytest.mark.timeout(300)

SERVICES = {
    "kvshuttle.v1.SessionRegistry": registry_pb2,
    "kvshuttle.v1.TransferScheduler": scheduler_pb2,
    "kvshuttle.v1.Gateway": gateway_pb2,
}


class Registry(registry_pb2_grpc.SessionRegistryServicer):
    async def ListWorkers(self, request, context):
        return registry_pb2.ListWorkersResponse(workers=[common_pb2.Worker(worker_id="d0", lease_id=1 << 40)])


class Scheduler(scheduler_pb2_grpc.TransferSchedulerServicer):
    async def PlanTurn(self, request, context):
        return scheduler_pb2.PlanTurnResponse(decision=scheduler_pb2.DECISION_RECOMPUTE,
                                              reason=f"{len(request.prompt_token_ids)} tokens, no session")


class Gateway(gateway_pb2_grpc.GatewayServicer):
    async def Complete(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no decode workers")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def address():
    server = Server("127.0.0.1:0", list(SERVICES), [
        lambda s: registry_pb2_grpc.add_SessionRegistryServicer_to_server(Registry(), s),
        lambda s: scheduler_pb2_grpc.add_TransferSchedulerServicer_to_server(Scheduler(), s),
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(Gateway(), s),
    ])
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop(0)


async def test_list_shows_every_service(address):
    listed = await asyncio.to_thread(list_services, address)
    assert {*SERVICES, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed, listed


@pytest.mark.parametrize("name", list(SERVICES))
async def test_describe_shows_the_methods(address, name):
    text = await asyncio.to_thread(describe, address, name)
    service = SERVICES[name].DESCRIPTOR.services_by_name[name.rsplit(".", 1)[1]]
    for method in service.methods:
        assert f"rpc {method.name} (" in text, f"{method.name} missing from:\n{text}"
    if name == "kvshuttle.v1.Gateway":
        assert "returns ( stream .kvshuttle.v1.TurnEvent )" in text


async def test_describe_a_message(address):
    text = await asyncio.to_thread(describe, address, "kvshuttle.v1.Session")
    assert "repeated .kvshuttle.v1.PrefixCheckpoint checkpoints = 20;" in text
    assert "bytes block_hashes" not in text and 'reserved "block_hashes", "text";' in text


@pytest.mark.parametrize("service", ["", *SERVICES])
async def test_health_is_serving(address, service):
    assert await asyncio.to_thread(health_status, address, service) == "SERVING"


async def test_the_one_line_check(address):
    await asyncio.to_thread(check_serving, address, list(SERVICES))


async def test_invoke_with_json(address):
    out = await asyncio.to_thread(grpcurl, "-plaintext", "-d", '{"promptTokenIds": [1, 2, 3]}', address,
                                  "kvshuttle.v1.TransferScheduler/PlanTurn")
    assert json.loads(out.stdout) == {"decision": "DECISION_RECOMPUTE", "reason": "3 tokens, no session"}
    out = await asyncio.to_thread(grpcurl, "-plaintext", address, "kvshuttle.v1.SessionRegistry/ListWorkers")
    # grpcurl 1.8 prints proto field names (int64 still as a string).
    assert json.loads(out.stdout)["workers"][0] == {"worker_id": "d0", "lease_id": str(1 << 40)}
    failed = await asyncio.to_thread(grpcurl, "-plaintext", "-d", "{}", address, "kvshuttle.v1.Gateway/Complete",
                                     check=False)
    assert failed.returncode != 0 and "FailedPrecondition" in failed.stderr and "no decode workers" in failed.stderr
