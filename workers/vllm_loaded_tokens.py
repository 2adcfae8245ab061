"""A prefill worker's answer says how many prompt tokens it loaded over NIXL (kvshuttle's vLLM plugin).

vLLM reports a request's ``num_cached_tokens``: the prompt tokens it did not compute, its own prefix cache's and the
ones a pull loaded from a decode worker alike. Only the engine's scheduler knows the split: it tells the NIXL
connector how many tokens the request's transfer brings (``update_state_after_alloc``). ``install`` (run by the
plugin in every vLLM process) has vLLM's connector factory wrap the NIXL connector when it loads it (in the engine
core, for the scheduler): the connector notes that count for a prefill worker's request that pulls, and adds it to
the ``kv_transfer_params`` the prefill worker returns when the request finishes (``kv_params.LOADED_TOKENS_KEY``).
The gateway takes it out before it hands those params to D, and reports the turn's pulled tokens exactly (without
it: the tokens the pull could cover).
"""

from __future__ import annotations

import logging
from typing import Any

from kvshuttle.control_plane.kv_params import LOADED_TOKENS_KEY

log = logging.getLogger(__name__)
_MARK = "_kvshuttle_loaded_tokens"


def install() -> bool:
    """Have vLLM's connector factory wrap the NIXL connector's class when it loads it (importing NIXL here could
    abort a process that has no use for it); False when this vLLM has no connector factory."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return False
    if getattr(KVConnectorFactory, _MARK, False):
        return True
    original = KVConnectorFactory.get_connector_class.__func__

    def get_connector_class(cls, kv_transfer_config):
        connector_cls = original(cls, kv_transfer_config)
        base = next((k for k in connector_cls.__mro__ if k.__name__ == "NixlBaseConnector"), None)
        if base is not None:
            wrap(base)
        return connector_cls

    KVConnectorFactory.get_connector_class = classmethod(get_connector_class)
    setattr(KVConnectorFactory, _MARK, True)
    return True


def wrap(cls: type) -> None:
    """Wrap vLLM's NIXL connector class (``NixlBaseConnector``: its scheduler-side calls), once."""
    if cls.__dict__.get(_MARK, False):
        return
    alloc, finished, finished_all = cls.update_state_after_alloc, cls.request_finished, \
        cls.request_finished_all_groups

    def noted(self) -> dict[str, int]:
        return self.__dict__.setdefault(_MARK, {})

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        # A prefill worker's pull: it hands its KV on to D (do_remote_decode) and loads the history from D's blocks
        # (remote_engine_id; vLLM has already turned do_remote_prefill off here). The scheduler calls this again once
        # the load is done, with 0: the count is the largest it was told.
        if params and params.get("do_remote_decode") and params.get("remote_engine_id"):
            counts = noted(self)
            counts[request.request_id] = max(counts.get(request.request_id, 0), int(num_external_tokens))
        return alloc(self, request, blocks, num_external_tokens)

    def with_count(self, request, result: tuple[bool, dict[str, Any] | None]):
        delay_free, params = result
        loaded = noted(self).pop(request.request_id, None)
        if loaded is not None and params is not None:
            params = {**params, LOADED_TOKENS_KEY: loaded}
        return delay_free, params

    def request_finished(self, request, block_ids):
        return with_count(self, request, finished(self, request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return with_count(self, request, finished_all(self, request, block_ids))

    cls.update_state_after_alloc = update_state_after_alloc
    cls.request_finished = request_finished
    cls.request_finished_all_groups = request_finished_all_groups
    setattr(cls, _MARK, True)
