"""TLS on loopback with real processes: mutual TLS between the registry, the scheduler and their clients (the
worker agent's registry link included), each internal method open only to the service identities it is for (the
client certificate's Common Name: control_plane/service_access.py), etcd with client TLS and user/password auth, and
the gRPC message limit.

Certificates come from a throwaway CA made in the test; a second CA stands for an attacker's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc
import pytest
from etcd3aio import prefix_range_end
from etcd3aio.auth import AuthService, PermissionType
from etcd3aio.kv import KVService
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.tls import ClientTls, EtcdSecurity, TlsClientConfig
from kvshuttle.services.devtools.etcd_process import EtcdProcess, EtcdTls
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.store.etcd_channel import etcd_channel
from kvshuttle.services.store.etcd_maintenance import EtcdMaintenance, defragment
from kvshuttle.services.store.etcd_store import EtcdStore, StoreError, StoreUnavailable, parse_endpoints
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvshuttle.workers.agent import RegistryLink

from tests.support.certs import TestCA
from tests.support.scheduler import first_plan, handle_for, worker
from tests.support.waits import until

pytestmark = pytest.mark.timeout(180)
BS = 16
ETCD_USER, ETCD_PASSWORD = "kvshuttle", "etcd-pass-0f9c"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(directory / "ca"), TestCA(directory / "rogue", name="rogue CA")
    return {"ca": ca, "rogue": rogue, "registry": ca.issue("registry"), "scheduler": ca.issue("scheduler"),
            "gateway": ca.issue("gateway", server=False), "worker": ca.issue("worker", server=False),
            "worker:p-1": ca.issue("worker:p-1", server=False), "admin": ca.issue("admin", server=False),
            "client": ca.issue("client", server=False), "etcd": ca.issue("etcd", client=False),
            "etcd-client": ca.issue("etcd-client", server=False),
            "rogue-client": rogue.issue("rogue-client", server=False)}


def server_tls(pki, name: str) -> dict:
    return {"tls_cert": pki[name].cert, "tls_key": pki[name].key, "tls_client_ca": pki["ca"].ca_file}


def client_tls(pki, name: str, ca: str = "ca") -> dict:
    return {"tls_ca": pki[ca].ca_file, "tls_client_cert": pki[name].cert, "tls_client_key": pki[name].key}


def tls_of(pki, name: str | None = "gateway") -> ClientTls:
    cfg = TlsClientConfig(tls_ca=pki["ca"].ca_file, tls_client_cert=pki[name].cert if name else "",
                          tls_client_key=pki[name].key if name else "")
    return cfg.client_tls()


async def refused(call, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value
    return err.value.details() or ""


async def plan_eventually(sched, request) -> scheduler_pb2.PlanTurnResponse:
    """PlanTurn once the scheduler's worker watch has seen the workers (and their source check passes)."""
    async def planned():
        got = await first_plan(sched, request, timeout=5)
        return got if "not alive" not in got.reason else None

    return await until(planned, 10, "a plan with the registered workers")


# --------------------------------------------------------------------------------------------------- etcd, secured

@pytest.fixture(scope="module")
async def secure_etcd(pki, tmp_path_factory):
    """etcd serving clients over TLS only, requiring client certificates, with auth enabled: root, and a
    ``kvshuttle`` user allowed only under ``/secure/``."""
    ca, etcd_cert, health = pki["ca"], pki["etcd"], pki["etcd-client"]
    proc = EtcdProcess("secure", tls=EtcdTls(etcd_cert.cert, etcd_cert.key, client_ca=ca.ca_file,
                                             health_cert=health.cert, health_key=health.key))
    await proc.astart()
    admin = EtcdSecurity(ca=open(ca.ca_file, "rb").read(), cert=open(health.cert, "rb").read(),
                         key=open(health.key, "rb").read())
    store = EtcdStore(proc.endpoints, "/secure/", security=admin)
    await store.connect()
    auth = AuthService(store._channel)
    await auth.role_add("root")
    await auth.user_add("root", "root-pass-77")
    await auth.user_grant_role("root", "root")
    await auth.role_add("kvshuttle")
    await auth.role_grant_permission("kvshuttle", "/secure/", prefix_range_end("/secure/"),
                                     perm_type=PermissionType.READWRITE)
    await auth.user_add(ETCD_USER, ETCD_PASSWORD)
    await auth.user_grant_role(ETCD_USER, "kvshuttle")
    await auth.auth_enable()
    await store.close()
    yield proc
    await proc.astop()


