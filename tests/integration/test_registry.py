"""SessionRegistry against a real etcd: workers under leases, the worker watch, sessions, claims, errors."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.prefix import (
    checkpoint_lengths,
    ids_bytes,
    matched_prefix_tokens,
    prefix_digest,
    prefix_digests,
)
from kvshuttle.control_plane.session import LEASE_GRACE_S
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.devtools.etcd_process import EtcdCluster, EtcdProcess, free_port
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from tests.support.registry import (
    MARGIN_S,
    TENANT,
    decode_worker,
    deregister,
    handle,
    prefill_worker,
    session_exists,
    turn,
    uid,
)
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)
Ev = registry_pb2.WatchWorkersResponse


async def expect_status(coro, code: grpc.StatusCode, words: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert words in (info.value.details() or ""), info.value.details()
    return info.value.details()


class Watch:
    """Reads a WatchWorkers stream in the background; tests wait for events about their own workers."""

    def __init__(self, stub):
        self.call = stub.WatchWorkers(registry_pb2.WatchWorkersRequest())
        self.events: list[Ev] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for ev in self.call:
            self.events.append(ev)
            self._changed.set()

    async def wait_for(self, pred, timeout: float = 15.0) -> Ev:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if pred(ev):
                    return ev
            seen = len(self.events)
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching watch event in {timeout}s; got {self.events}")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    async def close(self) -> None:
        self.call.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def about(kind, worker_id):
    return lambda ev: ev.type == kind and any(w.worker_id == worker_id for w in ev.workers)


# -- service plumbing --------------------------------------------------------------------------------------------


async def test_health_reports_serving(registry):
    async with grpc.aio.insecure_channel(registry) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvshuttle.v1.SessionRegistry"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


# -- workers -----------------------------------------------------------------------------------------------------


async def test_register_list_watchderegister(stub):
    watch = Watch(stub)
    try:
        first = await watch.wait_for(lambda ev: True)
        assert first.type == Ev.EVENT_TYPE_SNAPSHOT
        p, d = prefill_worker(uid("p")), decode_worker(uid("d"))
        rp = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=p))
        rd = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=d, lease_ttl_s=30))
        assert rp.lease_ttl_s == 10 and rd.lease_ttl_s == 30  # registry default, then as asked
        assert rp.worker.lease_id == rp.lease_id and rp.worker.registered_at.seconds > 0
        put = await watch.wait_for(about(Ev.EVENT_TYPE_PUT, d.worker_id))
        assert put.workers[0].engine_id == d.engine_id and put.workers[0].lease_id == rd.lease_id
        await watch.wait_for(about(Ev.EVENT_TYPE_PUT, p.worker_id))

        listed = {w.worker_id: w for w in (await stub.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
        assert listed[p.worker_id].role == common_pb2.WORKER_ROLE_PREFILL and d.worker_id in listed
        decodes = await stub.ListWorkers(registry_pb2.ListWorkersRequest(role=common_pb2.WORKER_ROLE_DECODE))
        ids = {w.worker_id for w in decodes.workers}
        assert d.worker_id in ids and p.worker_id not in ids

        resp = await stub.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=d.worker_id, lease_id=rd.lease_id))
        assert resp.lease_ttl_s == 30

        await stub.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=d.worker_id,
                                                                         lease_id=rd.lease_id))
        gone = await watch.wait_for(about(Ev.EVENT_TYPE_DELETE, d.worker_id))
        assert gone.workers[0].engine_id == d.engine_id  # the removed record, from etcd's prev_kv
        await stub.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=p.worker_id))  # lease 0: any
        await watch.wait_for(about(Ev.EVENT_TYPE_DELETE, p.worker_id))
        ids = {w.worker_id for w in (await stub.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
        assert not ids & {p.worker_id, d.worker_id}
        await expect_status(stub.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=p.worker_id)),
                            grpc.StatusCode.NOT_FOUND, "not registered")
    finally:
        await watch.close()


async def test_worker_without_keepalive_expires_then_reregisters(stub):
    w = decode_worker(uid("d"))
    watch = Watch(stub)
    try:
        await watch.wait_for(lambda ev: ev.type == Ev.EVENT_TYPE_SNAPSHOT)
        reg = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=2))
        await watch.wait_for(about(Ev.EVENT_TYPE_PUT, w.worker_id))
        started = time.monotonic()
        # No keep-alives: etcd ends the lease and the watch reports the worker gone.
        await watch.wait_for(about(Ev.EVENT_TYPE_DELETE, w.worker_id), timeout=20)
        assert time.monotonic() - started >= 1.0
        await expect_status(stub.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=w.worker_id,
                                                                         lease_id=reg.lease_id)),
                            grpc.StatusCode.NOT_FOUND, "register again")
        ids = {x.worker_id for x in (await stub.ListWorkers(registry_pb2.ListWorkersRequest())).workers}
        assert w.worker_id not in ids

        again = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
        assert again.lease_id != reg.lease_id
        await watch.wait_for(about(Ev.EVENT_TYPE_PUT, w.worker_id))
        await stub.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=w.worker_id, lease_id=again.lease_id))
        await deregister(stub, again.worker)
    finally:
        await watch.close()


async def test_reregistering_moves_worker_to_new_lease(stub):
    w = decode_worker(uid("d"))
    first = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
    second = await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
    assert second.lease_id != first.lease_id
    # The old lease is revoked: keep-alives on it are refused, the new one works.
    await expect_status(stub.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=w.worker_id,
                                                                     lease_id=first.lease_id)),
                        grpc.StatusCode.NOT_FOUND)
    await stub.KeepAlive(registry_pb2.KeepAliveRequest(worker_id=w.worker_id, lease_id=second.lease_id))
    await expect_status(stub.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=w.worker_id,
                                                                                   lease_id=first.lease_id)),
                        grpc.StatusCode.FAILED_PRECONDITION, "another lease")
    await deregister(stub, second.worker)


# -- sessions ----------------------------------------------------------------------------------------------------


async def test_record_turn_and_get_session(stub, decode):
    sid = uid("s")
    tokens = list(range(1000, 1010))
    t0 = time.time()
    rec = (await stub.RecordTurn(turn(decode, sid, tokens, covered=9))).session
    assert rec.covered_tokens == 9 and rec.block_size == 4 and rec.turn == 1 and not rec.claimed
    # The record keeps the digest, the ids' count and first block, the text's length and key; not the ids or text.
    assert rec.prefix_digest == prefix_digest(tokens, 9) and not rec.checkpoints
    assert not rec.token_ids and rec.history_tokens == 10 and rec.history_generation > 0
    assert list(rec.head_token_ids) == tokens[:5]
    assert (rec.text_chars, rec.text_key) == (len("some text"), text_key("some text")) and rec.revision > 0
    assert json.loads(rec.kv_transfer_params_json)["remote_num_tokens"] == 9

    got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
    assert got.session == rec and not got.history_missing
    expected_left = decode.kv_blocks_ttl_s - MARGIN_S - (time.time() - t0)
    assert got.expires_in_s == pytest.approx(expected_left, abs=5)
    # The next prompt extends the recorded ids: the whole covered prefix matches.
    assert matched_prefix_tokens(9, 4, tokens + [7, 8, 9], got.session.prefix_digest) == 9
    # The exact ids come from the history store when asked for.
    full = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT,
                                                                include_token_ids=True))
    assert list(full.session.token_ids) == tokens and not full.history_missing
    full.session.ClearField("token_ids")
    assert full.session == rec

    # Another tenant does not see it.
    await expect_status(stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant="other")),
                        grpc.StatusCode.NOT_FOUND, "no session")

    # Next turn: counts up, new revision, finished_at shortens the life.
    req = turn(decode, sid, tokens + [5, 6, 7, 8, 9], covered=14)
    req.finished_at.FromSeconds(int(time.time()) - 100)
    rec2 = (await stub.RecordTurn(req)).session
    assert rec2.turn == 2 and rec2.revision > rec.revision and rec2.covered_tokens == 14
    got2 = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
    assert got2.session.revision == rec2.revision
    assert got2.expires_in_s == pytest.approx(decode.kv_blocks_ttl_s - MARGIN_S - 100, abs=5)
    assert (await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))).deleted


def appended(worker: common_pb2.Worker, sid: str, record: common_pb2.Session, ids: list[int],
             covered: int | None = None) -> registry_pb2.RecordTurnRequest:
    """The turn after ``record`` whose whole history is ``ids``, sent as the gateway sends it: only the ids after
    the recorded ones (base_tokens, base_turn), with the digests over all of them."""
    base = record.history_tokens
    covered = len(ids) - 1 if covered is None else covered
    lengths = checkpoint_lengths([*(cp.tokens for cp in record.checkpoints), record.covered_tokens, base], base,
                                 covered)
    digests = prefix_digests(ids, [*lengths, covered])
    return turn(worker, sid, ids[base:], covered=covered, base_tokens=base, base_turn=record.turn,
                prefix_digest=digests[covered],
                checkpoints=[common_pb2.PrefixCheckpoint(tokens=n, digest=digests[n]) for n in lengths])


async def history(stub, sid: str) -> registry_pb2.GetSessionResponse:
    return await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT,
                                                                include_token_ids=True))


async def test_turns_append_to_the_recorded_history(stub, decode):
    sid = uid("s")
    ids = list(range(1000, 1010))
    rec1 = (await stub.RecordTurn(turn(decode, sid, ids))).session
    ids2 = [*ids, *range(2000, 2007)]
    rec2 = (await stub.RecordTurn(appended(decode, sid, rec1, ids2))).session
    assert rec2.turn == 2 and rec2.history_tokens == 17 and rec2.covered_tokens == 16
    assert rec2.history_generation == rec1.history_generation  # the same lineage, one segment longer
    assert rec2.prefix_digest == prefix_digest(ids2, 16) and list(rec2.head_token_ids) == ids[:5]
    assert [(cp.tokens, cp.digest) for cp in rec2.checkpoints] == [(n, prefix_digest(ids2, n)) for n in (9, 10)]
    got = await history(stub, sid)
    assert list(got.session.token_ids) == ids2 and not got.history_missing and got.session.revision == rec2.revision

    ids3 = [*ids2, 3000, 3001, 3002]
    rec3 = (await stub.RecordTurn(appended(decode, sid, rec2, ids3))).session
    assert rec3.turn == 3 and rec3.history_tokens == 20
    assert list((await history(stub, sid)).session.token_ids) == ids3
    edited = ids3.copy()
    edited[12] += 1  # after checkpoint 10: its 2 whole blocks are proven, no more
    checkpoints = [(cp.tokens, cp.digest) for cp in rec3.checkpoints]
    assert [n for n, _ in checkpoints] == [9, 10, 16, 17]
    assert matched_prefix_tokens(rec3.covered_tokens, 4, edited, rec3.prefix_digest, checkpoints) == 8
    assert matched_prefix_tokens(rec3.covered_tokens, 4, [*ids3, 1], rec3.prefix_digest, checkpoints) == 19

    # Appending to a history the record no longer has: refused, nothing changes.
    await expect_status(stub.RecordTurn(appended(decode, sid, rec2, [*ids3, 4])), PRECONDITION, "history changed")
    wrong_count = appended(decode, sid, rec3, [*ids3, 4])
    wrong_count.base_tokens = 21  # more ids than the record holds
    await expect_status(stub.RecordTurn(wrong_count), PRECONDITION, "history changed")
    no_digest = appended(decode, sid, rec3, [*ids3, 4])
    no_digest.prefix_digest = b""
    no_digest.ClearField("checkpoints")
    await expect_status(stub.RecordTurn(no_digest), INVALID, "prefix_digest is required")
    got = await history(stub, sid)
    assert got.session.revision == rec3.revision and list(got.session.token_ids) == ids3

    # A turn that kept only the first 15 ids (the history re-rendered otherwise past a text boundary): only the ids
    # after them are sent; the record names a new lineage, the kept ids copied inside the history store.
    kept = [*ids3[:15], *range(5000, 5006)]
    part = appended(decode, sid, rec3, kept)
    part.base_tokens = 15
    del part.token_ids[:]
    part.token_ids.extend(kept[15:])
    part.checkpoints.clear()
    part.checkpoints.add(tokens=15, digest=prefix_digest(kept, 15))
    rec3b = (await stub.RecordTurn(part)).session
    assert rec3b.turn == 4 and rec3b.history_tokens == 21 and rec3b.history_generation != rec3.history_generation
    got = await history(stub, sid)
    assert list(got.session.token_ids) == kept and not got.history_missing
    rec3 = rec3b

    # The whole history again (an edited conversation): a new lineage.
    ids4 = [7] * 12
    rec4 = (await stub.RecordTurn(turn(decode, sid, ids4))).session
    assert rec4.turn == 5 and rec4.history_generation != rec1.history_generation and rec4.history_tokens == 12
    assert list((await history(stub, sid)).session.token_ids) == ids4
    assert (await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))).deleted
    await expect_status(stub.RecordTurn(appended(decode, sid, rec4, [*ids4, 1])), PRECONDITION, "history changed")


async def test_the_history_store_follows_the_records(etcd, stub, decode):
    """A replaced lineage and a deleted session's history leave the history store; a lost history is reported, not
    an error (the caller tokenizes the text again)."""
    service = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd))
    channel = client_channel(service.address)
    own = registry_pb2_grpc.SessionRegistryStub(channel)
    sid = uid("s")
    try:
        ids = list(range(50, 70))
        rec1 = (await own.RecordTurn(turn(decode, sid, ids))).session
        rec2 = (await own.RecordTurn(appended(decode, sid, rec1, [*ids, 1, 2, 3]))).session
        stored = await service.history.read(TENANT, sid, rec2.history_generation, 23)
        assert stored == ids_bytes([*ids, 1, 2, 3])
        rec3 = (await own.RecordTurn(turn(decode, sid, [9] * 8))).session  # a new lineage replaces the old one
        await service.servicer.drain()  # the replaced lineage is dropped off the turn's path
        assert await service.history.read(TENANT, sid, rec1.history_generation, 20) is None
        assert await service.history.read(TENANT, sid, rec3.history_generation, 8) == ids_bytes([9] * 8)

        await service.history.drop(TENANT, sid, rec3.history_generation)  # e.g. a restarted in-memory store
        lost = await history(own, sid)
        assert not lost.session.token_ids and "no longer holds" in lost.history_missing
        assert lost.session.revision == rec3.revision and lost.session.prefix_digest == rec3.prefix_digest
        plain = await own.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
        assert not plain.history_missing  # not asked for: nothing to report

        rec4 = (await own.RecordTurn(turn(decode, sid, [8] * 8))).session
        assert (await own.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))).deleted
        assert await service.history.read(TENANT, sid, rec4.history_generation, 8) is None
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def test_session_expires_then_leaves_etcd(stub, etcd):
    # KV TTL just above the margin: the handle expires ~2 s after the turn, the record soon after.
    w = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
        worker=decode_worker(uid("d"), kv_blocks_ttl_s=MARGIN_S + 4), lease_ttl_s=60))).worker
    try:
        sid = uid("s")
        req = turn(w, sid, list(range(20)))
        req.finished_at.FromNanoseconds(int((time.time() - 2) * 1e9))
        rec = (await stub.RecordTurn(req)).session
        got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
        assert got.expires_in_s <= 2.01

        await asyncio.sleep(max(0.0, got.expires_in_s) + 0.2)
        # Expired. The record stays a moment longer (lease grace; readers then see a negative expiry) but a
        # claim is refused either way. (On a loaded machine the lease may already have ended.)
        try:
            got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
            assert got.expires_in_s < 0
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
        claim = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                         revision=rec.revision))
        assert not claim.claimed and claim.reason.startswith(("expired", "missing")), claim.reason

        async def gone() -> bool:
            return not await session_exists(stub, sid)

        await until(gone, LEASE_GRACE_S + 20, "the session record to leave with its lease", interval_s=0.2)
        async with EtcdStore(etcd) as store:  # and it is really gone from etcd
            assert await store.sessions.get(TENANT, sid) is None

        # A turn that finished longer ago than the TTL is refused outright.
        old = turn(w, uid("s"), list(range(20)))
        old.finished_at.FromSeconds(int(time.time()) - 60)
        await expect_status(stub.RecordTurn(old), grpc.StatusCode.FAILED_PRECONDITION, "already expired")
    finally:
        await deregister(stub, w)


async def test_claim_race_has_exactly_one_winner(registry, stub, decode):
    channels = [client_channel(registry), client_channel(registry)]
    clients = [registry_pb2_grpc.SessionRegistryStub(c) for c in channels]
    sid = uid("s")
    try:
        tokens = list(range(30))
        for i in range(30):
            tokens = tokens + [i]
            rec = (await stub.RecordTurn(turn(decode, sid, tokens))).session
            req = registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT, revision=rec.revision)
            a, b = await asyncio.gather(clients[0].ClaimSession(req), clients[1].ClaimSession(req))
            assert [a.claimed, b.claimed].count(True) == 1, (a, b)
            win, lose = (a, b) if a.claimed else (b, a)
            assert win.session.kv_transfer_params_json == rec.kv_transfer_params_json and win.session.claimed
            assert lose.reason.startswith("already claimed"), lose.reason
            assert not lose.session.kv_transfer_params_json

        got = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT))
        assert got.session.claimed and not got.session.kv_transfer_params_json
        assert got.session.revision == win.session.revision and not got.session.token_ids
        full = await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT,
                                                                    include_token_ids=True))
        assert list(full.session.token_ids) == tokens  # a claim leaves the history alone
        again = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                         revision=got.session.revision))
        assert not again.claimed and again.reason == "already claimed"
    finally:
        for c in channels:
            await c.close()
        await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_claims_stay_exact_across_registry_replicas(etcd, stub, decode):
    """Each registry remembers the records it wrote or read to skip a read when claiming; a record another replica
    changed or claimed meanwhile must still be caught by the claim's revision check."""
    other = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd))
    channel = client_channel(other.address)
    replica = registry_pb2_grpc.SessionRegistryStub(channel)
    sid = uid("s")
    try:
        first = (await stub.RecordTurn(turn(decode, sid, list(range(40))))).session  # this replica remembers it
        second = (await replica.RecordTurn(turn(decode, sid, list(range(41))))).session  # the other changes it
        stale = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                         revision=first.revision))
        assert not stale.claimed and stale.reason.startswith("changed"), stale.reason
        won = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                       revision=second.revision))
        assert won.claimed and won.session.kv_transfer_params_json == second.kv_transfer_params_json
        assert won.session.covered_tokens == 40 and not won.session.token_ids
        assert won.session.prefix_digest == second.prefix_digest

        third = (await stub.RecordTurn(turn(decode, sid, list(range(42))))).session
        taken = await replica.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                            revision=third.revision))
        assert taken.claimed
        again = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                         revision=third.revision))
        assert not again.claimed and not again.session.kv_transfer_params_json, again
    finally:
        await channel.close()
        await other.stop(grace=0.5)
        await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_claim_refusals(stub, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(12))))).session
    stale = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                     revision=rec.revision - 1))
    assert not stale.claimed and stale.reason.startswith("changed"), stale.reason
    missing = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=uid("s"), tenant=TENANT,
                                                                       revision=rec.revision))
    assert not missing.claimed and missing.reason == "missing"
    ok = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                  revision=rec.revision))
    assert ok.claimed and ok.reason == ""
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_delete_session(stub, decode):
    sid = uid("s")
    await stub.RecordTurn(turn(decode, sid, list(range(8))))
    resp = await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))
    assert resp.deleted
    await expect_status(stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT)),
                        grpc.StatusCode.NOT_FOUND)
    resp = await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))
    assert not resp.deleted


