"""A vLLM general plugin (entry point ``vllm.general_plugins``): tunes vLLM and NIXL for small CPU-only hosts.

NIXL's Python agent hard-codes its UCX progress thread to poll with no delay, so every idle vLLM-CPU engine burns a
core spinning. On a 2-core development machine two engines then starve everything else, kernel work queues included
(seen here: multi-minute engine stalls). When ``KVSHUTTLE_NIXL_PROGRESS_DELAY_US`` is set (the worker agent sets it
from ``--nixl-progress-delay-us``), agents are created with that progress-thread delay instead. Unset, nothing is
changed, so GPU deployments are untouched. vLLM loads this in each of its processes; it must stay cheap and safe.

``KVSHUTTLE_VLLM_DIE_WITH_PARENT`` (the agent always sets it): each vLLM process that has no parent-death signal
yet asks the kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``). The server has one already (SIGTERM,
from kvshuttle.services.common.processes: it shuts down cleanly when the agent dies); the engine core and its workers, spawned by
vLLM, had none: a server killed outright (SIGKILL, the OOM killer) left them running under PID 1, busy and holding
the KV cache's memory (a GPU's, on a GPU).

Likewise ``KVSHUTTLE_VLLM_IDLE_SPIN_MS``: after each message, vLLM's shared-memory queue readers spin (yielding the
CPU) for one second before they sleep on a socket. On 2 cores, three engines doing that after every request keep
the control plane waiting for a CPU; a few milliseconds of spinning keeps a busy engine's latency and frees the core
when it is idle.

Always: a prefill worker's answer to a pull says how many prompt tokens it loaded over NIXL
(workers/vllm_loaded_tokens.py). And in the process that serves vLLM's gRPC API, ``VllmEngineServicer.Generate`` learns to take a per-request
prefix-cache salt and LoRA adapter from call metadata (workers/vllm_call_options.py: each tenant's own prefix cache,
each adapter's turns). Calls without them run unchanged.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import types

ENV = "KVSHUTTLE_NIXL_PROGRESS_DELAY_US"
SPIN_ENV = "KVSHUTTLE_VLLM_IDLE_SPIN_MS"
DIE_ENV = "KVSHUTTLE_VLLM_DIE_WITH_PARENT"
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2  # linux/prctl.h
log = logging.getLogger(__name__)


class _Bindings(types.ModuleType):
    """The NIXL bindings module with ``nixlAgent`` wrapped to apply the delay; everything else passes through."""

    def __init__(self, real: types.ModuleType, delay_us: int):
        super().__init__(real.__name__)
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return None


def _shorten_idle_spin(spin_ms: int) -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_kvshuttle_spin_s", None) is not None:
        cls._kvshuttle_spin_s = spin_ms / 1000
        return
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = cls._kvshuttle_spin_s

    cls._kvshuttle_spin_s = spin_ms / 1000
    cls.__init__ = init


def tie_to_parent() -> int:
    """Unless this process already has a parent-death signal, have the kernel SIGKILL it when its parent dies
    (Linux). Returns the signal now in place (0: none, e.g. not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = ctypes.c_int(0)
        if libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(current), 0, 0, 0) == 0 and current.value:
            return current.value
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return 0
    except (OSError, AttributeError) as exc:  # not Linux
        log.warning("cannot tie this process's life to its parent's: %s", exc)
        return 0
    return int(signal.SIGKILL)


def _install_call_options() -> None:
    try:
        from kvshuttle.workers import vllm_call_options

        vllm_call_options.install()
    except Exception:  # noqa: BLE001 - never stop vLLM here: salted calls are then refused, not served unsalted
        log.exception("could not install per-request cache salts and adapters on vLLM's gRPC servicer")


def _install_loaded_tokens() -> None:
    try:
        from kvshuttle.workers import vllm_loaded_tokens

        vllm_loaded_tokens.install()
    except Exception:  # noqa: BLE001 - never stop vLLM here: the gateway then reports what a pull could cover
        log.exception("could not install the loaded-token count on vLLM's NIXL connector")


def register() -> None:
    _install_call_options()
    _install_loaded_tokens()
    if os.environ.get(DIE_ENV) == "1":
        tie_to_parent()
    spin_ms = _int_env(SPIN_ENV)
    if spin_ms is not None and spin_ms >= 0:
        _shorten_idle_spin(spin_ms)
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return
    try:
        delay = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", ENV, raw)
        return
    for name in ("nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        if not isinstance(api.nixlBind, _Bindings):
            api.nixlBind = _Bindings(api.nixlBind, delay)