def etcd_settings(pki, password: str = ETCD_PASSWORD) -> dict:
    return {"etcd_ca": pki["ca"].ca_file, "etcd_cert": pki["etcd-client"].cert, "etcd_key": pki["etcd-client"].key,
            "etcd_username": ETCD_USER, "etcd_password": password}


async def test_registry_and_scheduler_plan_and_record_over_mutual_tls_with_secured_etcd(pki, secure_etcd):
    """The whole control-plane round trip over TLS: registry (mTLS server, etcd over TLS with auth), scheduler (mTLS
    server, mTLS client of the registry, claims in the secured etcd), a worker agent's registry link, a client."""
    prefix = f"/secure/{uuid.uuid4().hex[:6]}/"
    reg_cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=secure_etcd.endpoints, key_prefix=prefix,
                             expiry_margin_s=5, **server_tls(pki, "registry"), **etcd_settings(pki))
    reg_cfg.validate()
    registry = await serve(reg_cfg)
    sched_cfg = SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                etcd_endpoints=secure_etcd.endpoints, pull_threshold_tokens=16,
                                load_poll_interval_s=0, policy="threshold", **server_tls(pki, "scheduler"),
                                **client_tls(pki, "scheduler"), **etcd_settings(pki))
    sched_cfg.validate()
    scheduler = SchedulerService(sched_cfg)
    await scheduler.start()
    assert scheduler.claims.via == "etcd"
    channels = [client_channel(registry.address, tls_of(pki)), client_channel(scheduler.address, tls_of(pki))]
    link = None
    try:
        reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
        sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])

        # A worker agent registers over mutual TLS.
        p = worker("p-tls", common_pb2.WORKER_ROLE_PREFILL, 7700)
        link = RegistryLink(registry.address, p, 30, tls=tls_of(pki, "worker"))
        link_task = asyncio.create_task(link.run())
        await asyncio.wait_for(link.registered.wait(), 20)
        d = worker("d-tls", common_pb2.WORKER_ROLE_DECODE, 7800)
        async with client_channel(registry.address, tls_of(pki, "worker")) as as_worker:
            await registry_pb2_grpc.SessionRegistryStub(as_worker).RegisterWorker(
                registry_pb2.RegisterWorkerRequest(worker=d, lease_ttl_s=30))
        listed = {w.worker_id for w in (await reg.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
        assert listed == {"p-tls", "d-tls"}

        session, history = f"s-{uuid.uuid4().hex[:8]}", list(range(500, 600))
        first = await plan_eventually(sched, scheduler_pb2.PlanTurnRequest(session_id=session,
                                                                           prompt_token_ids=history[:60]))
        assert first.decision == scheduler_pb2.DECISION_RECOMPUTE and "no recorded KV" in first.reason
        await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id=d.worker_id,
                                                            kv_transfer_params_json=handle_for(d, 99),
                                                            token_ids=history))
        pulled = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session,
                                                                    prompt_token_ids=history + [1, 2]))
        assert pulled.decision == scheduler_pb2.DECISION_PULL and pulled.figures.reusable_tokens == 99, pulled.reason
        assert (await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))).session.claimed

        # Clients without a certificate of the right CA, or without TLS, are refused in the handshake.
        for channel in (client_channel(registry.address), client_channel(registry.address, tls_of(pki, None)),
                        client_channel(registry.address, ClientTls(
                            open(pki["ca"].ca_file, "rb").read(), open(pki["rogue-client"].cert, "rb").read(),
                            open(pki["rogue-client"].key, "rb").read())),
                        client_channel(scheduler.address, tls_of(pki, None))):
            try:
                stub = registry_pb2_grpc.SessionRegistryStub(channel)
                await refused(stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=3))
            finally:
                await channel.close()
        # A client that does not trust the servers' CA refuses them.
        rogue_ca = ClientTls(open(pki["rogue"].ca_file, "rb").read(), open(pki["client"].cert, "rb").read(),
                             open(pki["client"].key, "rb").read())
        async with client_channel(registry.address, rogue_ca) as channel:
            await refused(registry_pb2_grpc.SessionRegistryStub(channel).ListWorkers(
                registry_pb2.ListWorkersRequest(), timeout=3))
        link_task.cancel()
        await asyncio.gather(link_task, return_exceptions=True)
        await link.deregister()
    finally:
        if link is not None:
            await link.close()
        for channel in channels:
            await channel.close()
        await scheduler.stop()
        await registry.stop(grace=0.5)