# -- bad input ---------------------------------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


async def test_bad_worker_requests(stub):
    R = registry_pb2
    cases = [
        (stub.RegisterWorker(R.RegisterWorkerRequest()), INVALID, "worker.worker_id is required"),
        (stub.RegisterWorker(R.RegisterWorkerRequest(worker=decode_worker("a/b"))), INVALID, "characters"),
        (stub.RegisterWorker(R.RegisterWorkerRequest(
            worker=decode_worker("x", role=common_pb2.WORKER_ROLE_UNSPECIFIED))), INVALID, "role"),
        (stub.RegisterWorker(R.RegisterWorkerRequest(worker=decode_worker("x", kv_blocks_ttl_s=0))),
         INVALID, "kv_blocks_ttl_s"),
        (stub.RegisterWorker(R.RegisterWorkerRequest(worker=decode_worker("x", block_size=0))),
         INVALID, "block_size"),
        (stub.RegisterWorker(R.RegisterWorkerRequest(worker=decode_worker("x"), lease_ttl_s=-1)),
         INVALID, "lease_ttl_s"),
        (stub.KeepAlive(R.KeepAliveRequest(worker_id="x")), INVALID, "lease_id is required"),
        (stub.KeepAlive(R.KeepAliveRequest(worker_id="x", lease_id=123456789)), grpc.StatusCode.NOT_FOUND,
         "register again"),
        (stub.DeregisterWorker(R.DeregisterWorkerRequest()), INVALID, "worker_id is required"),
        (stub.DeregisterWorker(R.DeregisterWorkerRequest(worker_id=uid("none"))), grpc.StatusCode.NOT_FOUND,
         "not registered"),
        (stub.ListWorkers(R.ListWorkersRequest(role=7)), INVALID, "unknown role"),
    ]
    for call, code, words in cases:
        await expect_status(call, code, words)


