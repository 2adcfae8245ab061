"""`kvshuttle bench-services`: microbenchmarks of the control-plane services, without vLLM.

What runs: a real etcd (data on /dev/shm), the session registry and the transfer scheduler as separate processes on
loopback (``python -m kvshuttle.services.commands registry|scheduler``, the way ``kvshuttle up`` starts them; logs in
``<work dir>/logs``). A fake prefill and a fake decode worker are registered through ``RegisterWorker`` and kept
alive with ``KeepAlive`` for the whole run; nothing listens at their addresses, nothing needs to: the services only
ever look at the records (the scheduler runs without load polling, ``--load-poll-interval-s 0``).

What is measured, per operation and per concurrency level:

``PlanTurn recompute``
    ``TransferScheduler.PlanTurn`` for a session that has no record: the scheduler reads it (none there) and
    answers RECOMPUTE.
``PlanTurn pull``
    ``PlanTurn`` for a session recorded just before (``RecordTurn`` with ``history_tokens`` ids, untimed): the
    scheduler reads the record, checks the prompt against its prefix digest, claims the handle (an etcd
    transaction at the record's revision) and answers PULL. Every timed plan is a verified pull with a claim; only
    ``PlanTurn`` is timed.
``PlanTurn pull+snapshot``
    The same, the way the gateway plans: with the record it has just read (``session_snapshot``, read untimed), so
    the scheduler skips its own read; it still claims at the snapshot's revision and re-checks the claimed record.
``PlanTurn disable_pull``
    ``PlanTurn`` with ``disable_pull``: the scheduler picks workers and answers RECOMPUTE without reading the
    session, i.e. the scheduler's own cost plus one gRPC hop.
``in-process disable_pull``, ``in-process recompute`` and ``in-process pull+snapshot``
    The same plans answered by a scheduler inside the client's own process, as a gateway with ``--scheduler local``
    plans: ``SchedulerService`` built in the client process (same settings as the scheduler process, joined to its
    shared learning) and called through ``InProcessScheduler``: no serialization, no gRPC hop; the planner's CPU is
    the client's column. The requests are built before the clock starts, as for the gRPC rows.
``RecordTurn``
    ``SessionRegistry.RecordTurn`` of a conversation's next turn, as the gateway records a turn that continued its
    history: ``turn_tokens`` new ids after the ``history_tokens`` recorded ones (each request is the second turn of
    its own conversation, whose first turn was recorded untimed), with the prefix digests the gateway computes
    (here untimed): the registry reads the previous (small) record, looks up
    the decode worker, appends the new ids to the history store (an SQLite file, the local stack's), grants a
    lease, compare-and-puts the record and revokes the old lease. The row also gives etcd's own byte counters per
    turn (WAL, put, sent) next to the bytes of the turn's new ids.
``ClaimSession``
    ``SessionRegistry.ClaimSession`` on a freshly recorded session (recorded untimed); only the claim is timed.
``GetSession``
    ``SessionRegistry.GetSession`` of recorded sessions with ``include_token_ids`` (each answer carries the
    ``history_tokens`` exact ids, read from the history store), as a gateway without its own copy reads one.

``etcd claim txn``
    The floor under a claiming plan: the transaction the scheduler's claim sends (``EtcdStore.claims.claim``:
    compare the record's revision and lease and that no claim exists, put the claim key and the worker's claim note on
    the record's lease, read the record back), on freshly recorded sessions (recorded untimed, through the registry),
    sent by the client process itself through the project's etcd client (``EtcdStore``, its retry wrapper
    included): no scheduler, no gRPC server of ours. etcd's own claim rate on this machine.
``gRPC echo``
    The floor under any plan: a bare grpc.aio unary method in its own process (started like the services, with the
    scheduler's server options, no interceptors, health for the readiness check only) that answers every request
    with a fixed reply; the client sends the bytes of a claim-free PlanTurn request (the prompt's ids) through a
    ``client_channel`` like the other rows and gets back as many bytes as a real PlanTurn answer.

After the table, the decision-rate goals (#17) next to what was measured: claim-free PlanTurn (``disable_pull``,
and ``recompute``, which also reads the session) against 5,000/s and p99 <= 1 ms, with its ratio to the gRPC echo
at each concurrency; claiming PlanTurn (``pull+snapshot``, ``pull``) as a ratio to the etcd claim txn's rate at
each concurrency, against 0.5x. Where a goal is missed, the line names the floor that stops it: the gRPC echo (when
the echo itself misses the goal, or a gRPC hop plus the claim txn on the same cores cannot reach 0.5x of the txn
alone), else the plan's own work.

``--scale-history-tokens 1024,131072`` also runs RecordTurn, ClaimSession and GetSession at concurrency 1 at each
size and prints each one's p50 as a ratio to the first size's: a record's cost should not grow with its history
(GetSession's does: it returns the ids).

``--model-counts 1,20`` (with ``--fleet-workers 1000``) also runs the claim-free and claiming plans at concurrency 1
with the fleet's workers serving that many models, each with the same number of workers (50): the turn's model keeps
its workers while the others' grow. A plan looks only at its model's workers, so its p50 should not grow with the
number of models (each count's p50 is printed as a ratio to the first's).

The scheduler reads records and claims handles in etcd itself (``--claims etcd``, with the registry's store code,
as ``kvshuttle up`` runs it) or through the registry's ``GetSession``/``ClaimSession`` (``--claims registry``).

Prompts are ``history_tokens`` recorded ids followed by ``new_tokens`` new ones; the decode worker's handle covers
all recorded ids but the last (vLLM's ``remote_num_tokens``) in ``block_size``-token blocks (its JSON lists every
block id: the one part of a record that grows with the history), and the scheduler hashes the prompt's covered ids
once per plan.

The client model: one client process with one event loop, like the gateway (the registry's and scheduler's real
caller), with ``concurrency`` coroutines each sending one request at a time (closed loop, no think time). By default
every coroutine shares one grpc.aio channel per service, exactly as one gateway does; ``--channels N`` spreads them
round-robin over N channels (N gateways' worth of HTTP/2 connections, still from one process). The client is part of
the measurement: on a small machine the client, etcd and both services share the cores, which is why every row also
shows the CPU time each process spent per operation (``cpu ms/op``: client, registry, scheduler, etcd).

Each (operation, concurrency) cell runs ``requests_per_level`` timed requests (at least one per coroutine), split
evenly among the coroutines, after ``warmup_requests`` untimed ones per operation. Cells run operation by operation
(each at every level) or, with ``--order level``, level by level (every operation at one level), which keeps the
cells the goals compare close in time when the machine's load varies. ops/s is successful requests divided by the
wall time from the first request to the last answer; latencies are per request, client side.
A request counts as an error when the RPC fails or the answer is not the expected one (e.g. a plan that should pull
and does not). Output: a table on stdout and ``<out>/services.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import random
import shutil
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvshuttle.control_plane.continuation import text_key
from kvshuttle.control_plane.prefix import checkpoint_lengths, ids_bytes, prefix_digests
from kvshuttle.services.common.config import load, require, require_effect, setting
from kvshuttle.services.common.grpc_server import _message_options, client_channel
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.common.tls import DEFAULT_MAX_MESSAGE_MB
from kvshuttle.services.devtools.bench.stats import percentile
from kvshuttle.services.devtools.etcd_process import ETCD_BIN, EtcdProcess, free_port
from kvshuttle.services.scheduler.in_process import InProcessScheduler
from kvshuttle.services.scheduler.server import SchedulerConfig, SchedulerService
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_store import EtcdStore, claim_txn
from kvshuttle.services.store.interface import StoreError
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("kvshuttle.bench.services")
REPO = Path(__file__).resolve().parents[2]

PLAN_RECOMPUTE = "plan_recompute"
PLAN_PULL = "plan_pull"
PLAN_PULL_SNAPSHOT = "plan_pull_snapshot"
PLAN_DISABLE_PULL = "plan_disable_pull"
RECORD_TURN = "record_turn"
CLAIM_SESSION = "claim_session"
GET_SESSION = "get_session"
ETCD_CLAIM = "etcd_claim"
GRPC_ECHO = "grpc_echo"
LOCAL_DISABLE_PULL = "local_disable_pull"
LOCAL_RECOMPUTE = "local_recompute"
LOCAL_PULL_SNAPSHOT = "local_pull_snapshot"
OPERATIONS = (PLAN_RECOMPUTE, PLAN_PULL, PLAN_PULL_SNAPSHOT, PLAN_DISABLE_PULL, LOCAL_DISABLE_PULL, LOCAL_RECOMPUTE,
              LOCAL_PULL_SNAPSHOT, ETCD_CLAIM, GRPC_ECHO, RECORD_TURN, CLAIM_SESSION, GET_SESSION)
PLANS = (PLAN_RECOMPUTE, PLAN_PULL, PLAN_PULL_SNAPSHOT, PLAN_DISABLE_PULL)
# The planner in the client's own process (the gateway's --scheduler local): the same plans, no gRPC hop.
LOCAL = {LOCAL_DISABLE_PULL: PLAN_DISABLE_PULL, LOCAL_RECOMPUTE: PLAN_RECOMPUTE,
         LOCAL_PULL_SNAPSHOT: PLAN_PULL_SNAPSHOT}
LABELS = {
    PLAN_RECOMPUTE: "PlanTurn recompute", PLAN_PULL: "PlanTurn pull", PLAN_PULL_SNAPSHOT: "PlanTurn pull+snapshot",
    PLAN_DISABLE_PULL: "PlanTurn disable_pull",
    LOCAL_DISABLE_PULL: "in-process disable_pull", LOCAL_RECOMPUTE: "in-process recompute",
    LOCAL_PULL_SNAPSHOT: "in-process pull+snapshot",
    RECORD_TURN: "RecordTurn", CLAIM_SESSION: "ClaimSession", GET_SESSION: "GetSession",
    ETCD_CLAIM: "etcd claim txn", GRPC_ECHO: "gRPC echo",
}
PROCESSES = ("client", "registry", "scheduler", "etcd")
# The plan operations measure a pull's plan and claim (plan_pull) and a recompute's: the scheduler's cost policy
# never continues these turns on D (on idle fake workers it would: a LOCAL plan claims the handle the same way).
PLAN_POLICY_PARAMS = "continue_on_decode=never"
ETCD_COUNTERS = {"etcd_disk_wal_write_bytes_total": "wal", "etcd_network_client_grpc_received_bytes_total": "received",
                 "etcd_network_client_grpc_sent_bytes_total": "sent",
                 "etcd_debugging_mvcc_total_put_size_in_bytes": "put"}

VOCAB = (100, 50_000)  # token ids are drawn from this range (a typical BPE vocabulary)
TEXT_CHARS_PER_TOKEN = 4  # the recorded text: about this many characters per token, as English BPE gives
WORKER_LEASE_TTL_S = 10
BENCH_MODEL = "bench"  # the model the fake workers serve and every benchmarked turn names
FLEET_LEASE_TTL_S = 3600  # --model-counts: the fleet's leases outlast the run (no keep-alives during it)
MODEL_OPS = (PLAN_DISABLE_PULL, LOCAL_DISABLE_PULL, PLAN_PULL_SNAPSHOT)  # --model-counts: what it measures
DECODE_KV_TTL_S = 3600  # the fake decode worker keeps KV long enough that no handle expires during the run
SETUP_CONCURRENCY = 16  # untimed recording of the sessions a cell needs
ECHO_METHOD = "/kvshuttle.bench.Echo/Echo"
ECHO_MODULE = "kvshuttle.services.devtools.bench.services_bench"  # ``python -m`` it with ``echo ADDRESS BYTES``

# The decision-rate goals of #17, printed next to what was measured.
GOAL_CLAIM_FREE_OPS = 5000.0  # claim-free PlanTurn/s
GOAL_P99_MS = 1.0  # claim-free PlanTurn p99
GOAL_CLAIM_RATIO = 0.5  # claiming PlanTurn/s as a fraction of etcd's own claim txn/s at the same concurrency
CLAIM_FREE = (LOCAL_DISABLE_PULL, LOCAL_RECOMPUTE, PLAN_DISABLE_PULL, PLAN_RECOMPUTE)
CLAIMING = (LOCAL_PULL_SNAPSHOT, PLAN_PULL_SNAPSHOT, PLAN_PULL)
# The operations each setting shapes (ServicesBenchConfig.validate_effects).
SCALED = (RECORD_TURN, CLAIM_SESSION, GET_SESSION)  # --scale-history-tokens
PROMPTED = (*PLANS, *LOCAL, GRPC_ECHO)  # --new-tokens: a PlanTurn prompt (the echo sends its bytes)
READS_SESSIONS = (PLAN_RECOMPUTE, PLAN_PULL, PLAN_PULL_SNAPSHOT, LOCAL_RECOMPUTE, LOCAL_PULL_SNAPSHOT)  # --claims
CHANNELED = tuple(op for op in OPERATIONS if op not in LOCAL and op != ETCD_CLAIM)  # --channels


@dataclasses.dataclass
class ServicesBenchConfig:
    """Microbenchmarks of the session registry and transfer scheduler (real etcd and processes, no vLLM)."""

    ENV_PREFIX = "KVSHUTTLE_BENCH_SERVICES_"
    concurrency: str = setting("1,4,16,64", "Concurrency levels (concurrent client coroutines), comma-separated")
    requests_per_level: int = setting(400, "Timed requests per operation and concurrency level (raised to the "
                                           "concurrency when lower)")
    warmup_requests: int = setting(20, "Untimed requests per operation before its first level")
    operations: str = setting(",".join(OPERATIONS), f"Operations to measure, comma-separated, among "
                                                    f"{', '.join(OPERATIONS)}")
    history_tokens: int = setting(4096, "Token ids per recorded turn (the conversation so far)")
    new_tokens: int = setting(64, "Tokens a PlanTurn prompt adds after the recorded history")
    turn_tokens: int = setting(1024, "Token ids each timed RecordTurn adds to its conversation (sent alone, after "
                                     "the recorded ones, as the gateway records a turn that continued its history)")
    scale_history_tokens: str = setting("", "Also measure RecordTurn, ClaimSession and GetSession (concurrency 1) "
                                            "at these history sizes, comma-separated (e.g. 1024,131072), and "
                                            "print each one's p50 as a ratio to the first size's")
    block_size: int = setting(16, "The fake decode worker's KV block size (tokens per hashed block)")
    model_counts: str = setting("", "Also measure claim-free and claiming plans (PlanTurn disable_pull, in-process "
                                    "disable_pull, PlanTurn pull+snapshot, those of them in --operations) at "
                                    "concurrency 1 with the fleet's workers serving this many models each, "
                                    "comma-separated (e.g. 1,20): every model has --fleet-workers / the largest count "
                                    "workers, so the turn's model keeps its workers while the others' grow; each p50 "
                                    "is printed as a ratio to the first count's")
    fleet_workers: int = setting(1000, "--model-counts: the fleet's workers at the largest count (half prefill, "
                                       "half decode)")
    channels: int = setting(1, "gRPC channels per service that the client coroutines share round-robin "
                               "(1: one connection, like one gateway)")
    claims: str = setting("etcd", "Where the scheduler reads session records and claims handles: etcd (directly, "
                                  "as `kvshuttle up` runs it) or registry (through the registry's gRPC API)",
                          choices=("etcd", "registry"))
    order: str = setting("operation", "Cell order: operation (each operation at every level, then the next) or "
                                       "level (every operation at one level, then the next level: the cells the goals "
                                       "compare run minutes closer in time on a machine whose load varies)",
                         choices=("operation", "level"))
    rpc_timeout_s: float = setting(10.0, "Deadline of each benchmarked RPC")
    startup_timeout_s: float = setting(60.0, "Seconds to wait for etcd, the registry and the scheduler")
    seed: int = setting(0, "Seed of the random token ids")
    out: str = setting("", "Output directory for services.json (default var/bench/services-<timestamp>)")
    work_dir: str = setting("", "Directory for the services' logs (default <out>/work)")
    log_level: str = setting("INFO", "Log level (also passed to the registry and scheduler)",
                             env="KVSHUTTLE_LOG_LEVEL")

    def levels(self) -> list[int]:
        return [int(x) for x in self.concurrency.split(",") if x.strip()]

    def operation_list(self) -> list[str]:
        return [x.strip() for x in self.operations.split(",") if x.strip()]

    def cells(self) -> list[tuple[str, int]]:
        """(operation, concurrency) in the order they run (--order)."""
        if self.order == "level":
            return [(op, c) for c in self.levels() for op in self.operation_list()]
        return [(op, c) for op in self.operation_list() for c in self.levels()]

    def scale_sizes(self) -> list[int]:
        return [int(x) for x in self.scale_history_tokens.split(",") if x.strip()]

    def model_count_list(self) -> list[int]:
        return sorted({int(x) for x in self.model_counts.split(",") if x.strip()})

    def validate(self) -> None:
        try:
            levels = self.levels()
        except ValueError:
            levels = []
        require(bool(levels) and all(c >= 1 for c in levels),
                "--concurrency must be a comma-separated list of integers >= 1, e.g. 1,4,16,64")
        ops = self.operation_list()
        unknown = [op for op in ops if op not in OPERATIONS]
        require(bool(ops) and not unknown, f"--operations: unknown {unknown}; choose among {', '.join(OPERATIONS)}")
        require(self.requests_per_level >= 1, "--requests-per-level must be >= 1")
        require(self.warmup_requests >= 0, "--warmup-requests must be >= 0")
        require(self.block_size >= 1, "--block-size must be >= 1")
        require(self.history_tokens >= 2 * self.block_size + 1 and self.history_tokens >= 32,
                "--history-tokens must be >= 32 and cover at least two blocks (a pull needs reusable blocks)")
        require(self.new_tokens >= 1, "--new-tokens must be >= 1")
        require(self.turn_tokens >= 1, "--turn-tokens must be >= 1")
        try:
            sizes = self.scale_sizes()
        except ValueError:
            sizes = [0]
        require(all(n >= max(32, 2 * self.block_size + 1) for n in sizes),
                "--scale-history-tokens must list integers that cover at least two blocks, e.g. 1024,131072")
        try:
            counts = self.model_count_list()
        except ValueError:
            counts = [0]
        require(all(n >= 1 for n in counts), "--model-counts must list integers >= 1, e.g. 1,20")
        require(not counts or self.fleet_workers >= 2 * max(counts),
                "--fleet-workers must give every model at least a prefill and a decode worker (>= 2 x the largest "
                "--model-counts)")
        require(self.channels >= 1, "--channels must be >= 1")
        require(self.rpc_timeout_s > 0 and self.startup_timeout_s > 0, "timeouts must be > 0")
        self.validate_effects(ops)

    def validate_effects(self, ops: Sequence[str]) -> None:
        """Settings that only some operations use, given without any of them: an error naming both flags."""
        def among(names: Sequence[str]) -> str:
            return f"without {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else f"without {names[0]}"

        require_effect(self, "scale_history_tokens", any(op in SCALED for op in ops),
                       f"{among(SCALED)} in --operations (the operations it measures at each size)")
        require_effect(self, "model_counts", any(op in MODEL_OPS for op in ops),
                       f"{among(MODEL_OPS)} in --operations (the plans it measures at each count)")
        require_effect(self, "fleet_workers", bool(self.model_counts), "without --model-counts")
        require_effect(self, "turn_tokens", RECORD_TURN in ops,
                       f"without {RECORD_TURN} in --operations (the ids each timed RecordTurn adds)")
        require_effect(self, "new_tokens", any(op in PROMPTED for op in ops),
                       f"{among(PROMPTED)} in --operations (the operations that send a PlanTurn prompt)")
        require_effect(self, "claims", any(op in READS_SESSIONS for op in ops),
                       f"{among(READS_SESSIONS)} in --operations (the plans that read session records and claim "
                       f"handles)")
        require_effect(self, "channels", any(op in CHANNELED for op in ops),
                       f"when --operations holds only in-process plans and {ETCD_CLAIM} (none of them uses the "
                       f"client's gRPC channels)")
        require_effect(self, "order", self.order == "operation" or (len(ops) > 1 and len(self.levels()) > 1),
                       "unless --operations lists more than one operation and --concurrency more than one level "
                       "(otherwise both orders are the same)")


def _reraise_if_cancelling() -> None:
    """Call in an ``except grpc.aio.AioRpcError`` block: re-raises a cancellation of the current task.

    grpc.aio can turn a cancellation that lands just as the answer arrives into an AioRpcError (even one with status
    OK) instead of CancelledError; a loop that counts RPC errors and goes on would then swallow Ctrl-C.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# -- the fake workers ----------------------------------------------------------------------------------------------

