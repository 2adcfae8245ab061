"""A session as long as a model's context (1M tokens) through a real registry, etcd and history store: every turn is
recorded (the old whole-history record was refused past ~204k tokens), the etcd record stays small, the exact ids
come back, and the record's digests still prove what the next prompt may pull."""

from __future__ import annotations

import random
import time

import pytest
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane.decision import HandleView, PullPolicy, decide
from kvshuttle.control_plane.prefix import MAX_CHECKPOINTS, checkpoint_lengths, prefix_digests
from kvshuttle.services.common.grpc_server import client_channel
from kvshuttle.services.store import codec
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

from tests.support.registry import TENANT, decode_worker, deregister, handle, uid

pytestmark = pytest.mark.timeout(300)
MILLION = 1 << 20
TURN = 1 << 17  # 131,072 ids a turn: 8 turns make 1M
BS = 16


def _view(record: common_pb2.Session, expires_in_s: float) -> HandleView:
    return HandleView(record.kv_transfer_params_json, record.covered_tokens, record.block_size, expires_in_s,
                      record.claimed, True, prefix_digest=record.prefix_digest,
                      checkpoints=[(cp.tokens, cp.digest) for cp in record.checkpoints])


async def test_a_million_token_session_is_recorded_turn_by_turn_and_read_back_exactly(registry):
    channel = client_channel(registry, max_message_bytes=64 << 20)
    stub = registry_pb2_grpc.SessionRegistryStub(channel)
    worker = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
        worker=decode_worker(uid("d"), block_size=BS), lease_ttl_s=120))).worker
    rng, session_id = random.Random(7), uid("long")
    ids: list[int] = []
    record = None
    try:
        for k in range(MILLION // TURN):
            base = len(ids)
            ids.extend(rng.randrange(100, 150_000) for _ in range(TURN))
            covered = len(ids) - 1
            request = registry_pb2.RecordTurnRequest(
                session_id=session_id, tenant=TENANT, decode_worker_id=worker.worker_id,
                kv_transfer_params_json=handle(worker, covered), text=f"turn {k}")
            if record is None:  # the first turn: the whole history, digested by the registry
                request.token_ids.extend(ids)
            else:  # later turns: only the new ids, digested by the caller over all of them (as the gateway does)
                lengths = checkpoint_lengths([*(cp.tokens for cp in record.checkpoints), record.covered_tokens,
                                              base], base, covered)
                digests = prefix_digests(ids, [*lengths, covered])
                request.token_ids.extend(ids[base:])
                request.base_tokens, request.base_turn = base, record.turn
                request.prefix_digest = digests[covered]
                request.checkpoints.extend(common_pb2.PrefixCheckpoint(tokens=n, digest=digests[n]) for n in lengths)
            started = time.perf_counter()
            record = (await stub.RecordTurn(request, timeout=60)).session
            elapsed_ms = (time.perf_counter() - started) * 1000
            handle_bytes = len(record.kv_transfer_params_json)
            small = common_pb2.Session()
            small.CopyFrom(record)
            small.ClearField("kv_transfer_params_json")
            print(f"turn {k + 1}: {len(ids)} ids, RecordTurn {elapsed_ms:.1f} ms, record without handle "
                  f"{len(codec.stored_record(small)[1])} B, handle {handle_bytes} B")
            assert (record.turn, record.history_tokens, record.covered_tokens) == (k + 1, len(ids), covered)
            assert len(codec.stored_record(small)[1]) <= 2048  # constant: digests, counts, first block, times
            assert len(record.checkpoints) <= MAX_CHECKPOINTS and not record.token_ids

        got = await stub.GetSession(registry_pb2.GetSessionRequest(
            session_id=session_id, tenant=TENANT, include_token_ids=True), timeout=60)
        assert got.history_missing == "" and len(got.session.token_ids) == MILLION
        assert list(got.session.token_ids) == ids  # the exact ids, across 8 appends

        policy = PullPolicy(pull_threshold_tokens=16)
        view = _view(got.session, got.expires_in_s)
        extended = decide([*ids, 1, 2, 3], view, policy)
        assert (extended.code, extended.reusable_tokens) == (why.PULL_ALL, MILLION - 1)
        # A prompt that differs inside the last turn: the turn boundary before it is still proven, whole blocks.
        edited = list(ids)
        edited[7 * TURN + 500] += 1
        partial = decide(edited, view, policy)
        assert partial.code == why.PULL_PREFIX and partial.reusable_tokens == 7 * TURN, partial.reason
        # One that differs in the first block: nothing is proven.
        edited[3] += 1
        assert decide(edited, view, policy).reusable_tokens == 0
    finally:
        await stub.DeleteSession(registry_pb2.DeleteSessionRequest(session_id=session_id, tenant=TENANT))
        await deregister(stub, worker)
        await channel.close()