async def test_bad_session_requests(stub, decode):
    R = registry_pb2
    p = (await stub.RegisterWorker(R.RegisterWorkerRequest(worker=prefill_worker(uid("p")), lease_ttl_s=60))).worker
    try:
        tokens = list(range(10))
        good = turn(decode, uid("s"), tokens)
        bad_json = turn(decode, uid("s"), tokens)
        bad_json.kv_transfer_params_json = "{not json"
        too_many = turn(decode, uid("s"), tokens)
        too_many.kv_transfer_params_json = handle(decode, 11)
        short = turn(decode, uid("s"), tokens)
        short.kv_transfer_params_json = handle(decode, 9, blocks=2)
        cases = [
            (stub.GetSession(R.GetSessionRequest(session_id=uid("s"))), grpc.StatusCode.NOT_FOUND,
                 "tenant 'default'"),  # no tenant: the default one
                (stub.GetSession(R.GetSessionRequest(session_id="s1", tenant="a/b")), INVALID, "characters"),
            (stub.GetSession(R.GetSessionRequest(session_id="x" * 257, tenant=TENANT)), INVALID, "at most 256"),
            (stub.GetSession(R.GetSessionRequest(session_id="a b", tenant=TENANT)), INVALID, "characters"),
            (stub.GetSession(R.GetSessionRequest(session_id=uid("s"), tenant=TENANT)), grpc.StatusCode.NOT_FOUND,
             "no session"),
            (stub.RecordTurn(bad_json), INVALID, "not a JSON object"),
            (stub.RecordTurn(too_many), INVALID, "covers 11 tokens"),
            (stub.RecordTurn(short), INVALID, "blocks"),
            (stub.RecordTurn(R.RecordTurnRequest(session_id=good.session_id, tenant=TENANT,
                                                 decode_worker_id=decode.worker_id,
                                                 kv_transfer_params_json=good.kv_transfer_params_json)),
             INVALID, "token_ids is required"),
            (stub.RecordTurn(turn(decode_worker(uid("ghost")), uid("s"), tokens)), PRECONDITION, "not registered"),
            (stub.ClaimSession(R.ClaimSessionRequest(session_id="s", tenant=TENANT)), INVALID, "revision"),
            (stub.DeleteSession(R.DeleteSessionRequest(session_id="", tenant=TENANT)), INVALID, "session_id"),
        ]
        for call, code, words in cases:
            await expect_status(call, code, words)
        as_prefill = turn(decode, uid("s"), tokens)
        as_prefill.decode_worker_id = p.worker_id
        as_prefill.kv_transfer_params_json = handle(p, 9)
        await expect_status(stub.RecordTurn(as_prefill), PRECONDITION, "not a decode worker")
    finally:
        await deregister(stub, p)