def fake_worker(worker_id: str, role: int, port: int, block_size: int, model: str = "bench") -> common_pb2.Worker:
    """A worker record as a worker agent registers it; nothing listens at its addresses."""
    return common_pb2.Worker(worker_id=worker_id, role=role, engine_id=f"bench-engine-{worker_id}",
                             grpc_address=f"127.0.0.1:{port}", nixl_host="127.0.0.1", nixl_port=port + 1,
                             block_size=block_size, kv_blocks_ttl_s=DECODE_KV_TTL_S, model=model)


def handle_for(decode: common_pb2.Worker, covered: int) -> str:
    """The decode worker's kv_transfer_params after a turn, covering ``covered`` tokens (as vLLM returns them)."""
    blocks = -(-covered // decode.block_size)
    return json.dumps({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": decode.engine_id,
                       "remote_host": decode.nixl_host, "remote_port": decode.nixl_port,
                       "remote_num_tokens": covered, "remote_block_ids": [list(range(1000, 1000 + blocks))],
                       "tp_size": 1})


class FakeWorkers:
    """One prefill and one decode worker, registered, with their leases kept alive until ``stop()``."""

    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub, block_size: int):
        self.registry = registry
        self.prefill = fake_worker("bench-p0", common_pb2.WORKER_ROLE_PREFILL, 7000, block_size)
        self.decode = fake_worker("bench-d0", common_pb2.WORKER_ROLE_DECODE, 7100, block_size)
        self.leases: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self.keepalive_failures = 0

    async def _register(self, worker: common_pb2.Worker) -> None:
        resp = await self.registry.RegisterWorker(
            registry_pb2.RegisterWorkerRequest(worker=worker, lease_ttl_s=WORKER_LEASE_TTL_S), timeout=10.0)
        self.leases[worker.worker_id] = resp.lease_id

    async def start(self) -> None:
        for worker in (self.prefill, self.decode):
            await self._register(worker)
        self._task = asyncio.create_task(self._keep_alive(), name="bench-keepalive")

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(WORKER_LEASE_TTL_S / 3)
            for worker in (self.prefill, self.decode):
                try:
                    await self.registry.KeepAlive(registry_pb2.KeepAliveRequest(
                        worker_id=worker.worker_id, lease_id=self.leases[worker.worker_id]), timeout=5.0)
                except grpc.aio.AioRpcError as exc:
                    _reraise_if_cancelling()
                    self.keepalive_failures += 1
                    log.warning("KeepAlive of %s failed (%s); registering again", worker.worker_id, exc.code().name)
                    try:
                        await self._register(worker)
                    except grpc.aio.AioRpcError as again:
                        _reraise_if_cancelling()
                        log.warning("re-registering %s failed (%s)", worker.worker_id, again.code().name)

    async def stop(self) -> None:
        """Stop the keep-alives (the records go with the benchmark's etcd)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


# -- the gRPC floor: a bare echo server ---------------------------------------------------------------------------

def echo_server_options() -> list[tuple[str, int]]:
    """The options a kvshuttle service's server runs with by default (``Server`` with ``--grpc-max-message-mb``)."""
    return _message_options(DEFAULT_MAX_MESSAGE_MB << 20)


