import json

import pytest
from kvshuttle.control_plane import session as rules
from kvshuttle.control_plane.prefix import block_hash_chain, matched_prefix_tokens, prefix_digest
from kvshuttle.v1 import common_pb2, registry_pb2

NOW = 1_800_000_000.0


def decode_worker(**kw) -> common_pb2.Worker:
    fields = dict(worker_id="d1", role=common_pb2.WORKER_ROLE_DECODE, engine_id="d-engine",
                  grpc_address="127.0.0.1:9000", block_size=4, kv_blocks_ttl_s=480)
    fields.update(kw)
    return common_pb2.Worker(**fields)


def handle(num_tokens=9, blocks=(1, 2, 3), engine="d-engine") -> str:
    return json.dumps({"do_remote_decode": True, "remote_block_ids": [list(blocks)], "remote_engine_id": engine,
                       "remote_host": "127.0.0.1", "remote_port": 5700, "remote_num_tokens": num_tokens})


def turn(**kw) -> registry_pb2.RecordTurnRequest:
    fields = dict(session_id="s1", tenant="default", decode_worker_id="d1", kv_transfer_params_json=handle(),
                  token_ids=list(range(100, 110)), text="hello")
    fields.update(kw)
    return registry_pb2.RecordTurnRequest(**fields)


@pytest.mark.parametrize("value", ["a", "conv-1", "Tenant_A.b:c@d=e+f", "x" * 256, "0123"])
def test_validate_id_accepts(value):
    assert rules.validate_id("session_id", value) == value


@pytest.mark.parametrize("value, words", [
    ("", "required"), ("x" * 257, "at most 256"), ("a/b", "characters"), ("a b", "characters"),
    ("ü", "characters"), ("a\n", "characters"),
])
def test_validate_id_rejects(value, words):
    with pytest.raises(rules.InvalidArgument, match=words):
        rules.validate_id("session_id", value)


def test_validate_worker():
    rules.validate_worker(decode_worker())
    rules.validate_worker(decode_worker(role=common_pb2.WORKER_ROLE_PREFILL, kv_blocks_ttl_s=0))
    for bad in (decode_worker(worker_id=""), decode_worker(role=common_pb2.WORKER_ROLE_UNSPECIFIED),
                decode_worker(grpc_address=""), decode_worker(block_size=0), decode_worker(kv_blocks_ttl_s=0),
                decode_worker(nixl_port=70000)):
        with pytest.raises(rules.InvalidArgument):
            rules.validate_worker(bad)


def test_worker_lease_ttl():
    assert rules.worker_lease_ttl(0, 10) == 10
    assert rules.worker_lease_ttl(3, 10) == 3
    with pytest.raises(rules.InvalidArgument):
        rules.worker_lease_ttl(-1, 10)


def test_build_session_covers_handle_tokens():
    plan = rules.build_session(turn(), decode_worker(), now=NOW, margin_s=30)
    s = plan.session
    assert (s.session_id, s.tenant, s.decode_worker_id, s.text) == ("s1", "default", "d1", "hello")
    assert s.covered_tokens == 9 and s.block_size == 4 and list(s.token_ids) == list(range(100, 110))
    assert list(s.block_hashes) == block_hash_chain(list(range(100, 110)), 9, 4)
    assert len(s.block_hashes) == 3  # 4 + 4 + 1 (partial last block)
    assert matched_prefix_tokens(list(s.block_hashes), 9, 4, list(range(100, 120))) == 9
    assert s.prefix_digest == prefix_digest(list(range(100, 110)), 9) and len(s.prefix_digest) == 16
    assert matched_prefix_tokens(list(s.block_hashes), 9, 4, list(range(100, 120)), s.prefix_digest) == 9
    assert s.turn == 1 and not s.claimed and s.revision == 0
    assert rules.expires_in(s, NOW) == pytest.approx(450, abs=1e-6)
    assert plan.lease_ttl_s == 450 + rules.LEASE_GRACE_S


def test_build_session_counts_turns_and_uses_finished_at():
    previous = common_pb2.Session(turn=4)
    req = turn()
    req.finished_at.FromSeconds(int(NOW - 100))
    plan = rules.build_session(req, decode_worker(), now=NOW, margin_s=30, previous=previous)
    assert plan.session.turn == 5
    assert rules.expires_in(plan.session, NOW) == pytest.approx(350)
    assert plan.lease_ttl_s == 350 + rules.LEASE_GRACE_S


def test_future_finished_at_counts_as_now():
    req = turn()
    req.finished_at.FromSeconds(int(NOW + 1000))
    plan = rules.build_session(req, decode_worker(), now=NOW, margin_s=30)
    assert rules.expires_in(plan.session, NOW) == pytest.approx(450)


def test_build_session_rejects_handle_beyond_tokens():
    with pytest.raises(rules.InvalidArgument, match="covers 11 tokens.*only 10 token_ids"):
        rules.build_session(turn(kv_transfer_params_json=handle(num_tokens=11)), decode_worker(), now=NOW,
                            margin_s=30)


