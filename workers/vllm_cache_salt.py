"""Per-request prefix-cache salts on vLLM's gRPC server (smg-grpc-servicer's ``VllmEngineServicer.Generate``).

vLLM's ``GenerateRequest`` has no ``cache_salt`` for token input (the servicer sets ``prompt["cache_salt"]`` only for
a multimodal identity). The gateway sends each turn's salt as call metadata (kvshuttle.control_plane.cache_salt:
``METADATA_KEY``); ``install``, run by kvshuttle's vLLM plugin in the process that serves gRPC, wraps ``Generate``:

- a call without the metadata runs unchanged (benchmarks and tools that call a worker directly);
- a call with it must carry token ids only (no text, no media: their prompts take other paths) and one valid salt;
  the salt is kept under the call's request id, the call's initial metadata answers ``APPLIED_KEY: 1`` (a worker
  without this patch sends no such answer, and the gateway refuses to go on with it), and the engine's
  ``generate`` (hooked once per engine) puts the salt into the rendered prompt it receives for that request id, the
  way vLLM's renderer does for a prompt's own ``cache_salt`` (vLLM then hashes the first KV block with it);
- a salted call whose salt the engine never took (a servicer that calls the engine otherwise) is aborted with
  INTERNAL before its first answer, so nothing computed without the salt is reported as if salted.

Cheap when the servicer is not loaded (the engine's own processes): nothing is imported.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Iterable
from typing import Any

log = logging.getLogger(__name__)
SERVICER_MODULE = "smg_grpc_servicer.vllm.servicer"
_MARK = "_kvshuttle_cache_salt"
_ENGINE_SALTS = "_kvshuttle_cache_salts"


def salt_of(metadata: Iterable[tuple[str, Any]] | None) -> tuple[str | None, str]:
    """The call's salt (None: none sent) and, when the metadata is unusable, why ('' when usable)."""
    from kvshuttle.control_plane import cache_salt

    values = {value for key, value in (metadata or ()) if key == cache_salt.METADATA_KEY}
    if not values:
        return None, ""
    if len(values) > 1:
        return None, f"{cache_salt.METADATA_KEY} sent more than once with different values"
    salt = values.pop()
    if not isinstance(salt, str) or not cache_salt.valid(salt):
        return None, f"{cache_salt.METADATA_KEY} must be 1-128 characters of letters, digits and ._:-"
    return salt, ""


def refusal(request: Any) -> str:
    """Why a salted request cannot be salted here ('' when it can)."""
    if request.WhichOneof("input") != "tokenized":
        return "a cache salt needs token-id input (tokenized), not text"
    if request.HasField("media_refs") or request.HasField("mm_inputs") or len(getattr(request, "extra_mm_inputs", ())):
        return "a cache salt is not supported with multimodal input"
    return ""


def engine_salts(engine: Any) -> dict[str, str]:
    """The salts waiting for ``engine.generate``, by request id; hooks the engine's ``generate`` the first time."""
    salts = engine.__dict__.get(_ENGINE_SALTS)
    if salts is not None:
        return salts
    salts = {}
    generate = engine.generate

    def salted_generate(*args: Any, **kwargs: Any) -> Any:
        salt = salts.pop(kwargs.get("request_id"), None)
        if salt is not None:
            prompt = kwargs.get("prompt")
            if not isinstance(prompt, dict) or "type" not in prompt or prompt.get("cache_salt"):
                raise ValueError("the request's rendered prompt cannot take a cache salt")
            kwargs["prompt"] = {**prompt, "cache_salt": salt}
        return generate(*args, **kwargs)

    engine.generate = salted_generate
    setattr(engine, _ENGINE_SALTS, salts)
    return salts


def install() -> bool:
    """Wrap ``VllmEngineServicer.Generate`` when this process has loaded it (idempotent). True when in place."""
    module = sys.modules.get(SERVICER_MODULE)
    servicer = getattr(module, "VllmEngineServicer", None) if module is not None else None
    if servicer is None:
        return False
    if getattr(servicer.Generate, _MARK, False):
        return True
    import grpc
    from kvshuttle.control_plane import cache_salt

    original = servicer.Generate

    async def Generate(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802 - gRPC's name
        salt, problem = salt_of(context.invocation_metadata())
        if salt is None and not problem:
            async with contextlib.aclosing(original(self, request, context)) as responses:
                async for response in responses:
                    yield response
            return
        problem = problem or refusal(request)
        salts = engine_salts(self.engine)
        request_id = request.request_id
        if not problem and request_id in salts:
            problem = f"request {request_id!r} is already in flight"
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        salts[request_id] = salt
        try:
            await context.send_initial_metadata(((cache_salt.APPLIED_KEY, "1"),))
            async with contextlib.aclosing(original(self, request, context)) as responses:
                async for response in responses:
                    if salts.get(request_id) == salt:  # the engine was never given the request through its generate
                        log.error("request %s: the engine never took its cache salt; aborting it", request_id)
                        await context.abort(grpc.StatusCode.INTERNAL, "the worker could not apply the cache salt")
                    yield response
        finally:
            if salts.get(request_id) == salt:
                del salts[request_id]

    setattr(Generate, _MARK, True)
    Generate.__doc__ = original.__doc__
    servicer.Generate = Generate
    return True
