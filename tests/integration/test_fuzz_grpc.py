"""Generated bad input for the session registry's and transfer scheduler's gRPC APIs (issue #5, item 7).

Real services on loopback over the session's etcd, driven with messages hypothesis generates: wrong ranges, huge and
negative numbers, NaN and infinities, odd strings, random bytes, forged session snapshots and handles. Every answer
must be OK or a client-error status with a message; never UNKNOWN or INTERNAL (an unhandled exception), never a
hang, and the services must still serve a normal turn afterwards.

The services run on their own event loop in a background thread, so hypothesis can drive them with plain
(synchronous) gRPC calls.
"""

from __future__ import annotations

import asyncio
import math
import threading
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvshuttle.services.registry.server import RegistryConfig, serve
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS}
EXAMPLES = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
# Ids: mostly plausible (so the checks past the id check run too), sometimes empty, too long, or with characters ids
# may not have.


def mostly(good, bad):
    """``good`` nine times in ten: bad values in one field at a time reach the checks behind the first one."""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 0 else good)


VALID_ID = st.from_regex(r"[A-Za-z0-9._:@=+-]{1,40}", fullmatch=True)
IDS = mostly(VALID_ID, st.one_of(st.text(max_size=300), st.just(""), st.just("x" * 257)))
TOKENS = mostly(st.lists(st.integers(0, 50_000), min_size=51, max_size=3000), st.lists(INT32, max_size=300))
COUNTS = mostly(st.integers(0, 10_000), INT32)
ODD_HANDLES = st.one_of(
    st.text(max_size=200),
    st.builds(lambda host, port, n, blocks: (
        f'{{"do_remote_decode": true, "remote_engine_id": "engine-d0", "remote_host": "{host}", '
        f'"remote_port": {port}, "remote_num_tokens": {n}, "remote_block_ids": {blocks}}}'),
        st.sampled_from(["127.0.0.1", "10.9.9.9", ""]), st.sampled_from([19, 0, -1, 70000]), INT32,
        st.sampled_from(["[[1, 2, 3]]", "[]", "[[]]", "null", "[[-1]]", '"x"'])),
)
# d0's handle (its registered NIXL address) for its first 50 tokens, or something odd.
JSON_HANDLES = mostly(st.just(
    '{"do_remote_decode": true, "remote_engine_id": "engine-d0", "remote_host": "127.0.0.1", "remote_port": 19, '
    '"remote_num_tokens": 50, "remote_block_ids": [[1, 2, 3, 4]]}'), ODD_HANDLES)


class Services:
    """etcd-backed registry + scheduler on a background event loop."""

    def __init__(self, etcd: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-services", daemon=True)
        self.thread.start()
        prefix = f"/fuzz-{uuid.uuid4().hex[:6]}/"

        async def start():
            registry = await serve(RegistryConfig(listen="127.0.0.1:0", etcd_endpoints=etcd, key_prefix=prefix,
                                                  expiry_margin_s=5))
            scheduler = SchedulerService(SchedulerConfig(
                listen="127.0.0.1:0", registry=registry.address, etcd_endpoints=etcd, key_prefix=prefix,
                load_poll_interval_s=0, policies="t64=threshold:pull_threshold_tokens=64"))
            await scheduler.start()
            return registry, scheduler

        self.registry, self.scheduler = self.run(start())

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def stop():
            await self.scheduler.stop()
            await self.registry.stop(grace=0.5)

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stubs(etcd):
    services = Services(etcd)
    channels = [grpc.insecure_channel(services.registry.address), grpc.insecure_channel(services.scheduler.address)]
    reg = registry_pb2_grpc.SessionRegistryStub(channels[0])
    sched = scheduler_pb2_grpc.TransferSchedulerStub(channels[1])
    for w in (worker("p0", common_pb2.WORKER_ROLE_PREFILL), worker("d0", common_pb2.WORKER_ROLE_DECODE)):
        reg.RegisterWorker(registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=300), timeout=10)
    yield reg, sched
    for channel in channels:
        channel.close()
    services.stop()


def worker(worker_id: str, role: int) -> common_pb2.Worker:
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"engine-{worker_id}",
                             grpc_address="127.0.0.1:9", nixl_host="127.0.0.1", nixl_port=19, block_size=16,
                             kv_blocks_ttl_s=60, model="tiny")


def call(method, request) -> None:
    """One RPC: OK, or a client error with a message. Anything else (UNKNOWN, INTERNAL, a timeout) fails."""
    try:
        method(request, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details(), request)
        assert exc.details(), (exc.code(), request)


