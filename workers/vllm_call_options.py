"""Per-request options from call metadata on vLLM's gRPC server (smg-grpc-servicer's ``VllmEngineServicer.Generate``):
the prefix-cache salt and the LoRA adapter.

vLLM's ``GenerateRequest`` has no ``cache_salt`` for token input (the servicer sets ``prompt["cache_salt"]`` only for
a multimodal identity) and no LoRA field. The gateway sends each turn's salt (kvshuttle.control_plane.cache_salt:
``METADATA_KEY``) and, for a turn of an adapter, the adapter's name (kvshuttle.control_plane.models:
``ADAPTER_METADATA_KEY``) as call metadata; ``install``, run by kvshuttle's vLLM plugin in the process that serves
gRPC, wraps ``Generate``:

- a call without either runs unchanged (benchmarks and tools that call a worker directly);
- a call with them must carry token ids only (no text, no media: their prompts take other paths), one valid salt
  and one adapter this worker has loaded (``ADAPTERS_ENV``: the table its agent writes, re-read when it changes; an
  unknown name is NOT_FOUND). The options are kept under the call's request id, the call's initial metadata answers
  ``APPLIED_KEY: 1`` / ``ADAPTER_APPLIED_KEY: 1`` (a worker without this patch sends no such answer, and the gateway
  refuses to go on with it), and the engine's ``generate`` (hooked once per engine) puts the salt into the rendered
  prompt it receives for that request id, the way vLLM's renderer does for a prompt's own ``cache_salt`` (vLLM then
  hashes the first KV block with it), and passes the adapter as its ``lora_request`` (vLLM loads it on first use);
- a call whose options the engine never took (a servicer that calls the engine otherwise) is aborted with INTERNAL
  before its first answer, so nothing computed without them is reported as if they were applied.

Cheap when the servicer is not loaded (the engine's own processes): nothing is imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
SERVICER_MODULE = "smg_grpc_servicer.vllm.servicer"
ADAPTERS_ENV = "KVSHUTTLE_LORA_ADAPTERS_FILE"  # the worker's loaded adapters: {"adapters": [{name, id, path}]}
_MARK = "_kvshuttle_call_options"
_ENGINE_OPTIONS = "_kvshuttle_call_options"


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter this worker serves: its name (what clients ask for), vLLM's int id, its files."""

    name: str
    id: int
    path: str


@dataclass(frozen=True, eq=False)
class Options:
    """One call's options (compared by identity: the wrapper knows whether the engine took its own)."""

    salt: str | None = None
    adapter: Adapter | None = None


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


def adapter_name_of(metadata: Iterable[tuple[str, Any]] | None) -> tuple[str | None, str]:
    """The adapter the call names (None: the base model) and, when the metadata is unusable, why."""
    from kvshuttle.control_plane.models import ADAPTER_METADATA_KEY

    values = {value for key, value in (metadata or ()) if key == ADAPTER_METADATA_KEY}
    if not values:
        return None, ""
    name = values.pop()
    if values:
        return None, f"{ADAPTER_METADATA_KEY} sent more than once with different values"
    if not isinstance(name, str) or not name or len(name) > 256:
        return None, f"{ADAPTER_METADATA_KEY} must name an adapter (1-256 characters)"
    return name, ""


class AdapterTable:
    """The adapters this worker has loaded, read from the file its agent writes (``ADAPTERS_ENV``), again whenever
    the file changes (the agent rewrites it when adapters are loaded or unloaded while it runs)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._by_name: dict[str, Adapter] = {}

    def get(self, name: str) -> Adapter | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._by_name = parse_adapters(json.loads(open(self.path, encoding="utf-8").read()))
                self._stamp = stamp
        except (OSError, ValueError) as exc:  # unreadable or half-written: keep the last good table
            log.warning("cannot read the adapter table %s: %s", self.path, exc)
        return self._by_name.get(name)


def parse_adapters(raw: Any) -> dict[str, Adapter]:
    """The adapters of a table file's content, by name (ValueError: not a table)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("adapters"), list):
        raise ValueError('an adapter table is {"adapters": [{"name", "id", "path"}, ...]}')
    found: dict[str, Adapter] = {}
    for entry in raw["adapters"]:
        if not isinstance(entry, dict):
            raise ValueError("each adapter is an object")
        name, lora_id, path = entry.get("name"), entry.get("id"), entry.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path \
                or not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise ValueError(f"adapter entry {entry!r}: needs a name, a path and an id >= 1")
        found[name] = Adapter(name, lora_id, path)
    return found


