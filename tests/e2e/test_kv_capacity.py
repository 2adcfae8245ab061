"""A decode worker with a small KV cache, filled by sessions that are never ended, on the real stack.

One more decode worker is started with 20 MiB of KV cache (40 blocks of 128 tokens of the tiny fp32 model; its TTL
is the stack's 480 s, far longer than the test), and the shared decode worker is paused (SIGSTOP) so that every
turn lands on the small one. Sessions that are abandoned after one turn fill it: without the scheduler's KV manager
the next turns would wait for blocks that only the TTL frees (minutes). With it:

- every turn, the abandoned ones and a new session after them, is served in normal time;
- the scheduler frees held handles (by pressure, or to make room for a turn) and shows it in GetStats;
- an evicted session's next turn recomputes, says why (``kv_freed_pressure``, "KV freed ..."), and answers exactly
  like the same conversation recomputed on a twin session;
- turns sent with no session id at all (the official ``openai`` client, as applications use it) leave no KV behind
  either: each starts a session found by content (freed like the others), or, with finding sessions off, nothing
  records its handle and the gateway frees it after each answer.
"""

from __future__ import annotations

import time

import httpx
import pytest
from kvshuttle.services.devtools.stack import cpu_binds
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from openai import AsyncOpenAI

from tests.support.e2e import (
    EXTRA_STARTUP_TIMEOUT_S,
    Paused,
    chat,
    new_session,
    spawn_gateway,
    tokens,
    user_turn,
    wait_registered,
)
from tests.support.waits import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SMALL = "small-kv-decode"
BLOCKS = 40  # 20 MiB of the tiny fp32 model's KV (4 KiB a token); the e2e stack's 4,096-token context needs 32
ABANDONED = 14  # one-turn sessions of ~4 blocks each: 56 blocks wanted of 40
NORMAL_TURN_S = 20.0  # a turn takes well under a second here; a stall waits for the 480 s TTL


@pytest.fixture(scope="module")
async def small_decode(stack):
    channel = stack.channel(stack.registry_address)
    registry = registry_pb2_grpc.SessionRegistryStub(channel)
    bind = cpu_binds(len(stack.workers) + 1)[-1] if stack.cfg.cpu_bind == "split" else stack.cfg.cpu_bind
    child = await stack.spawn_worker("decode", SMALL, bind, extra_args=f"--num-gpu-blocks-override {BLOCKS}")
    try:
        yield await wait_registered(registry, child, SMALL, EXTRA_STARTUP_TIMEOUT_S)
    finally:
        await child.stop()
        stack.children.remove(child)
        await channel.close()


async def decode_kv(stack, worker_id: str) -> scheduler_pb2.DecodeKvStats:
    async with stack.channel(stack.scheduler_address) as channel:
        stats = await scheduler_pb2_grpc.TransferSchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                                 timeout=5)
    assert stats.kv_managed and stats.kv_eviction_policy == "value", stats
    return next(row for row in stats.decode_kv if row.worker_id == worker_id)


