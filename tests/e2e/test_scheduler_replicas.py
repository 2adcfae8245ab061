"""Three scheduler replicas and two gateways on the real stack (real etcd, vLLM pair, NIXL pulls).

Replicas: the stack's scheduler plus two more processes started now (they begin from the learned-state snapshot the
leader wrote, then read the outcome log). Gateway A spreads its plans over the three, round robin
(``--scheduler ipv4:a,b,c``); gateway B plans in its own process (``--scheduler local``), one more replica of the
shared learning. One conversation alternates between the gateways: every continued turn pulls (the handle is
claimed once, in etcd, whichever replica or gateway plans it) and answers as a recompute does; afterwards every
replica, B's embedded one included, holds exactly the same learned fits.
"""

from __future__ import annotations

import httpx
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.v1 import scheduler_pb2, scheduler_pb2_grpc
from openai import AsyncOpenAI

from tests.support.e2e import chat, new_session, spawn_gateway, user_turn
from tests.support.waits import until

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are a careful planner of shared work."}


def answer(resp: httpx.Response) -> dict:
    return resp.json()["choices"][0]["message"]


def fits(stats: scheduler_pb2.GetStatsResponse) -> tuple:
    """What the replicas must agree on: the fits (compute and links) and the outcomes learned."""
    return (stats.reported_turns, [(c.prefill_worker_id, c.fixed_ms, c.ms_per_ktoken, c.ms_per_ktoken_per_kcontext,
                                    c.observations) for c in stats.compute],
            sorted((t.prefill_worker_id, t.decode_worker_id, t.ms_per_transfer, t.ms_per_kpulled, t.observations)
                   for t in stats.transfers),
            sorted((p.name, p.judged_turns, p.regret_turns) for p in stats.policies if p.judged_turns))


@pytest.fixture(scope="module")
async def replicas(stack):
    """Two more scheduler processes configured as the stack's (same etcd, history store and policies)."""
    history = stack.work / "registry" / "history.db"
    addresses, children = [], []
    for n in range(2):
        address = f"127.0.0.1:{free_port()}"
        children.append(await stack._spawn(f"scheduler-{n + 2}", "scheduler", "--listen", address,
                                           "--etcd-endpoints", stack.etcd.endpoints,
                                           "--history-store", f"sqlite:{history}", env=stack.scheduler_env))
        stack.children.remove(children[-1])  # stopped here
        addresses.append(address)
    channels = [stack.channel(a) for a in [stack.scheduler_address, *addresses]]
    stubs = [scheduler_pb2_grpc.TransferSchedulerStub(c) for c in channels]

    async def serving() -> bool:
        for child in children:
            assert child.returncode is None, child.log_tail(30)
        try:
            for stub in stubs:
                await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except Exception:  # noqa: BLE001 - not up yet
            return False
        return True

    await until(serving, 60, "the extra scheduler replicas")
    yield [stack.scheduler_address, *addresses], stubs
    for channel in channels:
        await channel.close()
    for child in children:
        await child.stop()


@pytest.fixture(scope="module")
async def gateways(stack, replicas):
    addresses, _ = replicas
    embedded_listen = f"127.0.0.1:{free_port()}"
    history = stack.work / "registry" / "history.db"
    spread, spread_url = await spawn_gateway(stack, "gateway-rr", "--scheduler", "ipv4:" + ",".join(addresses))
    local, local_url = await spawn_gateway(
        stack, "gateway-local", "--scheduler", "local", "--scheduler-args",
        f"--listen {embedded_listen} --etcd-endpoints {stack.etcd.endpoints} --history-store sqlite:{history}",
        env=stack.scheduler_env)
    channel = client_channel(embedded_listen)
    yield spread_url, local_url, scheduler_pb2_grpc.TransferSchedulerStub(channel)
    await channel.close()
    for child in (spread, local):
        await child.stop()


async def test_three_replicas_and_two_gateways_pull_every_continued_turn_and_learn_one_world(stack, replicas,
                                                                                           gateways):
    _, stubs = replicas
    spread_url, local_url, embedded = gateways
    session, twin = new_session("replicas"), new_session("replicas-twin")
    async with (httpx.AsyncClient(base_url=spread_url, timeout=300) as a,
                httpx.AsyncClient(base_url=local_url, timeout=300) as b,
                httpx.AsyncClient(base_url=stack.base_url, timeout=300) as ref):
        history, twin_history = [SYSTEM], [SYSTEM]
        for n, client in enumerate([a, b, a, b, a, b]):
            history.append(user_turn(n))
            twin_history.append(user_turn(n))
            resp = await chat(client, session, history)
            reference = await chat(ref, twin, twin_history, disable_pull=True)
            assert resp.status_code == 200, resp.text
            if n:
                assert resp.headers["X-KV-Decision"] == "pull", (n, resp.headers["X-KV-Reason"])
            assert answer(resp) == answer(reference), n
            history.append(answer(resp))
            twin_history.append(answer(reference))

        # As an SDK client: the official OpenAI SDK, streaming, through the gateway that plans in-process.
        sdk = AsyncOpenAI(base_url=f"{local_url}/v1", api_key="unused", timeout=300)
        model = (await sdk.models.list()).data[0].id
        history.append(user_turn(6))
        twin_history.append(user_turn(6))
        raw = await sdk.chat.completions.with_raw_response.create(
            model=model, messages=history, max_tokens=16, temperature=0, stream=True,
            extra_headers={"X-Session-ID": session})
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in raw.parse() if chunk.choices])
        assert raw.headers["x-kv-decision"] == "pull", raw.headers.get("x-kv-reason")
        reference = await chat(ref, twin, twin_history, disable_pull=True)
        assert text == answer(reference)["content"]
        await sdk.close()

    everyone = [*stubs, embedded]

    async def agreed():
        stats = [await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5) for stub in everyone]
        revisions = {s.learning.applied_revision for s in stats}
        return stats if len(revisions) == 1 and not any(s.learning.pending_outcomes for s in stats) else None

    stats = await until(agreed, 30, "every replica at the same revision of the outcome log")
    assert all(s.learning.mode == "shared" and s.learning.missed_batches == 0 for s in stats)
    assert len({s.learning.replica for s in stats}) == 4
    first = fits(stats[0])
    assert first[0] > 0 and first[1]  # it learned from real turns: compute fits exist
    for s in stats[1:]:
        assert fits(s) == first