_table: AdapterTable | None = None


def adapter_table() -> AdapterTable | None:
    """This process's adapter table (None: the worker serves no adapter)."""
    global _table
    path = os.environ.get(ADAPTERS_ENV, "")
    if not path:
        return None
    if _table is None or _table.path != path:
        _table = AdapterTable(path)
    return _table


def refusal(request: Any) -> str:
    """Why a call with options cannot take them here ('' when it can)."""
    if request.WhichOneof("input") != "tokenized":
        return "a cache salt or an adapter needs token-id input (tokenized), not text"
    if request.HasField("media_refs") or request.HasField("mm_inputs") or len(getattr(request, "extra_mm_inputs", ())):
        return "a cache salt or an adapter is not supported with multimodal input"
    return ""


def engine_options(engine: Any) -> dict[str, Options]:
    """The options waiting for ``engine.generate``, by request id; hooks the engine's ``generate`` the first time."""
    waiting = engine.__dict__.get(_ENGINE_OPTIONS)
    if waiting is not None:
        return waiting
    waiting = {}
    generate = engine.generate

    def generate_with_options(*args: Any, **kwargs: Any) -> Any:
        options = waiting.pop(kwargs.get("request_id"), None)
        if options is not None:
            if options.salt is not None:
                prompt = kwargs.get("prompt")
                if not isinstance(prompt, dict) or "type" not in prompt or prompt.get("cache_salt"):
                    raise ValueError("the request's rendered prompt cannot take a cache salt")
                kwargs["prompt"] = {**prompt, "cache_salt": options.salt}
            if options.adapter is not None:
                if kwargs.get("lora_request") is not None:
                    raise ValueError("the request already runs under an adapter")
                from vllm.lora.request import LoRARequest

                a = options.adapter
                kwargs["lora_request"] = LoRARequest(lora_name=a.name, lora_int_id=a.id, lora_path=a.path)
        return generate(*args, **kwargs)

    engine.generate = generate_with_options
    setattr(engine, _ENGINE_OPTIONS, waiting)
    return waiting


def options_of(metadata: Iterable[tuple[str, Any]] | None) -> tuple[Options | None, Any, str]:
    """The call's options (None: none sent), the gRPC status and message when they cannot be applied (None, '')."""
    import grpc

    metadata = tuple(metadata or ())
    salt, problem = salt_of(metadata)
    name, adapter_problem = adapter_name_of(metadata)
    problem = problem or adapter_problem
    if problem:
        return None, grpc.StatusCode.INVALID_ARGUMENT, problem
    if salt is None and name is None:
        return None, None, ""
    adapter = None
    if name is not None:
        table = adapter_table()
        adapter = table.get(name) if table is not None else None
        if adapter is None:
            return None, grpc.StatusCode.NOT_FOUND, f"this worker has no adapter named {name!r} loaded"
    return Options(salt, adapter), None, ""


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
    from kvshuttle.control_plane.models import ADAPTER_APPLIED_KEY

    original = servicer.Generate

    async def Generate(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802 - gRPC's name
        options, code, problem = options_of(context.invocation_metadata())
        if options is None and code is None:
            async with contextlib.aclosing(original(self, request, context)) as responses:
                async for response in responses:
                    yield response
            return
        waiting = engine_options(self.engine)
        request_id = request.request_id
        if code is None:
            problem = refusal(request) or (f"request {request_id!r} is already in flight"
                                           if request_id in waiting else "")
            code = grpc.StatusCode.INVALID_ARGUMENT if problem else None
        if code is not None or options is None:
            await context.abort(code or grpc.StatusCode.INTERNAL, problem)
            return
        waiting[request_id] = options
        applied = ((cache_salt.APPLIED_KEY, "1"),) if options.salt is not None else ()
        if options.adapter is not None:
            applied += ((ADAPTER_APPLIED_KEY, "1"),)
        try:
            await context.send_initial_metadata(applied)
            async with contextlib.aclosing(original(self, request, context)) as responses:
                async for response in responses:
                    if waiting.get(request_id) is options:  # the engine was never given it through its generate
                        log.error("request %s: the engine never took its call options; aborting it", request_id)
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            "the worker could not apply the cache salt or the adapter")
                    yield response
        finally:
            if waiting.get(request_id) is options:
                del waiting[request_id]

    setattr(Generate, _MARK, True)
    Generate.__doc__ = original.__doc__
    servicer.Generate = Generate
    return True
