"""A decode worker whose lease ends takes its sessions with it: the registry drops their records (real etcd)."""

from __future__ import annotations

import grpc
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.v1 import registry_pb2, registry_pb2_grpc

from tests.integration.test_registry import TENANT, _deregister, decode_worker, eventually, turn, uid

pytestmark = pytest.mark.timeout(120)


async def exists(stub, sid: str) -> bool:
    try:
        await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
        return False


async def test_sessions_of_a_worker_whose_lease_ended_are_dropped(stub, decode):
    gone = decode_worker(uid("d"))
    reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=gone, lease_ttl_s=2))
    on_gone, on_live, moved = uid("s"), uid("s"), uid("s")
    tokens = list(range(100, 120))
    await stub.RecordTurn(turn(reg.worker, on_gone, tokens))
    await stub.RecordTurn(turn(decode, on_live, tokens))
    await stub.RecordTurn(turn(reg.worker, moved, tokens))
    await stub.RecordTurn(turn(decode, moved, tokens + [1, 2, 3, 4]))  # its next turn ran on the live worker
    assert await exists(stub, on_gone)

    # No keep-alives: the lease ends (a crashed or cut-off worker), and with it the sessions whose KV it held.
    assert await eventually(lambda: _not(exists(stub, on_gone)), timeout=20), "record of a departed worker kept"
    ids = {w.worker_id for w in (await stub.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
    assert gone.worker_id not in ids
    assert await exists(stub, on_live) and await exists(stub, moved)
    got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=moved, tenant=TENANT))
    assert got.session.decode_worker_id == decode.worker_id


async def test_a_registry_that_starts_later_drops_what_it_missed(etcd):
    """Records left by a worker that went away while no registry was cleaning up go when one starts."""
    prefix = f"/{uid('janitor')}/"  # other registries on this etcd (other tests') must not clean up here
    quiet = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix, drop_departed_sessions=False)
    quiet.validate()
    first = await serve(quiet)
    channel = client_channel(first.address)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    w = decode_worker(uid("d"))
    reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
    sid = uid("s")
    await stub.RecordTurn(turn(reg.worker, sid, list(range(50, 60))))
    await _deregister(stub, reg.worker)
    assert await exists(stub, sid)  # nobody cleans up here
    await channel.close()
    await first.stop(grace=0.5)

    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix)
    cfg.validate()
    second = await serve(cfg)
    channel = client_channel(second.address)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    try:
        assert await eventually(lambda: _not(exists(stub, sid)), timeout=15)
        assert second.janitor.dropped >= 1
    finally:
        await channel.close()
        await second.stop(grace=0.5)


async def _not(coro) -> bool:
    return not await coro


@pytest.mark.parametrize("same_engine", [True, False])
async def test_a_worker_back_within_the_grace_keeps_its_sessions_only_with_the_same_engine(etcd, same_engine):
    """A lease lost while the worker lived on (etcd was away) must not cost its sessions their pulls; a worker that
    came back as another engine (restarted: its KV is gone) loses them."""
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=f"/{uid('grace')}/",
                         departed_grace_s=3)
    cfg.validate()
    service = await serve(cfg)
    channel = client_channel(service.address)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    try:
        w = decode_worker(uid("d"))
        reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
        sid = uid("s")
        await stub.RecordTurn(turn(reg.worker, sid, list(range(70, 80))))
        await service.store.revoke_lease(reg.lease_id)  # the lease is lost; the worker itself lives on
        again = decode_worker(w.worker_id, **({} if same_engine else {"engine_id": "eng-restarted"}))
        await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=again, lease_ttl_s=60))
        gone = await eventually(lambda: _not(exists(stub, sid)), timeout=8)
        assert gone is not same_engine, "kept a restarted worker's sessions" if gone is False else "dropped them"
        assert service.janitor.dropped == (0 if same_engine else 1)
    finally:
        await channel.close()
        await service.stop(grace=0.5)
