"""The check every front end runs on a request's decoded JSON before anything else (the OpenAI, Responses and
Anthropic routes through http_entry.py, the REST bridge on its body, the gRPC API on its message): what no field may
hold, whatever the API. A failure is an InputError naming the field as a JSON path (``messages[0].content``).

Refused:
- text UTF-8 cannot encode (a lone surrogate such as ``"\\ud800"``), in any value or object key, unknown ones too;
- a body nested deeper than MAX_BODY_DEPTH, and a JSON schema the request carries (tool parameters, response
  formats) nested deeper than MAX_SCHEMA_DEPTH;
- a number that is not finite (``NaN``, ``Infinity``), an integer beyond 64 bits anywhere, and an integer field
  the engine takes outside its range (``Api.ranges``).

Pure: no I/O, no framework.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_BODY_DEPTH = 96  # objects and arrays inside one another in a whole request body
MAX_SCHEMA_DEPTH = 64  # the same, inside one JSON schema (about 32 nested "properties")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # vLLM's gRPC API takes counts, seeds and token ids as int32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # no field of any API takes an integer beyond these
MAX_LOGPROBS = 20  # the most likely tokens a request may ask for at each position (OpenAI's limit)

COUNT = (1, INT32_MAX)  # a number of tokens to generate
SEED = (INT32_MIN, INT32_MAX)


class InputError(ValueError):
    """A field no request may hold: ``param`` is its JSON path."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Api:
    """What one API's requests carry: where its JSON schemas are, and the ranges of its integer fields that reach the
    engine. Paths are JSON paths with ``[]`` for any list index (``tools[].function.parameters``)."""

    name: str
    schemas: frozenset[str] = frozenset()
    ranges: Mapping[str, tuple[int, int]] = field(default_factory=dict)


_SAMPLING = {"max_tokens": COUNT, "seed": SEED, "n": (1, 1), "top_k": (-1, INT32_MAX), "min_tokens": (0, INT32_MAX),
             "stop_token_ids[]": (0, INT32_MAX), "best_of": (1, 1)}
_STRUCTURED = frozenset({"response_format.json_schema.schema", "structured_outputs.json"})
CHAT = Api("chat completions", _STRUCTURED | {"tools[].function.parameters"},
           {**_SAMPLING, "max_completion_tokens": COUNT, "top_logprobs": (0, MAX_LOGPROBS)})
COMPLETIONS = Api("completions", _STRUCTURED,
                  {**_SAMPLING, "logprobs": (0, MAX_LOGPROBS), "prompt[]": (0, INT32_MAX)})
RESPONSES = Api("responses", frozenset({"tools[].parameters", "text.format.schema"}),
                {"max_output_tokens": COUNT, "top_logprobs": (0, MAX_LOGPROBS)})
MESSAGES = Api("messages", frozenset({"tools[].input_schema"}),
               {"max_tokens": COUNT, "top_k": (0, INT32_MAX), "thinking.budget_tokens": COUNT})
# The gRPC API and the REST bridge: protobuf's types bound the integers (int32 fields); no schemas.
PROTO = Api("grpc", ranges={"sampling.max_tokens": (0, INT32_MAX), "sampling.top_k": (-1, INT32_MAX),
                            "sampling.min_tokens": (0, INT32_MAX), "sampling.stop_token_ids[]": (0, INT32_MAX),
                            "prompt_token_ids[]": (0, INT32_MAX)})
GENERIC = Api("generic")


def json_path(parts: tuple[str | int, ...] | list[str | int]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def encodable(text: str) -> bool:
    """UTF-8 can encode ``text`` (a Python str from JSON can hold lone surrogates; nothing downstream can)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(key: str) -> str:
    return key if encodable(key) else key.encode("utf-8", "backslashreplace").decode("utf-8")


def check(body: Any, api: Api = GENERIC) -> None:
    """Raises InputError for the first field of ``body`` (decoded JSON) that no request may hold (see the module)."""
    _walk(body, api, [], "", 0, None)


def check_schema(schema: Any, param: str) -> None:
    """check() for a JSON schema that came as text (``structured_outputs.json`` may be a string), once parsed:
    errors name ``param``."""
    _walk(schema, GENERIC, [param], "", 0, (0, param))


def _walk(value: Any, api: Api, path: list[str | int], pattern: str, depth: int, schema: tuple[int, str] | None
          ) -> None:
    """``pattern``: the path with ``[]`` for indices (what Api names); ``schema``: (depth, path) of the JSON schema
    this value is inside."""
    if schema is None and pattern in api.schemas:
        schema = (depth, json_path(path))
    if isinstance(value, str):
        if not encodable(value):
            raise InputError(json_path(path), f"{json_path(path) or 'the body'}: text with a lone surrogate "
                                              "(UTF-8 cannot encode it)")
        return
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        _check_int(value, api, path, pattern)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InputError(json_path(path), f"{json_path(path) or 'the body'}: {value} is not a finite number")
        return
    if not isinstance(value, (dict, list)):
        return
    depth += 1
    if schema is not None and depth - schema[0] > MAX_SCHEMA_DEPTH:
        raise InputError(schema[1], f"{schema[1]}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels "
                                    "(objects and arrays)")
    if depth > MAX_BODY_DEPTH:
        where = json_path(path[:4]) + ("..." if len(path) > 4 else "")
        raise InputError(json_path(path[:4]), f"{where or 'the body'}: nests deeper than {MAX_BODY_DEPTH} levels "
                                               "(objects and arrays)")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, api, [*path, i], f"{pattern}[]", depth, schema)
        return
    for key, item in value.items():
        if not isinstance(key, str):
            continue
        if not encodable(key):
            where = json_path([*path, _shown(key)])
            raise InputError(where, f"{where}: a field name with a lone surrogate (UTF-8 cannot encode it)")
        _walk(item, api, [*path, key], f"{pattern}.{key}" if pattern else key, depth, schema)


def _check_int(value: int, api: Api, path: list[str | int], pattern: str) -> None:
    where = json_path(path) or "the body"
    bounds = api.ranges.get(pattern)
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise InputError(json_path(path), f"{where}: {_short(value)} is out of range (allowed: {bounds[0]} to "
                                          f"{bounds[1]})")
    if not INT64_MIN <= value <= INT64_MAX:
        raise InputError(json_path(path), f"{where}: {_short(value)} is beyond 64-bit integers (allowed: "
                                          f"{INT64_MIN} to {INT64_MAX})")


def _short(value: int) -> str:
    return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
