"""Fixtures shared by the registry tests: a stub on the session's registry and a registered decode worker."""

from __future__ import annotations

import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc

from tests.support.registry import decode_worker, deregister, uid


@pytest.fixture
async def stub(registry):
    channel = client_channel(registry)
    yield registry_pb2_grpc.SessionRegistryStub(channel)
    await channel.close()


@pytest.fixture
async def decode(stub):
    """A decode worker registered (long lease) for the test, deregistered after it."""
    w = decode_worker(uid("d"))
    resp = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
    yield resp.worker
    await deregister(stub, resp.worker)
