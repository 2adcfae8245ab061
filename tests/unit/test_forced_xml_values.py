"""The number and integer texts forced.XmlArguments lets a model write read back (schema.typed, as the XML parsers
type a value) into a value that both ways the templates render one (``| string``, ``tojson``) write as the very same
text: the condition for an echoed call to re-render as written."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.control_plane.tool_calls.forced import _INTEGER, _NUMBER
from kvshuttle.control_plane.tool_calls.schema import typed


def _tool(kind: str) -> list[dict]:
    return [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": {"type": kind}}}}}]


def _round_trip(text: str, kind: str) -> tuple[str, str]:
    value = json.loads(typed(json.dumps({"x": text}), "t", _tool(kind)))["x"]
    assert isinstance(value, (int, float)) and not isinstance(value, bool), (text, value)
    return str(value), json.dumps(value)


@settings(max_examples=400, deadline=None)
@given(st.from_regex(f"^({_NUMBER})$", fullmatch=True))
def test_a_forced_number_renders_back_as_written(text):
    assert _round_trip(text, "number") == (text, text)


@settings(max_examples=200, deadline=None)
@given(st.from_regex(f"^({_INTEGER})$", fullmatch=True))
def test_a_forced_integer_renders_back_as_written(text):
    assert _round_trip(text, "integer") == (text, text)


def test_the_number_pattern_refuses_what_would_not_render_back():
    import re

    for text in ("1.50", "-0", "01", "1e5", "0.00001", "1234567.5", "1.", ".5", "+1", "1234567890123456"):
        assert not re.fullmatch(_NUMBER, text), text
    for text in ("0", "-3", "0.0001", "123456.123456789", "999999999999999", "-0.5"):
        assert re.fullmatch(_NUMBER, text), text