# -- etcd down / reconnects --------------------------------------------------------------------------------------


async def test_unreachable_etcd_answers_unavailable():
    cfg = RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=f"127.0.0.1:{free_port()}", etcd_timeout_s=0.5)
    service = await serve(cfg)
    channel = client_channel(service.address)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    try:
        await expect_status(stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=10),
                            grpc.StatusCode.UNAVAILABLE, "unavailable")
        await expect_status(stub.GetSession(registry_pb2.GetSessionRequest(session_id="s", tenant="t"), timeout=10),
                            grpc.StatusCode.UNAVAILABLE)
        w = decode_worker("d")
        await expect_status(stub.RecordTurn(turn(w, "s", list(range(9))), timeout=10), grpc.StatusCode.UNAVAILABLE)
        await expect_status(stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w), timeout=10),
                            grpc.StatusCode.UNAVAILABLE)
        call = stub.WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=10)
        await expect_status(call.read(), grpc.StatusCode.UNAVAILABLE)
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def test_store_watch_resends_snapshot_after_etcd_restart():
    etcd = EtcdProcess("restart")
    endpoints = await etcd.astart()
    try:
        async with EtcdStore(endpoints, "/watch-test/", timeout_s=2.0) as store:
            lease, _ = await store.leases.grant(60)
            await store.workers.put(decode_worker("w1", lease_id=lease))
            events = store.workers.watch()
            first = await asyncio.wait_for(anext(events), 20)
            assert first.kind == "snapshot" and [w.worker_id for w in first.workers] == ["w1"]
            # The stream opens on this read, from the snapshot's revision on: the put below is delivered whether it
            # lands before or after the stream is open.
            pending = asyncio.ensure_future(anext(events))
            await store.workers.put(decode_worker("w2", lease_id=lease))
            put = await asyncio.wait_for(pending, 10)
            assert put.kind == "put" and put.workers[0].worker_id == "w2"

            etcd.kill()  # the stream breaks; the data dir survives
            await etcd.astart()
            event = await asyncio.wait_for(anext(events), 30)
            while event.kind != "snapshot":
                event = await asyncio.wait_for(anext(events), 30)
            # A fresh full snapshot after the reconnect.
            assert {w.worker_id for w in event.workers} == {"w1", "w2"}
            await events.aclose()
    finally:
        await etcd.astop()


