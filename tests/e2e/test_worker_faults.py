"""Workers that die, on the real stack: one more prefill and one more decode worker are started and killed (SIGKILL
of the whole process group: agent and vLLM, as when a node goes away) while the shared pair keeps serving.

- A decode worker killed in the middle of an answer: the client's stream goes on (the gateway prefills the prompt
  plus what was already answered on a live P and a live D continues) and the answer equals an uninterrupted one.
- Sessions whose KV the dead decode worker held: their next turn recomputes at once (nothing waits on the dead
  worker), and the registry drops their records when its lease ends.
- A prefill worker killed while it prefills: the turn is recomputed on the other prefill worker; both concurrent
  turns succeed.

To place turns on an extra worker, the test pauses (SIGSTOP) the shared stack's worker of that role until the
scheduler sees it unreachable, and resumes it (SIGCONT) before the extra worker is killed.

The extra decode worker keeps finished turns' KV for a short time (``SHORT_TTL_S``, 10 s more than the registry's
expiry margin), so the first test can also check expiry: a turn whose handle expired (inside the margin, and after
the worker's own TTL) recomputes and is never sent the expired handle.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import pytest
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.devtools.stack import cpu_binds
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from tests.e2e.helpers import Paused, new_session, signal_tree, user_turn
from tests.e2e.test_load_aware import EXTRA_STARTUP_TIMEOUT_S, wait_registered

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ANSWER_TOKENS = 96
LONG_ANSWER_TOKENS = 512  # long enough that the decode worker is still generating when it is killed
HANDLE_LIFE_S = 10  # a handle of the extra decode worker expires this long after its turn


class Extra:
    """An extra worker of the shared stack: its process and registration."""

    def __init__(self, name: str, child: ChildProcess, worker):
        self.name, self.child, self.worker = name, child, worker

    def kill(self) -> None:
        """SIGKILL the agent and its vLLM together: nothing deregisters, the lease runs out on its own."""
        assert signal_tree(self.child, signal.SIGKILL) >= 2  # the agent and at least vLLM's server


@pytest.fixture(scope="module")
async def extras(stack):
    """One more prefill and one more decode worker, started side by side; stopped (if still alive) at the end."""
    channel = client_channel(stack.registry_address)
    registry = registry_pb2_grpc.SessionRegistryStub(channel)
    bind = cpu_binds(len(stack.workers) + 1)[-1] if stack.cfg.cpu_bind == "split" else stack.cfg.cpu_bind
    names = {"prefill": "fault-prefill", "decode": "fault-decode"}
    ttl = int(stack.cfg.expiry_margin_s) + HANDLE_LIFE_S
    children = {role: await stack.spawn_worker(role, name, bind, decoder_kv_blocks_ttl=ttl if role == "decode" else None)
                for role, name in names.items()}
    try:
        workers = await asyncio.gather(*(wait_registered(registry, children[role], name, EXTRA_STARTUP_TIMEOUT_S)
                                         for role, name in names.items()))
        yield {role: Extra(names[role], children[role], w) for role, w in zip(names, workers, strict=True)}
    finally:
        for child in children.values():
            await child.stop()
            stack.children.remove(child)
        await channel.close()


def body(messages: list[dict], **kw) -> dict:
    return {"messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


async def reference(client: httpx.AsyncClient, messages: list[dict], **kw) -> str:
    """The same answer, computed without a session (the prompt's ids are the same: there is no history)."""
    resp = await client.post("/v1/chat/completions", json=body(messages, disable_pull=True, **kw))
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


async def session_exists(registry, sid: str) -> bool:
    try:
        await registry.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant="default"), timeout=5)
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
        return False


async def turn_on(client: httpx.AsyncClient, decode_id: str, prefix: str, n: int) -> tuple[str, list[dict]]:
    """A first turn of a new session, which must have been placed on decode worker ``decode_id``."""
    sid, messages = new_session(prefix), [user_turn(n)]
    resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": sid}, json=body(messages, max_tokens=8))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kv-decode-worker"] == decode_id, resp.headers["x-kv-decode-worker"]
    return sid, [*messages, resp.json()["choices"][0]["message"]]


