"""kvshuttle's vLLM plugin: inert without its variables; with them, NIXL's progress delay and vLLM's idle spin."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from kvshuttle.workers import vllm_plugin

from tests.support.waits import wait_until


def test_without_variables_nothing_changes(monkeypatch):
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    monkeypatch.delenv(vllm_plugin.SPIN_ENV, raising=False)
    before = shm.SpinCondition.__init__
    vllm_plugin.register()
    assert shm.SpinCondition.__init__ is before


class _SpinCondition:
    """Stands in for vLLM's class (same constructor) so no zmq sockets are made."""

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        self.is_reader = is_reader
        self.busy_loop_s = busy_loop_s if is_reader else 0


def test_idle_spin_of_queue_readers_is_shortened(monkeypatch):
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.setattr(shm, "SpinCondition", _SpinCondition)
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "20")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins more than once per process: no double wrapping
    reader = shm.SpinCondition(is_reader=True, context=None, notify_address="x")
    writer = shm.SpinCondition(is_reader=False, context=None, notify_address="x")
    assert reader.busy_loop_s == pytest.approx(0.02) and writer.busy_loop_s == 0
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "5")
    vllm_plugin.register()
    assert shm.SpinCondition(is_reader=True, context=None, notify_address="x").busy_loop_s == pytest.approx(0.005)


def test_a_vllm_process_is_tied_to_its_parent_unless_it_already_is(tmp_path):
    """In a child: with no parent-death signal the plugin sets SIGKILL; one set before (the agent's SIGTERM for the
    server) is kept. Then the parent dies, and the child with it."""
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(
        "import ctypes, signal, sys, time\n"
        "from kvshuttle.workers import vllm_plugin\n"
        "if sys.argv[1] == 'preset':\n"
        "    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
        "print(vllm_plugin.tie_to_parent(), flush=True)\n"
        "time.sleep(60)\n")
    parent_code = ("import subprocess, sys, time\n"
                   f"c = subprocess.Popen([sys.executable, {str(script)!r}, sys.argv[1]])\n"
                   "print(c.pid, flush=True)\ntime.sleep(60)\n")
    for mode, expected in (("fresh", signal.SIGKILL), ("preset", signal.SIGTERM)):
        parent = subprocess.Popen([sys.executable, "-c", parent_code, mode], stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parents[2])
        child = int(parent.stdout.readline())
        assert int(parent.stdout.readline()) == int(expected)
        parent.kill()
        parent.wait()
        wait_until(lambda: not _running(child), 10, f"the child ({mode}) to die with its parent", interval_s=0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
