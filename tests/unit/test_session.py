import json

import pytest
from kvshuttle.control_plane import session as rules
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.prefix import ids_bytes, matched_prefix_tokens, prefix_digest, prefix_digests
from kvshuttle.v1 import common_pb2, registry_pb2

NOW = 1_800_000_000.0


def decode_worker(**kw) -> common_pb2.Worker:
    fields = dict(worker_id="d1", role=common_pb2.WORKER_ROLE_DECODE, engine_id="d-engine",
                  grpc_address="127.0.0.1:9000", block_size=4, kv_blocks_ttl_s=480)
    fields.update(kw)
    return common_pb2.Worker(**fields)


def handle(num_tokens=9, blocks=(1, 2, 3), engine="d-engine", **extra) -> str:
    return json.dumps({"do_remote_decode": True, "remote_block_ids": [list(blocks)], "remote_engine_id": engine,
                       "remote_host": "127.0.0.1", "remote_port": 5700, "remote_num_tokens": num_tokens, **extra})


HISTORY = list(range(100, 110))


def _boundary(text: str, tokens: int, loop_start: bool = False) -> common_pb2.TextBoundary:
    return common_pb2.TextBoundary(key=text_key(text), chars=len(text), tokens=tokens, loop_start=loop_start)


def turn(**kw) -> registry_pb2.RecordTurnRequest:
    fields = dict(session_id="s1", tenant="default", decode_worker_id="d1", kv_transfer_params_json=handle(),
                  token_ids=HISTORY, text="hello", text_key=text_key("hello"))
    fields.update(kw)
    return registry_pb2.RecordTurnRequest(**fields)


@pytest.mark.parametrize("value", ["a", "conv-1", "Tenant_A.b:c@d=e+f", "x" * 256, "0123", ".x", "a..b", "x."])
def test_validate_id_accepts(value):
    assert rules.validate_id("session_id", value) == value


