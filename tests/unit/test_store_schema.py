"""The etcd schema's single owners (services/store/keys.py, codec.py) pinned byte for byte: deployed clusters hold
these keys and values. And the scheduler's small interface to the store (ClaimStore), which EtcdStore implements."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import get_type_hints

import pytest
from kvshuttle.services.scheduler.learning import LearningStore
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_store import EtcdStore
from kvshuttle.services.store.interface import ClaimStore, StoreUnavailable
from kvshuttle.services.store.keys import Keys, first_segment, session_ref
from kvshuttle.v1 import common_pb2

from tests.support.import_graph import imports

REPO = Path(__file__).resolve().parents[2]


def test_the_key_layout():
    keys = Keys.under("/kv")
    assert keys.prefix == "/kv/" and Keys.under().prefix == "/kvshuttle/"
    assert keys.ping == "/kv/ping"
    assert keys.workers == "/kv/workers/" and keys.worker("w1") == "/kv/workers/w1"
    assert keys.worker_id_of("/kv/workers/w1") == "w1"
    assert keys.session("t", "s") == "/kv/sessions/t/s"
    assert keys.claim("t", "s") == "/kv/sessions/t/s!claim" == keys.claim_of(keys.session("t", "s"))
    assert keys.session_range_end(keys.session("t", "s")) == b'/kv/sessions/t/s"'
    assert keys.worker_sessions == "/kv/worker-sessions/"
    assert keys.worker_sessions_of("d1") == "/kv/worker-sessions/d1/"
    assert keys.worker_session("d1", "t", "s") == "/kv/worker-sessions/d1/t/s"
    assert keys.worker_claims_of("d1") == "/kv/worker-claims/d1/"
    assert keys.worker_claim("d1", "t", "s") == "/kv/worker-claims/d1/t/s"
    assert keys.leader("kv-manager") == "/kv/leaders/kv-manager"
    assert session_ref("t/s") == ("t", "s") and session_ref("t") == ("t", "")
    assert first_segment("d1/t/s") == "d1"
    key = bytes(range(32))
    assert keys.content("t", key) == f"/kv/content/t/{key.hex()}"
    # a model's sessions are indexed under a key of their own (issue #37): one model's find never reaches another's
    scoped = hashlib.sha256(b"model\0Qwen/Qwen3-8B\0" + key).hexdigest()
    assert keys.content("t", key, "Qwen/Qwen3-8B") == f"/kv/content/t/{scoped}"
    assert len({keys.content("t", key, m) for m in ("", "a", "b", "a:lora")}) == 4


def test_the_store_builds_its_keys_from_the_layout():
    store = EtcdStore("127.0.0.1:1", "/kv")
    assert store.prefix == "/kv/" and store.keys == Keys("/kv/")
    assert store.sessions.key("t", "s") == "/kv/sessions/t/s"
    assert store.claims.key("t", "s") == "/kv/sessions/t/s!claim"
    assert store.workers.key("w") == "/kv/workers/w"
    assert store.keys.worker_session("d", "t", "s") == "/kv/worker-sessions/d/t/s"
    assert store.claims.worker_key("d", "t", "s") == "/kv/worker-claims/d/t/s"


def test_the_record_codec():
    assert codec.claim_value(42, "") == b"42" and codec.claim_value(42, "idle") == b"42 idle"
    assert codec.claim_free_reason(b"42") == "" and codec.claim_free_reason(b"42 pressure") == "pressure"
    assert codec.worker_claim_value(42) == b"42"
    assert codec.leader_value("host-1-abc") == b"host-1-abc"
    worker = common_pb2.Worker(worker_id="w", lease_id=7, role=common_pb2.WORKER_ROLE_DECODE)
    assert codec.parse_worker(codec.worker_value(worker)) == worker
    assert codec.parse_worker(b"\xff\xff") is None

    session = common_pb2.Session(tenant="t", session_id="s", revision=9, lease_id=3, claimed=True, covered_tokens=64,
                                 block_size=16, turn=2, token_ids=[1, 2, 3], kv_transfer_params_json="{}",
                                 prefix_digest=b"d" * 16, history_tokens=70, history_generation=5,
                                 head_token_ids=[1, 2, 3], text_chars=12,
                                 checkpoints=[common_pb2.PrefixCheckpoint(tokens=30, digest=b"c" * 16)])
    session.expires_at.seconds = 100
    record, value = codec.stored_record(session)
    assert (record.revision, record.lease_id, record.claimed) == (0, 0, False)
    assert not record.token_ids  # the history store holds the ids, never etcd
    assert value == record.SerializeToString() and session.revision == 9  # the caller's copy is left alone
    assert session.token_ids == [1, 2, 3]
    back = codec.parse_session(value, 11)
    assert back.revision == 11 and back.token_ids == []
    assert (back.prefix_digest, back.history_tokens, back.history_generation, back.head_token_ids,
            back.text_chars) == (b"d" * 16, 70, 5, [1, 2, 3], 12)
    assert [(cp.tokens, cp.digest) for cp in back.checkpoints] == [(30, b"c" * 16)]
    summary = common_pb2.Session.FromString(codec.summary(record))
    assert summary == common_pb2.Session(covered_tokens=64, block_size=16, turn=2, expires_at=session.expires_at)
    cleared = codec.handle_cleared(back)
    assert cleared.kv_transfer_params_json == "" and back.kv_transfer_params_json == "{}"
    assert codec.handle_cleared(None) is None


class _Kv:
    def __init__(self, key: str, value: bytes, mod_revision: int = 0, lease: int = 0):
        self.key, self.value, self.mod_revision, self.lease = key.encode(), value, mod_revision, lease


def test_a_record_read_with_its_claim_is_claimed_without_its_handle():
    keys = Keys.under()
    key = keys.session("t", "s")
    _, value = codec.stored_record(common_pb2.Session(tenant="t", session_id="s", kv_transfer_params_json="{}"))
    unclaimed = codec.session_from([_Kv(key, value, 5, 8)], key)
    assert (unclaimed.revision, unclaimed.lease_id, unclaimed.claimed) == (5, 8, False)
    assert unclaimed.kv_transfer_params_json == "{}"
    freed = codec.session_from([_Kv(key, value, 5, 8), _Kv(keys.claim_of(key), codec.claim_value(5, "idle"))], key)
    assert freed.claimed and freed.kv_freed == "idle" and freed.kv_transfer_params_json == ""
    assert codec.session_from([_Kv(keys.claim_of(key), b"5")], key) is None


def _implements(protocol: type, obj: object) -> None:
    """``obj`` has each of ``protocol``'s members with the same parameters (a property: a part that implements the
    property's own protocol)."""
    members = [name for name in vars(protocol) if not name.startswith("_")]
    for name in members:
        wanted = inspect.getattr_static(protocol, name)
        if isinstance(wanted, property):
            _implements(get_type_hints(wanted.fget)["return"], getattr(obj, name))
            continue
        have = getattr(obj, name)
        assert inspect.signature(wanted).parameters.keys() - {"self"} == inspect.signature(have).parameters.keys(), \
            name
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(wanted), name
        assert inspect.isasyncgenfunction(have) or not inspect.isasyncgenfunction(wanted), name


