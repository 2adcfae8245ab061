"""The worker agent's registry link (register, keep-alive, re-register) and life cycle, against a small in-test
SessionRegistry on a real loopback gRPC server and a fake vLLM (tests/support/fake_engine.py) on another."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import grpc
import pytest
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from kvshuttle.workers import agent as agent_mod
from kvshuttle.workers.agent import Agent, RegistryLink
from kvshuttle.workers.vllm_process import WorkerConfig

from tests.support.fake_engine import FakeEngineServer
from tests.support.waits import until


class FakeRegistry(registry_pb2_grpc.SessionRegistryServicer):
    def __init__(self, first_lease: int = 100):
        self.leases: dict[int, str] = {}
        self.ttls: dict[int, int] = {}
        self.next_lease = first_lease
        self.registered: list[common_pb2.Worker] = []
        self.keepalives = 0
        self.deregistered: list[tuple[str, int]] = []

    async def RegisterWorker(self, request, context):
        self.next_lease += 1
        self.leases[self.next_lease] = request.worker.worker_id
        self.ttls[self.next_lease] = request.lease_ttl_s
        self.registered.append(request.worker)
        return registry_pb2.RegisterWorkerResponse(worker=request.worker, lease_id=self.next_lease,
                                                   lease_ttl_s=request.lease_ttl_s)

    async def KeepAlive(self, request, context):
        if self.leases.get(request.lease_id) != request.worker_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        self.keepalives += 1
        return registry_pb2.KeepAliveResponse(lease_ttl_s=self.ttls[request.lease_id])

    async def DeregisterWorker(self, request, context):
        self.deregistered.append((request.worker_id, request.lease_id))
        self.leases.pop(request.lease_id, None)
        return registry_pb2.DeregisterWorkerResponse()


class RegistryServer:
    def __init__(self, port: int, servicer: FakeRegistry):
        self.servicer = servicer
        self.server = grpc.aio.server()
        registry_pb2_grpc.add_SessionRegistryServicer_to_server(servicer, self.server)
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port

    @classmethod
    async def start(cls, port: int, first_lease: int = 100) -> RegistryServer:
        s = cls(port, FakeRegistry(first_lease))
        await s.server.start()
        return s

    async def stop(self) -> None:
        await self.server.stop(0)


WORKER = common_pb2.Worker(worker_id="decode-a", role=common_pb2.WORKER_ROLE_DECODE, engine_id="e1",
                           grpc_address="127.0.0.1:1", block_size=16)


async def test_registers_and_keeps_alive():
    port = free_port()
    reg = await RegistryServer.start(port)
    link = RegistryLink(f"127.0.0.1:{port}", WORKER, 2)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.registered.wait(), 5)
        assert link.lease_id == 101 and reg.servicer.registered[0].worker_id == "decode-a"
        await until(lambda: reg.servicer.keepalives >= 3, what="three keep-alives")  # every ttl/3 = 0.67 s
        assert link.registrations == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert await link.deregister()
    assert reg.servicer.deregistered == [("decode-a", 101)]
    await link.close()
    await reg.stop()


async def test_reregisters_when_the_lease_is_gone():
    port = free_port()
    reg = await RegistryServer.start(port)
    link = RegistryLink(f"127.0.0.1:{port}", WORKER, 2)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.registered.wait(), 5)
        reg.servicer.leases.clear()  # the lease expired in the store
        await until(lambda: link.registrations == 2, what="a second registration")
        assert link.lease_id == 102
        before = reg.servicer.keepalives
        await until(lambda: reg.servicer.keepalives > before, what="a keep-alive on the new lease")  # kept alive too
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        await reg.stop()


async def test_recovers_after_registry_outage_and_waits_for_first_start(caplog):
    caplog.set_level(logging.WARNING, logger="kvshuttle.worker")
    port = free_port()
    link = RegistryLink(f"127.0.0.1:{port}", WORKER, 2, retry_s=0.2, max_retry_s=0.5)
    task = asyncio.create_task(link.run())

    def said(words: str) -> bool:
        return any(words in r.getMessage() for r in caplog.records)

    try:
        await until(lambda: said("register failed"), what="a failed registration")  # registry not up yet
        assert link.registrations == 0 and not link.registered.is_set()
        reg = await RegistryServer.start(port)  # it keeps trying: registered once the registry is up
        await asyncio.wait_for(link.registered.wait(), 5)
        await reg.stop()  # an outage longer than the TTL (2 s): the link presumes its lease lost
        await until(lambda: not link.registered.is_set(), 10, "the link to give up its lease")
        assert said("the lease has expired, registering again") and link.registrations == 1
        # A fresh registry (restarted, store lost its leases): the agent registers again under a new lease.
        reg = await RegistryServer.start(port, first_lease=500)
        await until(lambda: link.registrations == 2, what="a second registration")
        assert link.lease_id == 501 and reg.servicer.registered[0].worker_id == "decode-a"
        await until(lambda: reg.servicer.keepalives >= 1, what="a keep-alive")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        await reg.stop()


class FakeProcess:
    """Stands in for VllmProcess: 'starting' it starts a fake engine server."""

    def __init__(self):
        self.server = FakeEngineServer()
        self.pid = 4242
        self.returncode = None
        self.exited = asyncio.Event()
        self.stopped = False

    async def start(self) -> None:
        await self.server.start()

    async def wait(self) -> int:
        await self.exited.wait()
        return self.returncode

    async def stop(self):
        self.stopped = True
        await self.server.stop()
        if self.returncode is None:
            self.returncode = -15
            self.exited.set()
        return self.returncode

    def log_tail(self, lines: int = 40) -> str:
        return "fake log"

    def exit(self, code: int) -> None:
        self.returncode = code
        self.exited.set()


async def start_agent(reg_port: int, **overrides):
    proc = FakeProcess()
    cfg = WorkerConfig(role="decode", model="/models/tiny", registry=f"127.0.0.1:{reg_port}", lease_ttl_s=2,
                       health_interval_s=0.1, nixl_port=5700, **overrides)
    out = io.StringIO()
    agent = Agent(cfg, process=proc, out=out)
    # The fake engine listens on a free port; the agent's client talks to it there.
    agent.engine = EngineClient(proc.server.address, timeout_s=cfg.warmup_timeout_s)
    task = asyncio.create_task(agent.run())
    return agent, proc, out, task


async def test_agent_lifecycle_ready_line_and_graceful_stop():
    port = free_port()
    reg = await RegistryServer.start(port)
    agent, proc, out, task = await start_agent(port)
    try:
        await until(lambda: agent_mod.READY_MARKER in out.getvalue(), what="the ready line")
        line = out.getvalue().strip()
        ready = json.loads(line.split(" ", 1)[1])
        assert ready["engine_id"] == "fake-engine" and ready["block_size"] == 16 and ready["lease_id"] == 101
        assert ready["worker_id"] == "decode-127.0.0.1-50061" and ready["nixl_port"] == 5700
        w = reg.servicer.registered[0]
        assert (w.role, w.kv_blocks_ttl_s, w.model, w.grpc_address) == (
            common_pb2.WORKER_ROLE_DECODE, 480, "tiny", "127.0.0.1:50061")
        # The warm-up request went to the engine before registration.
        assert proc.server.engine.requests[0].request_id.startswith("warmup-")
        agent.request_stop()
        assert await asyncio.wait_for(task, 10) == 0
        assert reg.servicer.deregistered == [("decode-127.0.0.1-50061", 101)] and proc.stopped
    finally:
        await reg.stop()


@pytest.mark.parametrize("failure", ["exit", "not_serving"])
async def test_agent_leaves_when_vllm_dies(failure):
    port = free_port()
    reg = await RegistryServer.start(port)
    agent, proc, out, task = await start_agent(port)
    try:
        await until(lambda: agent_mod.READY_MARKER in out.getvalue(), what="the ready line")
        if failure == "exit":
            proc.exit(9)
        else:
            await proc.server.set_serving(False)
        assert await asyncio.wait_for(task, 10) == 1
        assert len(reg.servicer.deregistered) == 1 and proc.stopped
    finally:
        await reg.stop()


async def test_agent_fails_fast_when_vllm_exits_during_start_up():
    port = free_port()
    reg = await RegistryServer.start(port)
    proc = FakeProcess()
    proc.start = lambda: _exit_soon(proc)  # never serves; the process dies
    cfg = WorkerConfig(role="prefill", model="/m", registry=f"127.0.0.1:{port}", ready_timeout_s=30)
    agent = Agent(cfg, process=proc, out=io.StringIO())
    agent.engine.address = "127.0.0.1:1"
    assert await asyncio.wait_for(agent.run(), 10) == 1
    assert reg.servicer.registered == []
    await reg.stop()


async def _exit_soon(proc: FakeProcess) -> None:
    asyncio.get_running_loop().call_later(0.3, proc.exit, 1)


def _adapter(path, rank: int = 8) -> str:
    """A directory that reads as a PEFT LoRA adapter of ``rank`` (the agent checks its config, vLLM loads it)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return str(path)


