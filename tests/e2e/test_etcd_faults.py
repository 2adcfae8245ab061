"""etcd faults on the real stack (3-member etcd, registry, scheduler, gateway over HTTP, vLLM P/D):

- the etcd leader SIGKILLed while several conversations run: no turn fails, and turns pull again once a new leader
  is elected;
- every etcd member down: turns still succeed, each recomputing with the reason in ``X-KV-Reason``, counted in the
  gateway's ``GET /health`` and logged; etcd back on the same data dirs: turns pull again, nothing restarted; the
  workers, without keep-alives for longer than their lease TTL meanwhile, are registered afterwards;
- a worker's lease revoked in etcd (as when it expired while etcd was unreachable): the agent registers again under
  a new lease on its own, and the scheduler plans with it again.

The stack is shared with the other e2e tests: each test brings etcd and the workers back in ``finally``. Timings are
measured and printed, not asserted; waits for recovery are bounded.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from kvshuttle.control_plane.session import STORE_UNAVAILABLE
from kvshuttle.services.devtools.etcd_process import EtcdCluster
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.e2e import new_session
from tests.support.waits import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CLIENT_TIMEOUT_S = 120  # far above any control timeout: a hang fails the turn instead of the test run
RECOVERY_S = 90  # bounded waits for recovery


def _members(stack) -> EtcdCluster:
    if not isinstance(stack.etcd, EtcdCluster):
        pytest.skip("needs the stack on a 3-member etcd cluster (KVSHUTTLE_STACK_ETCD_MEMBERS=3)")
    return stack.etcd


class Conversation:
    """A multi-turn chat through the gateway; every turn's status, decision, reason and time are kept."""

    def __init__(self, prefix: str, index: int = 0):
        self.session = new_session(prefix)
        self.index = index
        self.messages = [{"role": "system", "content": f"You are coding agent number {index}."}]
        self.turns: list[dict] = []

    def _user(self) -> dict:
        import inspect
        import textwrap

        n = len(self.turns) + 7 * self.index
        source = inspect.getsource(textwrap)
        at = n * 700 % (len(source) - 700)
        return {"role": "user", "content": f"Step {n}. Tool output:\n{source[at:at + 700]}\nGo on."}

    async def turn(self, client: httpx.AsyncClient) -> dict:
        self.messages.append(self._user())
        started = time.monotonic()
        try:
            resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": self.session}, json={
                "messages": self.messages, "max_tokens": 8, "temperature": 0})
            status, text = resp.status_code, resp.text
        except httpx.HTTPError as exc:
            resp, status, text = None, 0, f"{type(exc).__name__}: {exc}"
        record = {"session": self.session, "n": len(self.turns) + 1, "started": started, "status": status,
                  "s": round(time.monotonic() - started, 3), "error": "" if status == 200 else text[:300]}
        if status == 200:
            body = resp.json()
            record.update(decision=resp.headers["x-kv-decision"], reason=resp.headers["x-kv-reason"],
                          pulled=body["kvshuttle"]["pulled_tokens"], decode=resp.headers["x-kv-decode-worker"])
            self.messages.append(body["choices"][0]["message"])
        else:
            self.messages.pop()  # the turn did not happen: the next one asks again
        self.turns.append(record)
        return record


def _show(title: str, turns: list[dict], since: float) -> None:
    print(f"\n{title}")
    for t in sorted(turns, key=lambda t: t["started"]):
        print(f"  {t['started'] - since:+7.2f}s {t['session'][:22]:22} turn {t['n']}: {t['status']} {t['s']:6.2f}s "
              f"{t.get('decision', '-'):9} {t.get('reason', t['error'])[:110]}")


async def _health(client: httpx.AsyncClient) -> dict:
    resp = await client.get("/health")
    assert resp.status_code == 200
    return resp.json()


async def _workers(stack) -> dict[str, common_pb2.Worker]:
    async with stack.channel(stack.registry_address) as channel:
        resp = await registry_pb2_grpc.SessionRegistryStub(channel).ListWorkers(registry_pb2.ListWorkersRequest(),
                                                                                timeout=10)
    return {w.worker_id: w for w in resp.workers}