@pytest.mark.parametrize("value, words", [
    ("", "required"), ("x" * 257, "at most 256"), ("a/b", "characters"), ("a b", "characters"),
    ("ü", "characters"), ("a\n", "characters"), (".", "not an id"), ("..", "not an id"), ("...", "not an id"),
    ("../a", "characters"),
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
    assert (s.session_id, s.tenant, s.decode_worker_id) == ("s1", "default", "d1")
    assert s.covered_tokens == 9 and s.block_size == 4
    # The record keeps the ids' count, digests and first block (block_size + 1 ids), never the ids or the text.
    assert not s.token_ids and s.history_tokens == 10 and list(s.head_token_ids) == HISTORY[:5]
    assert (s.text_chars, s.text_key) == (5, text_key("hello"))
    assert s.prefix_digest == prefix_digest(HISTORY, 9) and len(s.prefix_digest) == 16
    assert not s.checkpoints  # nothing sent, nothing earlier to keep
    assert matched_prefix_tokens(9, 4, list(range(100, 120)), s.prefix_digest) == 9
    assert matched_prefix_tokens(9, 4, [1, *range(100, 120)], s.prefix_digest) == 0
    assert s.turn == 1 and not s.claimed and s.revision == 0
    assert rules.expires_in(s, NOW) == pytest.approx(450, abs=1e-6)
    assert plan.lease_ttl_s == 450 + rules.LEASE_GRACE_S
    # The ids go to the history store: the whole history, at 0, of a new lineage that replaces nothing.
    assert (plan.history_start, plan.history_ids) == (0, ids_bytes(HISTORY))
    assert s.history_generation == int(NOW * 1_000_000) and plan.replaces_generation == 0
    assert rules.build_session(turn(), decode_worker(), now=NOW, margin_s=30,
                               new_generation=42).session.history_generation == 42


def test_the_text_is_kept_as_its_length_and_key():
    plan = rules.build_session(turn(text="", text_chars=7, text_key=text_key("héllo w")), decode_worker(), now=NOW,
                               margin_s=30)
    assert (plan.session.text_chars, plan.session.text_key) == (7, text_key("héllo w"))
    plan = rules.build_session(turn(text="héllo", text_key=text_key("héllo")), decode_worker(), now=NOW, margin_s=30)
    assert plan.session.text_chars == 5  # characters, not UTF-8 bytes
    plan = rules.build_session(turn(text="", text_key=b""), decode_worker(), now=NOW, margin_s=30)
    assert (plan.session.text_chars, plan.session.text_key) == (0, b"")  # raw ids: not indexed
    plan = rules.build_session(turn(text_key=b""), decode_worker(), now=NOW, margin_s=30)
    assert (plan.session.text_chars, plan.session.text_key) == (5, text_key("hello"))  # the key of the text sent


def test_the_text_boundaries_are_kept_with_the_record():
    bounds = [_boundary("he", 2, loop_start=True), _boundary("hell", 7)]
    plan = rules.build_session(turn(text_boundaries=bounds), decode_worker(), now=NOW, margin_s=30)
    assert list(plan.session.text_boundaries) == bounds
    # without the text (only its key and length), the keys cannot be checked: they are kept as the caller's
    plan = rules.build_session(turn(text="", text_chars=5, text_boundaries=bounds), decode_worker(), now=NOW,
                               margin_s=30)
    assert list(plan.session.text_boundaries) == bounds


def test_the_callers_digests_are_kept():
    digests = prefix_digests(HISTORY, [3, 6, 9])
    req = turn(prefix_digest=digests[9], checkpoints=[common_pb2.PrefixCheckpoint(tokens=n, digest=digests[n])
                                                      for n in (3, 6)])
    s = rules.build_session(req, decode_worker(), now=NOW, margin_s=30).session
    assert s.prefix_digest == digests[9]
    assert [(cp.tokens, cp.digest) for cp in s.checkpoints] == [(3, digests[3]), (6, digests[6])]
    edited = [*HISTORY[:7], 1, 2, 3]
    cps = [(cp.tokens, cp.digest) for cp in s.checkpoints]
    assert matched_prefix_tokens(9, 4, edited, s.prefix_digest, cps) == 4  # checkpoint 6: one whole block


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
    with pytest.raises(rules.InvalidArgument, match="covers 11 tokens.*only 10 ids"):
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
    (turn(base_tokens=-1), "base_tokens must not be negative"),
    (turn(text_key=b"x" * 31), "text_key must be 32 bytes"),
    (turn(text="", text_chars=5, text_key=b""), "text_key is required with text_chars"),
    (turn(text_chars=-1), "text_chars must not be negative"),
    (turn(text_chars=4), "text_chars is 4 but text has 5"),
    (turn(prefix_digest=b"x" * 15), "prefix_digest must be 16 bytes"),
    (turn(checkpoints=[common_pb2.PrefixCheckpoint(tokens=3, digest=b"x" * 16)]), "checkpoints need a prefix_digest"),
    (turn(prefix_digest=b"x" * 16, checkpoints=[common_pb2.PrefixCheckpoint(tokens=9, digest=b"x" * 16)]),
     r"checkpoints\[0\].tokens must increase and stay within 1..8"),
    (turn(prefix_digest=b"x" * 16, checkpoints=[common_pb2.PrefixCheckpoint(tokens=5, digest=b"x" * 16),
                                                common_pb2.PrefixCheckpoint(tokens=5, digest=b"x" * 16)]),
     r"checkpoints\[1\].tokens must increase"),
    (turn(prefix_digest=b"x" * 16, checkpoints=[common_pb2.PrefixCheckpoint(tokens=0, digest=b"x" * 16)]),
     r"checkpoints\[0\].tokens"),
    (turn(prefix_digest=b"x" * 16, checkpoints=[common_pb2.PrefixCheckpoint(tokens=3, digest=b"x")]),
     r"checkpoints\[0\].digest must be 16 bytes"),
    (turn(token_ids=list(range(100, 200)), kv_transfer_params_json=handle(num_tokens=90, blocks=range(23)),
          prefix_digest=b"x" * 16,
          checkpoints=[common_pb2.PrefixCheckpoint(tokens=n, digest=b"x" * 16)
                       for n in range(1, rules.MAX_CHECKPOINTS + 2)]), "at most 32 checkpoints"),
    (turn(base_tokens=10, base_turn=1), "prefix_digest is required with base_tokens"),
    (turn(text_boundaries=[_boundary("hel", 3)] * (rules.MAX_TEXT_BOUNDARIES + 1)), "at most 4 text_boundaries"),
    (turn(text_boundaries=[common_pb2.TextBoundary(key=b"k", chars=2, tokens=2)]), r"text_boundaries\[0\].key must"),
    (turn(text_boundaries=[_boundary("hello", 5)]), r"text_boundaries\[0\].chars must .* within 1..4"),
    (turn(text_boundaries=[_boundary("hel", 3), _boundary("he", 2)]), r"text_boundaries\[1\].chars must increase"),
    (turn(text_boundaries=[_boundary("he", 11)]), r"text_boundaries\[0\].tokens must .* within 1..10"),
    (turn(text_boundaries=[_boundary("he", 0)]), r"text_boundaries\[0\].tokens"),
    (turn(text_boundaries=[_boundary("he", 3), _boundary("hel", 3)]), r"text_boundaries\[1\].tokens must increase"),
    (turn(text_boundaries=[common_pb2.TextBoundary(key=text_key("xy"), chars=2, tokens=2)]),
     r"text_boundaries\[0\].key is not the key of the text's first 2"),
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
    # The text is not stored, so a long one is fine; a handle too big for etcd is not.
    long_text = "x" * (rules.MAX_RECORD_BYTES + 1)
    plan = rules.build_session(turn(text=long_text, text_key=text_key(long_text)), decode_worker(), now=NOW,
                               margin_s=30)
    assert plan.session.ByteSize() < 1000 and plan.session.text_chars == rules.MAX_RECORD_BYTES + 1
    big = turn(kv_transfer_params_json=handle(padding="x" * (rules.MAX_RECORD_BYTES + 1)))
    with pytest.raises(rules.InvalidArgument, match="bytes"):  # kept in the record
        rules.build_session(big, decode_worker(), now=NOW, margin_s=30, handle_inline_bytes=2 * rules.MAX_RECORD_BYTES)


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


# -- append mode: the ids after the recorded history ----------------------------------------------------------------

TURN2 = list(range(200, 208))  # the next prompt's new ids and the answer


def first_record(**kw) -> common_pb2.Session:
    s = rules.build_session(turn(**kw), decode_worker(), now=NOW, margin_s=30).session
    s.revision = 7
    return s


def append(previous: common_pb2.Session, new_ids=TURN2, covered=17, **kw) -> registry_pb2.RecordTurnRequest:
    whole = [*HISTORY, *new_ids]
    boundary = previous.history_tokens
    digests = prefix_digests(whole, [n for n in (boundary, covered) if n <= len(whole)])
    fields = dict(kv_transfer_params_json=handle(num_tokens=covered, blocks=range(-(-covered // 4))),
                  token_ids=new_ids, base_tokens=boundary, base_turn=previous.turn,
                  prefix_digest=digests.get(covered, b"x" * 16),
                  checkpoints=[common_pb2.PrefixCheckpoint(tokens=boundary, digest=digests[boundary])]
                  if boundary < covered else [],
                  text="hello there", text_key=text_key("hello there"))
    fields.update(kw)
    return turn(**fields)


def test_an_appended_turn_continues_the_history():
    first = first_record()
    plan = rules.build_session(append(first), decode_worker(), now=NOW + 5, margin_s=30, previous=first)
    s = plan.session
    whole = [*HISTORY, *TURN2]
    assert s.turn == 2 and s.covered_tokens == 17 and s.history_tokens == 18
    assert s.history_generation == first.history_generation and plan.replaces_generation == 0
    assert (plan.history_start, plan.history_ids) == (10, ids_bytes(TURN2))  # only the new ids are written
    assert list(s.head_token_ids) == whole[:5] and not s.token_ids
    assert s.prefix_digest == prefix_digest(whole, 17)
    assert [(cp.tokens, cp.digest) for cp in s.checkpoints] == [(10, prefix_digest(whole, 10))]
    assert matched_prefix_tokens(17, 4, [*whole, 1], s.prefix_digest,
                                 [(cp.tokens, cp.digest) for cp in s.checkpoints]) == 17
    assert (s.text_chars, s.text_key) == (11, text_key("hello there"))


def test_an_appended_turn_may_send_no_new_ids():
    first = first_record()
    req = append(first, new_ids=[], covered=9)
    s = rules.build_session(req, decode_worker(), now=NOW, margin_s=30, previous=first).session
    assert s.history_tokens == 10 and s.covered_tokens == 9 and s.turn == 2


def test_a_short_head_grows_with_the_appended_ids():
    short = rules.build_session(turn(token_ids=HISTORY[:3], kv_transfer_params_json=handle(num_tokens=3, blocks=(1,))),
                                decode_worker(), now=NOW, margin_s=30).session
    assert list(short.head_token_ids) == HISTORY[:3]
    whole = [*HISTORY[:3], *TURN2]
    digests = prefix_digests(whole, [9])
    req = turn(token_ids=TURN2, base_tokens=3, base_turn=1, prefix_digest=digests[9],
               kv_transfer_params_json=handle(num_tokens=9))
    s = rules.build_session(req, decode_worker(), now=NOW, margin_s=30, previous=short).session
    assert list(s.head_token_ids) == whole[:5] and s.history_tokens == 11


def test_an_append_beyond_the_history_is_refused():
    first = first_record()
    with pytest.raises(rules.InvalidArgument, match=r"covers 19 tokens.*only 18 ids \(10 recorded \+ 8 given\)"):
        rules.build_session(append(first, covered=19), decode_worker(), now=NOW,
                            margin_s=30, previous=first)


@pytest.mark.parametrize("change", ["turn", "tokens", "absent", "no lineage"])
def test_an_append_to_a_changed_history_is_refused(change):
    first = first_record()
    req = append(first)
    if change == "turn":
        req.base_turn = 2
    elif change == "tokens":
        first.history_tokens = 9  # another turn's history, same turn number: fewer ids than the base
    elif change == "absent":
        first = None
    else:
        first.history_generation = 0  # a record written before the history store
    with pytest.raises(rules.FailedPrecondition, match="history changed"):
        rules.build_session(req, decode_worker(), now=NOW, margin_s=30, previous=first)


def test_a_turn_that_continues_part_of_the_history_starts_a_lineage_copied_from_it():
    """The prompt continued the record's ids only up to a text boundary (its last answer re-rendered otherwise): the
    caller sends the ids after that many; the history store copies the first ones from the previous lineage."""
    first = first_record()  # 10 ids
    kept, new = 6, [7, 7, 7, 7, 7, 7]
    whole = [*HISTORY[:kept], *new]
    digests = prefix_digests(whole, [kept, 11])
    req = turn(token_ids=new, base_tokens=kept, base_turn=first.turn, prefix_digest=digests[11],
               checkpoints=[common_pb2.PrefixCheckpoint(tokens=kept, digest=digests[kept])],
               kv_transfer_params_json=handle(num_tokens=11))
    plan = rules.build_session(req, decode_worker(), now=NOW + 1, margin_s=30, previous=first)
    s = plan.session
    assert s.history_tokens == 12 and s.turn == 2 and list(s.head_token_ids) == whole[:5]
    assert s.history_generation != first.history_generation
    assert (plan.copy_from, plan.replaces_generation) == (first.history_generation, first.history_generation)
    assert (plan.history_start, plan.history_ids) == (kept, ids_bytes(new))  # only the ids after the kept ones
    # all of the history kept: appended to the same lineage, nothing copied
    plan = rules.build_session(append(first), decode_worker(), now=NOW + 5, margin_s=30, previous=first)
    assert plan.copy_from == 0 and plan.session.history_generation == first.history_generation


def test_a_whole_history_replaces_the_previous_lineage():
    first = first_record()
    plan = rules.build_session(turn(), decode_worker(), now=NOW + 1, margin_s=30, previous=first)
    assert plan.session.turn == 2 and plan.history_start == 0 and plan.history_ids == ids_bytes(HISTORY)
    assert plan.session.history_generation == int((NOW + 1) * 1_000_000) != first.history_generation
    assert plan.replaces_generation == first.history_generation
    same = rules.build_session(turn(), decode_worker(), now=NOW + 1, margin_s=30, previous=first,
                               new_generation=first.history_generation)
    assert same.replaces_generation == 0  # never drop the lineage the new record names