async def test_expired_handles_are_never_pulled(stack, extras):
    d2, ttl = extras["decode"], int(stack.cfg.expiry_margin_s) + HANDLE_LIFE_S
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        async with Paused(stack, common_pb2.WORKER_ROLE_DECODE):
            fresh, fresh_history = await turn_on(client, d2.name, "expiry-fresh", 1)
            started = time.monotonic()
            in_margin, in_margin_history = await turn_on(client, d2.name, "expiry-margin", 2)
            margin_done = time.monotonic()  # its handle expires HANDLE_LIFE_S after its turn ended: before this
            late, late_history = await turn_on(client, d2.name, "expiry-late", 3)
            late_done = time.monotonic()

        async def next_turn(sid: str, history: list[dict], n: int) -> httpx.Response:
            resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": sid},
                                     json=body([*history, user_turn(n)], max_tokens=8))
            assert resp.status_code == 200, resp.text
            kv = resp.json()["kvshuttle"]
            print(f"\n{sid} at {time.monotonic() - started:.1f} s: {kv['decision']} ({kv['reason']})")
            return resp

        # Control: while the handle is valid, this worker's KV is pulled.
        assert (await next_turn(fresh, fresh_history, 40)).headers["x-kv-decision"] == "pull"
        # Past the handle's expiry but inside the margin (the worker still holds the blocks): recompute.
        await asyncio.sleep(max(0.0, margin_done + HANDLE_LIFE_S + 1 - time.monotonic()))
        resp = await next_turn(in_margin, in_margin_history, 41)
        kv = resp.json()["kvshuttle"]
        assert kv["decision"] == "recompute" and "expire" in kv["reason"], kv
        assert not kv["retried_as_recompute"] and kv["pulled_tokens"] == 0  # P was never sent the expired handle
        # Past the decode worker's own TTL (its blocks are freed): recompute, and P is never sent the handle.
        await asyncio.sleep(max(0.0, late_done + ttl + 2 - time.monotonic()))
        resp = await next_turn(late, late_history, 42)
        kv = resp.json()["kvshuttle"]
        assert kv["decision"] == "recompute" and not kv["retried_as_recompute"] and kv["pulled_tokens"] == 0, kv


async def test_a_decode_worker_killed_mid_answer(stack, extras):
    d2 = extras["decode"]
    channel = client_channel(stack.registry_address)
    registry = registry_pb2_grpc.SessionRegistryStub(channel)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        async with Paused(stack, common_pb2.WORKER_ROLE_DECODE) as paused:
            # Two sessions whose KV is on the worker about to die: one continues, one is left alone.
            continuing, history = await turn_on(client, d2.name, "fault-next", 4)
            idle, _ = await turn_on(client, d2.name, "fault-idle", 5)
            # An answer streaming from that worker when it dies.
            sid, messages = new_session("fault-stream"), [user_turn(10)]
            expected = await reference(client, messages, max_tokens=LONG_ANSWER_TOKENS)
            pieces, final, killed_at = [], None, None
            async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": sid},
                                     json=body(messages, stream=True, max_tokens=LONG_ANSWER_TOKENS)) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-kv-decode-worker"] == d2.name
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        pieces.append(chunk["choices"][0]["delta"]["content"])
                    if "kvshuttle" in chunk:
                        final = chunk
                    if killed_at is None and len(pieces) >= 8:
                        paused.resume()  # the other decode worker answers again, then this one dies
                        d2.kill()
                        killed_at = time.monotonic()
                        streamed_before_kill = len(pieces)
        resumed_in = time.monotonic() - killed_at
        failures = final["kvshuttle"]["worker_failures"]
        print(f"\nkilled {d2.name} after {streamed_before_kill} streamed pieces; the stream ended {resumed_in:.2f} s "
              f"later with {len(pieces)} pieces; "
              f"failures: {failures}")
        assert final["choices"][0]["finish_reason"] == "length"
        assert "".join(pieces) == expected, "the resumed answer differs from an uninterrupted one"
        assert len(failures) == 1 and failures[0].startswith(f"decode worker {d2.name} failed after"), failures
        assert "resumed on" in failures[0]
        assert final["kvshuttle"]["decode_worker"] != d2.name

        # The resumed session's KV is on the live worker now: its next turn can pull.
        resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": sid}, json=body(
            [*messages, {"role": "assistant", "content": expected}, user_turn(30)], max_tokens=8))
        assert resp.status_code == 200, resp.text
        print(f"next turn of the resumed session: {resp.headers['x-kv-decision']} ({resp.headers['x-kv-reason']})")

        # A session whose KV died with the worker: its next turn recomputes at once and succeeds.
        t = time.monotonic()
        resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": continuing},
                                 json=body([*history, user_turn(31)], max_tokens=8))
        took = time.monotonic() - t
        assert resp.status_code == 200, resp.text
        print(f"next turn of a session on the dead worker: {resp.headers['x-kv-decision']} "
              f"({resp.headers['x-kv-reason']}) in {took:.2f} s")
        assert resp.headers["x-kv-decision"] == "recompute"
        assert resp.headers["x-kv-decode-worker"] != d2.name
        assert not resp.json()["kvshuttle"]["worker_failures"]  # planned around the dead worker, not tried on it

        # The untouched session's record goes when the dead worker's lease ends.
        t = time.monotonic()
        deadline = t + 60
        while await session_exists(registry, idle):
            assert time.monotonic() < deadline, "the dead worker's session record was not dropped"
            await asyncio.sleep(0.5)
        print(f"the idle session's record was dropped {time.monotonic() - t:.1f} s after the checks")
        # (Its handle is short-lived here: the record may also have ended with its own lease.) The dead worker
        # leaves the registry when its lease ends.
        while d2.name in {w.worker_id for w in (await registry.ListWorkers(
                registry_pb2.ListWorkersRequest(), timeout=5)).workers}:
            assert time.monotonic() < deadline, "the dead worker is still registered"
            await asyncio.sleep(0.5)
    await channel.close()