async def test_each_internal_method_is_open_only_to_the_identities_it_is_for(pki, etcd):
    """Registry and scheduler over mutual TLS (authorization on, the default): a certificate of the CA is not enough;
    its Common Name must be a role the method is for (PERMISSION_DENIED, saying who may, otherwise), a named worker
    certificate registers only itself, health stays open, and a refused call is counted under its status code."""
    from kvshuttle.services.common.metrics import GRPC_HANDLED

    prefix = f"/authz/{uuid.uuid4().hex[:6]}/"
    reg_cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                             **server_tls(pki, "registry"))
    reg_cfg.validate()
    registry = await serve(reg_cfg)
    sched_cfg = SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                etcd_endpoints=etcd, load_poll_interval_s=0, policy="threshold",
                                **server_tls(pki, "scheduler"), **client_tls(pki, "scheduler"))
    sched_cfg.validate()
    scheduler = SchedulerService(sched_cfg)
    await scheduler.start()
    names = ("gateway", "worker", "worker:p-1", "admin", "client", "scheduler")
    channels = {n: (client_channel(registry.address, tls_of(pki, n)), client_channel(scheduler.address, tls_of(pki, n)))
                for n in names}
    denied = GRPC_HANDLED.labels("kvshuttle.v1.SessionRegistry", "RegisterWorker", "PERMISSION_DENIED")
    try:
        def reg(name):
            return registry_pb2_grpc.SessionRegistryStub(channels[name][0])

        def sched(name):
            return scheduler_pb2_grpc.TransferSchedulerStub(channels[name][1])

        def register(worker_id):
            return registry_pb2.RegisterWorkerRequest(
                worker=worker(worker_id, common_pb2.WORKER_ROLE_PREFILL, 7700), lease_ttl_s=30)

        # workers register workers; a gateway, a scheduler or a certificate naming no role may not
        before = denied._value.get()
        for name in ("gateway", "scheduler", "client"):
            details = await refused(reg(name).RegisterWorker(register("p-9"), timeout=5),
                                    grpc.StatusCode.PERMISSION_DENIED)
            assert "RegisterWorker" in details and ("worker or admin" in details or "service identity" in details)
        assert denied._value.get() == before + 3
        await reg("worker").RegisterWorker(register("p-2"), timeout=5)
        # a certificate issued to one worker acts only as that worker
        details = await refused(reg("worker:p-1").RegisterWorker(register("p-2"), timeout=5),
                                grpc.StatusCode.PERMISSION_DENIED)
        assert "only act as worker 'p-1'" in details
        await reg("worker:p-1").RegisterWorker(register("p-1"), timeout=5)
        # sessions are for gateways and schedulers: a worker reads none, nor lists the workers
        get = registry_pb2.GetSessionRequest(session_id="s-1")
        await refused(reg("worker").GetSession(get, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
        await refused(reg("worker").ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5),
                      grpc.StatusCode.PERMISSION_DENIED)
        await refused(reg("gateway").GetSession(get, timeout=5), grpc.StatusCode.NOT_FOUND)  # allowed: none there
        listed = await reg("gateway").ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)
        assert {w.worker_id for w in listed.workers} == {"p-1", "p-2"}
        record = registry_pb2.RecordTurnRequest(session_id="s-1", decode_worker_id="d", token_ids=[1],
                                                kv_transfer_params_json="{}")
        await refused(reg("scheduler").RecordTurn(record, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
        # a worker's streamed watch is refused before it starts
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in reg("worker").WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # the scheduler plans for gateways only; its stats are for schedulers, gateways and admins
        plan = scheduler_pb2.PlanTurnRequest(session_id="s-2", prompt_token_ids=list(range(40)))
        await refused(sched("worker").PlanTurn(plan, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
        await refused(sched("client").GetStats(scheduler_pb2.GetStatsRequest(), timeout=5),
                      grpc.StatusCode.PERMISSION_DENIED)
        await sched("admin").GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        details = await refused(sched("gateway").PlanTurn(plan, timeout=10), grpc.StatusCode.UNAVAILABLE)
        assert "no live decode worker" in details  # allowed: it planned, and found only prefill workers
        # health stays open to any certificate of the CA
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = await health_pb2_grpc.HealthStub(channels["client"][0]).Check(health_pb2.HealthCheckRequest(),
                                                                              timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for pair in channels.values():
            for channel in pair:
                await channel.close()
        await scheduler.stop()
        await registry.stop(grace=0.5)


async def test_with_authorization_off_any_certificate_of_the_ca_may_call(pki, etcd):
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=f"/authz-off/{uuid.uuid4().hex[:6]}/",
                         authorize_callers=False, **server_tls(pki, "registry"))
    cfg.validate()
    registry = await serve(cfg)
    try:
        async with client_channel(registry.address, tls_of(pki, "client")) as channel:
            await registry_pb2_grpc.SessionRegistryStub(channel).ListWorkers(registry_pb2.ListWorkersRequest(),
                                                                             timeout=5)
    finally:
        await registry.stop(grace=0.5)


async def test_secured_etcd_refuses_wrong_credentials_clearly(pki, secure_etcd):
    good = RegistryConfig(etcd_endpoints=secure_etcd.endpoints, **etcd_settings(pki))
    async with EtcdStore(secure_etcd.endpoints, "/secure/ok/", security=good.etcd_security()) as store:
        lease, _ = await store.leases.grant(10)
        await store.workers.put(common_pb2.Worker(worker_id="w-ok", role=common_pb2.WORKER_ROLE_DECODE,
                                                  lease_id=lease))
        assert [w.worker_id for w in await store.workers.live()] == ["w-ok"]
        assert await store.leases.keep_alive_once(lease) > 0  # a stream call (LeaseKeepAlive) carries the token too
        events = store.workers.watch()  # and the watch stream
        try:
            first = await asyncio.wait_for(anext(events), 10)
            assert first.kind == "snapshot" and [w.worker_id for w in first.workers] == ["w-ok"]
            await store.workers.put(common_pb2.Worker(worker_id="w-two", role=common_pb2.WORKER_ROLE_DECODE,
                                                      lease_id=lease))
            second = await asyncio.wait_for(anext(events), 10)
            assert second.kind == "put" and second.workers[0].worker_id == "w-two"
        finally:
            await events.aclose()
    async with EtcdStore(secure_etcd.endpoints, "/elsewhere/", security=good.etcd_security()) as store:
        with pytest.raises(StoreError, match="permission denied"):  # the user may only touch /secure/
            await store.workers.get("w-ok")

    wrong = RegistryConfig(etcd_endpoints=secure_etcd.endpoints, **etcd_settings(pki, password="not-it"))
    store = EtcdStore(secure_etcd.endpoints, "/secure/", security=wrong.etcd_security())
    with pytest.raises(StoreError, match=f"etcd refused user '{ETCD_USER}'.*authentication failed"):
        await store.connect()

    anonymous = EtcdSecurity(ca=open(pki["ca"].ca_file, "rb").read(), cert=open(pki["client"].cert, "rb").read(),
                             key=open(pki["client"].key, "rb").read())
    async with EtcdStore(secure_etcd.endpoints, "/secure/", security=anonymous, timeout_s=2) as store:
        with pytest.raises(StoreError) as err:  # a certificate etcd trusts, but no etcd user behind it
            await store.workers.live()
        assert not isinstance(err.value, StoreUnavailable) and "etcd list workers" in str(err.value)

    no_cert = EtcdSecurity(ca=open(pki["ca"].ca_file, "rb").read(), username=ETCD_USER, password=ETCD_PASSWORD)
    store = EtcdStore(secure_etcd.endpoints, "/secure/", security=no_cert, timeout_s=1, attempt_timeout_s=0.5)
    t = time.monotonic()
    await store.connect()  # etcd refuses the handshake: authentication is deferred, calls fail as unavailable
    with pytest.raises(StoreUnavailable):
        await store.workers.live()
    assert time.monotonic() - t < 10
    await store.close()

    plaintext = EtcdStore(secure_etcd.endpoints, "/secure/", timeout_s=1, attempt_timeout_s=0.5)
    async with plaintext:
        with pytest.raises(StoreUnavailable):
            await plaintext.workers.live()


async def test_an_expired_etcd_token_is_renewed(pki, secure_etcd):
    security = RegistryConfig(etcd_endpoints=secure_etcd.endpoints, **etcd_settings(pki)).etcd_security()
    channel, auth = etcd_channel(f"ipv4:{secure_etcd.endpoints}", [], security, "127.0.0.1")
    try:
        kv = KVService(channel, max_attempts=1)
        await kv.put("/secure/renew", "1")
        auth._token = "expired.token"  # what etcd answers for: invalid auth token
        assert (await kv.get("/secure/renew")).kvs[0].value == b"1"
        assert auth._token != "expired.token"
    finally:
        await channel.close()


async def test_etcd_defragmentation_over_tls_needs_the_root_role(pki, secure_etcd):
    """Each member is reached with the store's TLS and auth: the member list and statuses answer the kvshuttle
    user, Defragment only root (the run fails, and says so)."""
    user = RegistryConfig(etcd_endpoints=secure_etcd.endpoints, **etcd_settings(pki)).etcd_security()
    async with EtcdMaintenance(parse_endpoints(secure_etcd.endpoints), user) as maintenance:
        (member,), problems = await maintenance.statuses()
        assert not problems and member.db_size > 0 and member.endpoint == secure_etcd.endpoints
        refused = await maintenance.defragment_member(member)
    assert refused.after is None and "permission denied" in refused.error and "root role" in refused.error
    root = dataclasses.replace(user, username="root", password="root-pass-77")
    (done,) = await defragment(secure_etcd.endpoints, root)
    assert not done.error and done.after is not None and done.after.db_size <= done.before.db_size


async def test_settings_name_missing_or_unpaired_files(pki, tmp_path):
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key"):
        RegistryConfig(tls_cert=pki["registry"].cert).validate()
    with pytest.raises(ConfigError, match="--tls-client-ca .*needs --tls-cert"):
        RegistryConfig(tls_client_ca=pki["ca"].ca_file).validate()
    with pytest.raises(ConfigError, match="--tls-ca: cannot read"):
        SchedulerConfig(tls_ca=str(tmp_path / "missing.pem")).validate()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="is not a PEM file"):
        RegistryConfig(tls_cert=str(tmp_path / "junk.pem"), tls_key=pki["registry"].key).validate()
    with pytest.raises(ConfigError, match="needs --etcd-username"):
        RegistryConfig(etcd_password="x").validate()
    shown = repr(RegistryConfig(etcd_username="u", etcd_password="hunter2-secret"))
    assert "etcd_username='u'" in shown and "hunter2-secret" not in shown and "etcd_password=" not in shown


# ------------------------------------------------------------------------------------------------ message size limit

async def test_grpc_messages_over_the_configured_size_are_refused(etcd):
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=f"/size-{uuid.uuid4().hex[:6]}/",
                         grpc_max_message_mb=1)
    cfg.validate()
    registry = await serve(cfg)
    try:
        async with client_channel(registry.address) as channel:
            stub = registry_pb2_grpc.SessionRegistryStub(channel)
            big = registry_pb2.RecordTurnRequest(session_id="big", decode_worker_id="d", token_ids=[1],
                                                 kv_transfer_params_json="{}", text="x" * (1 << 20))
            details = await refused(stub.RecordTurn(big, timeout=5), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "larger than max" in details or "exceeds" in details, details
            small = registry_pb2.RecordTurnRequest(session_id="small", decode_worker_id="d", token_ids=[1],
                                                   kv_transfer_params_json="{}", text="x" * 1000)
            details = await refused(stub.RecordTurn(small, timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
            assert "kv_transfer_params_json" in details  # it reached the servicer
    finally:
        await registry.stop(grace=0.5)