async def test_sessions_nobody_ends_never_stall_a_small_decode_worker(stack, small_decode):
    histories: dict[str, list[dict]] = {}
    took: list[float] = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        async with Paused(stack, common_pb2.WORKER_ROLE_DECODE):
            for i in range(ABANDONED):  # each session sends one turn and is never heard of again
                sid, messages = new_session(f"abandoned{i}"), [user_turn(i)]
                started = time.monotonic()
                resp = await chat(client, sid, messages, max_tokens=8)
                took.append(time.monotonic() - started)
                assert resp.headers["x-kv-decode-worker"] == SMALL, resp.headers["x-kv-decode-worker"]
                histories[sid] = [*messages, resp.json()["choices"][0]["message"]]
            started = time.monotonic()  # a new conversation after them all: served in normal time
            fresh = await chat(client, new_session("after-abandoned"), [user_turn(30)], max_tokens=8)
            fresh_s = time.monotonic() - started
            assert fresh.headers["x-kv-decode-worker"] == SMALL
            print(f"\nturn times (s): {[round(t, 2) for t in took]}; the new session after them: {fresh_s:.2f}")
            assert max(took) < NORMAL_TURN_S and fresh_s < NORMAL_TURN_S, (took, fresh_s)

            kv = await decode_kv(stack, SMALL)
            freed = kv.evictions["pressure"] + kv.evictions["room"]
            print(f"{SMALL}: {kv.held_sessions} sessions held, {kv.held_tokens} of {kv.capacity_tokens} tokens; "
                  f"used {kv.used_tokens}; evictions {dict(kv.evictions)}")
            assert freed >= 1 and kv.eviction_failures == 0, kv
            assert kv.capacity_tokens == BLOCKS * 128 and kv.held_tokens <= kv.capacity_tokens, kv

            # An evicted session: its record is kept, marked freed, and its next turn recomputes and says why.
            async with stack.channel(stack.registry_address) as channel:
                registry = registry_pb2_grpc.SessionRegistryStub(channel)
                records = {sid: (await registry.GetSession(registry_pb2.GetSessionRequest(session_id=sid),
                                                           timeout=5)).session for sid in histories}
            evicted = [sid for sid, r in records.items() if r.kv_freed]
            assert len(evicted) >= freed - 1, {sid: (r.kv_freed, r.claimed) for sid, r in records.items()}
            sid = evicted[0]
            assert records[sid].claimed and records[sid].kv_freed in ("pressure", "room")
            prompt = [*histories[sid], user_turn(40)]
            resp = await chat(client, sid, prompt, max_tokens=8)
            assert resp.headers["x-kv-decision"] == "recompute"
            assert resp.headers["x-kv-reason-code"] == "kv_freed_pressure", resp.headers["x-kv-reason"]
            assert resp.headers["x-kv-reason"].startswith("KV freed"), resp.headers["x-kv-reason"]

            # The same conversation on a twin session, recomputed: the same exact ids, so the same answer.
            twin = new_session("abandoned-twin")
            first = await chat(client, twin, prompt[:1], max_tokens=8)
            assert [*prompt[:1], first.json()["choices"][0]["message"]] == histories[sid]
            reference = (await chat(client, twin, prompt, max_tokens=8, disable_pull=True)).json()
            assert resp.json()["choices"][0]["message"] == reference["choices"][0]["message"]
            assert tokens(resp.json()["usage"]) == tokens(reference["usage"])

            kv = await decode_kv(stack, SMALL)
            assert sum(kv.pulls_lost.values()) >= 1, kv


@pytest.mark.parametrize("find", [True, False], ids=["found-sessions", "unrecorded"])
async def test_turns_without_a_session_id_leave_no_kv_behind(stack, small_decode, find):
    """What SDK clients send by default: no session id. With the gateway finding sessions by content (its default),
    each such one-turn chat starts a session of its own (a new id) that the KV manager frees under pressure like any
    other; with that off (a second gateway, --no-find-sessions), nothing records the turn's handle and the gateway
    frees it after the answer. Either way the small decode worker never stalls."""
    child, base_url = (None, stack.base_url) if find else await spawn_gateway(stack, "gw-unrecorded",
                                                                               "--no-find-sessions")
    sdk = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0)
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            before = await released_handles(client)
            model = (await sdk.models.list()).data[0].id
            async with Paused(stack, common_pb2.WORKER_ROLE_DECODE):
                took, sessions = [], set()
                for i in range(ABANDONED + 4):  # ~4 blocks each: far more than the worker's 40 blocks in all
                    started = time.monotonic()  # the official client, as an application uses it: no session id
                    raw = await sdk.chat.completions.with_raw_response.create(
                        model=model, messages=[user_turn(i % 12)],
                        max_tokens=8, temperature=0)
                    took.append(time.monotonic() - started)
                    assert raw.parse().choices[0].message.content
                    assert raw.headers["x-kv-decode-worker"] == SMALL
                    assert raw.headers.get("x-session-source") == ("new" if find else None)
                    sessions.add(raw.headers["x-session-id"])
                print(f"\nturn times without a session id (s): {[round(t, 2) for t in took]}")
                assert max(took) < NORMAL_TURN_S, took
            if find:  # every chat its own new session
                assert len(sessions) == len(took) and all(s.startswith("auto-") for s in sessions), sessions
                return

            async def all_released() -> bool:  # freed in the background after each answer
                return await released_handles(client) - before >= len(took)

            await until(all_released, 10, f"the {len(took)} turns' handles to be released", interval_s=0.2)
    finally:
        if child is not None:
            await child.stop()


async def released_handles(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvshuttle_kv_handles_released_total"))
