"""A write the registry cannot make is visible on the turn, on the real stack.

A second registry keeps its history in a real Redis (as the chart runs it), with a gateway in front; the Redis goes
away between two turns. The answer still arrives (200), and the turn says its record was not written:
``X-KV-Record: record_unavailable``, ``kvshuttle.record`` with the registry's reason, and the gateway's
``kvshuttle_turn_records_total``. With the Redis back, the next turn is recorded again.
"""

from __future__ import annotations

import time

import httpx
import pytest
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.devtools.redis_process import RedisProcess

from tests.support.e2e import chat, new_session, spawn_gateway, user_turn
from tests.support.waits import until

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}


def records_counted(metrics_text: str, outcome: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("kvshuttle_turn_records_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
async def redis_gateway(stack):
    """A Redis, a registry keeping its history there (on the stack's etcd), and a gateway on that registry."""
    redis = RedisProcess("record-refused")
    await redis.astart()
    address = f"127.0.0.1:{free_port()}"
    registry = await stack._spawn("registry-redis", "registry", "--listen", address, "--history-store", redis.url)
    stack.children.remove(registry)
    gateway = None
    try:
        await stack.wait_grpc(registry, address, time.monotonic() + 60)
        gateway, base_url = await spawn_gateway(stack, "gateway-redis", "--registry", address)
        yield redis, base_url
    finally:
        if gateway is not None:
            await gateway.stop()
        await registry.stop()
        await redis.astop()


async def test_a_record_the_history_store_cannot_take_shows_on_the_turn(stack, redis_gateway):
    redis, base_url = redis_gateway
    session = new_session("refused")
    history = [SYSTEM, user_turn(0)]
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        first = await chat(client, session, history)
        assert first.headers["X-KV-Record"] == "recorded", first.json()["kvshuttle"]
        history += [first.json()["choices"][0]["message"], user_turn(1)]
        before = records_counted((await client.get("/metrics")).text, "record_unavailable")

        redis.kill()  # the history store goes away
        second = await chat(client, session, history)
        kv = second.json()["kvshuttle"]
        assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"]
        assert second.headers["X-KV-Record"] == "record_unavailable", kv
        assert kv["record"] == "record_unavailable" and "history store unavailable" in kv["record_error"], kv
        metrics = (await client.get("/metrics")).text
        assert records_counted(metrics, "record_unavailable") == before + 1

        await redis.astart()  # back (empty: the lost turn's ids are tokenized again from the text)
        history += [second.json()["choices"][0]["message"], user_turn(2)]

        async def recorded_again() -> bool:
            return (await chat(client, session, history)).headers["X-KV-Record"] == "recorded"

        await until(recorded_again, 60, "a turn recorded again once the Redis is back", interval_s=1.0)
