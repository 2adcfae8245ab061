"""Two models behind one gateway on the real stack (issue #37, docs/models.md): real vLLM prefill and decode workers
for each, one gateway serving both (``--models``), conversations through the OpenAI SDK with no session id.

The second model is the tiny test model's weights served by a pair of its own under another name (``tiny-b``): the
two models render a chat the same way and answer it the same way, so nothing but the model keeps their sessions
and KV apart. Every later turn is found in its own model's session and pulls on its own model's prefill worker
(checked against the prefill workers' own vLLM counters); the same history sent to the other model is a new session
that pulls nothing.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from tests.support.e2e import EXTRA_STARTUP_TIMEOUT_S, extra_worker_bind, spawn_gateway, user_turn, wait_registered

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SECOND = "tiny-b"


def _delta(after: dict[str, float], before: dict[str, float], source: str) -> float:
    return after.get(source, 0.0) - before.get(source, 0.0)


async def test_two_models_behind_one_gateway_find_and_pull_within_their_own(stack):
    first = stack.model_dir.name
    bind = extra_worker_bind(stack)
    children = {role: await stack.spawn_worker(role, f"{SECOND}-{role}", bind, served_model_name=SECOND)
                for role in ("prefill", "decode")}
    gateway = None
    try:
        async with stack.channel(stack.registry_address) as channel:
            registry = registry_pb2_grpc.SessionRegistryStub(channel)
            await asyncio.gather(*(wait_registered(registry, child, f"{SECOND}-{role}", EXTRA_STARTUP_TIMEOUT_S)
                                   for role, child in children.items()))
            listed = (await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)).workers
        prefills = {m: [w for w in listed if w.role == common_pb2.WORKER_ROLE_PREFILL and w.model == m]
                    for m in (first, SECOND)}
        assert all(prefills.values()), prefills
        gateway, base_url = await spawn_gateway(stack, "gateway-models", "--models",
                                                f"{SECOND}={stack.model_dir}?max_model_len={stack.cfg.max_model_len}")
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        assert [m.id async for m in client.models.list()] == [first, SECOND]

        async def turn(model: str, messages: list[dict]) -> tuple[dict[str, str], str, dict[str, dict[str, float]]]:
            """One turn of ``model`` on empty prefix caches: its headers, its answer, and each model's prefill
            counters' change over it."""
            every = [w for ws in prefills.values() for w in ws]
            await stack.flush_prefill(workers=every)
            ids = {m: [w.worker_id for w in ws] for m, ws in prefills.items()}
            before = {m: await asyncio.to_thread(stack.prefill_prompt_tokens_by_source, i) for m, i in ids.items()}
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=8,
                                                                         temperature=0)
            answer = raw.parse()
            assert answer.model == model
            after = {m: await asyncio.to_thread(stack.prefill_prompt_tokens_by_source, i) for m, i in ids.items()}
            moved = {m: {s: _delta(after[m], before[m], s) for s in ("external_kv_transfer", "local_compute")}
                     for m in ids}
            return dict(raw.headers), answer.choices[0].message.content or "", moved

        messages = [{"role": "system", "content": "You are terse."}, user_turn(0)]
        session = ""
        for n in range(3):  # the first model's conversation: each later turn found and pulled on its own P
            h, text, moved = await turn(first, messages)
            pulled = int(h["x-kv-pulled-tokens"])
            assert moved[SECOND] == {"external_kv_transfer": 0, "local_compute": 0}, moved  # never the other's P
            if n == 0:
                assert h["x-session-source"] == "new" and h["x-kv-decision"] != "pull", h
                session = h["x-session-id"]
            else:
                assert (h["x-session-source"], h["x-session-id"], h["x-kv-decision"]) == ("found", session, "pull"), h
                assert pulled > 0 and moved[first]["external_kv_transfer"] == pulled, (h, moved)
            messages += [{"role": "assistant", "content": text}, user_turn(n + 1)]

        # The same history sent to the second model: a new session of its own, nothing pulled anywhere.
        h, text, moved = await turn(SECOND, messages)
        assert h["x-session-source"] == "new" and h["x-session-id"] != session and h["x-kv-decision"] != "pull", h
        assert all(m["external_kv_transfer"] == 0 for m in moved.values()), moved
        assert moved[first]["local_compute"] == 0 and moved[SECOND]["local_compute"] > 0, moved
        # ... and its next turn continues that session, pulling on the second model's own P.
        messages += [{"role": "assistant", "content": text}, user_turn(4)]
        later, _, moved = await turn(SECOND, messages)
        assert (later["x-session-source"], later["x-session-id"], later["x-kv-decision"]) == (
            "found", h["x-session-id"], "pull"), later
        pulled = int(later["x-kv-pulled-tokens"])
        assert pulled > 0 and moved[SECOND]["external_kv_transfer"] == pulled, (later, moved)
        assert moved[first] == {"external_kv_transfer": 0, "local_compute": 0}, moved

        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="tiny-c", messages=messages[:2], max_tokens=4)
        assert err.value.code == "model_not_found"
    finally:
        if gateway is not None:
            await gateway.stop()
        for child in children.values():
            stack.children.remove(child)
            await child.stop()