async def serve_echo(address: str, reply_bytes: int) -> None:
    """A bare grpc.aio server: one unary method that answers every request with ``reply_bytes`` bytes, without
    parsing it (no interceptors; health only so that the benchmark sees it serving). Runs until cancelled."""
    reply = b"\x00" * reply_bytes

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply

    server = grpc.aio.server(options=echo_server_options())
    service, method = ECHO_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(echo)})])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"echo: cannot listen on {address}")  # the benchmark retries another port
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("echo serving on %s (%d-byte replies)", address, reply_bytes)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(0.5)


def echo_server_main(argv: Sequence[str]) -> None:
    """``python -m kvshuttle.services.devtools.bench.services_bench echo ADDRESS REPLY_BYTES`` (until SIGTERM)."""
    address, reply_bytes = argv[0], int(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await serve_echo(address, reply_bytes)

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


# -- the services under test -----------------------------------------------------------------------------------

def _proc_cpu_seconds(pid: int | None) -> float:
    """user+system CPU seconds of a process (all its threads) from /proc; NaN when it cannot be read."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)


class Services:
    """etcd, then the registry and the scheduler as child processes on free loopback ports."""

    def __init__(self, work: Path, log_level: str, startup_timeout_s: float, claims: str = "etcd"):
        self.logs = work / "logs"
        self.claims = claims
        self.log_level = log_level
        self.startup_timeout_s = startup_timeout_s
        self.etcd: EtcdProcess | None = None
        self.children: dict[str, ChildProcess] = {}
        self.registry_address = ""
        self.scheduler_address = ""
        self.echo_address = ""
        self.history_store = ""

    def _env(self) -> dict[str, str]:
        return {"KVSHUTTLE_ETCD_ENDPOINTS": self.etcd.endpoints if self.etcd else "",
                "KVSHUTTLE_REGISTRY_ADDRESS": self.registry_address, "KVSHUTTLE_LOG_LEVEL": self.log_level}

    async def start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        self.etcd = EtcdProcess("bench")
        await self.etcd.astart()
        log.info("etcd on %s (pid %s, data in %s)", self.etcd.endpoints, self.etcd.proc.pid if self.etcd.proc else None,
                 self.etcd.data_dir)
        self.history_store = f"sqlite:{self.logs.parent / 'history.db'}"  # as the local stack keeps it
        self.registry_address = await self._start_service("registry", deadline, "--history-store", self.history_store)
        self.scheduler_address = await self._start_service(
            "scheduler", deadline, "--etcd-endpoints", self.etcd.endpoints if self.claims == "etcd" else "",
            "--history-store", self.history_store if self.claims == "etcd" else "",
            "--load-poll-interval-s", "0",  # nothing listens at the fake workers: no GetLoads to poll
            "--policy-params", PLAN_POLICY_PARAMS)

    async def start_echo(self, reply_bytes: int) -> None:
        """The bare gRPC echo server (``echo_server_main``) in its own process, answering ``reply_bytes`` bytes."""
        deadline = time.monotonic() + self.startup_timeout_s
        self.echo_address = await self._start_service("echo", deadline, str(reply_bytes), module=ECHO_MODULE,
                                                      listen_flag="")

    async def _start_service(self, name: str, deadline: float, *args: str,
                             module: str = "kvshuttle.services.commands", listen_flag: str = "--listen") -> str:
        """Start ``python -m <module> <name> [<listen_flag>] 127.0.0.1:<free port> <args>`` (by default
        ``kvshuttle <name> --listen ...``); a port taken meanwhile is retried."""
        for attempt in range(3):
            address = f"127.0.0.1:{free_port()}"
            listen = [listen_flag, address] if listen_flag else [address]
            child = ChildProcess(name, [sys.executable, "-m", module, name, *listen, *args],
                                 self.logs / f"{name}.log", env=self._env(), stop_grace_s=10.0, cwd=REPO)
            self.children[name] = child
            await child.start()
            try:
                await self._wait_serving(child, address, deadline)
                return address
            except ChildProcessError:
                if attempt == 2 or "cannot listen" not in child.log_tail(20):
                    raise
                log.info("%s could not listen on %s; trying another port", name, address)
        raise AssertionError("unreachable")

    async def _wait_serving(self, child: ChildProcess, address: str, deadline: float) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if child.returncode is not None:
                    raise ChildProcessError(f"{child.name} exited with code {child.returncode}; its log "
                                            f"({child.log_path}) ends with:\n{child.log_tail(30)}")
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        log.info("%s serving on %s (pid %s)", child.name, address, child.pid)
                        return
                except grpc.aio.AioRpcError:
                    _reraise_if_cancelling()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} not serving on {address} in time:\n{child.log_tail(30)}")
                await asyncio.sleep(0.1)

    def describe(self) -> dict[str, dict]:
        etcd = {"address": self.etcd.endpoints, "pid": self.etcd.proc.pid if self.etcd.proc else None} \
            if self.etcd else {}
        out = {"etcd": etcd, "registry": {"address": self.registry_address, "pid": self._pid("registry")},
               "scheduler": {"address": self.scheduler_address, "pid": self._pid("scheduler")}}
        if "echo" in self.children:
            out["echo"] = {"address": self.echo_address, "pid": self._pid("echo")}
        return out

    def _pid(self, name: str) -> int | None:
        return self.children[name].pid if name in self.children else None

    def check_alive(self) -> None:
        for child in self.children.values():
            if child.returncode is not None:
                raise RuntimeError(f"{child.name} exited with code {child.returncode}; its log "
                                   f"({child.log_path}) ends with:\n{child.log_tail(30)}")
        if self.etcd is not None and not self.etcd.running:
            raise RuntimeError(f"etcd exited: {self.etcd.log_tail()}")

    def etcd_counters(self) -> dict[str, float]:
        """etcd's byte counters (its /metrics), by short name; {} when they cannot be read."""
        if self.etcd is None:
            return {}
        try:
            with urllib.request.urlopen(f"http://{self.etcd.endpoints}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ETCD_COUNTERS:
                out[ETCD_COUNTERS[name]] = float(value)
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the client (this process), the registry, the scheduler and etcd (and the echo
        server once started). Reads /proc."""
        out = {
            "client": time.process_time(),
            "registry": _proc_cpu_seconds(self._pid("registry")),
            "scheduler": _proc_cpu_seconds(self._pid("scheduler")),
            "etcd": _proc_cpu_seconds(self.etcd.proc.pid if self.etcd and self.etcd.proc else None),
        }
        if "echo" in self.children:
            out["echo"] = _proc_cpu_seconds(self._pid("echo"))
        return out

    async def stop(self) -> None:
        """Scheduler, registry, then etcd; each is stopped even when another fails to."""
        for name in reversed(list(self.children)):
            try:
                await self.children.pop(name).stop()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                log.exception("stopping %s failed", name)
        if self.etcd is not None:
            await self.etcd.astop()
            self.etcd = None


# -- the operations --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Stubs:
    registry: registry_pb2_grpc.SessionRegistryStub
    scheduler: scheduler_pb2_grpc.TransferSchedulerStub
    echo: grpc.aio.UnaryUnaryMultiCallable | None = None  # the bare echo's method (bytes in, bytes out)
    local: InProcessScheduler | None = None  # the planner in this process (local_* operations)


class Workload:
    """Builds each operation's requests (untimed setup included) and checks its answers."""

    def __init__(self, cfg: ServicesBenchConfig, setup: Stubs, decode: common_pb2.Worker,
                 history_tokens: int | None = None, etcd: EtcdStore | None = None):
        self.cfg = cfg
        self.etcd = etcd  # the client's own etcd connection (etcd_claim)
        self.echo_reply_bytes = 0  # what the echo server answers (grpc_echo): a real PlanTurn answer's size
        self.setup = setup
        self.decode = decode
        self.history_tokens = history_tokens or cfg.history_tokens
        self.rng = rng = random.Random(cfg.seed)
        self.history = [rng.randrange(*VOCAB) for _ in range(self.history_tokens)]
        self.prompt = self.history + [rng.randrange(*VOCAB) for _ in range(cfg.new_tokens)]
        self.packed = ids_bytes(self.prompt)  # as the gateway sends a plan's prompt (PlanTurnRequest.prompt_ids_packed)
        self.covered = self.history_tokens - 1  # D holds prompt + answer; its KV covers all but the last token
        self.handle = handle_for(decode, self.covered)
        self.text_chars = self.history_tokens * TEXT_CHARS_PER_TOKEN
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:06x}"
        self._cells = 0
        self.record_bytes: dict[str, int] = {}  # what one recorded turn stores in etcd (RecordTurn cells)

    def record_request(self, session_id: str) -> registry_pb2.RecordTurnRequest:
        """A whole-history record, as a gateway writes a session's first turn: the registry digests the ids."""
        return registry_pb2.RecordTurnRequest(session_id=session_id, decode_worker_id=self.decode.worker_id,
                                              kv_transfer_params_json=self.handle, token_ids=self.history,
                                              text_chars=self.text_chars, text_key=text_key(session_id),
                                              model=BENCH_MODEL)

    def turn_requests(self, session_id: str, first: registry_pb2.RecordTurnResponse,
                      turns: int) -> list[registry_pb2.RecordTurnRequest]:
        """``turns`` RecordTurns that each add ``turn_tokens`` ids to the conversation ``first`` recorded, the way
        the gateway records a turn that continued its history: only the new ids, with the prefix digests computed
        over all of them (here, untimed)."""
        ids, record, out = list(self.history), first.session, []
        lengths = [cp.tokens for cp in record.checkpoints]
        for k in range(turns):
            base = len(ids)
            ids.extend(self.rng.randrange(*VOCAB) for _ in range(self.cfg.turn_tokens))
            covered = len(ids) - 1
            lengths = checkpoint_lengths([*lengths, base - 1, base], base, covered)
            digests = prefix_digests(ids, [*lengths, covered])
            out.append(registry_pb2.RecordTurnRequest(
                session_id=session_id, decode_worker_id=self.decode.worker_id,
                kv_transfer_params_json=handle_for(self.decode, covered), token_ids=ids[base:],
                base_tokens=base, base_turn=record.turn + k, text_chars=4 * len(ids),
                text_key=text_key(f"{session_id}-{k}"), prefix_digest=digests[covered],
                checkpoints=[common_pb2.PrefixCheckpoint(tokens=n, digest=digests[n]) for n in lengths],
                model=BENCH_MODEL))
        return out

    def disable_pull_request(self, session_id: str) -> scheduler_pb2.PlanTurnRequest:
        return scheduler_pb2.PlanTurnRequest(session_id=session_id, prompt_ids_packed=self.packed, disable_pull=True,
                                             model=BENCH_MODEL)

    async def _record_many(self, session_ids: Sequence[str]) -> list[registry_pb2.RecordTurnResponse]:
        """Record each session once (untimed setup), a few at a time."""
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def one(session_id: str) -> registry_pb2.RecordTurnResponse:
            async with gate:
                return await self.setup.registry.RecordTurn(self.record_request(session_id),
                                                            timeout=self.cfg.rpc_timeout_s)

        return await asyncio.gather(*(one(s) for s in session_ids))

    async def _read_many(self, session_ids: Sequence[str]) -> list[registry_pb2.GetSessionResponse]:
        """Read each session once (untimed setup), a few at a time."""
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def one(session_id: str) -> registry_pb2.GetSessionResponse:
            async with gate:
                return await self.setup.registry.GetSession(registry_pb2.GetSessionRequest(session_id=session_id),
                                                            timeout=self.cfg.rpc_timeout_s)

        return await asyncio.gather(*(one(s) for s in session_ids))

    async def prepare(self, op: str, requests: int, concurrency: int) -> list[Any]:
        """One payload per request (request ``i`` is sent by coroutine ``i % concurrency``)."""
        op = LOCAL.get(op, op)  # an in-process plan takes the same requests
        self._cells += 1
        prefix = f"bench-{self.run_id}-{self._cells}"
        if op == PLAN_RECOMPUTE:  # never recorded
            return [scheduler_pb2.PlanTurnRequest(session_id=f"{prefix}-none-{i % concurrency}",
                                                  prompt_ids_packed=self.packed, model=BENCH_MODEL)
                    for i in range(concurrency)]
        if op == PLAN_DISABLE_PULL:  # recorded, but the request disables the pull
            await self._record_many([f"{prefix}-dp"])
            return [self.disable_pull_request(f"{prefix}-dp")]
        if op == PLAN_PULL:  # a fresh record per plan
            ids = [f"{prefix}-pull-{i}" for i in range(requests)]
            await self._record_many(ids)
            return [scheduler_pb2.PlanTurnRequest(session_id=s, prompt_ids_packed=self.packed, model=BENCH_MODEL)
                    for s in ids]
        if op == PLAN_PULL_SNAPSHOT:  # as the gateway plans: with the record it has just read (GetSession untimed)
            ids = [f"{prefix}-snap-{i}" for i in range(requests)]
            await self._record_many(ids)
            snapshots = await self._read_many(ids)
            for snap in snapshots:  # what the gateway sends: the record without its history
                snap.session.ClearField("token_ids")
            return [scheduler_pb2.PlanTurnRequest(session_id=s, prompt_ids_packed=self.packed, session_snapshot=snap,
                                                  model=BENCH_MODEL)
                    for s, snap in zip(ids, snapshots, strict=True)]
        if op == ETCD_CLAIM:  # a fresh record per claim, claimed with the scheduler's transaction
            if self.etcd is None:
                raise RuntimeError("etcd_claim needs the client's etcd connection")
            ids = [f"{prefix}-txn-{i}" for i in range(requests)]
            recorded = await self._record_many(ids)
            return [claim_txn(self.etcd.keys, r.session.tenant, s, r.session.revision, r.session.lease_id,
                              r.session.decode_worker_id) for s, r in zip(ids, recorded, strict=True)]
        if op == GRPC_ECHO:  # the bytes of a claim-free plan (the prompt's ids)
            return [self.disable_pull_request(f"{prefix}-echo").SerializeToString()]
        if op == CLAIM_SESSION:  # a fresh record per claim, claimed at the revision RecordTurn returned
            ids = [f"{prefix}-claim-{i}" for i in range(requests)]
            recorded = await self._record_many(ids)
            return [registry_pb2.ClaimSessionRequest(session_id=s, revision=r.session.revision)
                    for s, r in zip(ids, recorded, strict=True)]
        if op == RECORD_TURN:  # a conversation per request, recorded (untimed) at history_tokens: its next turn
            ids = [f"{prefix}-turn-{i}" for i in range(requests)]
            first = await self._record_many(ids)
            return [(await asyncio.to_thread(self.turn_requests, s, r, 1))[0] for s, r in zip(ids, first, strict=True)]
        ids = [f"{prefix}-conv-{k}" for k in range(concurrency)]  # one conversation per coroutine, recorded once
        await self._record_many(ids)
        if op == GET_SESSION:  # as a gateway without its own copy reads: the record and the exact ids
            return [registry_pb2.GetSessionRequest(session_id=s, include_token_ids=True) for s in ids]
        raise ValueError(f"unknown operation {op!r}")

    def invoke(self, op: str, stubs: Stubs, payload: Any) -> Any:
        """Start the RPC (the caller awaits and times it)."""
        timeout = self.cfg.rpc_timeout_s
        if op in LOCAL:
            return stubs.local.PlanTurn(payload, timeout=timeout)
        if op in PLANS:
            return stubs.scheduler.PlanTurn(payload, timeout=timeout)
        if op == ETCD_CLAIM:  # through the store's own call wrapper (deadline, retries, error mapping), as it claims
            return self.etcd.call("claim session", self.etcd.kv.txn, *payload)
        if op == GRPC_ECHO:
            return stubs.echo(payload, timeout=timeout)
        if op == RECORD_TURN:
            return stubs.registry.RecordTurn(payload, timeout=timeout)
        if op == CLAIM_SESSION:
            return stubs.registry.ClaimSession(payload, timeout=timeout)
        return stubs.registry.GetSession(payload, timeout=timeout)

    def check(self, op: str, resp: Any) -> str | None:
        """None when the answer is the expected one, otherwise what is wrong with it."""
        op = LOCAL.get(op, op)
        if op == ETCD_CLAIM:
            return None if resp.succeeded else "the claim transaction's compare failed"
        if op == GRPC_ECHO:
            return None if len(resp) == self.echo_reply_bytes else f"echo answered {len(resp)} bytes"
        if op in (PLAN_RECOMPUTE, PLAN_DISABLE_PULL):
            if resp.decision != scheduler_pb2.DECISION_RECOMPUTE:
                return f"expected RECOMPUTE, got {scheduler_pb2.Decision.Name(resp.decision)}: {resp.reason}"
            if op == PLAN_RECOMPUTE and resp.figures.session_found:
                return f"the plan found a session that was never recorded: {resp.reason}"
            return None
        if op in (PLAN_PULL, PLAN_PULL_SNAPSHOT):
            if resp.decision != scheduler_pb2.DECISION_PULL:
                return f"expected PULL, got {scheduler_pb2.Decision.Name(resp.decision)}: {resp.reason}"
            if resp.figures.reusable_tokens != self.covered:
                return f"pulled {resp.figures.reusable_tokens} tokens, expected {self.covered}"
            return None
        if op == RECORD_TURN:
            s = resp.session
            ok = (s.covered_tokens == self.covered + self.cfg.turn_tokens and s.turn == 2
                  and s.history_tokens == s.covered_tokens + 1 and bool(s.prefix_digest))
            if ok and not self.record_bytes:
                record = codec.stored_record(s)[1]
                self.record_bytes = {"record": len(record), "history_tokens": s.history_tokens,
                                     "handle": len(handle_for(self.decode, s.covered_tokens).encode()),
                                     "handle_in_record": not s.handle_digest}
            return None if ok else (f"recorded {s.covered_tokens} covered tokens of {s.history_tokens} at turn "
                                    f"{s.turn}, expected {self.covered + self.cfg.turn_tokens} at turn 2")
        if op == CLAIM_SESSION:
            return None if resp.claimed else f"claim refused: {resp.reason}"
        if list(resp.session.token_ids) != self.history:
            return (f"got {len(resp.session.token_ids)} token ids (missing: {resp.history_missing!r}), expected the "
                    f"{self.history_tokens} recorded")
        return None


@dataclasses.dataclass
class CellResult:
    operation: str
    label: str
    concurrency: int
    requests: int
    ok: int
    errors: int
    wall_s: float
    ops_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    cpu_ms_per_op: dict[str, float]
    error_samples: list[str]
    history_tokens: int = 0
    models: int = 0  # --model-counts cells: the models the fleet's workers served
    # etcd's own counters over the cell, per request: WAL bytes written, client bytes received and sent, bytes put
    etcd_bytes_per_op: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return _json_safe(out)


def _json_safe(value: Any) -> Any:
    """NaN/inf become null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


async def run_cell(workload: Workload, services: Services, stubs: Sequence[Stubs], op: str, concurrency: int,
                   requests: int) -> CellResult:
    """``requests`` timed requests of ``op`` from ``concurrency`` coroutines (coroutine k sends requests
    k, k+concurrency, ...; it uses channel k % len(stubs))."""
    requests = max(requests, concurrency)
    payloads = await workload.prepare(op, requests, concurrency)
    latencies: list[float] = []
    errors: list[str] = []

    async def client(k: int) -> None:
        stub = stubs[k % len(stubs)]
        for i in range(k, requests, concurrency):
            payload = payloads[i % len(payloads)]
            started = time.perf_counter()
            try:
                resp = await workload.invoke(op, stub, payload)
            except grpc.aio.AioRpcError as exc:
                _reraise_if_cancelling()
                errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            except StoreError as exc:  # etcd_claim
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            wrong = workload.check(op, resp)
            if wrong is None:
                latencies.append(elapsed)
            else:
                errors.append(wrong)

    cpu_before = await asyncio.to_thread(services.cpu_seconds)
    etcd_before = await asyncio.to_thread(services.etcd_counters)
    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    cpu_after = await asyncio.to_thread(services.cpu_seconds)
    etcd_after = await asyncio.to_thread(services.etcd_counters)
    services.check_alive()

    ms = [x * 1000.0 for x in latencies]
    done = len(ms) + len(errors)
    return CellResult(
        operation=op, label=LABELS[op], concurrency=concurrency, requests=done, ok=len(ms), errors=len(errors),
        wall_s=wall, ops_per_s=len(ms) / wall if wall > 0 else math.nan,
        p50_ms=percentile(ms, 50) if ms else math.nan, p99_ms=percentile(ms, 99) if ms else math.nan,
        mean_ms=sum(ms) / len(ms) if ms else math.nan, max_ms=max(ms) if ms else math.nan,
        cpu_ms_per_op={p: (cpu_after[p] - cpu_before.get(p, math.nan)) * 1000.0 / done if done else math.nan
                       for p in cpu_after},
        error_samples=list(dict.fromkeys(errors))[:3], history_tokens=workload.history_tokens,
        etcd_bytes_per_op={k: (etcd_after[k] - etcd_before[k]) / done for k in etcd_after if k in etcd_before and done},
    )


# -- output ----------------------------------------------------------------------------------------------------

_COLUMNS = [("operation", 22, "<"), ("conc", 5, ">"), ("requests", 8, ">"), ("ops/s", 9, ">"), ("p50 ms", 8, ">"),
            ("p99 ms", 8, ">"), ("errors", 6, ">"), ("cpu ms/op client/registry/scheduler/etcd", 41, ">")]


def table_header() -> str:
    head = "  ".join(f"{name:{align}{width}}" for name, width, align in _COLUMNS)
    return f"{head}\n{'-' * len(head)}"


def _num(value: float, digits: int) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{digits}f}"


def table_row(r: CellResult) -> str:
    cpu = " / ".join(_num(r.cpu_ms_per_op.get(p, math.nan), 2) for p in PROCESSES)
    cells = [r.label, str(r.concurrency), str(r.requests), _num(r.ops_per_s, 0), _num(r.p50_ms, 2),
             _num(r.p99_ms, 2), str(r.errors), cpu]
    row = "  ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS, strict=True))
    if r.operation == GRPC_ECHO and "echo" in r.cpu_ms_per_op:
        row += f"  (echo server {_num(r.cpu_ms_per_op['echo'], 2)})"
    return row


# -- the goals ---------------------------------------------------------------------------------------------------

def _levels_of(results: Sequence[CellResult], op: str) -> dict[int, CellResult]:
    """``op``'s cells of the main table by concurrency (not the --scale-history-tokens ones)."""
    return {r.concurrency: r for r in results if r.operation == op and r.label == LABELS[op]}


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is missing or b is not positive."""
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def series_floor_ratio(echo_ops: float, etcd_ops: float) -> float:
    """The most a claiming plan (one gRPC hop, then one claim transaction, on the same cores) can reach as a
    fraction of the transaction alone: 1 / (1/echo + 1/etcd) / etcd = echo / (echo + etcd)."""
    return ratio(echo_ops, echo_ops + etcd_ops)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _rate(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.0f}/s"


def _finite(value: float, default: float) -> float:
    return value if math.isfinite(value) else default


def goals(results: Sequence[CellResult]) -> dict:
    """The decision-rate goals of #17 next to the measured cells, with the floor that stops a missed one.

    Claim-free PlanTurn (``disable_pull``, ``recompute``): its best rate against GOAL_CLAIM_FREE_OPS, its best p99
    against GOAL_P99_MS, and its rate as a ratio to the bare gRPC echo at each concurrency; a missed goal is the gRPC
    floor's when the echo itself misses it, else the plan's own work. Claiming PlanTurn (``pull+snapshot``,
    ``pull``): its rate as a ratio to the bare etcd claim transaction at each concurrency, against GOAL_CLAIM_RATIO;
    a missed level is the gRPC floor's when a gRPC hop plus the transaction on the same cores cannot reach the goal
    (``series_floor_ratio``), else the scheduler's own work. Returns the figures and the lines to print.
    """
    echo, etcd = _levels_of(results, GRPC_ECHO), _levels_of(results, ETCD_CLAIM)
    out: dict[str, Any] = {"goals": {"claim_free_ops_per_s": GOAL_CLAIM_FREE_OPS, "claim_free_p99_ms": GOAL_P99_MS,
                                     "claiming_to_etcd_ratio": GOAL_CLAIM_RATIO},
                           "grpc_floor": {c: r.ops_per_s for c, r in sorted(echo.items())},
                           "etcd_limit": {c: r.ops_per_s for c, r in sorted(etcd.items())},
                           "claim_free": {}, "claiming": {}, "lines": []}
    lines: list[str] = out["lines"]
    lines.append(f"goals (#17): claim-free PlanTurn >= {GOAL_CLAIM_FREE_OPS:,.0f}/s at p99 <= {GOAL_P99_MS:g} ms; "
                 f"claiming PlanTurn >= {GOAL_CLAIM_RATIO:g}x etcd's own claim txn rate at the same concurrency")
    echo_peak = max(echo.values(), key=lambda r: _finite(r.ops_per_s, -1.0)) if echo else None
    echo_p99 = min(echo.values(), key=lambda r: _finite(r.p99_ms, math.inf)) if echo else None
    for op in CLAIM_FREE:
        cells = _levels_of(results, op)
        if not cells:
            continue
        peak = max(cells.values(), key=lambda r: _finite(r.ops_per_s, -1.0))
        fastest = min(cells.values(), key=lambda r: _finite(r.p99_ms, math.inf))
        rate_ok = peak.ops_per_s >= GOAL_CLAIM_FREE_OPS
        p99_ok = fastest.p99_ms <= GOAL_P99_MS
        both_ok = any(r.ops_per_s >= GOAL_CLAIM_FREE_OPS and r.p99_ms <= GOAL_P99_MS for r in cells.values())
        to_echo = {c: ratio(cells[c].ops_per_s, echo[c].ops_per_s) for c in sorted(cells) if c in echo}
        rate_floor = p99_floor = ""
        if op in LOCAL:  # no gRPC under it: what stops it is the planner's own work
            rate_floor, p99_floor = "" if rate_ok else "planner", "" if p99_ok else "planner"
        elif echo_peak is not None:
            rate_floor = "" if rate_ok else "grpc" if echo_peak.ops_per_s < GOAL_CLAIM_FREE_OPS else "planturn"
            p99_floor = "" if p99_ok else "grpc" if echo_p99.p99_ms > GOAL_P99_MS else "planturn"
        out["claim_free"][op] = {
            "peak_ops_per_s": peak.ops_per_s, "peak_concurrency": peak.concurrency, "peak_p99_ms": peak.p99_ms,
            "best_p99_ms": fastest.p99_ms, "best_p99_concurrency": fastest.concurrency,
            "rate_met": rate_ok, "p99_met": p99_ok, "met": both_ok, "to_grpc_floor": to_echo,
            "rate_floor": rate_floor, "p99_floor": p99_floor}
        lines.append(f"{LABELS[op]}: peak {_rate(peak.ops_per_s)} at conc {peak.concurrency} (p99 "
                     f"{_num(peak.p99_ms, 2)} ms; goal >= {GOAL_CLAIM_FREE_OPS:,.0f}/s: {_met(rate_ok)}); best p99 "
                     f"{_num(fastest.p99_ms, 2)} ms at conc {fastest.concurrency} (goal <= {GOAL_P99_MS:g} ms: "
                     f"{_met(p99_ok)}); both at once: {_met(both_ok)}")
        if op in LOCAL:
            for missed, floor in (("rate", rate_floor), ("p99", p99_floor)):
                if floor:
                    lines.append(f"  {missed}: {_floor_words(floor)}")
            continue
        if echo_peak is None:
            lines.append("  no gRPC floor measured (add grpc_echo to --operations to name the floor)")
            continue
        lines.append("  vs the gRPC floor (bare echo), ratio at each conc: " + ", ".join(
            f"{c}: {x:.2f}x" for c, x in to_echo.items()))
        if not rate_ok:
            lines.append(f"  rate: {_floor_words(rate_floor)}: the bare echo peaks at {_rate(echo_peak.ops_per_s)} "
                         f"(conc {echo_peak.concurrency}), this plan at "
                         f"{ratio(peak.ops_per_s, echo_peak.ops_per_s):.2f}x of that")
        if not p99_ok:
            lines.append(f"  p99: {_floor_words(p99_floor)}: the bare echo's best p99 is "
                         f"{_num(echo_p99.p99_ms, 2)} ms (conc {echo_p99.concurrency})")
    for op in CLAIMING:
        cells = _levels_of(results, op)
        if not cells:
            continue
        if not etcd:
            lines.append(f"{LABELS[op]}: no etcd limit measured (add etcd_claim to --operations)")
            continue
        levels = [c for c in sorted(cells) if c in etcd]
        to_etcd = {c: ratio(cells[c].ops_per_s, etcd[c].ops_per_s) for c in levels}
        met = {c: to_etcd[c] >= GOAL_CLAIM_RATIO for c in levels}
        floor = {c: series_floor_ratio(echo[c].ops_per_s, etcd[c].ops_per_s) for c in levels if c in echo}
        if op in LOCAL:  # no gRPC hop: the planner's work and the txn's, on the same cores
            floor = {}
        stopped = {c: ("" if met[c] else "planner" if op in LOCAL else
                       "grpc" if floor.get(c, math.nan) < GOAL_CLAIM_RATIO else
                       "scheduler" if c in floor else "") for c in levels}
        out["claiming"][op] = {"to_etcd_limit": to_etcd, "met": met, "floor_ratio": floor, "floor": stopped}
        missed = [c for c in levels if not met[c]]
        each = ", ".join(f"{c}: {to_etcd[c]:.2f}x ({_rate(cells[c].ops_per_s)} of {_rate(etcd[c].ops_per_s)})"
                         for c in levels)
        verdict = f"MISSED at conc {', '.join(map(str, missed))}" if missed else "met"
        lines.append(f"{LABELS[op]} vs etcd's claim txn, ratio at each conc (goal >= {GOAL_CLAIM_RATIO:g}x): {each}; "
                     f"{verdict}")
        for c in missed:
            if op in LOCAL:
                lines.append(f"  conc {c}: {_floor_words('planner')}")
            elif c not in floor:
                lines.append(f"  conc {c}: no gRPC floor measured at this concurrency")
            elif stopped[c] == "grpc":
                lines.append(f"  conc {c}: {_floor_words('grpc')}: a gRPC hop ({_rate(echo[c].ops_per_s)} bare) plus "
                             f"the txn on the same cores reach at most {floor[c]:.2f}x (this plan: {to_etcd[c]:.2f}x)")
            else:
                lines.append(f"  conc {c}: not the floors (a gRPC hop plus the txn allow {floor[c]:.2f}x): "
                             f"{_floor_words('scheduler')}")
    return out


def _floor_words(floor: str) -> str:
    return {"grpc": "stopped by the gRPC floor",
            "planturn": "not the gRPC floor; stopped by PlanTurn's own work (the scheduler's handler and layers)",
            "scheduler": "stopped by the scheduler's own work (planning, the prompt's digest, the store's client)",
            "planner": "stopped by the planner's own work in this process (no gRPC hop: planning, the prompt's "
                       "digest, the store's client, on the client's event loop)",
            }.get(floor, "no floor measured")


async def _etcd_version() -> str:
    try:
        proc = await asyncio.create_subprocess_exec(ETCD_BIN, "--version", stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
        return out.decode(errors="replace").splitlines()[0].split(":", 1)[-1].strip()
    except (OSError, TimeoutError, IndexError):
        return "unknown"


def _write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


# -- the run ---------------------------------------------------------------------------------------------------

async def run_benchmark(cfg: ServicesBenchConfig, emit: Callable[[str], None] = print) -> tuple[dict, Path]:
    """Start the services, measure every operation at every level, stop everything; returns (report, JSON path).

    ``emit`` gets the table's lines as they are measured.
    """
    out = Path(cfg.out or f"var/bench/services-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    work = Path(cfg.work_dir).resolve() if cfg.work_dir else out / "work"
    started_at = time.time()
    environment = {"cpus": os.cpu_count(), "load_average_at_start": list(os.getloadavg()),
                   "python": platform.python_version(), "grpcio": grpc.__version__,
                   "etcd": await _etcd_version(), "platform": platform.platform()}
    services = Services(work, cfg.log_level, cfg.startup_timeout_s, cfg.claims)
    results: list[CellResult] = []
    channels: list[grpc.aio.Channel] = []
    workers: FakeWorkers | None = None
    etcd_client: EtcdStore | None = None
    embedded: SchedulerService | None = None
    processes: dict[str, dict] = {}
    summary: dict = {}
    try:
        await services.start()
        processes = services.describe()
        for _ in range(cfg.channels):
            channels += [client_channel(services.registry_address), client_channel(services.scheduler_address)]
        stubs = [Stubs(registry_pb2_grpc.SessionRegistryStub(channels[2 * i]),
                       scheduler_pb2_grpc.TransferSchedulerStub(channels[2 * i + 1])) for i in range(cfg.channels)]
        workers = FakeWorkers(stubs[0].registry, cfg.block_size)
        await workers.start()
        workload = Workload(cfg, stubs[0], workers.decode)
        await _wait_scheduler_ready(stubs[0].scheduler, workload, cfg.startup_timeout_s)
        if ETCD_CLAIM in cfg.operation_list():  # the client's own etcd connection, as the scheduler holds one
            etcd_client = EtcdStore(services.etcd.endpoints, timeout_s=cfg.rpc_timeout_s)
            await etcd_client.connect()
            workload.etcd = etcd_client
        if GRPC_ECHO in cfg.operation_list():  # answering as many bytes as a real claim-free plan's answer
            probe = await stubs[0].scheduler.PlanTurn(workload.disable_pull_request(f"bench-{workload.run_id}-probe"),
                                                      timeout=cfg.rpc_timeout_s)
            workload.echo_reply_bytes = probe.ByteSize()
            await services.start_echo(workload.echo_reply_bytes)
            for stub in stubs:
                channels.append(client_channel(services.echo_address))
                stub.echo = channels[-1].unary_unary(ECHO_METHOD)
        if any(op in LOCAL for op in cfg.operation_list()):
            embedded = await _start_embedded(services)
            for stub in stubs:
                stub.local = InProcessScheduler(embedded.planning)
            await _wait_scheduler_ready(stubs[0].local, workload, cfg.startup_timeout_s)
        processes = services.describe()

        emit(table_header())
        warmed: set[str] = set()
        for op, concurrency in cfg.cells():
            if cfg.warmup_requests and op not in warmed:
                warmed.add(op)
                warm = await run_cell(workload, services, stubs, op, min(4, cfg.warmup_requests), cfg.warmup_requests)
                if warm.errors:
                    log.warning("%s warm-up: %d errors, e.g. %s", op, warm.errors, warm.error_samples)
            result = await run_cell(workload, services, stubs, op, concurrency, cfg.requests_per_level)
            results.append(result)
            emit(table_row(result))
            if result.errors:
                log.warning("%s at concurrency %d: %d errors, e.g. %s", op, concurrency, result.errors,
                            result.error_samples)
        if any(op in cfg.operation_list() for op in (*CLAIM_FREE, *CLAIMING)):
            summary = goals(results)
            emit("")
            for line in summary["lines"]:
                emit(line)
        scaled = await _run_scaled(cfg, services, stubs, workers.decode, emit) if cfg.scale_sizes() else []
        results += scaled
        if cfg.model_count_list():
            results += await _run_models(cfg, services, stubs, workload, embedded, emit)
    finally:
        if embedded is not None:
            await embedded.stop()
        if workers is not None:
            await workers.stop()
        if etcd_client is not None:
            await etcd_client.close()
        for channel in channels:
            await channel.close()
        await services.stop()

    report = {
        "benchmark": "services",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started_at)),
        "duration_s": round(time.time() - started_at, 3),
        "config": dataclasses.asdict(cfg),
        "setup": {
            "client": "one process, one event loop; `concurrency` coroutines, closed loop, "
                      f"{cfg.channels} grpc.aio channel(s) per service shared round-robin",
            "services": "etcd, registry and scheduler as separate processes on loopback",
            "scheduler_claims": f"session reads and claims via {cfg.claims}",
            "history_tokens": cfg.history_tokens, "covered_tokens": workload.covered,
            "prompt_tokens": len(workload.prompt), "block_size": cfg.block_size,
            "blocks_per_record": -(-workload.covered // cfg.block_size), "text_chars": workload.text_chars,
            "keepalive_failures": workers.keepalive_failures if workers else 0,
            "etcd_claim": "the claim transaction of EtcdStore.claims.claim, sent from the client process through "
                          "EtcdStore (one channel)",
            "grpc_echo": {"server": "bare grpc.aio unary method in its own process, the services' default server "
                                    "options, no interceptors",
                          "request_bytes": workload.disable_pull_request("x").ByteSize(),
                          "reply_bytes": workload.echo_reply_bytes},
        },
        "processes": processes,
        "environment": {**environment, "load_average_at_end": list(os.getloadavg())},
        "logs": str(work / "logs"),
        "results": [r.to_dict() for r in results],
        "record_bytes": workload.record_bytes,
        "scaling": _scaling(results, cfg),
        "models": _by_models(results, cfg),
        "goals": _json_safe(summary),
    }
    path = out / "services.json"
    await asyncio.to_thread(_write_json, path, report)
    return report, path


async def _run_scaled(cfg: ServicesBenchConfig, services: Services, stubs: Sequence[Stubs],
                      decode: common_pb2.Worker, emit: Callable[[str], None]) -> list[CellResult]:
    """RecordTurn, ClaimSession and GetSession at concurrency 1 at each --scale-history-tokens size; then the
    p50 ratios to the first size, and what a turn writes to etcd."""
    results: list[CellResult] = []
    emit(f"\nat each history size (concurrency 1; RecordTurn adds {cfg.turn_tokens} ids a turn):")
    for size in cfg.scale_sizes():
        workload = Workload(cfg, stubs[0], decode, size)
        for op in (o for o in SCALED if o in cfg.operation_list()):
            if cfg.warmup_requests:
                await run_cell(workload, services, stubs, op, 1, min(cfg.warmup_requests, 5))
            result = await run_cell(workload, services, stubs, op, 1, cfg.requests_per_level)
            result.label = f"{LABELS[op]} @{size}"
            results.append(result)
            emit(table_row(result))
            if op == RECORD_TURN and workload.record_bytes:
                b, e = workload.record_bytes, result.etcd_bytes_per_op
                where = "in it" if b["handle_in_record"] else "in the history store"
                emit(f"{'':24}etcd record {b['record']} B (handle {b['handle']} B, {where}) at {b['history_tokens']} ids; "
                     f"per turn: WAL {e.get('wal', math.nan):.0f} B, put {e.get('put', math.nan):.0f} B, sent "
                     f"{e.get('sent', math.nan):.0f} B; the turn's new ids: {4 * cfg.turn_tokens} B")
    for line in _scaling(results, cfg).get("lines", []):
        emit(line)
    return results


class Fleet:
    """--model-counts: more fake workers, registered on long leases (no keep-alives while plans are timed), serving
    ``bench`` (the turn's model: the bench pair and more) and ``bench-m1``... (the others)."""

    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub, block_size: int, per_model: int):
        self.registry, self.block_size, self.per_model = registry, block_size, per_model
        self.registered: list[tuple[str, int]] = []  # (worker id, lease id)
        self.models = 1  # "bench", with the bench pair's 2 workers so far
        self._port = 20000

    async def _register(self, model: str, count: int) -> None:
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def one(i: int) -> None:
            role = common_pb2.WORKER_ROLE_PREFILL if i % 2 == 0 else common_pb2.WORKER_ROLE_DECODE
            async with gate:
                self._port += 2
                worker = fake_worker(f"fleet-{model}-{i}", role, self._port, self.block_size, model)
                resp = await self.registry.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                    worker=worker, lease_ttl_s=FLEET_LEASE_TTL_S), timeout=10.0)
                self.registered.append((worker.worker_id, resp.lease_id))

        await asyncio.gather(*(one(i) for i in range(count)))

    async def grow_to(self, models: int) -> str:
        """Register workers until ``models`` models have ``per_model`` workers each; returns the last model's name
        (registered last: a scheduler that plans on it has seen every worker, as its watch is in order)."""
        if len(self.registered) == 0:
            await self._register(BENCH_MODEL, self.per_model - 2)
        last = BENCH_MODEL
        while self.models < models:
            last = f"{BENCH_MODEL}-m{self.models}"
            await self._register(last, self.per_model)
            self.models += 1
        return last

    async def stop(self) -> None:
        for worker_id, lease_id in self.registered:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.registry.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(
                    worker_id=worker_id, lease_id=lease_id), timeout=10.0)
        self.registered.clear()


