"""Helpers for the end-to-end tests (tests/e2e, on the shared real stack): chat turns over HTTP, P's cache and
counters, more gateways and workers next to the stack's, and pausing one of its workers."""

from __future__ import annotations

import contextlib
import inspect
import signal
import textwrap
import uuid

import httpx
from kvshuttle.services.common.processes import ChildProcess
from kvshuttle.services.devtools.stack import cpu_binds
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from tests.support.waits import until

EXTRA_STARTUP_TIMEOUT_S = 240.0  # an extra vLLM worker's start-up (~40-85 s on 2 cores) and registration


def new_session(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def prefill_workers(stack) -> list[common_pb2.Worker]:
    return [w for w in stack.workers if w.role == common_pb2.WORKER_ROLE_PREFILL]


async def flush_prefill(stack, wait_s: float = 40.0) -> None:
    """Empty P's own prefix cache, so that any history P does not compute must have come over NIXL
    (Stack.flush_prefill: retried while P holds blocks)."""
    await stack.flush_prefill(wait_s)


def prompt_token_sources(stack) -> dict[str, float]:
    """vLLM's own counter on P: prompt tokens by source (local_compute, external_kv_transfer, local_cache_hit)."""
    return stack.prefill_prompt_tokens_by_source()


async def chat(client: httpx.AsyncClient, session: str, messages: list[dict], *, max_tokens: int = 16,
               disable_pull: bool = False) -> httpx.Response:
    resp = await client.post("/v1/chat/completions", headers={"X-Session-ID": session}, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "disable_pull": disable_pull})
    assert resp.status_code == 200, resp.text
    return resp


def tokens(usage: dict) -> tuple[int, int, int]:
    """A response's token counts (not ``prompt_tokens_details.cached_tokens``, which says how the prompt was served:
    a pull and a recompute of the same turn differ there)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def user_turn(n: int) -> dict:
    """A long-ish user message (tool output) so the history spans several KV blocks."""
    source = inspect.getsource(textwrap)
    return {"role": "user", "content": f"Turn {n}. Tool output:\n{source[n * 1500:(n + 1) * 1500]}\nExplain."}


async def spawn_gateway(stack, name: str, *args: str, env: dict[str, str] | None = None):
    """One more gateway process on the stack's registry and scheduler (Stack.spawn_gateway): the child and its base
    URL once it answers /health. The caller stops it (``child.stop()``)."""
    return await stack.spawn_gateway(name, *args, env=env)


def extra_worker_bind(stack) -> str:
    """The CPU binding of one more worker next to the stack's (its own cores when the stack splits them)."""
    return cpu_binds(len(stack.workers) + 1)[-1] if stack.cfg.cpu_bind == "split" else stack.cfg.cpu_bind


async def start_prefill_worker(stack, name: str) -> ChildProcess:
    """One more prefill worker, started the way the stack starts its own (own ports, work dir, CPU binding)."""
    return await stack.spawn_worker("prefill", name, extra_worker_bind(stack))


async def wait_registered(registry: registry_pb2_grpc.SessionRegistryStub, child: ChildProcess, worker_id: str,
                          timeout_s: float = EXTRA_STARTUP_TIMEOUT_S) -> common_pb2.Worker:
    """The registry's record of ``worker_id`` once the worker (process ``child``) has registered; fails if the
    process exits first."""

    async def registered() -> common_pb2.Worker | None:
        assert child.returncode is None, f"{worker_id} exited ({child.returncode}):\n{child.log_tail(30)}"
        resp = await registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5.0)
        return next((w for w in resp.workers if w.worker_id == worker_id), None)

    try:
        return await until(registered, timeout_s, f"{worker_id} to register", interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{child.log_tail(30)}") from None


async def registered_ids(stack) -> set[str]:
    """The ids of the workers registered with the stack's registry now."""
    async with stack.channel(stack.registry_address) as channel:
        resp = await registry_pb2_grpc.SessionRegistryStub(channel).ListWorkers(registry_pb2.ListWorkersRequest(),
                                                                                timeout=5)
    return {w.worker_id for w in resp.workers}


def signal_tree(child: ChildProcess, sig: int) -> int:
    """Send ``sig`` to the child and all its descendants (vLLM runs in a process group of its own), descendants
    first (a SIGKILLed agent would otherwise have its vLLM sent SIGTERM, and shut down cleanly, before the kill);
    returns how many processes got it."""
    import psutil

    try:
        root = psutil.Process(child.pid)
        procs = [*reversed(root.children(recursive=True)), root]
    except psutil.Error:
        return 0
    sent = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            sent += 1
    return sent


class Paused:
    """The shared stack's worker of ``role`` stopped (SIGSTOP) until the scheduler polls it as unreachable: new
    turns then go to the other worker of that role. ``resume()`` (also on exit) sends SIGCONT; the exit waits until
    the scheduler sees it answer again."""

    def __init__(self, stack, role: int):
        worker = next(w for w in stack.workers if w.role == role)
        self.worker_id = worker.worker_id
        self.child = next(c for c in stack.children if c.name == worker.worker_id)
        self.channel = stack.channel(stack.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.TransferSchedulerStub(self.channel)
        self.stopped = False

    async def reachable(self) -> bool:
        stats = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        return any(row.reachable for row in stats.loads if row.worker_id == self.worker_id)

    async def wait(self, reachable: bool, timeout_s: float = 30.0) -> None:
        async def seen() -> bool:
            return await self.reachable() == reachable

        await until(seen, timeout_s, f"the scheduler to see {self.worker_id} reachable={reachable}", interval_s=0.1)

    def resume(self) -> None:
        if self.stopped:
            signal_tree(self.child, signal.SIGCONT)
            self.stopped = False

    async def __aenter__(self) -> Paused:
        assert signal_tree(self.child, signal.SIGSTOP) >= 2
        self.stopped = True
        try:
            await self.wait(False)
        except BaseException:
            self.resume()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.resume()
        try:
            await self.wait(True)  # answering again (and registered: the load monitor polls registered workers)
        finally:
            await self.channel.close()
