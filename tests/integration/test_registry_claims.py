"""Claims as their own small etcd key next to the session record, against a real etcd.

A claim is one transaction: the record is still at the planned revision (and lease) and has no claim key, then the
claim key is created under the record's lease and the record is read back. RecordTurn replaces the record and drops
its claim in one transaction; GetSession reports the claim.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from kvshuttle.control_plane import session as rules
from kvshuttle.control_plane.session import LEASE_GRACE_S
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.v1 import common_pb2, registry_pb2

from tests.support.registry import MARGIN_S, TENANT, decode_worker, deregister, turn, uid
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def store(etcd):
    async with EtcdStore(etcd) as s:  # the registry fixture's key prefix (the default)
        yield s


def snapshot(record: common_pb2.Session) -> common_pb2.Session:
    """What a gateway sends the scheduler: the record without its history."""
    out = common_pb2.Session()
    out.CopyFrom(record)
    out.ClearField("token_ids")
    return out


async def get(stub, sid: str, include_token_ids: bool = False) -> registry_pb2.GetSessionResponse:
    return await stub.GetSession(registry_pb2.GetSessionRequest(session_id=sid, tenant=TENANT,
                                                                include_token_ids=include_token_ids))


async def test_records_carry_lease_and_digest_and_the_claim_is_its_own_key(stub, store, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(50))))).session
    assert rec.lease_id > 0 and len(rec.prefix_digest) == 16 and not rec.claimed
    got = (await get(stub, sid)).session
    assert got == rec
    raw = await store.kv.get(store.sessions.key(TENANT, sid))
    value = raw.kvs[0].value
    won = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=snapshot(rec))
    assert won.claimed and won.session.claimed and won.session.revision == rec.revision
    # The record is not rewritten: same value, same revision; the claim is a small key on the record's lease.
    after = await store.kv.get(store.sessions.key(TENANT, sid))
    assert after.kvs[0].value == value and after.kvs[0].mod_revision == rec.revision
    claim = (await store.kv.get(store.claims.key(TENANT, sid))).kvs[0]
    assert claim.lease == rec.lease_id and claim.value == str(rec.revision).encode() and len(claim.value) < 32
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))
    assert not (await store.kv.get(store.claims.key(TENANT, sid))).kvs  # deleted with the record


async def test_concurrent_claims_of_one_revision_have_exactly_one_winner(etcd, stub, decode):
    stores = [EtcdStore(etcd) for _ in range(4)]  # separate clients (channels), like scheduler replicas
    for s in stores:
        await s.connect()
    sid = uid("s")
    try:
        history = list(range(60))
        for i in range(10):
            history.append(i)
            rec = (await stub.RecordTurn(turn(decode, sid, history))).session
            known = snapshot(rec)
            results = await asyncio.gather(*(s.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=known)
                                             for s in stores for _ in range(4)))
            winners = [r for r in results if r.claimed]
            assert len(winners) == 1, [r.reason for r in results]
            assert winners[0].session.kv_transfer_params_json == rec.kv_transfer_params_json
            for r in results:
                if not r.claimed:
                    assert r.reason == rules.CLAIMED, r.reason
                    assert not r.session.kv_transfer_params_json  # a refusal never hands out the handle
    finally:
        for s in stores:
            await s.close()
        await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_a_claim_after_a_newer_record_turn_is_refused_as_changed(stub, store, decode):
    sid = uid("s")
    old = (await stub.RecordTurn(turn(decode, sid, list(range(40))))).session
    new = (await stub.RecordTurn(turn(decode, sid, list(range(41))))).session
    assert new.revision > old.revision and new.lease_id != old.lease_id
    for known in (snapshot(old), None):  # with the caller's (stale) copy, and without any
        stale = await store.claims.claim(TENANT, sid, old.revision, now=time.time(), known=known)
        assert not stale.claimed and stale.reason.startswith(rules.CHANGED), stale.reason
        assert stale.session.revision == new.revision and not stale.session.kv_transfer_params_json
    # The newer record is still there to claim.
    won = await store.claims.claim(TENANT, sid, new.revision, now=time.time(), known=snapshot(new))
    assert won.claimed and won.session.covered_tokens == 40
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_get_session_shows_the_claim_until_the_next_record_turn(stub, store, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(30))))).session
    won = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                   revision=rec.revision))
    assert won.claimed
    got = (await get(stub, sid, include_token_ids=True)).session
    assert got.claimed and not got.kv_transfer_params_json and got.revision == rec.revision
    assert list(got.token_ids) == list(range(30))  # the record itself (and its history) is untouched
    assert got.prefix_digest == rec.prefix_digest and got.history_tokens == 30
    direct = await store.sessions.get(TENANT, sid)
    assert direct.claimed and not direct.kv_transfer_params_json

    nxt = (await stub.RecordTurn(turn(decode, sid, list(range(31))))).session
    assert not nxt.claimed and nxt.turn == 2
    got = (await get(stub, sid)).session
    assert not got.claimed and got.kv_transfer_params_json == nxt.kv_transfer_params_json
    assert not (await store.kv.get(store.claims.key(TENANT, sid))).kvs  # dropped with the record it stood for
    again = await store.claims.claim(TENANT, sid, nxt.revision, now=time.time(), known=snapshot(nxt))
    assert again.claimed

    # The claim goes in the same transaction as the record it stood for, not only with that record's lease (here the
    # next record keeps the lease, so nothing is revoked).
    third = common_pb2.Session()
    third.CopyFrom(await store.sessions.get(TENANT, sid))
    third.kv_transfer_params_json = nxt.kv_transfer_params_json
    stored = await store.sessions.put(third, nxt.lease_id, expect_revision=nxt.revision)
    assert stored is not None and stored.lease_id == nxt.lease_id and not stored.claimed
    assert not (await store.kv.get(store.claims.key(TENANT, sid))).kvs
    assert not (await store.sessions.get(TENANT, sid)).claimed
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_the_claim_returns_the_stored_record_not_the_callers_copy(stub, store, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(30))))).session
    forged = snapshot(rec)
    forged.kv_transfer_params_json = forged.kv_transfer_params_json.replace("127.0.0.1", "10.9.9.9")
    forged.checkpoints.add(tokens=4, digest=b"x" * 16)
    forged.prefix_digest = b"y" * 16
    forged.covered_tokens = 5
    won = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=forged)
    assert won.claimed
    assert won.session.kv_transfer_params_json == rec.kv_transfer_params_json
    assert list(won.session.checkpoints) == list(rec.checkpoints) == []
    assert won.session.prefix_digest == rec.prefix_digest and won.session.covered_tokens == 29
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_a_wrong_or_missing_lease_hint_still_claims_once(stub, store, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(30))))).session
    wrong = snapshot(rec)
    wrong.lease_id = rec.lease_id + 12345  # no such lease
    won = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=wrong)
    assert won.claimed
    claim = (await store.kv.get(store.claims.key(TENANT, sid))).kvs[0]
    assert claim.lease == rec.lease_id  # on the record's own lease, not the hint's
    again = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=snapshot(rec))
    assert not again.claimed and again.reason == rules.CLAIMED

    # A store that never saw the record (another replica) and no hint: it reads the record first.
    rec2 = (await stub.RecordTurn(turn(decode, sid, list(range(31))))).session
    async with EtcdStore(store.endpoints) as fresh:
        won2 = await fresh.claims.claim(TENANT, sid, rec2.revision, now=time.time())
    assert won2.claimed and won2.session.kv_transfer_params_json == rec2.kv_transfer_params_json
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_an_expired_handle_is_refused_even_when_the_hint_says_otherwise(stub, store, decode):
    sid = uid("s")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(30))))).session
    now = rules.to_seconds(rec.expires_at) + 1  # the registry's clock, past the handle's expiry
    refused = await store.claims.claim(TENANT, sid, rec.revision, now=now, known=snapshot(rec))
    assert not refused.claimed and refused.reason.startswith(rules.EXPIRED), refused.reason
    lying = snapshot(rec)
    lying.expires_at.FromSeconds(int(now) + 600)
    refused = await store.claims.claim(TENANT, sid, rec.revision, now=now, known=lying)
    assert not refused.claimed and refused.reason.startswith(rules.EXPIRED), refused.reason
    assert not refused.session.kv_transfer_params_json
    await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=sid, tenant=TENANT))


async def test_the_claim_key_ends_with_the_session_lease(stub, store):
    # KV TTL just above the margin: the handle expires ~2 s after the turn, its lease LEASE_GRACE_S later.
    w = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
        worker=decode_worker(uid("d"), kv_blocks_ttl_s=MARGIN_S + 2), lease_ttl_s=60))).worker
    try:
        sid = uid("s")
        rec = (await stub.RecordTurn(turn(w, sid, list(range(20))))).session
        won = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=snapshot(rec))
        assert won.claimed
        ttl = await store.kv.get(store.claims.key(TENANT, sid))
        assert ttl.kvs and ttl.kvs[0].lease == rec.lease_id

        async def gone():
            record = await store.kv.get(store.sessions.key(TENANT, sid))
            claim = await store.kv.get(store.claims.key(TENANT, sid))
            return not record.kvs and not claim.kvs

        await until(gone, LEASE_GRACE_S + 20, "the claim to end with the session's lease", interval_s=0.2)
        assert await store.sessions.get(TENANT, sid) is None
    finally:
        await deregister(stub, w)


def test_no_other_session_key_falls_in_a_sessions_range():
    """get_session reads [record key, record key + '"'): its record and claim, nothing else (ids use A-Za-z0-9._:@=+-,
    all above '"')."""
    store = EtcdStore("127.0.0.1:1")
    key = store.sessions.key("t", "s")
    end = (key + '"').encode()
    inside = [key, store.claims.key("t", "s")]
    outside = [store.sessions.key("t", "s" + c) for c in "+-.0:=@AZ_az"] + [store.sessions.key("t", "r"),
                                                                          store.sessions.key("t.x", "s")]
    assert all(key.encode() <= k.encode() < end for k in inside)
    assert not any(key.encode() <= k.encode() < end for k in outside)


async def test_what_a_decode_worker_holds_reads_from_the_index_without_the_records(stub, store, decode):
    a, b, c = uid("held"), uid("held"), uid("held")
    history = list(range(41))
    recs = {}
    for sid in (a, b, c):
        recs[sid] = (await stub.RecordTurn(turn(decode, sid, history))).session
    second = (await stub.RecordTurn(turn(decode, a, [*history, 7, 8, 9, 10]))).session  # a's second turn
    held = {h.session_id: h for h in await store.claims.held_on_worker(decode.worker_id)}
    assert set(held) == {a, b, c}
    # A summary: sizes, times, turn count and the record's revision; never the ids, text or handle.
    assert held[a].revision == second.revision and held[a].turn == 2 and held[a].covered_tokens == 44
    assert held[a].created_at == recs[a].created_at and held[a].updated_at == second.updated_at
    assert held[b].revision == recs[b].revision and held[b].block_size == decode.block_size
    assert not held[b].token_ids and not held[b].head_token_ids and not held[b].text_key
    assert not held[b].prefix_digest and not held[b].kv_transfer_params_json
    raw = (await store.kv.get(store.keys.worker_session(decode.worker_id, TENANT, b))).kvs[0]
    assert len(raw.value) < 64 and raw.mod_revision == recs[b].revision
    # A claimed handle (a pull under way) is no longer held; the next turn's record is.
    assert (await store.claims.claim(TENANT, b, recs[b].revision, now=time.time())).claimed
    assert {h.session_id for h in await store.claims.held_on_worker(decode.worker_id)} == {a, c}
    await stub.RecordTurn(turn(decode, b, [*history, 1, 2, 3, 4]))
    assert {h.session_id for h in await store.claims.held_on_worker(decode.worker_id)} == {a, b, c}


async def test_a_claim_that_frees_the_kv_says_why_on_the_record(stub, store, decode):
    sid = uid("freed")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(50))))).session
    won = await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                   revision=rec.revision, free_reason="idle"))
    assert won.claimed and won.session.kv_freed == "idle" and won.session.kv_transfer_params_json
    got = (await get(stub, sid, include_token_ids=True)).session  # the record stays (its ids let the next turn
    # continue them exactly)
    assert got.claimed and got.kv_freed == "idle" and not got.kv_transfer_params_json and got.token_ids
    again = await store.claims.claim(TENANT, sid, rec.revision, now=time.time(), known=snapshot(rec))
    assert not again.claimed and again.session.kv_freed == "idle"  # a stale snapshot learns why
    assert sid not in {h.session_id for h in await store.claims.held_on_worker(decode.worker_id)}
    # The next turn's record is a fresh, unfreed one.
    nxt = (await stub.RecordTurn(turn(decode, sid, list(range(60))))).session
    assert not nxt.claimed and not nxt.kv_freed


async def test_a_free_reason_outside_the_vocabulary_is_refused(stub, decode):
    sid = uid("freed")
    rec = (await stub.RecordTurn(turn(decode, sid, list(range(50))))).session
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ClaimSession(registry_pb2.ClaimSessionRequest(session_id=sid, tenant=TENANT,
                                                                 revision=rec.revision, free_reason="bored"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "free_reason" in err.value.details()
    assert not (await get(stub, sid)).session.claimed


async def test_one_replica_leads_and_another_takes_over_when_its_lease_ends(etcd):
    name = uid("lead")
    first, second = EtcdStore(etcd), EtcdStore(etcd)
    for s in (first, second):
        await s.connect()
    try:
        assert await first.elections.campaign(name, "one", ttl_s=2)
        assert not await second.elections.campaign(name, "two", ttl_s=2)
        assert await first.elections.campaign(name, "one", ttl_s=2)  # it keeps leading while it campaigns
        # "one" stops campaigning (its process went away): its lease ends, "two" takes over.
        await until(lambda: second.elections.campaign(name, "two", ttl_s=2), 10, '"two" to take over', interval_s=0.5)
        assert not await first.elections.campaign(name, "one", ttl_s=2)
    finally:
        for s in (first, second):
            await s.close()
