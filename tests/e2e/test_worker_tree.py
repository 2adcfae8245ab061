"""No vLLM process outlives its worker, whatever is killed (real vLLM).

vLLM runs in a process group of its own under the worker agent: its gRPC server, the engine core it spawns, and
that one's workers. An operator or the kernel's OOM killer may SIGKILL any one of them. Each vLLM process asks the
kernel to kill it with its parent (workers/vllm_plugin.py, PR_SET_PDEATHSIG), so killing the agent alone, or the
vLLM server alone, leaves nothing of the tree running (before, the engine core went on under PID 1, busy, holding
the KV cache's memory).
"""

from __future__ import annotations

import asyncio
import signal

import psutil
import pytest
from kvshuttle.services.devtools.stack import cpu_binds
from kvshuttle.v1 import registry_pb2_grpc

from tests.support.e2e import EXTRA_STARTUP_TIMEOUT_S, wait_registered
from tests.support.waits import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def alive(pids: list[int]) -> list[str]:
    """The processes among ``pids`` still running (zombies waiting to be reaped do not count)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("victim", ["agent", "vllm server"])
async def test_killing_one_process_of_a_worker_takes_the_whole_tree(stack, victim):
    name = f"tree-{victim.replace(' ', '-')}"
    bind = cpu_binds(len(stack.workers) + 1)[-1] if stack.cfg.cpu_bind == "split" else stack.cfg.cpu_bind
    child = await stack.spawn_worker("decode", name, bind)
    stack.children.remove(child)  # this test stops (or kills) it
    try:
        async with stack.channel(stack.registry_address) as channel:
            await wait_registered(registry_pb2_grpc.SessionRegistryStub(channel), child, name,
                                  EXTRA_STARTUP_TIMEOUT_S)
        agent = psutil.Process(child.pid)
        tree = agent.children(recursive=True)
        server = next(p for p in agent.children() if "vllm" in " ".join(p.cmdline()))
        assert len(tree) >= 2, [" ".join(p.cmdline())[:120] for p in tree]  # the server and its engine core
        pids = [agent.pid, *(p.pid for p in tree)]
        (agent if victim == "agent" else server).send_signal(signal.SIGKILL)  # that process alone
        try:
            await until(lambda: not alive(pids), 60, f"the whole tree to go after the {victim} was killed",
                        interval_s=0.5)
        except AssertionError as exc:
            left = alive(pids)
            if agent.is_running():  # where it waits: every kvshuttle process prints its threads' stacks on SIGUSR1
                agent.send_signal(signal.SIGUSR1)
                await asyncio.sleep(2)
            raise AssertionError(f"{exc}; still running: {left}; the agent's log:\n{child.log_tail(80)}") from None
    finally:
        await child.stop()
