"""`kvshuttle worker`: run one vLLM gRPC server and keep it registered with the session registry.

Start-up: start vLLM, wait for grpc.health SERVING (failing fast when the process exits), read the engine id and
block size, send one tiny warm-up request, register, print ``KVSHUTTLE_WORKER_READY <json>`` on stdout.
Then: keep the lease alive (re-registering whenever the lease is lost or the registry was away), and watch vLLM;
when it dies (process exit, or the engine reports NOT_SERVING), deregister and exit 1. SIGTERM/SIGINT: deregister,
stop vLLM, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TextIO

import grpc
from kvshuttle.control_plane.kv_size import kv_bytes_per_token
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import load
from kvshuttle.services.common.telemetry import setup_tracing, shutdown_tracing
from kvshuttle.services.common.tls import ClientTls
from kvshuttle.services.engine.client import EngineClient, EngineError, ServerInfo, fast_reconnect_channel
from kvshuttle.services.store.kv_feed import KvFeedPublisher
from kvshuttle.services.store.load_feed import LoadFeedPublisher
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from kvshuttle.workers.kv_feed import KvFeedAgent
from kvshuttle.workers.load_feed import LoadFeedAgent
from kvshuttle.workers.lora_modules import AdapterError, AdapterSet
from kvshuttle.workers.vllm_process import VllmProcess, WorkerConfig, vllm_command

log = logging.getLogger("kvshuttle.worker")

READY_MARKER = "KVSHUTTLE_WORKER_READY"
ROLE_ENUM = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


class AgentError(RuntimeError):
    """Start-up failed (vLLM exited, never became ready, or its first request failed)."""


class RegistryLink:
    """The worker's registration: registers, keeps the lease alive, and re-registers under a new lease after a
    NOT_FOUND or after the registry has been unreachable for longer than the lease TTL. ``run`` never gives up.
    """

    def __init__(self, address: str, worker: common_pb2.Worker, ttl_s: int, *,
                 on_registered: Callable[[registry_pb2.RegisterWorkerResponse], None] | None = None,
                 retry_s: float = 1.0, max_retry_s: float = 5.0, tls: ClientTls | None = None):
        self.address = address
        self.worker = worker
        self.ttl_s = ttl_s
        self.granted_ttl_s = float(ttl_s)
        self.on_registered = on_registered
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.lease_id = 0
        self.registrations = 0
        self.keepalives = 0
        self.registered = asyncio.Event()
        self._changed = asyncio.Event()  # the record changed (update): register it again
        self._channel = fast_reconnect_channel(address, tls)  # notices a returning registry within ~2 s
        self._stub = registry_pb2_grpc.SessionRegistryStub(self._channel)

    def metrics_state(self) -> metrics.WorkerState:
        """Registrations so far and whether the lease is held now, for the worker's /metrics."""
        return metrics.WorkerState(registrations=self.registrations, registered=self.registered.is_set())

    async def run(self) -> None:
        while True:
            await self._register()
            await self._keep_alive()
            self.registered.clear()

    def update(self, worker: common_pb2.Worker) -> None:
        """Register ``worker`` (this worker's record, changed: e.g. its adapters) in place of the registered one."""
        self.worker = worker
        self._changed.set()

    async def _register(self) -> None:
        self._changed.clear()
        delay, failing = self.retry_s, False
        request = registry_pb2.RegisterWorkerRequest(worker=self.worker, lease_ttl_s=self.ttl_s)
        while True:
            try:
                resp = await self._stub.RegisterWorker(request, timeout=max(2.0, self.ttl_s / 3))
                break
            except grpc.aio.AioRpcError as exc:
                if not failing:
                    log.warning("registry %s: register failed (%s: %s); retrying", self.address,
                                exc.code().name, exc.details())
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_retry_s)
        self.lease_id = resp.lease_id
        self.granted_ttl_s = float(resp.lease_ttl_s or self.ttl_s)
        self.registrations += 1
        log.info("registered %s with %s: lease %x, ttl %.0f s (registration #%d)", self.worker.worker_id,
                 self.address, self.lease_id, self.granted_ttl_s, self.registrations)
        self.registered.set()
        if self.on_registered is not None:
            self.on_registered(resp)

    async def _keep_alive(self) -> None:
        """Refresh the lease every ttl/3; return when it must be presumed lost."""
        last_ok = time.monotonic()
        wait = self.granted_ttl_s / 3
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
            if self._changed.is_set():
                return
            interval = self.granted_ttl_s / 3
            try:
                resp = await self._stub.KeepAlive(
                    registry_pb2.KeepAliveRequest(worker_id=self.worker.worker_id, lease_id=self.lease_id),
                    timeout=max(1.0, interval))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("lease %x of %s is gone; registering again", self.lease_id, self.worker.worker_id)
                    return
                if time.monotonic() - last_ok >= self.granted_ttl_s:
                    log.warning("no keep-alive for %.0f s (%s); the lease has expired, registering again",
                                time.monotonic() - last_ok, exc.code().name)
                    return
                log.warning("keep-alive to %s failed (%s: %s); retrying", self.address, exc.code().name,
                            exc.details())
                wait = min(self.retry_s, interval)
                continue
            self.keepalives += 1
            last_ok = time.monotonic()
            if resp.lease_ttl_s:
                self.granted_ttl_s = float(resp.lease_ttl_s)
            wait = self.granted_ttl_s / 3

    async def deregister(self, timeout_s: float = 2.0) -> bool:
        if not self.registrations:
            return False
        try:
            await self._stub.DeregisterWorker(
                registry_pb2.DeregisterWorkerRequest(worker_id=self.worker.worker_id, lease_id=self.lease_id),
                timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("deregister %s failed (%s); its lease will expire", self.worker.worker_id, exc.code().name)
            return False
        log.info("deregistered %s", self.worker.worker_id)
        return True

    async def close(self) -> None:
        await self._channel.close()


class Process(Protocol):
    """What the agent needs of the vLLM process (VllmProcess; tests use a fake)."""

    pid: int | None
    returncode: int | None

    async def start(self) -> None: ...
    async def wait(self) -> int: ...
    async def stop(self) -> int | None: ...
    def log_tail(self, lines: int = 40) -> str: ...


class Agent:
    def __init__(self, cfg: WorkerConfig, *, process: Process | None = None, out: TextIO | None = None):
        self.cfg = cfg
        self.process: Process = process if process is not None else VllmProcess(cfg)
        self.engine = EngineClient(cfg.local_grpc_address, timeout_s=cfg.warmup_timeout_s)
        self.out = out or sys.stdout
        self.link: RegistryLink | None = None
        self.info: ServerInfo | None = None
        self._stop = asyncio.Event()
        self._started = time.monotonic()
        self.metrics = None  # the metrics endpoint (--metrics-listen), once vLLM's metrics directory exists
        self.kv_feed: KvFeedAgent | None = None  # with --kv-feed on a prefill worker, once the engine is up
        self.load_feed: LoadFeedAgent | None = None  # with --kv-feed, once the engine is up
        # the LoRA adapters served (--lora-modules, --lora-modules-file); None: LoRA off
        self.adapters = AdapterSet(cfg.adapter_table_path, cfg.lora_limits()[1]) if cfg.serves_adapters else None

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """The worker's whole life; returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
                pass
        status = 0
        link_task: asyncio.Task | None = None
        feed_task: asyncio.Task | None = None
        load_task: asyncio.Task | None = None
        adapters_task: asyncio.Task | None = None
        try:
            if self.adapters is not None:
                try:
                    await asyncio.to_thread(lambda: self.adapters.apply(self.cfg.adapters_at_start()))
                except AdapterError as exc:
                    raise AgentError(str(exc)) from None
                log.info("serving LoRA adapters: %s", ", ".join(self.adapters.current) or "none yet")
                metrics.LORA_ADAPTERS.set(len(self.adapters.current))
            await self.process.start()
            log.info("started vLLM (%s, pid %s) for %s on %s; log %s", self.cfg.role, self.process.pid,
                     self.cfg.model, self.cfg.grpc_address, getattr(self.process, "log_path", "-"))
            if self.cfg.metrics_listen:
                self.metrics = worker_metrics(self.cfg)
                await self.metrics.start()
            if not await self._until_stopped(self._start_up()):
                return 0
            if self.cfg.kv_events:
                self.kv_feed = self._kv_feed_agent()
                feed_task = asyncio.create_task(self.kv_feed.run(), name="kv-feed")
            if self.cfg.load_feed:
                self.load_feed = self._load_feed_agent()
                load_task = asyncio.create_task(self.load_feed.run(), name="load-feed")
            self.link = RegistryLink(self.cfg.registry, self._worker_record(), self.cfg.lease_ttl_s,
                                     on_registered=self._announce, tls=self.cfg.client_tls())
            metrics.WORKER_STATE.register(self.link.metrics_state)
            link_task = asyncio.create_task(self.link.run(), name="registry-link")
            if self.cfg.lora_modules_file:
                adapters_task = asyncio.create_task(self._follow_adapters(), name="lora-modules-file")
            reason = await self._until_stopped(self._watch(link_task))
            if reason:
                log.error("leaving: %s\n--- vLLM log tail ---\n%s", reason, self.process.log_tail())
                status = 1
        except AgentError as exc:
            log.error("%s\n--- vLLM log tail ---\n%s", exc, self.process.log_tail())
            status = 1
        finally:
            for task in (link_task, feed_task, load_task, adapters_task):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if self.link is not None:
                await self.link.deregister()
                await self.link.close()
            if self.kv_feed is not None:
                await self.kv_feed.close()
            if self.load_feed is not None:
                await self.load_feed.close()
            code = await self.process.stop()
            log.info("vLLM stopped (exit %s); agent exits %d", code, status)
            await self.engine.close()
            if self.metrics is not None:
                await self.metrics.stop()
        return status

    async def _until_stopped(self, coro) -> Any:
        """Run ``coro`` unless a stop is requested first (then cancel it and return None)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            log.info("stop requested")
            return None
        return task.result()

    async def _start_up(self) -> bool:
        await self._wait_serving()
        try:
            self.info = await self.engine.server_info()
        except EngineError as exc:
            raise AgentError(f"GetServerInfo failed: {exc}") from None
        if not self.info.block_size:
            raise AgentError("engine reports block_size 0")
        log.info("engine %s ready in %.1f s: block size %d, %s/%s, dtype %s", self.info.engine_id,
                 time.monotonic() - self._started, self.info.block_size, self.info.kv_connector,
                 self.info.kv_role, self.info.model_dtype)
        if self.cfg.cpu_affinity and self.process.pid:
            from kvshuttle.workers.affinity import parse_cpus, pin_tree

            n = await asyncio.to_thread(pin_tree, self.process.pid, parse_cpus(self.cfg.cpu_affinity))
            log.info("pinned %d vLLM threads to CPUs %s", n, self.cfg.cpu_affinity)
        if self.cfg.warmup:
            await self._warm_up()
        return True

    async def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        exited = asyncio.ensure_future(self.process.wait())
        try:
            while True:
                if exited.done():
                    raise AgentError(f"vLLM exited with status {exited.result()} before it was ready")
                if await self.engine.is_serving(timeout_s=2.0):
                    return
                if time.monotonic() > deadline:
                    raise AgentError(f"vLLM not SERVING after {self.cfg.ready_timeout_s:.0f} s")
                await asyncio.wait({exited}, timeout=1.0)
        finally:
            exited.cancel()

    async def _warm_up(self) -> None:
        t = time.monotonic()
        try:
            async for _ in self.engine.generate(f"warmup-{self.cfg.id}-{os.getpid()}", list(range(10, 26)),
                                                max_tokens=2, ignore_eos=True, stream=False):
                pass
        except EngineError as exc:
            raise AgentError(f"warm-up request failed: {exc}") from None
        log.info("warm-up request took %.2f s", time.monotonic() - t)

    def _worker_record(self) -> common_pb2.Worker:
        cfg, info = self.cfg, self.info
        return common_pb2.Worker(
            worker_id=cfg.id, role=ROLE_ENUM[cfg.role], engine_id=info.engine_id, grpc_address=cfg.grpc_address,
            nixl_host=cfg.nixl_host, nixl_port=cfg.nixl_port, block_size=info.block_size,
            kv_blocks_ttl_s=cfg.decoder_kv_blocks_ttl, model=cfg.model_name,
            kv_bytes_per_token=_kv_bytes_per_token(cfg.model, info.model_dtype),
            prefix_hash_algo=cfg.prefix_hash_algo, prefix_hash_seed=cfg.prefix_hash_seed, kv_events=cfg.kv_events,
            load_feed=cfg.load_feed, adapters=self.adapters.records() if self.adapters is not None else ())

    async def _follow_adapters(self) -> None:
        """Re-read --lora-modules-file every --lora-modules-poll-s: serve and register what it lists now. A file
        that cannot be read or names an unusable adapter changes nothing (the error is logged and counted)."""
        assert self.adapters is not None and self.link is not None
        last_error = ""
        while True:
            await asyncio.sleep(self.cfg.lora_modules_poll_s)
            try:
                wanted = await asyncio.to_thread(self.cfg.adapters_at_start)
                changed = await asyncio.to_thread(self.adapters.apply, wanted)
            except AdapterError as exc:
                if str(exc) != last_error:
                    log.error("adapters unchanged: %s", exc)
                    metrics.ADAPTER_FILE_ERRORS.inc()
                last_error = str(exc)
                continue
            last_error = ""
            if changed:
                log.info("serving LoRA adapters: %s; registering again", ", ".join(self.adapters.current) or "none")
                metrics.LORA_ADAPTERS.set(len(self.adapters.current))
                self.link.update(self._worker_record())

    def _kv_feed_agent(self) -> KvFeedAgent:
        """The one subscriber to this worker's KV events, publishing them to the feed (workers/kv_feed.py)."""
        cfg = self.cfg
        engine = EngineClient(cfg.local_grpc_address, timeout_s=cfg.warmup_timeout_s)
        publisher = KvFeedPublisher(cfg.kv_feed, cfg.kv_feed_key_prefix)
        log.info("publishing this worker's KV events to the KV feed at %s", cfg.kv_feed)
        return KvFeedAgent(cfg.id, engine, publisher, cfg.prefix_hash_scheme(self.info.block_size),
                           snapshot_interval_s=cfg.kv_feed_snapshot_s, ttl_s=max(60.0, 6 * cfg.kv_feed_snapshot_s))

    def _load_feed_agent(self) -> LoadFeedAgent:
        """This worker's load samples, polled over loopback and published for the planners (workers/load_feed.py)."""
        cfg = self.cfg
        engine = EngineClient(cfg.local_grpc_address, timeout_s=5.0)
        log.info("publishing this worker's load every %g s to the load feed at %s", cfg.load_feed_interval_s,
                 cfg.kv_feed)
        return LoadFeedAgent(cfg.id, engine, LoadFeedPublisher(cfg.kv_feed, cfg.kv_feed_key_prefix),
                             interval_s=cfg.load_feed_interval_s)

    def _announce(self, resp: registry_pb2.RegisterWorkerResponse) -> None:
        if self.link.registrations != 1:
            return
        w = self.link.worker
        ready = {"worker_id": w.worker_id, "role": self.cfg.role, "engine_id": w.engine_id,
                 "grpc_address": w.grpc_address, "nixl_host": w.nixl_host, "nixl_port": w.nixl_port,
                 "block_size": w.block_size, "model": w.model, "lease_id": resp.lease_id,
                 "vllm_pid": self.process.pid, "startup_s": round(time.monotonic() - self._started, 1)}
        print(f"{READY_MARKER} {json.dumps(ready, sort_keys=True)}", file=self.out, flush=True)

    async def _watch(self, link_task: asyncio.Task) -> str:
        """Return why the worker must leave: vLLM's process exited, 3 health checks in a row failed, or the
        registry link broke (a bug: it retries forever)."""
        exited = asyncio.ensure_future(self.process.wait())
        failures = 0
        try:
            while True:
                await asyncio.wait({exited, link_task}, timeout=self.cfg.health_interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if exited.done():
                    return f"process exited with status {exited.result()}"
                if link_task.done():
                    return f"registry link stopped: {link_task.exception()!r}"
                if await self.engine.is_serving(timeout_s=max(1.0, self.cfg.health_interval_s)):
                    failures = 0
                    continue
                failures += 1
                log.warning("engine health check failed (%d in a row)", failures)
                if failures >= 3:
                    return "engine health is NOT_SERVING"
        finally:
            exited.cancel()


def worker_metrics(cfg: WorkerConfig):
    """The worker's metrics endpoint: the agent's own metrics and vLLM's, read from the Prometheus multiprocess
    directory vLLM writes (``<work dir>/prometheus``; vLLM's gRPC server has no HTTP endpoint of its own). Built in a
    thread per scrape: reading vLLM's files is disk I/O."""
    from kvshuttle.services.common.metrics_http import MetricsServer
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = cfg.work_path / "prometheus"
    extra = [MultiProcessCollector(None, path=str(directory))] if directory.is_dir() else []
    return MetricsServer(cfg.metrics_listen, metrics.registry_for("worker", extra), name=f"worker {cfg.id}",
                         in_thread=True)


def print_vllm_command(cfg: WorkerConfig, out: TextIO | None = None) -> None:
    """``--print-vllm-command``: the vLLM argv and its changes to the environment (null: removed), as JSON (what the
    Helm chart must match)."""
    argv, env = vllm_command(cfg)
    print(json.dumps({"argv": argv, "env": env}, indent=2), file=out or sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load(WorkerConfig, argv, prog="kvshuttle worker", description=WorkerConfig.__doc__)
    if cfg.serves_adapters:
        try:
            cfg.lora_limits()
        except AdapterError as exc:
            print(f"kvshuttle worker: {exc}", file=sys.stderr)
            return 2
    if cfg.print_vllm_command:
        print_vllm_command(cfg)
        return 0
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    setup_tracing(f"kvshuttle-worker-{cfg.role}", cfg)
    log.info("config %s", json.dumps(dataclasses.asdict(cfg), sort_keys=True))
    try:
        return asyncio.run(Agent(cfg).run())
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())


def _kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """One token's KV in bytes at the served dtype, from the model directory's config.json (0: unknown)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return kv_bytes_per_token(json.load(f), dtype)
    except (OSError, ValueError):
        return 0