async def _until(pred, timeout_s: float, what: str) -> float:
    """``until(pred)``, where an error means "not yet" (the stack is still recovering); returns the seconds it
    took."""
    t, errors = time.monotonic(), []

    async def check() -> bool:
        try:
            return await pred()
        except Exception as exc:  # noqa: BLE001 - still recovering
            errors.append(exc)
            return False

    try:
        await until(check, timeout_s, what, interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last error: {errors[-1]!r}" if errors else str(exc)) from None
    return time.monotonic() - t


async def _restore_workers(stack, expected: set[str]) -> float:
    """Wait until every worker of the stack is registered again (the agents re-register on their own)."""
    async def all_back() -> bool:
        return expected <= set(await _workers(stack))
    return await _until(all_back, RECOVERY_S, f"workers {expected} to register again")


async def test_leader_kill_during_conversations_fails_no_turn(stack):
    cluster = _members(stack)
    convs = [Conversation("leader", i) for i in range(3)]
    turns_each, kill_after = 8, 5  # turns per conversation; the leader dies once this many turns are done in all
    done = asyncio.Event()
    killed: dict[str, float] = {}

    async def run(conv: Conversation, client: httpx.AsyncClient) -> None:
        for _ in range(turns_each):
            await conv.turn(client)
            if sum(len(c.turns) for c in convs) >= kill_after:
                done.set()

    async def kill_leader() -> None:
        await done.wait()
        leader = await asyncio.to_thread(cluster.leader)
        assert leader is not None, "no etcd leader"
        cluster.kill(leader)
        killed.update(index=leader, at=time.monotonic())
        async def elected() -> tuple[int] | None:  # (the new leader's index: 0 is one)
            leader = await asyncio.to_thread(cluster.leader)
            return None if leader is None else (leader,)

        (new,) = await until(elected, 30, "a new etcd leader", interval_s=0.05)
        killed.update(new=new, elected=time.monotonic())

    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
            await asyncio.gather(kill_leader(), *(run(c, client) for c in convs))
    finally:
        if "index" in killed:
            await cluster.arestart(killed["index"])
            await _until(lambda: asyncio.to_thread(cluster.healthy), RECOVERY_S, "the etcd cluster to be healthy")

    turns = [t for c in convs for t in c.turns]
    _show(f"leader m{killed['index']} killed at +{killed['at'] - t0:.2f}s, m{killed['new']} leads from "
          f"+{killed['elected'] - t0:.2f}s ({killed['elected'] - killed['at']:.2f}s later)", turns, t0)
    failed = [t for t in turns if t["status"] != 200]
    assert not failed, failed
    after_election = [t for t in turns if t["started"] > killed["elected"]]
    assert after_election, "no turn started after the new leader was elected"
    for conv in convs:  # each conversation pulls again under the new leader
        assert any(t["decision"] == "pull" for t in conv.turns if t["started"] > killed["elected"]), conv.turns


async def test_etcd_down_turns_recompute_and_pull_again_when_it_returns(stack):
    cluster = _members(stack)
    workers_before = await _workers(stack)
    lease_ttl_s = 10  # the workers' default lease TTL (kvshuttle worker --lease-ttl-s)
    a, b = Conversation("down-a", 10), Conversation("down-b", 11)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(2):
            assert (await a.turn(client))["status"] == 200
        assert a.turns[-1]["decision"] == "pull", a.turns[-1]
        counts_before = (await _health(client))["degraded"]
        outage: list[dict] = []
        down_at = time.monotonic()
        cluster.kill_all()
        try:
            for conv in (a, a, b, a, b):
                outage.append(await conv.turn(client))
            while time.monotonic() - down_at < lease_ttl_s + 3:  # longer than the workers' lease TTL
                outage.append(await b.turn(client))
                await asyncio.sleep(1.0)  # a turn a second while the outage lasts (its length is what is tested)
            counts_during = (await _health(client))["degraded"]
        finally:
            up_at = time.monotonic()
            await cluster.arestart_all()
            healthy_at = time.monotonic()

        # Without restarting anything, a later turn pulls again.
        after: list[dict] = []
        while not after or after[-1].get("decision") != "pull":
            assert time.monotonic() - healthy_at < RECOVERY_S, after
            after.append(await a.turn(client))
        counts_after = (await _health(client))["degraded"]
    # Without a keep-alive for longer than their lease TTL, the agents took their leases for lost: each registers
    # again under a new lease once etcd is back.
    async def registered_again() -> bool:
        now = await _workers(stack)
        return all(w in now and now[w].lease_id != workers_before[w].lease_id for w in workers_before)
    await _until(registered_again, RECOVERY_S, "the workers to register again after the outage")
    back_in = time.monotonic() - healthy_at
    workers_after = await _workers(stack)

    _show(f"etcd down at +{down_at - t0:.2f}s for {up_at - down_at:.1f}s, healthy again at +{healthy_at - t0:.2f}s",
          a.turns + b.turns, t0)
    print(f"degraded counts: before {counts_before}, during {counts_during}, after {counts_after}")
    print(f"first pull {after[-1]['started'] + after[-1]['s'] - healthy_at:.2f}s after etcd was healthy "
          f"({len(after)} turn(s)); workers registered {back_in:.1f}s after; leases "
          f"{ {w: (hex(workers_before[w].lease_id), hex(workers_after[w].lease_id)) for w in workers_before} }")
    assert all(t["status"] == 200 for t in outage + after), outage + after
    for t in outage:
        assert t["decision"] == "recompute" and t["reason"].startswith(STORE_UNAVAILABLE), t
    grew = counts_during["recomputed_store_unavailable"] - counts_before["recomputed_store_unavailable"]
    assert grew == len(outage)
    assert counts_during["record_failed"] > counts_before["record_failed"]
    assert counts_after["recomputed_store_unavailable"] <= counts_during["recomputed_store_unavailable"] + len(after) - 1
    log = (stack.logs / "gateway.log").read_text(errors="replace")
    assert "recomputes without the session store" in log and "could not record turn" in log


async def test_worker_registers_again_after_its_lease_is_lost(stack):
    """Both workers' leases revoked in etcd: each agent notices at its next keep-alive and registers under a new
    lease; the next turns run on them (the first may recompute: the registry drops the records of a decode worker
    whose registration ended), and a turn recorded after it pulls from the re-registered decode worker."""
    before = await _workers(stack)
    conv = Conversation("lease", 20)
    store = EtcdStore(stack.etcd.endpoints)
    await store.connect()
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_TIMEOUT_S) as client:
            for _ in range(2):
                assert (await conv.turn(client))["status"] == 200
            assert conv.turns[-1]["decision"] == "pull", conv.turns[-1]
            revoked_at = time.monotonic()
            for w in before.values():
                assert await store.leases.revoke(w.lease_id), f"lease of {w.worker_id} was not there"

            async def all_new() -> bool:
                now = await _workers(stack)
                return set(now) == set(before) and all(now[w].lease_id != before[w].lease_id for w in before)
            back = await _until(all_new, RECOVERY_S, "the workers to register again")

            async def scheduler_has_all() -> bool:  # its worker watch delivered the registrations (and a load poll)
                async with stack.channel(stack.scheduler_address) as channel:
                    stats = await scheduler_pb2_grpc.TransferSchedulerStub(channel).GetStats(
                        scheduler_pb2.GetStatsRequest(), timeout=5)
                return {row.worker_id for row in stats.loads if row.reachable} >= set(before)

            await _until(scheduler_has_all, RECOVERY_S, "the scheduler to have every worker again")
            first = await conv.turn(client)
            second = await conv.turn(client)
    finally:
        await _restore_workers(stack, set(before))
        await store.close()
    after = await _workers(stack)
    _show(f"leases revoked at +{revoked_at - t0:.2f}s; all workers registered again {back:.2f}s later, leases "
          f"{ {w: (hex(before[w].lease_id), hex(after[w].lease_id)) for w in before} }", conv.turns, t0)
    assert first["status"] == 200 and second["status"] == 200, (first, second)
    if first["decision"] == "recompute":
        assert "no recorded KV" in first["reason"] or "not alive" in first["reason"], first
    # A pull needs its source registered at the handle's address: the scheduler plans with the new registration.
    assert second["decision"] == "pull", second