@pytest.mark.parametrize("req, words", [
    (turn(session_id=""), "session_id is required"),
    (turn(tenant="a/b"), "tenant"),
    (turn(token_ids=[]), "token_ids is required"),
    (turn(token_ids=[1, -2, 3]), "negative"),
    (turn(kv_transfer_params_json=""), "kv_transfer_params_json is required"),
    (turn(kv_transfer_params_json="{nope"), "not a JSON object"),
    (turn(kv_transfer_params_json=json.dumps({"do_remote_decode": False})), "not a decode-side handle"),
    (turn(kv_transfer_params_json=handle(engine="other")), "remote_engine_id 'other'"),
    (turn(kv_transfer_params_json=handle(blocks=(1, 2))), "holds 2 blocks.*need 3"),
])
def test_build_session_invalid(req, words):
    with pytest.raises(rules.InvalidArgument, match=words):
        rules.build_session(req, decode_worker(), now=NOW, margin_s=30)


@pytest.mark.parametrize("worker, words", [
    (None, "not registered"),
    (decode_worker(role=common_pb2.WORKER_ROLE_PREFILL), "not a decode worker"),
])
def test_build_session_needs_registered_decode_worker(worker, words):
    with pytest.raises(rules.FailedPrecondition, match=words):
        rules.build_session(turn(), worker, now=NOW, margin_s=30)


def test_build_session_refuses_expired_handle():
    req = turn()
    req.finished_at.FromSeconds(int(NOW - 460))
    with pytest.raises(rules.FailedPrecondition, match="already expired"):
        rules.build_session(req, decode_worker(), now=NOW, margin_s=30)
    with pytest.raises(rules.FailedPrecondition, match="already expired"):
        rules.build_session(turn(), decode_worker(kv_blocks_ttl_s=20), now=NOW, margin_s=30)


def test_build_session_refuses_oversized_record():
    big = turn(text="x" * (rules.MAX_RECORD_BYTES + 1))
    with pytest.raises(rules.InvalidArgument, match="bytes"):
        rules.build_session(big, decode_worker(), now=NOW, margin_s=30)


def test_engine_id_not_checked_when_worker_has_none():
    plan = rules.build_session(turn(kv_transfer_params_json=handle(engine="x")), decode_worker(engine_id=""),
                               now=NOW, margin_s=30)
    assert plan.session.covered_tokens == 9


def test_lease_ttl_for():
    assert rules.lease_ttl_for(NOW + 0.2, NOW) == 1 + rules.LEASE_GRACE_S
    assert rules.lease_ttl_for(NOW + 10.5, NOW) == 11 + rules.LEASE_GRACE_S
    assert rules.lease_ttl_for(NOW - 5, NOW) == 1 + rules.LEASE_GRACE_S


def stored(revision=7, **kw) -> common_pb2.Session:
    s = rules.build_session(turn(), decode_worker(), now=NOW, margin_s=30).session
    s.revision = revision
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_claim_refusal_allows_fresh_record():
    assert rules.claim_refusal(stored(), 7, NOW + 10) is None


@pytest.mark.parametrize("session, revision, now, reason", [
    (None, 7, NOW, "missing"),
    (stored(claimed=True), 7, NOW, "already claimed"),
    (stored(), 6, NOW, "changed: the record is at revision 7, not 6"),
    (stored(kv_transfer_params_json=""), 7, NOW, "no handle"),
    (stored(), 7, NOW + 450, "expired"),
    (stored(), 7, NOW + 500, "expired 50.0s ago"),
])
def test_claim_refusals(session, revision, now, reason):
    assert rules.claim_refusal(session, revision, now).startswith(reason)



def test_a_session_remembers_when_it_began():
    first = rules.build_session(turn(), decode_worker(), now=NOW, margin_s=30).session
    assert rules.to_seconds(first.created_at) == NOW
    later = rules.build_session(turn(), decode_worker(), now=NOW + 50, margin_s=30, previous=first).session
    assert rules.to_seconds(later.created_at) == NOW and later.turn == 2
    assert rules.to_seconds(later.updated_at) == NOW + 50


def test_which_handles_can_be_freed():
    s = rules.build_session(turn(), decode_worker(), now=NOW, margin_s=30).session  # 9 tokens, blocks of 4
    assert rules.freeable(s, 10, NOW)
    assert not rules.freeable(s, 4, NOW)  # the read needs the block's tokens and one more
    assert not rules.freeable(s, 10, NOW + 445)  # within 10 s of its expiry: left to expire
    short = rules.build_session(turn(kv_transfer_params_json=handle(num_tokens=3, blocks=(1,))), decode_worker(),
                                now=NOW, margin_s=30).session
    assert short.covered_tokens == 3 and rules.freeable(short, 4, NOW)  # less than a block: all of it is read
    claimed = common_pb2.Session()
    claimed.CopyFrom(s)
    claimed.claimed = True
    assert not rules.freeable(claimed, 10, NOW)
    for bad in ("bored", "IDLE"):
        with pytest.raises(rules.InvalidArgument, match="free_reason"):
            rules.validate_free_reason(bad)
    rules.validate_free_reason("")
    rules.validate_free_reason("pressure")
