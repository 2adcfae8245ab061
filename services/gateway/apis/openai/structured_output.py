"""Structured output in requests: OpenAI's ``response_format`` and vLLM's ``structured_outputs``, checked and turned
into the one guided-decoding constraint of the turn (kvshuttle.control_plane.constraints).

One constraint per request: a ``response_format`` that asks for JSON, a ``structured_outputs`` object, and a forced
tool call (``tool_choice`` required or named) exclude each other (a 400 naming the second). vLLM's other
``structured_outputs`` options (``disable_fallback``, ``whitespace_pattern``, ...) are not applied, so they are
refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kvshuttle.control_plane.constraints import Constraint, json_answer
from kvshuttle.services.gateway.edge import input_check
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import check_schema
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CHOICES = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaIn(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatIn:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class StructuredOutputsIn(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=1 << 16)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, min_length=1, max_length=1 << 20)
    structural_tag: str | None = Field(default=None, min_length=1, max_length=1 << 20)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsIn:
        given = [name for name in ("json_", "regex", "choice", "grammar", "structural_tag", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, structural_tag, json_object; got "
                             f"{', '.join(g.rstrip('_') for g in given) or 'none'}")
        return self


def requested_constraint(response_format: ResponseFormatIn | None, structured: StructuredOutputsIn | None, *,
                         tenant: str = "") -> Constraint | None:
    """The constraint ``response_format`` or ``structured_outputs`` asks for (``tenant``: whose request)."""
    wants_json = response_format is not None and response_format.type != "text"
    if wants_json and structured is not None:
        raise FieldError("structured_outputs", "give either response_format (JSON) or structured_outputs, not both")
    if wants_json:
        schema = response_format.json_schema.schema_ if response_format.json_schema else None
        if response_format.type == "json_schema":
            schema = schema if schema is not None else {}
            check_schema(schema, "response_format.json_schema.schema", "response_format's schema", tenant=tenant)
        return json_answer(schema if response_format.type == "json_schema" else None)
    if structured is None:
        return None
    if structured.json_ is not None:
        schema = structured.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
                input_check.check_schema(schema, "structured_outputs.json")
            except (ValueError, RecursionError) as exc:  # InputError is a ValueError
                raise FieldError("structured_outputs.json", f"not valid JSON: {exc}"
                                 if not isinstance(exc, input_check.InputError) else str(exc)) from None
        check_schema(schema, "structured_outputs.json", "structured_outputs.json", tenant=tenant)
        return Constraint("json_schema", json.dumps(schema))
    for kind in ("regex", "grammar", "structural_tag"):
        if getattr(structured, kind) is not None:
            return Constraint(kind, getattr(structured, kind))
    if structured.choice is not None:
        return Constraint("choice", list(structured.choice))
    return Constraint("json_object", True)