async def test_store_fails_over_when_the_leader_dies():
    cluster = EtcdCluster(3)
    endpoints = await cluster.astart()
    try:
        async with EtcdStore(endpoints, "/failover-test/", timeout_s=10.0) as store:
            lease, _ = await store.leases.grant(30)
            await store.workers.put(decode_worker("w1", lease_id=lease))
            leader = await asyncio.to_thread(cluster.leader)
            assert leader is not None
            cluster.kill(leader)
            # Writes, reads and keep-alives go through the two survivors once they elect a new leader.
            await store.workers.put(decode_worker("w2", lease_id=lease))
            assert {w.worker_id for w in await store.workers.live()} == {"w1", "w2"}
            assert await store.leases.keep_alive_once(lease) is not None
            await cluster.arestart(leader)
            assert await store.workers.get("w2") is not None
    finally:
        await cluster.astop()


async def test_find_session_by_content(stub, decode):
    """Turns without a session id: a record is indexed under its text's content key; FindSession returns the record
    whose text the caller's prompt extends (the longest of the given prefixes), per tenant, and only the latest
    text of a session (its earlier texts' entries go with the replaced records' leases)."""
    from kvshuttle.control_plane.continuation import prefix_keys

    sid, end = uid("found"), "<|im_end|>"
    first = f"<|im_start|>user\nhi{end}\n<|im_start|>assistant\nhello{end}"
    await stub.RecordTurn(turn(decode, sid, list(range(1, 12)), text=first, text_key=text_key(first)))
    prompt = first + f"\n<|im_start|>user\nmore{end}\n<|im_start|>assistant\n"
    keys = prefix_keys(prompt, [end])
    found = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys))
    assert found.session.session_id == sid and found.expires_in_s > 0
    assert (found.session.text_chars, found.session.text_key) == (len(first), text_key(first))
    assert not found.session.token_ids and not found.history_missing
    with_ids = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys,
                                                                      include_token_ids=True))
    assert list(with_ids.session.token_ids) == list(range(1, 12)) and not with_ids.history_missing
    assert keys[found.matched_key] == text_key(first)
    await expect_status(stub.FindSession(registry_pb2.FindSessionRequest(tenant="other", text_keys=keys)),
                        grpc.StatusCode.NOT_FOUND, "no session")

    second = prompt + f"fine{end}"
    await stub.RecordTurn(turn(decode, sid, list(range(1, 20)), text=second, text_key=text_key(second)))
    # The old text no longer finds the session (its record was replaced); the new one does.
    await until(lambda: _not_found(stub, [text_key(first)]), 10, "the replaced record's index entry to go")
    newer = await stub.FindSession(registry_pb2.FindSessionRequest(
        tenant=TENANT, text_keys=prefix_keys(second + "\n<|im_start|>user\nx", [end])))
    assert newer.session.session_id == sid and newer.session.turn == 2

    for bad, words in [([], "text_keys is required"), ([b"short"], "must be 32 bytes"),
                       ([text_key(str(i)) for i in range(65)], "at most 64")]:
        await expect_status(stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=bad)),
                            grpc.StatusCode.INVALID_ARGUMENT, words)
    await expect_status(stub.RecordTurn(turn(decode, sid, list(range(1, 20)), text=second, text_key=b"x")),
                        grpc.StatusCode.INVALID_ARGUMENT, "text_key must be 32 bytes")

    # What a lookup costs: 64 candidate keys (the most a prompt sends), one of them indexed.
    long_prompt = "".join(f"<|im_start|>user\nturn {i}{end}\n<|im_start|>assistant\nanswer {i}{end}\n"
                          for i in range(40)) + "<|im_start|>assistant\n"
    recorded = long_prompt[:long_prompt.rindex(end) + len(end)]
    await stub.RecordTurn(turn(decode, uid("long"), list(range(1, 30)), text=recorded, text_key=text_key(recorded)))
    many = prefix_keys(long_prompt, [end])
    assert len(many) == 64
    took = []
    for _ in range(50):
        t = time.perf_counter()
        hit = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=many))
        took.append((time.perf_counter() - t) * 1000)
        assert hit.session.text_key == text_key(recorded)
    took.sort()
    print(f"\nFindSession, 64 keys, real etcd: p50 {took[25]:.2f} ms, p90 {took[45]:.2f} ms")
    # ... and when the match is a record's text boundary (its last answer re-rendered differently): the same one
    # transaction of at most 64 keys, then one read
    answer_cut = long_prompt.rindex("answer 39")
    bounded = long_prompt[:answer_cut - len("<|im_start|>assistant\n") - 1]
    other = recorded[:answer_cut] + "<think>why</think>answer 39" + end
    await stub.RecordTurn(turn(decode, uid("bound"), list(range(1, 30)), text=other, text_key=text_key(other),
                               text_boundaries=[common_pb2.TextBoundary(key=text_key(bounded), chars=len(bounded),
                                                                        tokens=20, loop_start=True)]))
    took = []
    for _ in range(50):
        t = time.perf_counter()
        hit = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=many[1:]))
        took.append((time.perf_counter() - t) * 1000)
        assert [b.key for b in hit.session.text_boundaries] == [text_key(bounded)], hit.session.session_id
    took.sort()
    print(f"FindSession, 63 keys, a boundary matched: p50 {took[25]:.2f} ms, p90 {took[45]:.2f} ms")


