"""Workers, handles and records for the tests that run a real TransferScheduler on a real registry."""

from __future__ import annotations

import json

import grpc
from kvshuttle.control_plane.prefix import prefix_digests
from kvshuttle.v1 import common_pb2, registry_pb2, scheduler_pb2

from tests.support.waits import until

BS = 16  # the workers' KV block size


def worker(worker_id: str, role: int, port: int) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"engine-{worker_id}",
                             grpc_address=f"127.0.0.1:{port}", nixl_host="127.0.0.1", nixl_port=port + 1,
                             block_size=BS, kv_blocks_ttl_s=60, model="tiny")


def handle_for(w: common_pb2.Worker, covered: int) -> str:
    return json.dumps({"do_remote_decode": True, "remote_engine_id": w.engine_id, "remote_host": w.nixl_host,
                       "remote_port": w.nixl_port, "remote_num_tokens": covered,
                       "remote_block_ids": [list(range(100, 100 + -(-covered // BS)))]})


async def register_pair(reg, prefill_id: str, decode_id: str, port: int) -> tuple[common_pb2.Worker, common_pb2.Worker]:
    p, d = worker(prefill_id, common_pb2.WORKER_ROLE_PREFILL, port), worker(decode_id, common_pb2.WORKER_ROLE_DECODE,
                                                                             port + 100)
    for w in (p, d):
        await reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=30))
    return p, d


def digests(history: list[int], covered: int, checkpoints=()) -> dict:
    """RecordTurnRequest's prefix_digest and checkpoints (at the lengths ``checkpoints``: earlier turns' boundaries),
    computed by the caller as the gateway does."""
    got = prefix_digests(history, [*checkpoints, covered])
    return {"prefix_digest": got[covered],
            "checkpoints": [common_pb2.PrefixCheckpoint(tokens=n, digest=got[n]) for n in sorted(checkpoints)]}


async def record(reg, session: str, d: common_pb2.Worker, history: list[int],
                 checkpoints=()) -> registry_pb2.GetSessionResponse:
    """Record a turn whose handle covers all of ``history`` but its last token (with ``checkpoints`` at those
    lengths, if any); return the record as read."""
    extra = digests(history, len(history) - 1, checkpoints) if checkpoints else {}
    await reg.RecordTurn(registry_pb2.RecordTurnRequest(session_id=session, decode_worker_id=d.worker_id,
                                                        kv_transfer_params_json=handle_for(d, len(history) - 1),
                                                        token_ids=history, **extra))
    return await reg.GetSession(registry_pb2.GetSessionRequest(session_id=session))


async def plan(sched, session: str, prompt: list[int], **kw) -> scheduler_pb2.PlanTurnResponse:
    return await sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id=session, prompt_token_ids=prompt, **kw))


async def first_plan(sched, request: scheduler_pb2.PlanTurnRequest, timeout_s: float = 10.0,
                     **kw) -> scheduler_pb2.PlanTurnResponse:
    """``PlanTurn(request)`` once the scheduler has learnt of workers through its WatchWorkers (until then it
    answers UNAVAILABLE: no worker; any other error fails)."""

    async def planned():
        try:
            return await sched.PlanTurn(request, **kw)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            return None

    return await until(planned, timeout_s, "a plan (the scheduler's worker view)")
