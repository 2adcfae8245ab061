"""kvshuttle's vLLM plugin: inert without its variables; with them, NIXL's progress delay and vLLM's idle spin."""

from __future__ import annotations

import pytest

from workers import vllm_plugin


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
