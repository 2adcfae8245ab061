"""Prometheus endpoints of the registry and the scheduler on loopback, over a real etcd: scrape, call, scrape again,
and check the exact deltas (plans by reason code, etcd operations and errors, gRPC calls by status code, the census
of live workers and sessions). The services run in this process (the metrics are then shared by both endpoints, so
each test reads only what it moved) and, in the last test, as separate processes like `kvshuttle up` starts them."""

from __future__ import annotations

import re
import sys
import uuid

import grpc
import httpx
import pytest
from kvshuttle.services.common import metrics
from kvshuttle.services.common.grpc_server import Server, client_channel
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.devtools.stack import REPO
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from prometheus_client import generate_latest

from tests.support.metrics import delta, names, parse, scrape, value
from tests.support.scheduler import handle_for, record, worker
from tests.support.waits import until

REGISTRY_SVC, SCHEDULER_SVC = "kvshuttle.v1.SessionRegistry", "kvshuttle.v1.TransferScheduler"


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def planes(etcd):
    """A registry (census every 0.1 s) and a scheduler (claims in etcd itself), each with a metrics endpoint on a
    free port, under their own key prefix; yields (registry service, scheduler service, registry stub, sched stub)."""
    prefix = f"/metrics-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                          expiry_margin_s=5, metrics_listen="127.0.0.1:0", census_interval_s=0.1))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0, etcd_endpoints=etcd, policy="threshold",
                                                 metrics_listen="127.0.0.1:0"))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    yield (registry, scheduler, registry_pb2_grpc.SessionRegistryStub(channels[0]),
           scheduler_pb2_grpc.TransferSchedulerStub(channels[1]))
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def _workers_seen(sched) -> None:
    async def planned() -> bool:
        try:
            await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1, 2, 3], disable_pull=True))
            return True
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            return False
    await until(planned, what="the scheduler to see the workers")


async def test_plans_are_counted_by_decision_and_reason_code(planes):
    registry, scheduler, reg, sched = planes
    url = scheduler.metrics.url
    p, d = worker(uid("p"), common_pb2.WORKER_ROLE_PREFILL, 7300), worker(uid("d"), common_pb2.WORKER_ROLE_DECODE, 7400)
    for w in (p, d):
        await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
    await _workers_seen(sched)
    session, history = uid("s"), list(range(2000, 2100))

    before = await scrape(url)
    first = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=history[:60]))
    assert first.decision == scheduler_pb2.DECISION_RECOMPUTE and first.reason_code == "no_record"
    await record(reg, session, d, history)
    pulled = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=history + [7]))
    assert pulled.decision == scheduler_pb2.DECISION_PULL and pulled.reason_code == "pull_all", pulled.reason
    again = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=history + [7]))
    assert again.reason_code == "handle_used", again.reason
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session))  # no prompt
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = await scrape(url)

    plans = "kvshuttle_plans_total"
    assert delta(before, after, plans, policy="threshold", decision="recompute", reason="no_record") == 1
    assert delta(before, after, plans, policy="threshold", decision="pull", reason="pull_all") == 1
    assert delta(before, after, plans, decision="recompute", reason="handle_used") == 1
    assert delta(before, after, plans) == 3  # the refused request is no plan
    assert delta(before, after, "kvshuttle_plan_seconds_count", decision="pull") == 1
    assert delta(before, after, "kvshuttle_plan_seconds_count", decision="recompute") == 2
    assert 0 < delta(before, after, "kvshuttle_plan_seconds_sum") < 5
    handled = "kvshuttle_grpc_server_handled_total"
    assert delta(before, after, handled, service=SCHEDULER_SVC, method="PlanTurn", code="OK") == 3
    assert delta(before, after, handled, service=SCHEDULER_SVC, method="PlanTurn", code="INVALID_ARGUMENT") == 1
    assert delta(before, after, "kvshuttle_grpc_server_handling_seconds_count", service=SCHEDULER_SVC,
                 method="PlanTurn") == 4
    # the scheduler claimed in etcd itself: one claim transaction, timed
    assert delta(before, after, "kvshuttle_etcd_request_seconds_count", op="claim_session") == 1
    # its workers (load polling off: their state is unknown)
    assert value(after, "kvshuttle_workers", role="prefill") >= 1
    assert value(after, "kvshuttle_workers", state="live") == 0

    # the regret figures come from reported outcomes
    await sched.ReportOutcome(scheduler_pb2.ReportOutcomeRequest(
        prefill_worker_id=p.worker_id, prompt_tokens=101, pulled_tokens=99, computed_tokens=2, prefill_ms=50.0,
        decision=scheduler_pb2.DECISION_PULL, source_worker_id=d.worker_id, policy="threshold"))
    later = await scrape(url)
    assert delta(after, later, "kvshuttle_policy_judged_turns_total", policy="threshold") == 1


