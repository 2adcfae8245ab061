"""Named policies per request, the shared cost model's stats and regret, over a real registry, etcd and loopback gRPC.

The workers here are registry records only (no engines): load polls fail, which must not stop planning.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import scheduler_pb2, scheduler_pb2_grpc

from tests.support.scheduler import first_plan, record, register_pair
from tests.support.waits import until


@pytest.fixture(params=[0.0])
async def stubs(etcd, request):
    """Registry + scheduler stubs; ``request.param`` is the load poll interval (0: off, as the fake workers here have
    no engine to poll; on: they are soon unreachable, so no pull is planned from them)."""
    registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd,
                                          key_prefix=f"/pol-{uuid.uuid4().hex[:6]}/", expiry_margin_s=5))
    scheduler = SchedulerService(SchedulerConfig(
        listen="127.0.0.1:0", registry=registry.address, policy="cost", policy_params="continue_on_decode=never",
        policies="t512=threshold:pull_threshold_tokens=512; always-pull=threshold:pull_threshold_tokens=1",
        load_poll_interval_s=request.param))
    await scheduler.start()
    channels = [client_channel(registry.address), client_channel(scheduler.address)]
    from kvshuttle.v1 import registry_pb2_grpc

    yield registry_pb2_grpc.SessionRegistryStub(channels[0]), scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    for channel in channels:
        await channel.close()
    await scheduler.stop()
    await registry.stop(grace=0.5)


async def test_requests_choose_among_the_configured_policies(stubs):
    reg, sched = stubs
    _, d = await register_pair(reg, "p0", "d0", 7700)
    history = list(range(5000, 5300))  # 299 covered tokens: below t512's threshold
    session = f"s-{uuid.uuid4().hex[:8]}"

    def request(policy: str) -> scheduler_pb2.PlanTurnRequest:
        return scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=history + [7, 8], policy=policy)

    await record(reg, session, d, history)
    t512 = await first_plan(sched, request("t512"))
    assert t512.decision == scheduler_pb2.DECISION_RECOMPUTE and "threshold 512" in t512.reason
    assert t512.figures.policy == "t512" and t512.figures.pullable_tokens == 299
    assert t512.source.worker_id == "d0"  # the option not taken: where the KV was
    assert t512.figures.predicted_pull_ms > 0 and t512.figures.predicted_recompute_ms > 0
    assert "prefill p0" in t512.figures.worker_choice and "decode d0" in t512.figures.worker_choice

    default = await first_plan(sched, request(""))  # the default policy: cost
    assert default.decision == scheduler_pb2.DECISION_PULL and default.figures.policy == "cost", default.reason
    assert default.figures.reusable_tokens == 299 and "predicted pull" in default.reason

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sched.PlanTurn(request("fastest"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown policy 'fastest'" in err.value.details() and "t512" in err.value.details()


@pytest.mark.parametrize("stubs", [0.2], indirect=True)
async def test_stats_show_the_fitted_model_regret_per_policy_and_loads(stubs):
    reg, sched = stubs
    await register_pair(reg, "p0", "d0", 7800)
    await first_plan(sched, scheduler_pb2.PlanTurnRequest(prompt_token_ids=[1, 2, 3]))

    def report(decision, pulled: int, ms: float, policy: str, pullable: int = 0):
        return sched.ReportOutcome(scheduler_pb2.ReportOutcomeRequest(
            prefill_worker_id="p0", decode_worker_id="d0", source_worker_id="d0", prompt_tokens=2000,
            pulled_tokens=pulled, computed_tokens=2000 - pulled, prefill_ms=ms, decision=decision,
            pullable_tokens=pullable, policy=policy))

    for _ in range(5):  # recomputing 2000 tokens takes 300 ms, pulling 1900 of them 40 ms
        await report(scheduler_pb2.DECISION_RECOMPUTE, 0, 300.0, "t512", pullable=1900)
        await report(scheduler_pb2.DECISION_PULL, 1900, 40.0, "always-pull")
    stats = await sched.GetStats(scheduler_pb2.GetStatsRequest())
    assert stats.reported_turns == 10
    by_name = {p.name: p for p in stats.policies}
    assert set(by_name) == {"cost", "t512", "always-pull"} and by_name["cost"].is_default
    # t512's recomputes could have pulled, and the model (after the first reports) says the pull was faster
    assert by_name["t512"].judged_turns == 5 and by_name["t512"].regret_turns >= 4
    assert by_name["always-pull"].judged_turns == 5 and by_name["always-pull"].regret_turns == 0
    (compute,) = stats.compute
    assert compute.prefill_worker_id == "p0" and compute.observations == 5
    (link,) = stats.transfers
    assert (link.prefill_worker_id, link.decode_worker_id, link.observations) == ("p0", "d0", 5)
    # the workers are records without engines: their load polls fail and they show as unreachable
    async def both_unreachable():
        stats = await sched.GetStats(scheduler_pb2.GetStatsRequest())
        return stats if {w.worker_id for w in stats.loads if not w.reachable} >= {"p0", "d0"} else None

    stats = await until(both_unreachable, 5, "both workers shown unreachable")
    loads = {w.worker_id: w for w in stats.loads}
    assert not loads["p0"].reachable and loads["p0"].assigned_turns == 1