async def test_a_session_is_its_models_own(stub):
    """Session.model (issue #37): a record is found only by turns of its model (the same text sent to another model,
    or to an adapter of the same base, finds nothing); its ids are continued only for that model; a decode worker
    records only turns of a model it serves (its base model or one of its adapters)."""
    from kvshuttle.control_plane.continuation import prefix_keys

    w = decode_worker(uid("dm"), model="base", adapters=[common_pb2.LoraAdapter(name="base-sql", id=1, path="/a")])
    w = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=60))).worker
    try:
        end = "<|im_end|>"
        text = f"<|im_start|>user\nhi{end}\n<|im_start|>assistant\nhello{end}"
        keys = prefix_keys(text + f"\n<|im_start|>user\nmore{end}", [end])
        sids = {}
        for model in ("base", "base-sql"):
            sids[model] = uid("model")
            got = await stub.RecordTurn(turn(w, sids[model], list(range(1, 12)), text=text, text_key=text_key(text),
                                             model=model))
            assert got.session.model == model
        for model in ("base", "base-sql"):
            found = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys, model=model))
            assert (found.session.session_id, found.session.model) == (sids[model], model)
        for other in ("", "other", "base-other"):
            await expect_status(stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys,
                                                                                 model=other)),
                                grpc.StatusCode.NOT_FOUND, "no session")
        # the adapter's ids are not continued for the base model
        later = turn(w, sids["base-sql"], [12, 13], covered=12, text=text + "x", model="base", base_tokens=11,
                     base_turn=1, prefix_digest=prefix_digest(list(range(1, 14)), 12))
        await expect_status(stub.RecordTurn(later), grpc.StatusCode.FAILED_PRECONDITION, "model 'base-sql'")
        later.model = "base-sql"
        assert (await stub.RecordTurn(later)).session.turn == 2
        await expect_status(stub.RecordTurn(turn(w, uid("model"), [1, 2, 3], model="tiny")),
                            grpc.StatusCode.FAILED_PRECONDITION, "serves ['base', 'base-sql'], not model 'tiny'")
        await expect_status(stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys,
                                                                             model="x\ny")),
                            grpc.StatusCode.INVALID_ARGUMENT, "control characters")
    finally:
        await deregister(stub, w)