sessions = st.builds(
    common_pb2.Session, session_id=IDS, tenant=IDS, decode_worker_id=st.sampled_from(["d0", "p0", "", "ghost"]),
    kv_transfer_params_json=JSON_HANDLES, covered_tokens=COUNTS, block_size=mostly(st.sampled_from([16, 128]), INT32),
    checkpoints=st.lists(st.builds(common_pb2.PrefixCheckpoint, tokens=COUNTS, digest=st.binary(max_size=20)),
                         max_size=20),
    revision=INT64, claimed=st.booleans(), prefix_digest=st.binary(max_size=20), lease_id=INT64,
    history_tokens=COUNTS, head_token_ids=TOKENS)


@EXAMPLES
@given(session_id=IDS, tenant=IDS, prompt=TOKENS, disable_pull=st.booleans(), exclude=st.lists(IDS, max_size=3),
       policy=st.sampled_from(["", "t64", "threshold", "nope", "a;b"]),
       snapshot=st.one_of(st.none(), st.builds(registry_pb2.GetSessionResponse, session=sessions,
                                              expires_in_s=mostly(st.floats(-10, 600), FLOATS))),
       not_found=st.booleans())
def test_plan_turn_answers_bad_input_with_a_client_error(stubs, session_id, tenant, prompt, disable_pull, exclude,
                                                         policy, snapshot, not_found):
    _, sched = stubs
    request = scheduler_pb2.PlanTurnRequest(session_id=session_id, tenant=tenant, prompt_token_ids=prompt,
                                            disable_pull=disable_pull, exclude_worker_ids=exclude, policy=policy)
    if snapshot is not None:
        request.session_snapshot.CopyFrom(snapshot)
    elif not_found:
        request.session_not_found = True
    call(sched.PlanTurn, request)


@EXAMPLES
@given(prefill=IDS, decode=IDS, source=IDS, prompt=COUNTS, pulled=COUNTS, computed=COUNTS, pullable=COUNTS,
       ms=mostly(st.floats(0, 10_000), FLOATS), decision=mostly(st.sampled_from([1, 2]), st.integers(-1, 4)),
       policy=st.text(max_size=20), cached=COUNTS)
def test_report_outcome_answers_bad_input_with_a_client_error(stubs, prefill, decode, source, prompt, pulled,
                                                              computed, pullable, ms, decision, policy, cached):
    _, sched = stubs
    call(sched.ReportOutcome, scheduler_pb2.ReportOutcomeRequest(
        prefill_worker_id=prefill, decode_worker_id=decode, source_worker_id=source, prompt_tokens=prompt,
        pulled_tokens=pulled, computed_tokens=computed, prefill_ms=ms, decision=decision, pullable_tokens=pullable,
        policy=policy, cached_tokens_estimate=cached))
    stats = sched.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)  # the model stays usable
    assert all(math.isfinite(c.fixed_ms) and c.fixed_ms >= 0 for c in stats.compute), stats.compute


DIGESTS = mostly(st.binary(min_size=16, max_size=16), st.binary(max_size=40))
APPENDS = st.one_of(st.none(), st.fixed_dictionaries({
    "base_tokens": COUNTS, "base_turn": INT64, "prefix_digest": DIGESTS, "text_chars": mostly(COUNTS, INT64),
    "text_key": mostly(st.binary(min_size=32, max_size=32), st.binary(max_size=40)),
    "checkpoints": st.lists(st.builds(common_pb2.PrefixCheckpoint, tokens=COUNTS, digest=DIGESTS), max_size=40)}))


@EXAMPLES
@given(session_id=IDS, tenant=IDS, decode=st.sampled_from(["d0", "d0", "p0", "", "ghost"]), handle=JSON_HANDLES,
       tokens=TOKENS, text=st.text(max_size=500), revision=INT64, finished=st.one_of(st.none(), INT64),
       append=APPENDS, with_ids=st.booleans())
def test_registry_answers_bad_input_with_a_client_error(stubs, session_id, tenant, decode, handle, tokens, text,
                                                        revision, finished, append, with_ids):
    reg, _ = stubs
    record = registry_pb2.RecordTurnRequest(session_id=session_id, tenant=tenant, decode_worker_id=decode,
                                            kv_transfer_params_json=handle, token_ids=tokens, text=text,
                                            **(append or {}))
    if finished is not None:
        record.finished_at.seconds = max(-62135596800, min(253402300799, finished))
    call(reg.RecordTurn, record)
    call(reg.GetSession, registry_pb2.GetSessionRequest(session_id=session_id, tenant=tenant,
                                                        include_token_ids=with_ids))
    call(reg.ClaimSession, registry_pb2.ClaimSessionRequest(session_id=session_id, tenant=tenant, revision=revision))
    call(reg.DeleteSession, registry_pb2.DeleteSessionRequest(session_id=session_id, tenant=tenant))


