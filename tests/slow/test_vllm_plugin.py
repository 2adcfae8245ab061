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


class _NixlConnector:
    """Stands in for vLLM's NixlBaseConnector (the same scheduler-side methods): records what it was told, returns
    the params a prefill worker hands to D."""

    def __init__(self):
        self.allocs: list[tuple[str, int]] = []

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs.append((request.request_id, num_external_tokens))

    def request_finished(self, request, block_ids):
        return True, {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_num_tokens": 300}

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids[0])


class _Request:
    def __init__(self, request_id: str, **params):
        self.request_id, self.kv_transfer_params = request_id, params


def test_a_prefill_workers_pull_reports_the_tokens_it_loaded():
    """The connector wrapped by the plugin: a prefill worker's pull returns params that say how many tokens the
    connector loaded; a recompute, and a decode worker's own pull, return them unchanged."""
    from kvshuttle.control_plane.kv_params import LOADED_TOKENS_KEY
    from kvshuttle.workers import vllm_loaded_tokens

    cls = type("NixlBaseConnector", (_NixlConnector,), {})
    vllm_loaded_tokens.wrap(cls)
    vllm_loaded_tokens.wrap(cls)  # once, however often
    connector = cls()

    # P's pull as vLLM's scheduler hands it over (do_remote_prefill already off); told again, with 0, once loaded
    pull = _Request("p-pull", do_remote_decode=True, do_remote_prefill=False, remote_engine_id="d-engine")
    connector.update_state_after_alloc(pull, None, 256)
    connector.update_state_after_alloc(pull, None, 0)
    delay, params = connector.request_finished(pull, [1, 2])
    assert delay and params[LOADED_TOKENS_KEY] == 256 and params["remote_num_tokens"] == 300
    assert connector.allocs == [("p-pull", 256), ("p-pull", 0)]

    recompute = _Request("p-recompute", do_remote_decode=True, do_remote_prefill=False, remote_engine_id=None)
    connector.update_state_after_alloc(recompute, None, 0)
    assert LOADED_TOKENS_KEY not in connector.request_finished_all_groups(recompute, ([1],))[1]

    decode = _Request("d-pull", do_remote_prefill=False, remote_engine_id="p-engine")  # D loading P's blocks
    connector.update_state_after_alloc(decode, None, 512)
    assert LOADED_TOKENS_KEY not in connector.request_finished(decode, [3])[1]
    assert not connector.__dict__[vllm_loaded_tokens._MARK], "nothing is kept once a request finished"


WRAPPED_BY_THE_FACTORY = """
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvshuttle.workers import vllm_plugin
vllm_plugin.register()
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"))
base = next(k for k in cls.__mro__ if k.__name__ == "NixlBaseConnector")
names = ("update_state_after_alloc", "request_finished", "request_finished_all_groups")
print(cls.__name__, *(getattr(base, n).__module__ for n in names))
"""


def test_vllms_connector_factory_hands_out_the_wrapped_nixl_connector():
    """In a process of its own (NIXL is loaded only where vLLM creates the connector, never by the plugin itself:
    loading it can abort a process): after the plugin's register, vLLM's factory gives the NIXL connector class
    with the plugin's scheduler-side methods."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WRAPPED_BY_THE_FACTORY], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    name, *modules = out.stdout.split()[-4:]
    assert name.startswith("Nixl") and modules == ["kvshuttle.workers.vllm_loaded_tokens"] * 3, out.stdout