async def test_find_session_by_a_text_boundary(stub, decode):
    """A record is also indexed under its text boundaries: a prompt that re-renders the last answer differently
    (its reasoning dropped) still finds it, and learns which boundary matched; a later record of the session
    replaces the boundaries' entries with its own; the index stays at most 1 + MAX_TEXT_BOUNDARIES keys a record."""
    from kvshuttle.control_plane.continuation import prefix_keys

    sid, end = uid("bound"), "<|im_end|>"
    head = f"<|im_start|>user\nhi{end}"
    first = f"{head}\n<|im_start|>assistant\n<think>why</think>hello{end}"
    boundary = common_pb2.TextBoundary(key=text_key(head), chars=len(head), tokens=5, loop_start=True)
    await stub.RecordTurn(turn(decode, sid, list(range(1, 12)), text=first, text_key=text_key(first),
                               text_boundaries=[boundary]))
    dropped = f"{head}\n<|im_start|>assistant\nhello{end}\n<|im_start|>user\nmore{end}\n<|im_start|>assistant\n"
    keys = prefix_keys(dropped, [end])
    found = await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys,
                                                                   include_token_ids=True))
    assert found.session.session_id == sid and keys[found.matched_key] == boundary.key
    assert list(found.session.text_boundaries) == [boundary] and list(found.session.token_ids) == list(range(1, 12))
    await expect_status(stub.FindSession(registry_pb2.FindSessionRequest(tenant="other", text_keys=keys)),
                        grpc.StatusCode.NOT_FOUND)
    # the session's next record keeps other boundaries: the old one no longer finds it
    second = dropped + f"fine{end}"
    cut = dropped[:dropped.rindex(end) + len(end)]
    await stub.RecordTurn(turn(decode, sid, list(range(1, 30)), text=second, text_key=text_key(second),
                               text_boundaries=[common_pb2.TextBoundary(key=text_key(cut), chars=len(cut), tokens=20,
                                                                        loop_start=True)]))
    await until(lambda: _not_found(stub, [boundary.key]), 10, "the replaced record's boundary entry to go")
    again = await stub.FindSession(registry_pb2.FindSessionRequest(
        tenant=TENANT, text_keys=prefix_keys(cut + "\n<|im_start|>assistant\nfine!", [end])))
    assert again.session.session_id == sid and again.session.turn == 2
    await expect_status(stub.RecordTurn(turn(decode, sid, list(range(1, 30)), text=second, text_key=text_key(second),
                                             text_boundaries=[common_pb2.TextBoundary(key=text_key(cut), chars=3,
                                                                                      tokens=2)])),
                        grpc.StatusCode.INVALID_ARGUMENT, "is not the key of the text's first 3 characters")