async def test_the_registry_counts_etcd_operations_calls_by_code_and_live_records(planes):
    registry, _, reg, _ = planes
    url = registry.metrics.url
    d = worker(uid("d"), common_pb2.WORKER_ROLE_DECODE, 7500)
    session = uid("s")

    before = await scrape(url)
    await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=d, lease_ttl_s=30))
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id=d.worker_id,
                                                        kv_transfer_params_json=handle_for(d, 99),
                                                        token_ids=list(range(100))))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await reg.GetSession(registry_pb2.GetSessionRequest(session_id=uid("missing")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await reg.GetSession(registry_pb2.GetSessionRequest(session_id="no spaces allowed"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = await scrape(url)

    handled = "kvshuttle_grpc_server_handled_total"
    for method, code in [("RegisterWorker", "OK"), ("RecordTurn", "OK"), ("GetSession", "NOT_FOUND"),
                         ("GetSession", "INVALID_ARGUMENT")]:
        assert delta(before, after, handled, service=REGISTRY_SVC, method=method, code=code) == 1, (method, code)
    assert delta(before, after, "kvshuttle_etcd_request_seconds_count", op="put_session") == 1
    assert delta(before, after, "kvshuttle_etcd_request_seconds_count", op="put_worker") == 1
    assert delta(before, after, "kvshuttle_etcd_request_seconds_sum", op="put_session") > 0
    assert delta(before, after, "kvshuttle_etcd_errors_total") == 0

    async def counted() -> bool:
        now = await scrape(url)
        return (value(now, "kvshuttle_live_workers", role="decode") == 1
                and value(now, "kvshuttle_live_sessions") == 1)
    await until(counted, what="the census to count the worker and the session")  # this prefix holds just those

    # A client cannot invent label values: an unknown method is not counted.
    channel = client_channel(registry.address)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(f"/{REGISTRY_SVC}/NoSuchMethod")(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A stream the client cancels is counted as CANCELLED.
    watch = registry_pb2_grpc.SessionRegistryStub(channel).WatchWorkers(registry_pb2.WatchWorkersRequest())
    await watch.read()
    watch.cancel()
    await channel.close()

    async def cancelled() -> bool:
        now = await scrape(url)
        return delta(after, now, handled, method="WatchWorkers", code="CANCELLED") == 1
    await until(cancelled, what="the cancelled watch to be counted")
    assert not any("NoSuchMethod" in str(labels) for _, labels in await scrape(url))


async def test_etcd_failures_are_counted_by_operation_and_kind():
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints="127.0.0.1:9", etcd_timeout_s=0.3,
                         etcd_attempt_timeout_s=0.1, metrics_listen="127.0.0.1:0", drop_departed_sessions=False)
    registry = await serve(cfg)
    channel = client_channel(registry.address)
    try:
        before = await scrape(registry.metrics.url)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry_pb2_grpc.SessionRegistryStub(channel).GetSession(
                registry_pb2.GetSessionRequest(session_id=uid("s")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        after = await scrape(registry.metrics.url)
    finally:
        await channel.close()
        await registry.stop(grace=0.2)
    assert delta(before, after, "kvshuttle_etcd_errors_total", op="get_session", kind="unavailable") == 1
    assert delta(before, after, "kvshuttle_etcd_request_seconds_count", op="get_session") == 1
    assert delta(before, after, "kvshuttle_grpc_server_handled_total", method="GetSession", code="UNAVAILABLE") == 1


async def test_a_handler_that_raises_is_counted_as_unknown():
    async def boom(request, context):
        raise RuntimeError("boom")

    handlers = {"Raise": grpc.unary_unary_rpc_method_handler(boom)}
    server = Server("127.0.0.1:0", ["test.Boom"],
                    [lambda s: s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Boom",
                                                                                                handlers)])])
    await server.start()
    channel = client_channel(server.address)
    try:
        registry = metrics.registry_for("gateway")
        before = parse(generate_latest(registry).decode())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/test.Boom/Raise")(b"")
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        after = parse(generate_latest(registry).decode())
    finally:
        await channel.close()
        await server.stop(0.2)
    assert delta(before, after, "kvshuttle_grpc_server_handled_total", service="test.Boom", method="Raise",
                 code="UNKNOWN") == 1


async def test_the_services_serve_their_own_metrics_as_separate_processes(etcd, tmp_path):
    """`kvshuttle registry` and `kvshuttle scheduler` with --metrics-listen on port 0: each logs the address it
    bound, and serves its own metrics only; a plan through the registry moves both processes' figures exactly."""
    prefix = f"/metrics-proc-{uuid.uuid4().hex[:6]}/"
    env = {"KVSHUTTLE_ETCD_ENDPOINTS": etcd, "KVSHUTTLE_REGISTRY_KEY_PREFIX": prefix, "PYTHONUNBUFFERED": "1"}
    children = []

    async def start(name: str, *args: str) -> tuple[str, str]:
        child = ChildProcess(name, [sys.executable, "-m", "kvshuttle.services.commands", name, "--listen", "127.0.0.1:0",
                                    "--metrics-listen", "127.0.0.1:0", *args], tmp_path / f"{name}.log",
                             env=env, cwd=REPO)
        await child.start()
        children.append(child)
        found: list[str] = []

        async def logged() -> bool:
            assert child.returncode is None, child.log_tail()
            text = (tmp_path / f"{name}.log").read_text()
            found[:] = [*re.findall(r"serving \S+ on (\S+)", text)[:1],
                        *re.findall(rf"{name} metrics on (http://\S+/metrics)", text)[:1]]
            return len(found) == 2
        await until(logged, 60, f"{name} to log its addresses")
        return found[0], found[1]

    try:
        reg_address, reg_url = await start("registry")
        sched_address, sched_url = await start("scheduler", "--registry", reg_address, "--load-poll-interval-s", "0",
                                             "--etcd-endpoints", "")
        assert not reg_url.endswith(":0/metrics") and reg_url != sched_url
        reg_channel, sched_channel = client_channel(reg_address), client_channel(sched_address)
        reg, sched = registry_pb2_grpc.SessionRegistryStub(reg_channel), scheduler_pb2_grpc.TransferSchedulerStub(
            sched_channel)
        for w in (worker(uid("p"), common_pb2.WORKER_ROLE_PREFILL, 7600),
                  worker(uid("d"), common_pb2.WORKER_ROLE_DECODE, 7700)):
            await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
        await _workers_seen(sched)

        reg_before, sched_before = await scrape(reg_url), await scrape(sched_url)
        plan = await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=uid("s"), prompt_token_ids=[5, 6, 7]))
        reg_after, sched_after = await scrape(reg_url), await scrape(sched_url)
        async with httpx.AsyncClient() as client:
            assert (await client.get(reg_url.replace("/metrics", "/other"))).status_code == 404
            assert (await client.post(reg_url)).status_code == 405
        await reg_channel.close()
        await sched_channel.close()
    finally:
        for child in children:
            await child.stop()

    assert plan.reason_code == "no_record"
    assert delta(sched_before, sched_after, "kvshuttle_plans_total", decision="recompute", reason="no_record") == 1
    assert delta(sched_before, sched_after, "kvshuttle_plans_total") == 1
    # the scheduler read the session through the registry (no --etcd-endpoints): one GetSession, NOT_FOUND
    assert delta(reg_before, reg_after, "kvshuttle_grpc_server_handled_total", method="GetSession",
                 code="NOT_FOUND") == 1
    assert delta(reg_before, reg_after, "kvshuttle_etcd_request_seconds_count", op="get_session") == 1
    reg_names, sched_names = names(reg_after), names(sched_after)
    assert {"kvshuttle_live_sessions", "kvshuttle_etcd_request_seconds_count"} <= reg_names
    assert not any(n.startswith(("kvshuttle_plans", "kvshuttle_workers", "kvshuttle_turns")) for n in reg_names)
    assert "kvshuttle_plans_total" in sched_names and "kvshuttle_live_sessions" not in sched_names
    assert "process_cpu_seconds_total" in reg_names and "process_cpu_seconds_total" in sched_names


async def test_the_gateway_serves_metrics_on_its_http_port_or_its_own(etcd, model_dir, tmp_path):
    """GET /metrics on the HTTP port needs an admin key when API keys are configured (it names tenants); a refused
    turn is counted by kind and the gRPC API's calls by code. With --metrics-listen the metrics move to their own
    port, off the HTTP one, served there without a key."""
    from kvshuttle.services.gateway.server import GatewayConfig, GatewayService

    from tests.support.auth import KEYS, bearer, keys_file

    prefix = f"/metrics-gw-{uuid.uuid4().hex[:6]}/"
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix))
    scheduler = SchedulerService(SchedulerConfig(listen="127.0.0.1:0", registry=registry.address, key_prefix=prefix,
                                                 load_poll_interval_s=0))
    await scheduler.start()
    gateways = []

    async def gateway(**settings) -> GatewayService:
        cfg = GatewayConfig(http_listen="127.0.0.1:0", grpc_listen="127.0.0.1:0", registry=registry.address,
                            scheduler=scheduler.address, model_dir=str(model_dir), max_model_len=2048,
                            max_prompt_tokens=8, **settings)
        cfg.validate()
        service = GatewayService(cfg)
        await service.start()
        gateways.append(service)
        return service

    try:
        keyed = await gateway(api_keys_file=keys_file(tmp_path))
        base = f"http://{keyed.http_address}"
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers=bearer("acme"))).status_code == 403  # a tenant's key
            before = parse((await client.get("/metrics", headers=bearer("ops"))).text)
            assert (await client.get("/v1/models")).status_code == 401  # everything else still needs a key
            resp = await client.post("/v1/completions", headers=bearer("acme"),
                                     json={"prompt": "a prompt longer than eight tokens, surely", "max_tokens": 2})
            assert resp.status_code == 400, resp.text
            async with grpc.aio.insecure_channel(keyed.grpc_address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="hi"))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            async def scraped():
                # the server counts a call once its handler has returned, which can be just after the client got
                # its status: wait for that, rather than scrape once
                resp = await client.get("/metrics", headers=bearer("ops"))
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
                after = parse(resp.text)
                counted = delta(before, after, "kvshuttle_grpc_server_handled_total", service="kvshuttle.v1.Gateway",
                                method="Complete", code="UNAUTHENTICATED")
                return (resp, after) if counted else None

            resp, after = await until(scraped, timeout_s=5, what="the refused gRPC call to be counted")
            assert "/metrics" not in (await client.get("/openapi.json", headers=bearer("acme"))).text
        assert delta(before, after, "kvshuttle_turn_failures_total", kind="bad_request") == 1
        assert delta(before, after, "kvshuttle_grpc_server_handled_total", service="kvshuttle.v1.Gateway",
                     method="Complete", code="UNAUTHENTICATED") == 1
        assert not any(n.startswith(("kvshuttle_plans", "kvshuttle_etcd")) for n in names(after))
        assert KEYS["acme"] not in resp.text and KEYS["ops"] not in resp.text

        apart = await gateway(metrics_listen="127.0.0.1:0")
        assert apart.metrics.address != apart.http_address
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://{apart.http_address}/metrics")).status_code == 404
            own = await client.get(apart.metrics.url)
            assert own.status_code == 200 and "kvshuttle_turns_total" in own.text
    finally:
        for service in gateways:
            await service.stop()
        await scheduler.stop()
        await registry.stop(grace=0.5)
