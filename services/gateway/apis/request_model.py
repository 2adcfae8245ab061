"""The base of every front end's request objects (StrictIn): JSON types exactly as documented, and no field dropped
silently. Shared by the OpenAI, Anthropic and Responses front ends, so none imports another."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from kvshuttle.control_plane.session import ID_PATTERN, InvalidArgument, validate_id
from kvshuttle.services.gateway.turns.errors import FieldError
from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED = "unsupported_fields"  # the pydantic error type of fields the gateway does not apply

# kvshuttle.control_plane.session.validate_id's rule; "" means no session.
SESSION_ID_PATTERN = ID_PATTERN
SESSION_HEADER = "X-Session-ID"


def session_id_of(headers: Mapping[str, str], conversation_id: str | None = None) -> str:
    """A turn's session id: the ``X-Session-ID`` header's, else the body's ``conversation_id`` (checked by its
    model's pattern), "" for none. A header that holds no id (``..``, ``a/b``) is a FieldError naming it."""
    session = headers.get(SESSION_HEADER.lower()) or ""
    if not session:
        return conversation_id or ""
    try:
        return validate_id(f"{SESSION_HEADER} header", session)
    except InvalidArgument as exc:
        raise FieldError(SESSION_HEADER, str(exc)) from None


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral


class StrictIn(BaseModel):
    """A request object: JSON types exactly as documented (strict: no "5" for 5, 0 for false or false for a token
    id, as the fuzzer expects), and no field dropped. A field it does not declare is refused (error type
    ``unsupported_fields``, naming them all), except a known one (``KNOWN``: fields of OpenAI's or vLLM's API that
    this gateway does not apply yet) that is null or at a value in ``NEUTRAL`` (one that asks for nothing)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    KNOWN: ClassVar[frozenset[str]] = frozenset()
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept, refused = {}, []
        aliases = {f.alias for f in cls.model_fields.values() if f.alias}  # e.g. Responses text.format's "schema"
        for key, value in data.items():
            if key in cls.model_fields or key in aliases:
                kept[key] = value
            elif not ((value is None and key in cls.KNOWN)
                      or any(_same(value, n) for n in cls.NEUTRAL.get(key, ()))):
                refused.append(key)
        if refused:
            raise PydanticCustomError(UNSUPPORTED, "unsupported field(s): {fields}",
                                      {"fields": ", ".join(map(str, refused)), "first": str(refused[0])})
        return kept