async def _not_found(stub, keys) -> bool:
    try:
        await stub.FindSession(registry_pb2.FindSessionRequest(tenant=TENANT, text_keys=keys))
    except grpc.aio.AioRpcError as exc:
        return exc.code() == grpc.StatusCode.NOT_FOUND
    return False


async def test_stored_responses(stub):
    """The Responses API's stored responses: put under a lease, read back per tenant, deleted, refused when bad."""
    rid = uid("resp")
    body = json.dumps({"response": {"id": rid}, "items": []}).encode()
    put = await stub.PutResponse(registry_pb2.PutResponseRequest(response=registry_pb2.StoredResponse(
        response_id=rid, tenant=TENANT, session_id="s-1", body_json=body), ttl_s=600))
    assert put.response.expires_at.seconds >= int(time.time()) + 590 and put.response.created_at.seconds > 0
    got = (await stub.GetResponse(registry_pb2.GetResponseRequest(response_id=rid, tenant=TENANT))).response
    assert got.body_json == body and got.session_id == "s-1"
    await expect_status(stub.GetResponse(registry_pb2.GetResponseRequest(response_id=rid, tenant="other")),
                        grpc.StatusCode.NOT_FOUND, "no stored response")
    assert (await stub.DeleteResponse(registry_pb2.DeleteResponseRequest(response_id=rid, tenant=TENANT))).deleted
    assert not (await stub.DeleteResponse(registry_pb2.DeleteResponseRequest(response_id=rid, tenant=TENANT))).deleted
    await expect_status(stub.GetResponse(registry_pb2.GetResponseRequest(response_id=rid, tenant=TENANT)),
                        grpc.StatusCode.NOT_FOUND, "unknown, expired or deleted")
    for kwargs, words in [({"ttl_s": 0}, "ttl_s must be between"), ({"ttl_s": 600, "body": b""}, "body_json"),
                          ({"ttl_s": 600, "rid": "bad id"}, "response_id")]:
        bad = registry_pb2.StoredResponse(response_id=kwargs.get("rid", rid), tenant=TENANT, session_id="s",
                                          body_json=kwargs.get("body", body))
        await expect_status(stub.PutResponse(registry_pb2.PutResponseRequest(response=bad, ttl_s=kwargs["ttl_s"])),
                            grpc.StatusCode.INVALID_ARGUMENT, words)
