"""A decode worker whose lease ends takes its sessions with it: the registry drops their records (real etcd)."""

from __future__ import annotations

import contextlib
import logging

import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc

from tests.support.registry import TENANT, decode_worker, deregister, session_exists, turn, uid
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)
GRACE_S = 1.0  # the registries here look at a departed worker again after this (the default is 10 s)


@contextlib.asynccontextmanager
async def registry_on(etcd: str, prefix: str, **settings):
    """A registry of its own on ``prefix`` (other registries on this etcd, other tests', must not clean up here);
    yields the service and a stub."""
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix, **settings)
    cfg.validate()
    service = await serve(cfg)
    channel = client_channel(service.address)
    try:
        yield service, registry_pb2_grpc.SessionRegistryStub(channel)
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def gone(stub, sid: str) -> bool:
    return not await session_exists(stub, sid)


async def test_sessions_of_a_worker_whose_lease_ended_are_dropped(etcd):
    async with registry_on(etcd, f"/{uid('departed')}/", departed_grace_s=GRACE_S) as (service, stub):
        live = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=decode_worker(uid("d")),
                                                                             lease_ttl_s=60))).worker
        departing = decode_worker(uid("d"))
        reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=departing, lease_ttl_s=2))
        on_gone, on_live, moved = uid("s"), uid("s"), uid("s")
        tokens = list(range(100, 120))
        await stub.RecordTurn(turn(reg.worker, on_gone, tokens))
        await stub.RecordTurn(turn(live, on_live, tokens))
        await stub.RecordTurn(turn(reg.worker, moved, tokens))
        await stub.RecordTurn(turn(live, moved, tokens + [1, 2, 3, 4]))  # its next turn ran on the live worker
        assert await session_exists(stub, on_gone)

        # No keep-alives: the lease ends (a crashed or cut-off worker), and with it the sessions whose KV it held.
        await until(lambda: gone(stub, on_gone), 20, "the departed worker's session record to be dropped",
                    interval_s=0.2)
        ids = {w.worker_id for w in (await stub.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
        assert departing.worker_id not in ids and live.worker_id in ids
        assert await session_exists(stub, on_live) and await session_exists(stub, moved)
        got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=moved, tenant=TENANT))
        assert got.session.decode_worker_id == live.worker_id
        assert service.janitor.dropped == 1
        await deregister(stub, live)


async def test_a_registry_that_starts_later_drops_what_it_missed(etcd):
    """Records left by a worker that went away while no registry was cleaning up go when one starts."""
    prefix = f"/{uid('janitor')}/"
    async with registry_on(etcd, prefix, drop_departed_sessions=False) as (_, stub):
        w = decode_worker(uid("d"))
        reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
        sid = uid("s")
        await stub.RecordTurn(turn(reg.worker, sid, list(range(50, 60))))
        await deregister(stub, reg.worker)
        assert await session_exists(stub, sid)  # nobody cleans up here

    async with registry_on(etcd, prefix, departed_grace_s=GRACE_S) as (second, stub):
        await until(lambda: gone(stub, sid), 15, "the missed worker's session record to be dropped", interval_s=0.2)
        assert second.janitor.dropped == 1


@pytest.mark.parametrize("same_engine", [True, False])
async def test_a_worker_back_within_the_grace_keeps_its_sessions_only_with_the_same_engine(etcd, same_engine, caplog):
    """A lease lost while the worker lived on (etcd was away) must not cost its sessions their pulls; a worker that
    came back as another engine (restarted: its KV is gone) loses them."""
    caplog.set_level(logging.INFO, logger="kvshuttle.services.registry.janitor")
    async with registry_on(etcd, f"/{uid('grace')}/", departed_grace_s=3) as (service, stub):
        w = decode_worker(uid("d"))
        reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
        sid = uid("s")
        await stub.RecordTurn(turn(reg.worker, sid, list(range(70, 80))))
        await service.store.leases.revoke(reg.lease_id)  # the lease is lost; the worker itself lives on
        again = decode_worker(w.worker_id, **({} if same_engine else {"engine_id": "eng-restarted"}))
        await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=again, lease_ttl_s=60))

        def decided() -> list[str]:  # the janitor's look at the worker, once the grace has passed
            return [r.getMessage() for r in caplog.records if r.name.endswith("janitor") and w.worker_id in
                    r.getMessage() and ("registered again" in r.getMessage() or "is gone" in r.getMessage())]

        said = await until(decided, 15, "the janitor's decision on the departed worker")
        assert said == [f"worker {w.worker_id} is registered again with its engine: its sessions stay" if same_engine
                        else f"worker {w.worker_id} is gone: dropped 1 session record(s) whose KV it held"]
        assert await session_exists(stub, sid) is same_engine
        assert service.janitor.dropped == (0 if same_engine else 1)
