"""Two gateway processes serving one conversation (as behind a load balancer), on the real stack.

Concurrent turns of one session through both gateways: exactly one pulls (the handle is claimed once, in etcd), the
other recomputes, and both answer like a recompute. Then the conversation alternates between the gateways: each
turn continues the exact token ids the other gateway recorded and pulls, with a recompute's answer.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.e2e import chat, new_session, spawn_gateway, tokens, user_turn

pytestmark = pytest.mark.e2e
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}


@pytest.fixture(scope="module")
async def second_gateway(stack):
    child, base_url = await spawn_gateway(stack, "gateway-two")
    yield base_url
    await child.stop()


def answer(resp: httpx.Response) -> dict:
    return resp.json()["choices"][0]["message"]


async def test_two_gateways_share_sessions(stack, second_gateway):
    session, twin = new_session("two-gw"), new_session("two-gw-twin")
    async with (httpx.AsyncClient(base_url=stack.base_url, timeout=300) as a,
                httpx.AsyncClient(base_url=second_gateway, timeout=300) as b):
        history = [SYSTEM, user_turn(0)]
        first = await chat(a, session, history)
        history.append(answer(first))
        twin_history = [SYSTEM, user_turn(0)]
        twin_history.append(answer(await chat(a, twin, twin_history, disable_pull=True)))
        assert twin_history == history

        # The same next turn through both gateways at once.
        history.append(user_turn(1))
        both = await asyncio.gather(chat(a, session, history), chat(b, session, history))
        reference = await chat(a, twin, [*twin_history, user_turn(1)], disable_pull=True)
        decisions = sorted(r.headers["X-KV-Decision"] for r in both)
        assert decisions == ["pull", "recompute"], [r.headers["X-KV-Reason"] for r in both]
        for resp in both:
            assert answer(resp) == answer(reference)
            assert tokens(resp.json()["usage"]) == tokens(reference.json()["usage"])
        history.append(answer(reference))
        twin_history = [*twin_history, user_turn(1), answer(reference)]

        # Alternate: each gateway continues what the other recorded, and pulls it.
        for n, client in enumerate([b, a, b], start=2):
            history.append(user_turn(n))
            twin_history.append(user_turn(n))
            resp = await chat(client, session, history)
            reference = await chat(a, twin, twin_history, disable_pull=True)
            assert resp.headers["X-KV-Decision"] == "pull", resp.headers["X-KV-Reason"]
            assert answer(resp) == answer(reference)
            history.append(answer(resp))
            twin_history.append(answer(reference))