def test_the_etcd_store_implements_the_claim_store_the_scheduler_uses():
    """The scheduler holds the store's parts: ``store.sessions.get``, ``store.claims.claim`` / ``held_on_worker``,
    ``store.elections.campaign`` (claims, services/scheduler/claims.py); ``store.outcomes``, ``store.snapshots``,
    ``store.leases.grant`` and ``store.elections.campaign`` (shared learning, services/scheduler/learning.py)."""
    assert {name for name in vars(ClaimStore) if not name.startswith("_")} == {
        "connect", "close", "sessions", "claims", "elections"}
    store = EtcdStore("127.0.0.1:1")
    _implements(ClaimStore, store)
    _implements(LearningStore, store)


async def test_the_store_reports_each_operation_to_its_observer():
    seen = []
    store = EtcdStore("127.0.0.1:1", timeout_s=0.3, attempt_timeout_s=0.1,
                      on_op=lambda op, seconds, error: seen.append((op, error, seconds)))
    await store.connect()
    try:
        with pytest.raises(StoreUnavailable):
            await store.ping()
    finally:
        await store.close()
    assert [(op, error) for op, error, _ in seen] == [("ping", "unavailable")] and seen[0][2] > 0


def test_the_store_does_not_import_the_metrics():
    """The services inject metrics.etcd_op (on_op); the store knows no metrics module."""
    for path in (REPO / "services" / "store").glob("*.py"):
        assert not [imp for imp in imports("kvshuttle.services.store.x", path)
                    if "metrics" in imp.imported], path


def test_the_store_is_one_connection_with_one_part_per_kind_of_record():
    """EtcdStore composes the record stores (services/store/etcd_*.py) on itself, its connection: a part's
    operations go through the same channel, retries and ``on_op``."""
    store = EtcdStore("127.0.0.1:1", "/kv")
    parts = {name: getattr(store, name) for name in ("leases", "elections", "workers", "sessions", "claims",
                                                     "responses", "outcomes", "snapshots")}
    assert all(part._conn is store for part in parts.values())
    for path in (REPO / "services" / "store").glob("etcd_*.py"):
        assert len(path.read_text().splitlines()) <= 300, f"{path.name}: keep each store small"