async def _run_models(cfg: ServicesBenchConfig, services: Services, stubs: Sequence[Stubs], workload: Workload,
                      embedded: SchedulerService | None, emit: Callable[[str], None]) -> list[CellResult]:
    """The plans of MODEL_OPS at concurrency 1 at each --model-counts count; then the p50 ratios to the first."""
    counts, results = cfg.model_count_list(), []
    fleet = Fleet(stubs[0].registry, cfg.block_size, cfg.fleet_workers // max(counts))
    emit(f"\nat each number of models ({fleet.per_model} workers each; concurrency 1; the turn names its model):")
    try:
        for n in counts:
            last = await fleet.grow_to(n)
            await _wait_scheduler_ready(stubs[0].scheduler, workload, cfg.startup_timeout_s, last)
            if embedded is not None:
                await _wait_scheduler_ready(stubs[0].local, workload, cfg.startup_timeout_s, last)
            for op in (o for o in MODEL_OPS if o in cfg.operation_list()):
                if cfg.warmup_requests:
                    await run_cell(workload, services, stubs, op, 1, min(cfg.warmup_requests, 5))
                result = await run_cell(workload, services, stubs, op, 1, cfg.requests_per_level)
                result.label, result.models = f"{LABELS[op]} x{n} models", n
                results.append(result)
                emit(table_row(result))
    finally:
        await fleet.stop()
    for line in _by_models(results, cfg).get("lines", []):
        emit(line)
    return results


def _by_models(results: Sequence[CellResult], cfg: ServicesBenchConfig) -> dict:
    """Each --model-counts operation's p50 at every count as a ratio to its p50 at the first count."""
    counts = cfg.model_count_list()
    if not counts:
        return {}
    out = _p50_ratios(results, MODEL_OPS, counts, lambda r: r.models,
                      f"{counts[0]} model{'s' * (counts[0] > 1)}", digits=3)
    return {"counts": counts, "workers_per_model": cfg.fleet_workers // max(counts), **out}


def _scaling(results: Sequence[CellResult], cfg: ServicesBenchConfig) -> dict:
    """Each scaled operation's p50 at every size as a ratio to its p50 at the first size."""
    sizes = cfg.scale_sizes()
    if not sizes:
        return {}
    out = _p50_ratios(results, SCALED, sizes,
                      lambda r: r.history_tokens if r.label.startswith(LABELS[r.operation] + " @") else 0,
                      f"{sizes[0]} ids", digits=2)
    return {"sizes": sizes, **out}


def _p50_ratios(results: Sequence[CellResult], ops: Sequence[str], points: Sequence[int],
                point_of: Callable[[CellResult], int], first: str, digits: int) -> dict:
    """For each of ``ops``: its cells' p50 at every one of ``points`` (``point_of`` a cell: 0 for none) as a ratio
    to the first point's, and a line saying so (``first`` names the first point)."""
    out: dict[str, Any] = {"ratios": {}, "lines": []}
    for op in ops:
        cells = {point_of(r): r for r in results if r.operation == op and point_of(r)}
        base = cells.get(points[0])
        if base is None or not math.isfinite(base.p50_ms):
            continue
        ratios = {n: cells[n].p50_ms / base.p50_ms for n in points if n in cells}
        out["ratios"][op] = ratios
        out["lines"].append(f"{LABELS[op]} p50 vs {first}: " + ", ".join(
            f"{n}: {r:.2f}x ({cells[n].p50_ms:.{digits}f} ms)" for n, r in ratios.items()))
    return out


async def _start_embedded(services: Services) -> SchedulerService:
    """The scheduler inside this (the client's) process, configured as the scheduler process is, as a gateway with
    --scheduler local runs it; it joins the scheduler process's shared learning."""
    etcd = services.claims == "etcd"
    service = SchedulerService(SchedulerConfig(
        listen="127.0.0.1:0", registry=services.registry_address,
        etcd_endpoints=services.etcd.endpoints if etcd and services.etcd else "",
        history_store=services.history_store if etcd else "", load_poll_interval_s=0,
        policy_params=PLAN_POLICY_PARAMS))
    await service.start()
    return service


async def _wait_scheduler_ready(scheduler: scheduler_pb2_grpc.TransferSchedulerStub, workload: Workload,
                                timeout_s: float, model: str = BENCH_MODEL) -> None:
    """Until the scheduler's worker view (WatchWorkers) holds a prefill and a decode worker of ``model`` and it
    answers a plan."""
    deadline = time.monotonic() + timeout_s
    request = scheduler_pb2.PlanTurnRequest(session_id=f"bench-{workload.run_id}-ready",
                                            prompt_token_ids=workload.prompt[:64], model=model)
    while True:
        try:
            await scheduler.PlanTurn(request, timeout=5.0)
            return
        except grpc.aio.AioRpcError as exc:
            _reraise_if_cancelling()
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _main(cfg: ServicesBenchConfig) -> None:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # stop the children, then exit
    try:
        _, path = await run_benchmark(cfg, emit=lambda line: print(line, flush=True))
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    print(f"\nwrote {path}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(ServicesBenchConfig, argv, prog="kvshuttle bench-services")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if shutil.which(ETCD_BIN) is None and not os.path.isfile(ETCD_BIN):
        raise SystemExit("etcd is not installed: run `make install` (installs Debian's etcd-server)")
    try:
        asyncio.run(_main(cfg))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except asyncio.CancelledError:  # SIGTERM
        raise SystemExit(143) from None


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"]:
        echo_server_main(sys.argv[2:])
    else:
        main()
