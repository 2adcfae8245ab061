"""Worker records, turns and handles for the tests that talk to a real SessionRegistry (tests/integration)."""

from __future__ import annotations

import json
import uuid

import grpc
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.v1 import common_pb2, registry_pb2

MARGIN_S = 30  # the shared ``registry`` fixture's (tests/conftest.py) default expiry margin
TENANT = "itest"


def uid(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:10]}"


def decode_worker(worker_id: str, **kw) -> common_pb2.Worker:
    fields = dict(worker_id=worker_id, role=common_pb2.WORKER_ROLE_DECODE, engine_id=f"eng-{worker_id}",
                  grpc_address="127.0.0.1:9", nixl_host="127.0.0.1", nixl_port=5700, block_size=4,
                  kv_blocks_ttl_s=480, model="tiny")
    fields.update(kw)
    return common_pb2.Worker(**fields)


def prefill_worker(worker_id: str) -> common_pb2.Worker:
    return decode_worker(worker_id, role=common_pb2.WORKER_ROLE_PREFILL, kv_blocks_ttl_s=0)


def handle(worker: common_pb2.Worker, num_tokens: int, blocks: int | None = None) -> str:
    n = blocks if blocks is not None else -(-num_tokens // worker.block_size)
    return json.dumps({"do_remote_decode": True, "remote_block_ids": [list(range(n))],
                       "remote_engine_id": worker.engine_id, "remote_host": "127.0.0.1", "remote_port": 5700,
                       "remote_num_tokens": num_tokens, "remote_blocks_expiry_time": 1.0, "tp_size": 1})


def turn(worker: common_pb2.Worker, session_id: str, tokens: list[int], covered: int | None = None,
         **kw) -> registry_pb2.RecordTurnRequest:
    """A whole-history turn (``tokens``; covered: all but the last) with a text ("some text") and its key."""
    covered = len(tokens) - 1 if covered is None else covered
    kw = {"text": "some text", **kw}
    if kw["text"] and "text_key" not in kw:
        kw["text_key"] = text_key(kw["text"])
    return registry_pb2.RecordTurnRequest(session_id=session_id, tenant=TENANT, decode_worker_id=worker.worker_id,
                                          kv_transfer_params_json=handle(worker, covered), token_ids=tokens, **kw)


async def deregister(stub, worker: common_pb2.Worker) -> None:
    """Deregister ``worker`` (its lease id as registered); a worker already gone is fine."""
    try:
        await stub.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(worker_id=worker.worker_id,
                                                                         lease_id=worker.lease_id))
    except grpc.aio.AioRpcError:
        pass


async def session_exists(stub, session_id: str, tenant: str = TENANT) -> bool:
    """Whether the registry has the session's record (NOT_FOUND: no; any other error fails)."""
    try:
        await stub.GetSession(registry_pb2.GetSessionRequest(session_id=session_id, tenant=tenant))
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
        return False