async def test_a_prefill_worker_killed_while_it_prefills(stack, extras):
    p2 = extras["prefill"]
    # A long prompt (~3k tokens: around a second of prefill here), so that P2 dies while it prefills.
    import inspect
    import textwrap

    messages = [{"role": "user", "content": inspect.getsource(textwrap)[:11000] + "\nSummarize."}]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        async with Paused(stack, common_pb2.WORKER_ROLE_PREFILL) as paused:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body(messages),
                                                   headers={"X-Session-ID": new_session("fault-p")}))
            started = time.monotonic()
            await asyncio.sleep(0.05)  # planned (a few ms) and prefilling (~0.3 s here): kill it now
            paused.resume()  # the other prefill worker answers again, then this one dies
            p2.kill()
            killed_after = time.monotonic() - started
            resp = await task
        expected = await reference(client, messages)  # after: a prefill worker with this prompt cached is too fast
    assert resp.status_code == 200, resp.text
    kv = resp.json()["kvshuttle"]
    print(f"\nkilled {p2.name} {killed_after:.2f} s after sending; prefilled on "
          f"{kv['prefill_worker']}; failures: {kv['worker_failures']}")
    assert len(kv["worker_failures"]) == 1
    assert kv["worker_failures"][0].startswith(f"prefill worker {p2.name} failed")
    assert kv["prefill_worker"] != p2.name and kv["decision"] == "recompute"
    assert resp.json()["choices"][0]["message"]["content"] == expected


async def test_a_hung_decode_worker_with_none_left_is_a_503_with_retry_after(stack, extras):
    """The extra decode worker is dead (previous test); the stack's own one hangs (SIGSTOP). A gateway with a short
    stall timeout gives up on it and, with no decode worker left, answers 503 with Retry-After, in bounded time."""
    from tests.e2e.helpers import spawn_gateway

    # Wait for the stack to be its own again: the killed extras gone, its own two workers registered and answering
    # in the scheduler's view (a pause in an earlier test can outlast a lease on a loaded machine).
    channel = client_channel(stack.registry_address)
    registry = registry_pb2_grpc.SessionRegistryStub(channel)
    own = {w.worker_id for w in stack.workers}
    deadline = time.monotonic() + 60
    while {w.worker_id for w in (await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)).workers
           } != own:
        assert time.monotonic() < deadline, "the stack's workers are not back to its own two"
        await asyncio.sleep(0.5)
    await channel.close()
    for role in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        view = Paused(stack, role)
        try:
            await view.wait(True)
        finally:
            await view.channel.close()
    child, base_url = await spawn_gateway(stack, "gateway-stall", "--decode-stall-timeout-s", "3")
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            # One turn first: the gateway then holds a connection to the decode worker, which will stop answering
            # on it (a fresh connection to a stopped process fails at connect, quickly, like a dead one).
            resp = await client.post("/v1/chat/completions", json=body([user_turn(49)], max_tokens=8))
            assert resp.status_code == 200, resp.text
            async with Paused(stack, common_pb2.WORKER_ROLE_DECODE):
                t = time.monotonic()
                resp = await client.post("/v1/chat/completions", json=body([user_turn(50)], max_tokens=8),
                                         headers={"X-Session-ID": new_session("fault-none")})
                took = time.monotonic() - t
            print(f"\nwith the only decode worker hung: {resp.status_code} in {took:.1f} s: {resp.text[:300]}")
            assert resp.status_code == 503, resp.text
            assert resp.headers["retry-after"] == "1"
            message = resp.json()["error"]["message"]
            assert "decode worker" in message and "no token for 3 s" in message and "no worker left" in message
            # Resumed, the worker serves again through the same gateway.
            resp = await client.post("/v1/chat/completions", json=body([user_turn(51)], max_tokens=8))
            assert resp.status_code == 200, resp.text
    finally:
        await child.stop()
