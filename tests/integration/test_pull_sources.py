"""P is only ever told to pull from a registered decode worker's address (real etcd, registry and scheduler).

A session record whose handle points anywhere but the NIXL host, port and engine of the registered decode worker it
names (written through the registry with a foreign address, written straight into etcd for a worker that is not
registered, or handed to PlanTurn as a forged snapshot) is planned as a recompute: no pull, no claim.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kvshuttle.control_plane import session as session_rules
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.scheduler import first_plan
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)
BS = 16
HISTORY = list(range(4000, 4100))


def worker(worker_id: str, role: int, port: int) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"engine-{worker_id}",
                             grpc_address=f"127.0.0.1:{port}", nixl_host="127.0.0.1", nixl_port=port + 1,
                             block_size=BS, kv_blocks_ttl_s=60, model="tiny")


def handle(engine_id: str, host: str, port: int, covered: int = 99) -> str:
    return json.dumps({"do_remote_decode": True, "remote_engine_id": engine_id, "remote_host": host,
                       "remote_port": port, "remote_num_tokens": covered,
                       "remote_block_ids": [list(range(100, 100 + -(-covered // BS)))]})


@pytest.fixture(scope="module", params=["registry", "etcd"])
async def plane(etcd, request):
    """Registry + scheduler (claiming through the registry or in etcd) on their own key prefix, a registered P and
    D, stubs, and a store on the same prefix for writing records the registry would never write."""
    prefix = f"/sources-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                          expiry_margin_s=5))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, policy="threshold",
                                                 etcd_endpoints=etcd if request.param == "etcd" else ""))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
    sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    p, d = worker("p-src", common_pb2.WORKER_ROLE_PREFILL, 7900), worker("d-src", common_pb2.WORKER_ROLE_DECODE, 7950)
    for w in (p, d):
        await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))
    store = EtcdStore(etcd, prefix)
    await store.connect()
    yield reg, sched, store, d
    await store.close()
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def plan(sched, session: str, **kw) -> scheduler_pb2.PlanTurnResponse:
    """PlanTurn for HISTORY + 2 new tokens, once the scheduler's worker watch has seen the workers."""
    async def on_d_src():
        got = await first_plan(sched, scheduler_pb2.PlanTurnRequest(session_id=session,
                                                                    prompt_token_ids=HISTORY + [1, 2], **kw))
        return got if got.decode.worker_id == "d-src" else None

    return await until(on_d_src, what="a plan on d-src (the scheduler's worker view)")


async def record(reg, session: str, params: str) -> registry_pb2.GetSessionResponse:
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id="d-src",
                                                        kv_transfer_params_json=params, token_ids=HISTORY))
    return await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))


async def test_the_real_handle_pulls(plane):
    reg, sched, _, d = plane
    session = f"s-{uuid.uuid4().hex[:8]}"
    await record(reg, session, handle(d.engine_id, d.nixl_host, d.nixl_port))
    pulled = await plan(sched, session)
    assert pulled.decision == scheduler_pb2.DECISION_PULL, pulled.reason
    params = json.loads(pulled.prefill_kv_transfer_params_json)
    assert (params["remote_host"], params["remote_port"]) == (d.nixl_host, d.nixl_port)


@pytest.mark.parametrize("host,port_offset", [("10.9.9.9", 0), ("127.0.0.1", 7)])
async def test_a_handle_naming_another_address_is_never_pulled(plane, host, port_offset):
    """Recorded through the registry for the registered D (its engine id), but naming another NIXL address."""
    reg, sched, _, d = plane
    session = f"s-{uuid.uuid4().hex[:8]}"
    await record(reg, session, handle(d.engine_id, host, d.nixl_port + port_offset))
    got = await plan(sched, session)
    assert got.decision == scheduler_pb2.DECISION_RECOMPUTE and "not alive" in got.reason, got.reason
    params = json.loads(got.prefill_kv_transfer_params_json or "{}")
    assert not params.get("do_remote_prefill") and params.get("remote_host") is None, params  # P computes all
    assert not (await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))).session.claimed


async def test_a_record_forged_in_etcd_for_an_unregistered_worker_is_never_pulled(plane):
    reg, sched, store, d = plane
    session = f"s-{uuid.uuid4().hex[:8]}"
    real = (await record(reg, session, handle(d.engine_id, d.nixl_host, d.nixl_port))).session
    forged = common_pb2.Session()
    forged.CopyFrom(real)
    forged.decode_worker_id = "d-ghost"  # never registered; its "NIXL side channel" is an attacker's host
    forged.kv_transfer_params_json = handle("engine-d-ghost", "10.6.6.6", 5600)
    lease, _ = await store.leases.grant(60)
    assert await store.sessions.put(forged, lease, expect_revision=real.revision) is not None
    got = await plan(sched, session)
    assert got.decision == scheduler_pb2.DECISION_RECOMPUTE and "not alive" in got.reason, got.reason
    assert "10.6.6.6" not in got.prefill_kv_transfer_params_json
    assert not json.loads(got.prefill_kv_transfer_params_json or "{}").get("do_remote_prefill")

    # The same forgery handed to PlanTurn as the caller's snapshot of the (real) record: still no pull.
    real = (await record(reg, session, handle(d.engine_id, d.nixl_host, d.nixl_port))).session
    snapshot = registry_pb2.GetSessionResponse(session=real, expires_in_s=session_rules.expires_in(real, time.time()))
    snapshot.session.kv_transfer_params_json = handle(d.engine_id, "10.6.6.6", d.nixl_port)
    got = await plan(sched, session, session_snapshot=snapshot)
    assert got.decision == scheduler_pb2.DECISION_RECOMPUTE and "not alive" in got.reason, got.reason
    assert not (await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))).session.claimed
