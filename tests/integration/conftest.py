"""Fixtures shared by the integration tests: a stub on the session's registry, a registered decode worker, and a
real Redis."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.devtools.redis_process import RedisProcess
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


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real redis-server on loopback for the module (nothing on disk); yields its URL (``redis://127.0.0.1:PORT/0``).

    ``KVSHUTTLE_TEST_REDIS_URL`` points the tests at a Redis you run yourself instead. Without redis-server the tests
    that need it are skipped, except under ``CI=true`` (make install installs it).
    """
    external = os.environ.get("KVSHUTTLE_TEST_REDIS_URL")
    if external:
        yield external
        return
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("redis-server is not installed: CI runs every test (make install installs it)", pytrace=False)
        pytest.skip("redis-server is not installed")
    proc = RedisProcess("kvshuttle-test")
    proc.start()
    try:
        yield proc.url
    finally:
        proc.stop()