async def test_adapters_loaded_and_unloaded_while_running_are_registered(tmp_path):
    """Issue #37: ``--lora-modules`` at start, ``--lora-modules-file`` followed while the worker runs: each change
    is written to the plugin's table and registered again (a new lease, the record's adapters); a file naming an
    adapter that cannot be served changes nothing and is counted; ids stay each adapter's own."""
    from kvshuttle.services.common import metrics
    from kvshuttle.workers.vllm_call_options import AdapterTable

    port = free_port()
    reg = await RegistryServer.start(port)
    fixed, extra = _adapter(tmp_path / "fixed"), _adapter(tmp_path / "extra")
    listing = tmp_path / "lora-modules.json"
    listing.write_text("{}")
    agent, proc, out, task = await start_agent(port, lora_modules=f"fixed={fixed}", lora_modules_file=str(listing),
                                               lora_modules_poll_s=0.1, work_dir=str(tmp_path / "work"))
    table = AdapterTable(str(agent.cfg.adapter_table_path))

    def registered() -> list[tuple[str, int]]:
        return [(a.name, a.id) for a in reg.servicer.registered[-1].adapters] if reg.servicer.registered else []

    try:
        await until(lambda: agent_mod.READY_MARKER in out.getvalue(), what="the ready line")
        assert registered() == [("fixed", 1)] and table.get("fixed").path == fixed and table.get("extra") is None
        listing.write_text(json.dumps({"extra": extra}))
        await until(lambda: registered() == [("extra", 2), ("fixed", 1)], what="the loaded adapter registered")
        assert table.get("extra").id == 2
        errors = metrics.ADAPTER_FILE_ERRORS._value.get()
        listing.write_text(json.dumps({"extra": extra, "broken": str(tmp_path / "missing")}))
        await until(lambda: metrics.ADAPTER_FILE_ERRORS._value.get() == errors + 1, what="the bad file counted")
        assert registered() == [("extra", 2), ("fixed", 1)] and table.get("broken") is None
        listing.write_text("{}")  # unloaded: the fixed one stays
        await until(lambda: registered() == [("fixed", 1)], what="the unloaded adapter gone")
        assert table.get("extra") is None and agent.link.lease_id == reg.servicer.next_lease
        listing.write_text(json.dumps({"extra": extra}))
        await until(lambda: registered() == [("extra", 2), ("fixed", 1)], what="loaded again, under its old id")
        agent.request_stop()
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        await reg.stop()