@EXAMPLES
@given(worker_id=IDS, role=mostly(st.sampled_from([1, 2]), st.integers(-1, 3)), engine=st.text(max_size=40),
       address=mostly(st.sampled_from(["127.0.0.1:9", "[::1]:80", "host:1"]), st.text(max_size=60)),
       port=mostly(st.integers(1, 65535), INT32), block_size=mostly(st.sampled_from([16, 128]), INT32),
       ttl=mostly(st.integers(1, 600), INT32), lease_ttl=mostly(st.integers(0, 600), INT32), lease_id=INT64)
def test_worker_registration_answers_bad_input_with_a_client_error(stubs, worker_id, role, engine, address, port,
                                                                   block_size, ttl, lease_ttl, lease_id):
    reg, _ = stubs
    w = common_pb2.Worker(worker_id=worker_id, role=role, engine_id=engine, grpc_address=address, nixl_host=address,
                          nixl_port=port, block_size=block_size, kv_blocks_ttl_s=ttl, model="tiny")
    if worker_id in ("p0", "d0"):
        return  # the fuzzed registry keeps serving the test's own workers
    call(reg.RegisterWorker, registry_pb2.RegisterWorkerRequest(worker=w, lease_ttl_s=lease_ttl))
    call(reg.KeepAlive, registry_pb2.KeepAliveRequest(worker_id=worker_id, lease_id=lease_id))
    call(reg.DeregisterWorker, registry_pb2.DeregisterWorkerRequest(worker_id=worker_id, lease_id=lease_id))


RESPONSE_IDS = mostly(st.sampled_from(["resp_a", "resp_b", "resp_c"]), IDS)


@EXAMPLES
@given(response_id=RESPONSE_IDS, previous=st.one_of(st.just(""), RESPONSE_IDS), tenant=mostly(st.just("t"), IDS),
       body=mostly(st.just(b'{"response": {}, "items": []}'), st.binary(max_size=64)),
       ttl=mostly(st.integers(1, 600), INT64), max_responses=mostly(st.integers(1, 100), INT32),
       max_bytes=mostly(st.integers(1, 1 << 20), INT64), chain_length=INT32, chain_bytes=INT64)
def test_stored_responses_answer_bad_input_with_a_client_error(stubs, response_id, previous, tenant, body, ttl,
                                                               max_responses, max_bytes, chain_length, chain_bytes):
    """Put (with forged chain fields, which the registry sets itself), read back as a chain, delete."""
    reg, _ = stubs
    call(reg.PutResponse, registry_pb2.PutResponseRequest(ttl_s=ttl, response=registry_pb2.StoredResponse(
        response_id=response_id, tenant=tenant, session_id="s", previous_response_id=previous, body_json=body,
        chain_id=previous, chain_length=chain_length, chain_bytes=chain_bytes, body_in_history_store=False)))
    call(reg.GetResponse, registry_pb2.GetResponseRequest(response_id=response_id, tenant=tenant))
    call(reg.GetResponseChain, registry_pb2.GetResponseChainRequest(
        response_id=response_id, tenant=tenant, max_responses=max_responses, max_bytes=max_bytes))
    if previous == "":
        call(reg.DeleteResponse, registry_pb2.DeleteResponseRequest(response_id=response_id, tenant=tenant))


def test_a_normal_turn_still_plans_after_the_fuzzing(stubs):
    reg, sched = stubs
    history = list(range(100, 200))
    reg.RecordTurn(registry_pb2.RecordTurnRequest(
        session_id="after-fuzz", decode_worker_id="d0", token_ids=history,
        kv_transfer_params_json=('{"do_remote_decode": true, "remote_engine_id": "engine-d0", '
                                 '"remote_host": "127.0.0.1", "remote_port": 19, "remote_num_tokens": 99, '
                                 '"remote_block_ids": [[1, 2, 3, 4, 5, 6, 7]]}')), timeout=10)
    # The threshold policy: the default (cost) policy has learned from the fuzzed ReportOutcome calls, which may now
    # predict a recompute to be faster; the services must still plan normally.
    plan = sched.PlanTurn(scheduler_pb2.PlanTurnRequest(session_id="after-fuzz", prompt_token_ids=history + [1],
                                                        policy="t64"), timeout=10)
    assert plan.decision == scheduler_pb2.DECISION_PULL, plan.reason
