"""vLLM NixlConnector `kv_transfer_params`: the one place that knows their fields.

kvshuttle carries them as opaque JSON on the wire; only these functions look inside. Checked against vLLM 0.32
(pull mode, `bidirectional_kv_xfer`). A handle is the dict a decode worker returns after a turn: it covers the first
`remote_num_tokens` tokens of (its prompt + its output) in `remote_block_ids` (one list per KV-cache group).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# The key kvshuttle's vLLM plugin adds to the kv_transfer_params a prefill worker returns: the prompt tokens it
# loaded over NIXL for the request (workers/vllm_loaded_tokens.py). vLLM itself reports only their sum with the
# tokens its own prefix cache held (``cached_tokens``).
LOADED_TOKENS_KEY = "kvshuttle_loaded_tokens"


class HandleError(ValueError):
    """A kv_transfer_params dict that is not a usable decode-side handle."""


def take_loaded_tokens(params: dict[str, Any] | None, cached_tokens: int) -> int | None:
    """Remove ``LOADED_TOKENS_KEY`` from P's returned ``params`` (they go on to D without it); the tokens P loaded
    over NIXL, within ``0..cached_tokens``; None when P did not say (a worker without kvshuttle's plugin)."""
    if not params or LOADED_TOKENS_KEY not in params:
        return None
    raw = params.pop(LOADED_TOKENS_KEY)
    if isinstance(raw, bool) or not isinstance(raw, int):
        return None
    return max(0, min(raw, cached_tokens))


def prefill_request_params() -> dict[str, Any]:
    """Params for a prefill request that computes locally and keeps its blocks for the decode worker."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True)
class Handle:
    """The parts of a decode worker's handle that kvshuttle reasons about."""

    engine_id: str
    host: str
    port: int
    num_tokens: int
    block_groups: tuple[tuple[int, ...], ...]
    raw: Mapping[str, Any]  # read-only


def parse_handle(params: str | Mapping[str, Any]) -> Handle:
    """Parse and sanity-check a decode worker's returned params. Raises HandleError.

    A JSON text is parsed once while it is among the last few parsed (a plan checks the handle's source and then
    builds the pull from it: one parse, not two); the Handle is immutable (``raw`` is read-only), so sharing it is
    safe."""
    if isinstance(params, str):
        return _parse_text(params)
    return _parse(params)


@functools.lru_cache(maxsize=16)
def _parse_text(params: str) -> Handle:
    return _parse(params)


def _parse(params: str | Mapping[str, Any]) -> Handle:
    try:
        raw = json.loads(params) if isinstance(params, str) else dict(params)
    except (TypeError, ValueError) as exc:
        raise HandleError(f"kv_transfer_params is not a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise HandleError("kv_transfer_params is not a JSON object")
    if not raw.get("do_remote_decode"):
        raise HandleError("not a decode-side handle (do_remote_decode is not true)")
    blocks = raw.get("remote_block_ids")
    # vLLM sends a list per KV-cache group; older versions a flat list.
    if isinstance(blocks, list) and blocks and all(isinstance(b, int) for b in blocks):
        groups: tuple[tuple[int, ...], ...] = (tuple(blocks),)
    elif isinstance(blocks, list) and blocks and all(isinstance(g, list) for g in blocks):
        groups = tuple(tuple(g) for g in blocks)
    else:
        raise HandleError("remote_block_ids missing or empty")
    try:
        num_tokens = int(raw["remote_num_tokens"])
        port = int(raw["remote_port"])
        host = str(raw["remote_host"])
        engine_id = str(raw["remote_engine_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise HandleError(f"handle field missing or malformed: {exc}") from None
    if num_tokens <= 0:
        raise HandleError("remote_num_tokens must be positive")
    return Handle(engine_id, host, port, num_tokens, groups, MappingProxyType(raw))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def pull_params(handle: Handle, tokens: int, block_size: int) -> dict[str, Any]:
    """Params telling P to pull the first ``tokens`` tokens of ``handle``.

    vLLM pairs P's blocks with the remote list positionally and trusts its length: every group must hold exactly
    ``ceil(tokens / block_size)`` blocks. More blocks than that gives silently wrong KV; fewer kills P's engine.
    """
    if tokens <= 0 or tokens > handle.num_tokens:
        raise HandleError(f"cannot pull {tokens} tokens from a handle covering {handle.num_tokens}")
    need = blocks_for(tokens, block_size)
    groups = []
    for group in handle.block_groups:
        if len(group) < need:
            raise HandleError(f"handle has {len(group)} blocks, {need} needed for {tokens} tokens")
        groups.append(list(group[:need]))
    params = dict(handle.raw)
    params["do_remote_decode"] = True
    params["remote_block_ids"] = groups
    params["remote_num_tokens"] = tokens
    return params


def free_read(handle: Handle, ids: Sequence[int], block_size: int) -> tuple[dict[str, Any], list[int]]:
    """The smallest read that frees a decode worker's handle (D frees all of a handle's blocks after any read): P
    pulls its first ``min(covered, block_size)`` tokens and computes one more. ``ids``: the tokens the handle covers,
    and at least one after them. Returns (P's kv_transfer_params, P's prompt)."""
    n = min(handle.num_tokens, block_size)
    if n <= 0 or len(ids) <= n:
        raise HandleError(f"a freeing read needs {n + 1} token ids of the handle, got {len(ids)}")
    return pull_params(handle, n, block_size), list(ids[:n + 1])


def covers_extra_token(params: dict[str, Any] | None, prompt_tokens: int, block_size: int) -> bool:
    """Whether P's handle for D lists enough blocks for D's prompt to be the prompt plus one token (P's first token).

    D allocates blocks for its whole prompt and vLLM's NIXL connector asserts that P sent at least as many: when the
    prompt fills its last block exactly (and P lists only the prompt's blocks, as it does with prefix caching on),
    one more token needs a block P did not send, and the assertion kills D's engine. The caller then lets D sample
    the first token itself.
    """
    if not params or block_size <= 0:
        return False
    groups = params.get("remote_block_ids") or []
    if not groups or not all(isinstance(g, list) for g in groups):
        return False
    return min(len(g) for g in groups) >= blocks_for(prompt_tokens + 1, block_size)
