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

The extra decode worker keeps finished turns' KV for a short time (``HANDLE_LIFE_S``, 10 s more than the registry's
expiry margin), so the first test can also check expiry: a turn whose handle expired (inside the margin, and after
the worker's own TTL) recomputes and is never sent the expired handle.

Each test asks for the extra workers it needs (``Extras``: started on demand, a killed one replaced by a new one
for the next test that needs it) and leaves the stack as it found it, so the tests pass alone and in any order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import pytest
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from tests.support.e2e import (
    EXTRA_STARTUP_TIMEOUT_S,
    Paused,
    extra_worker_bind,
    new_session,
    signal_tree,
    spawn_gateway,
    user_turn,
    wait_registered,
)
from tests.support.waits import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ANSWER_TOKENS = 96
LONG_ANSWER_TOKENS = 512  # long enough that the decode worker is still generating when it is killed
HANDLE_LIFE_S = 10  # a handle of the extra decode worker expires this long after its turn


class Extra:
    """An extra worker of the shared stack: its process and registration."""

    def __init__(self, name: str, child: ChildProcess, worker):
        self.name, self.child, self.worker = name, child, worker
        self.killed = False

    def kill(self) -> None:
        """SIGKILL the agent and its vLLM together: nothing deregisters, the lease runs out on its own."""
        assert signal_tree(self.child, signal.SIGKILL) >= 2  # the agent and at least vLLM's server
        self.killed = True


class Extras:
    """Extra workers next to the shared stack's, started when a test asks for one: a living extra worker of a role
    is shared by the tests until one kills it; the next test that needs that role gets a new one. A test therefore
    never depends on what an earlier one left (``pytest -k``, any order)."""

    ROLES = ("prefill", "decode")

    def __init__(self, stack, registry):
        self.stack, self.registry = stack, registry
        self.living: dict[str, Extra] = {}
        self.started: list[Extra] = []

    async def get(self, role: str) -> Extra:
        """A living extra worker of ``role``. The first start also starts the other role's, side by side (starting
        vLLM is most of these tests' time)."""
        if role not in self.living:
            roles = [role] + [r for r in self.ROLES if r != role and not any(
                e.name.startswith(f"fault-{r}") for e in self.started)]
            ttl = int(self.stack.cfg.expiry_margin_s) + HANDLE_LIFE_S
            bind = extra_worker_bind(self.stack)
            children = {}
            for r in roles:
                name = f"fault-{r}-{len(self.started) + len(children) + 1}"
                children[r] = (name, await self.stack.spawn_worker(
                    r, name, bind, decoder_kv_blocks_ttl=ttl if r == "decode" else None))
            workers = await asyncio.gather(*(wait_registered(self.registry, child, name, EXTRA_STARTUP_TIMEOUT_S)
                                             for name, child in children.values()))
            for (r, (name, child)), w in zip(children.items(), workers, strict=True):
                self.living[r] = Extra(name, child, w)
                self.started.append(self.living[r])
        return self.living[role]

    async def settle(self) -> None:
        """After a test: the extras it killed have left the registry (their leases ended), so the next test sees
        only living workers."""
        for role, extra in list(self.living.items()):
            if extra.killed:
                del self.living[role]
                await until(lambda: self._gone(extra.name), 60, f"the dead {extra.name} to leave the registry",
                            interval_s=0.5)

    async def none(self) -> None:
        """No extra worker: the living ones stopped (they deregister), the registry lists the stack's own only."""
        for extra in self.living.values():
            await extra.child.stop()
        self.living.clear()
        own = {w.worker_id for w in self.stack.workers}
        await until(lambda: self._ids_are(own), 60, f"the registry to list the stack's own workers {own} only",
                    interval_s=0.5)

    async def _ids(self) -> set[str]:
        resp = await self.registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)
        return {w.worker_id for w in resp.workers}

    async def _gone(self, name: str) -> bool:
        return name not in await self._ids()

    async def _ids_are(self, ids: set[str]) -> bool:
        return await self._ids() == ids

    async def close(self) -> None:
        for extra in self.started:
            await extra.child.stop()
            self.stack.children.remove(extra.child)


@pytest.fixture(scope="module")
async def pool(stack):
    channel = stack.channel(stack.registry_address)
    extras = Extras(stack, registry_pb2_grpc.SessionRegistryStub(channel))
    try:
        yield extras
    finally:
        await extras.close()
        await channel.close()


@pytest.fixture
async def extras(stack, pool):
    """The extra workers, for one test; afterwards the stack is as the test found it: what it killed is gone from
    the registry and the stack's own workers answer the scheduler again (a pause can outlast a lease when loaded)."""
    yield pool
    await pool.settle()
    for role in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        view = Paused(stack, role)
        try:
            await view.wait(True, timeout_s=60)
        finally:
            await view.channel.close()


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
    d2, ttl = await extras.get("decode"), int(stack.cfg.expiry_margin_s) + HANDLE_LIFE_S
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
        # Past the handle's expiry but inside the margin (the worker still holds the blocks): recompute. (The
        # sleeps let the handles' life run out: the time is what is tested.)
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
    d2 = await extras.get("decode")
    channel = stack.channel(stack.registry_address)
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

        async def dropped() -> bool:
            return not await session_exists(registry, idle)

        await until(dropped, 60, "the dead worker's session record to be dropped", interval_s=0.5)
        print(f"the idle session's record was dropped {time.monotonic() - t:.1f} s after the checks")
        # (Its handle is short-lived here: the record may also have ended with its own lease.) The dead worker
        # leaves the registry when its lease ends.

        async def deregistered() -> bool:
            resp = await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5)
            return d2.name not in {w.worker_id for w in resp.workers}

        await until(deregistered, max(1.0, t + 60 - time.monotonic()), "the dead worker to leave the registry",
                    interval_s=0.5)
    await channel.close()


async def test_a_prefill_worker_killed_while_it_prefills(stack, extras):
    p2 = await extras.get("prefill")
    # A long prompt (~3k tokens: around a second of prefill here), so that P2 dies while it prefills.
    import inspect
    import textwrap

    messages = [{"role": "user", "content": inspect.getsource(textwrap)[:11000] + "\nSummarize."}]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        async with Paused(stack, common_pb2.WORKER_ROLE_PREFILL) as paused:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body(messages),
                                                   headers={"X-Session-ID": new_session("fault-p")}))
            started = time.monotonic()
            # The fault's timing is what is tested: planned (a few ms) and prefilling (~0.3 s here): kill it now.
            await asyncio.sleep(0.05)
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
    """No extra worker (stopped if any are running); the stack's own decode worker hangs (SIGSTOP). A gateway with
    a short stall timeout gives up on it and, with no decode worker left, answers 503 with Retry-After, in bounded
    time."""
    await extras.none()
    for role in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        view = Paused(stack, role)
        try:
            await view.wait(True)  # the stack's own workers answer the scheduler's polls
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
