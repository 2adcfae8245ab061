"""Find the tool calls in a model's answer (``--tool-call-parser``), streaming or whole.

Like reasoning.py, one state machine per answer serves both: content text is fed as it arrives; out come content
pieces and finished tool calls. A call is reported once its end arrives (or the answer ends), so a stream sends a
call's id and name, then its arguments in one piece. Feeding a whole answer at once gives what feeding it in any
pieces gives (a suffix that may be the start of a tag, or whitespace that a call would drop, is held back until it is
decided).

Every family is named as vLLM names it and finds the calls (names, arguments) that vLLM's own parser finds in the
same text, with what every family shares:

- content is the text before the first call; text between and after calls is not content, as in vLLM;
- a call whose text does not parse (broken JSON, an answer cut off inside it, a name the request has no tool for)
  is passed on as content, text and tags included, so nothing the model wrote is lost (vLLM drops or mangles it);
- ``request_tools`` (the request's ``tools``, OpenAI's dicts) type the arguments of ``qwen3_coder``, ``glm45`` and
  mistral's ``[ARGS]`` form by each tool's JSON schema, as vLLM does (:func:`typed`).

The families:

``hermes`` (Hermes 2 Pro, Qwen 2.5 / Qwen3, the offline agent test model; also ``qwen3_json``):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them; arguments re-serialised as vLLM
  does. Unlike the other families it keeps the whitespace before a call in the content, and a call tag that does not
  parse still ends the content (the text after it is dropped).

``qwen3_coder`` (Qwen3-Coder; also ``qwen3_xml``): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>\\n...</function>\\n</tool_call>``, several functions in a block or ``<function=`` without the block
  allowed. A value loses one leading and one trailing newline and is typed by the tool's schema; a parameter left
  unclosed before ``</function>`` is dropped, as vLLM does.

``glm45`` (GLM-4.5/4.6/4.7, GLM-5; also ``glm47``): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
  </tool_call>`` (newlines between the tags or not); values typed by schema; with tools given, a name that is not one
  of them is no call (vLLM's rule).

``llama3_json`` (Llama 3.x; also ``llama4_json``): JSON objects ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), ``<|python_tag|>`` optional, several separated by ``;``. vLLM looks for them anywhere in the
  text and, if it finds any, reports no content; here the text before the first one stays content (a stream cannot
  take back what it sent). An object that is not a call is content; unlike vLLM, which then reports the whole answer
  as content, the calls around it are still calls. A ``{`` not followed by a key (prose, code) is content at once.

``mistral``: ``[TOOL_CALLS]`` followed by either a JSON array (or one object) of ``{"name", "arguments"}``
  (tokenizers before v11) or ``NAME[ARGS]{...}`` (``NAME{...}`` accepted too; v11 and later, a marker before each
  call). vLLM picks the form by the model's tokenizer; here the text after the marker does (``[`` or ``{``: the
  array). The array's arguments are re-serialised (kept when a string); an array with an entry that is not a call is
  content (vLLM skips the entry), and every marker's array counts (vLLM reads the first). The v11 form's arguments are
  the JSON object's text as written, typed by schema.

``openai`` (gpt-oss's Harmony format): messages to ``functions.NAME`` are calls; Harmony writes reasoning and calls in
  one syntax, so answer.AnswerParser parses both with control_plane/harmony.py (which says where it differs from vLLM);
  :class:`HarmonyCalls` is that parser's tool-call half, for use on its own.

``deepseek_v3`` (DeepSeek-V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
  \\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; arguments are the text in the fence as written (which
  must be a JSON object here; vLLM passes on any text, and takes only one-line arguments).

The whitespace that ends the content before a call is dropped (vLLM's engine parsers strip the content of an
answer with calls), the whole content when it is only whitespace; ``deepseek_v3`` keeps it, and so does mistral's
array form unless the content is only whitespace, as vLLM's parsers for them do. Whitespace that starts the content is
kept (vLLM strips it too, in whole answers only: its streams keep it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kvshuttle.control_plane.reasoning import partial_tail


@dataclass(frozen=True)
class ParsedCall:
    """A tool call found in the answer: the function's name and its arguments as a JSON object's text."""

    index: int
    name: str
    arguments: str


Item = str | ParsedCall  # a piece of content, or a call
Tools = list[dict[str, Any]] | None  # the request's tools, as OpenAI's API spells them


class ToolCallParser(Protocol):
    """Incremental content/tool-call split of one answer's content. ``calls``: how many calls were found so far."""

    calls: int

    def feed(self, text: str) -> Iterator[Item]:
        """The content pieces and finished calls that the next piece of the answer decides."""
        ...

    def finish(self) -> Iterator[Item]:
        """What was held back, once the answer has ended."""
        ...


ToolCallParserFactory = Callable[[Tools], ToolCallParser]  # a parser for one answer, given the request's tools


# -- the request's tools --------------------------------------------------------------------------------------------


def _function(tool: Any) -> dict[str, Any] | None:
    """A tool's function definition (Chat Completions' ``{"type", "function": {...}}`` or the flat Responses form)."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else None


def tool_names(tools: Tools) -> set[str]:
    return {fn["name"] for fn in map(_function, tools or []) if fn and isinstance(fn.get("name"), str)}


def tool_properties(tools: Tools, name: str) -> dict[str, Any]:
    """The JSON schema ``properties`` of the first tool named ``name``; {} when there is none."""
    for fn in map(_function, tools or []):
        if fn and fn.get("name") == name:
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


# -- typing argument values by the tool's JSON schema (as vLLM's engine parsers do) ----------------------------------

_TYPE_NAMES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean", "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: ``type``, the types of its ``enum`` values, and those of its
    ``anyOf``/``oneOf``/``allOf`` branches; ``{"string"}`` when it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    for t in [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []:
        if isinstance(t, str):
            types.add(t)
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        if value is None:
            types.add("null")
        for kind, name in _ENUM_TYPES:
            if isinstance(value, kind):
                types.add(name)
                break
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            types |= schema_types(branch)
    return types or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


_UNCHANGED = object()


def _typed_text(value: str, types: set[str]) -> Any:
    """A string value as the first of the schema's types it reads as (null, integer, number, boolean, object, array,
    string in that order); failing all, the JSON it is, or else the string. ``_UNCHANGED`` when it stays the very
    same string."""
    wanted = {_TYPE_NAMES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in wanted:
            continue
        if kind == "string":
            return _UNCHANGED
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        elif kind == "boolean":
            word = value.strip().lower()
            if word in ("true", "1", "false", "0"):
                return word in ("true", "1")
        else:
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return _UNCHANGED
    return parsed if _finite(parsed) else _UNCHANGED


def _typed_value(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` typed by its schema; ``_UNCHANGED`` when it stays as it is (objects and arrays are typed in place)."""
    if isinstance(value, str):
        return _typed_text(value, schema_types(schema))
    if isinstance(value, dict):
        properties = schema.get("properties")
        changed = isinstance(properties, dict) and _typed_object(value, properties)
        return value if changed else _UNCHANGED
    if isinstance(value, list):
        items, changed = schema.get("items"), False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                typed = _typed_value(item, items)
                if typed is not _UNCHANGED:
                    value[i], changed = typed, True
        return value if changed else _UNCHANGED
    typed = _typed_text(json.dumps(value, ensure_ascii=False), schema_types(schema))
    if typed is _UNCHANGED:
        typed = json.dumps(value, ensure_ascii=False)
    return _UNCHANGED if type(typed) is type(value) and typed == value else typed


def _typed_object(args: dict[str, Any], properties: dict[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        schema = properties.get(key)
        if isinstance(schema, dict):
            typed = _typed_value(value, schema)
            if typed is not _UNCHANGED:
                args[key], changed = typed, True
    return changed


def typed(arguments: str, name: str, tools: Tools) -> str:
    """A call's arguments (a JSON object's text) with each value typed by the named tool's schema, as vLLM's engine
    parsers type them; the text as it was when nothing changes (no tools, no schema, nothing to convert)."""
    properties = tool_properties(tools, name)
    if not properties:
        return arguments
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(args, dict) or not _typed_object(args, properties):
        return arguments
    return json.dumps(args, ensure_ascii=False)


# -- scanning --------------------------------------------------------------------------------------------------------


def _first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest whole tag in ``text[start:]``: (index, tag); (-1, "") when there is none."""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best < 0 or at < best or (at == best and len(tag) > len(found))):
            best, found = at, tag
    return best, found


class _JsonEnd:
    """Where the JSON object or array that a text starts with ends, found as the text grows: brackets counted outside
    strings. A text that is not JSON ends where its brackets balance (or never); parsing it then fails."""

    def __init__(self) -> None:
        self._depth, self._in_string, self._escaped, self._pos = 0, False, False, 0

    @property
    def fresh(self) -> bool:
        """Nothing scanned yet."""
        return self._pos == 0

    def end(self, text: str) -> int:
        """One past the value's closing bracket in ``text``, or -1 when it has not closed yet."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return -1


class _Calls:
    """What the families share: the content outside calls (with the whitespace a call would drop held back), calls
    numbered in order, and a call that does not parse passed on as content. A family's ``_run`` consumes ``_held``."""

    def __init__(self, tools: Tools = None):
        self.tools = list(tools or [])
        self.calls = 0
        self._held = ""  # answer text not decided yet
        self._seen = 0  # how much of _held a search for a closing tag has already looked through
        self._ws = ""  # whitespace ending the content so far: dropped if a call follows
        self._spoke = False  # the content has had more than whitespace
        self._called = False  # a call was found: text outside calls is no longer content

    def feed(self, text: str) -> Iterator[Item]:
        self._held += text
        yield from self._run(final=False)

    def finish(self) -> Iterator[Item]:
        yield from self._run(final=True)
        if self._ws and not self._called:
            yield self._ws
        self._ws = ""

    def _run(self, *, final: bool) -> Iterator[Item]:
        raise NotImplementedError

    # -- content and calls --

    def _content(self, text: str) -> Iterator[str]:
        if self._called or not text:
            return
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out, self._ws, self._spoke = self._ws + body, text[len(body):], True
        yield out

    def _found(self, calls: list[tuple[str, str]], *, keep_ws: bool = False) -> Iterator[Item]:
        """Calls found; the whitespace before them is dropped, or passed on as content (``keep_ws``)."""
        if keep_ws and self._ws and not self._called:
            yield self._ws
        self._ws, self._called = "", True
        for name, arguments in calls:
            yield ParsedCall(self.calls, name, arguments)
            self.calls += 1

    def _unparsed(self, raw: str) -> Iterator[str]:
        """A call that does not parse: its text is content, tags and all."""
        if self._called:
            if raw:
                yield raw
        else:
            yield from self._content(raw)

    # -- scanning _held --

    def _scan(self, tags: tuple[str, ...], *, final: bool) -> Iterator[str]:
        """Content up to the first of ``tags``, which is consumed and returned ("" when none has come: the text that
        cannot start one is content, the rest held back, or all content once the answer has ended)."""
        at, tag = _first(self._held, tags)
        if at < 0:
            keep = 0 if final else max(partial_tail(self._held, t) for t in tags)
            cut = len(self._held) - keep
            yield from self._content(self._held[:cut])
            self._held = self._held[cut:]
            return ""
        yield from self._content(self._held[:at])
        self._held = self._held[at + len(tag):]
        self._seen = 0
        return tag

    def _take(self, tags: tuple[str, ...], *, final: bool) -> tuple[str, str] | None:
        """Inside a call: the text up to the first of ``tags`` and the tag, both consumed; at the answer's end without
        one, (all the text, ""); None while it has not come."""
        at, tag = _first(self._held, tags, max(0, self._seen - max(map(len, tags)) + 1))
        if at >= 0:
            before, self._held, self._seen = self._held[:at], self._held[at + len(tag):], 0
            return before, tag
        if final:
            before, self._held, self._seen = self._held, "", 0
            return before, ""
        self._seen = len(self._held)
        return None

    def _skip_space(self) -> str:
        """The whitespace that starts ``_held``, consumed."""
        rest = self._held.lstrip()
        space, self._held = self._held[:len(self._held) - len(rest)], rest
        return space


# -- hermes ----------------------------------------------------------------------------------------------------------


def _parse_hermes(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's body; None when it is not a call. Arguments are re-serialised as vLLM
    does (``json.dumps(..., ensure_ascii=False)``), so an echoed call renders back to the same text."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if arguments is None:
        arguments = {}
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser:
    """``<tool_call>{json}</tool_call>``: the content is the text before the first call tag."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Tools = None):
        self.tools = list(tools or [])
        self._held = ""
        self._in_call = False
        self._called = False  # a call has started: later text outside calls is not content
        self.calls = 0

    def feed(self, text: str) -> Iterator[Item]:
        self._held += text
        while self._held:
            if self._in_call:
                at = self._held.find(self.end)
                if at < 0:
                    return
                body, self._held = self._held[:at], self._held[at + len(self.end):]
                self._in_call = False
                yield from self._call(body, closed=True)
                continue
            at = self._held.find(self.start)
            if at >= 0:
                if at and not self._called:
                    yield self._held[:at]
                self._held = self._held[at + len(self.start):]
                self._in_call = self._called = True
                continue
            keep = partial_tail(self._held, self.start)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if out and not self._called:
                yield out
            return

    def finish(self) -> Iterator[Item]:
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            yield from self._call(held, closed=False)
        elif held and not self._called:
            yield held

    def _call(self, body: str, *, closed: bool) -> Iterator[Item]:
        parsed = _parse_hermes(body.strip())
        if parsed is None:
            yield self.start + body + (self.end if closed else "")
            return
        yield ParsedCall(self.calls, *parsed)
        self.calls += 1


# -- qwen3_coder -----------------------------------------------------------------------------------------------------

_PARAM_OPEN = r"<\s*parameter\s*=\s*"
# A parameter runs to its closing tag, or to the next parameter's opening one (the model left it unclosed).
_QWEN_PARAM = re.compile(rf"{_PARAM_OPEN}([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?={_PARAM_OPEN}))", re.DOTALL)


def _unwrap_newlines(value: str) -> str:
    """A Qwen3 value without the newline its template puts after the opening tag and before the closing one."""
    return value[value.startswith("\n"):len(value) - value.endswith("\n")] if value else value


class Qwen3CoderParser(_Calls):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``."""

    block, block_end = "<tool_call>", "</tool_call>"
    function, function_end = "<function=", "</function>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | block (before <function=) | name | args
        self._raw = ""  # the current call's text so far: content if it does not parse
        self._name = ""

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                tag = yield from self._scan((self.block, self.function), final=final)
                if not tag:
                    return
                self._raw, self._state = tag, "block" if tag == self.block else "name"
                continue
            if self._state == "block":
                got = self._take((self.block_end, self.function), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == self.function:
                    self._state = "name"
                    continue
                yield from self._unparsed(self._raw)  # a block without a function
            elif self._state == "name":
                got = self._take((">", self.function_end), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == ">":
                    self._name, self._state = got[0], "args"
                    continue
                yield from self._unparsed(self._raw)
            else:
                got = self._take((self.function_end,), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                call = self._parse(self._name, got[0], closed=bool(got[1]))
                yield from self._found([call]) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    def _parse(self, name: str, body: str, *, closed: bool) -> tuple[str, str] | None:
        name = name.strip()
        if not name:
            return None
        if not closed and _QWEN_PARAM.sub("", body).strip() not in ("", self.block_end):
            return None  # cut off inside a parameter
        params = {m[1]: _unwrap_newlines(m[2]) for m in _QWEN_PARAM.finditer(body)}
        return name, typed(json.dumps(params, ensure_ascii=False), name, self.tools)


# -- glm45 -----------------------------------------------------------------------------------------------------------

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(_Calls):
    """``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``."""

    start, end, first_arg = "<tool_call>", "</tool_call>", "<arg_key>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._in_call = False
        self._names = tool_names(self.tools)

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if not self._in_call:
                if not (yield from self._scan((self.start,), final=final)):
                    return
                self._in_call = True
            got = self._take((self.end,), final=final)
            if got is None:
                return
            self._in_call = False
            call = self._parse(got[0], closed=bool(got[1]))
            yield from self._found([call]) if call else self._unparsed(self.start + got[0] + got[1])

    def _parse(self, body: str, *, closed: bool) -> tuple[str, str] | None:
        at = body.find(self.first_arg)
        name, args = (body, "") if at < 0 else (body[:at], body[at:])
        name = name.strip()
        if not name or (self._names and name not in self._names):
            return None
        if not closed and (at < 0 or _GLM_ARG.sub("", args).strip()):
            return None  # cut off before its arguments, or inside one
        params = {m[1].strip(): m[2] for m in _GLM_ARG.finditer(args)}
        return name, typed(json.dumps(params, ensure_ascii=False), name, self.tools)


# -- llama3_json -----------------------------------------------------------------------------------------------------


class Llama3JsonParser(_Calls):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``: any JSON object naming a function is a call."""

    python_tag = "<|python_tag|>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | tag (after the python tag) | object
        self._raw = ""
        self._json = _JsonEnd()

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                tag = yield from self._scan((self.python_tag, "{"), final=final)
                if not tag:
                    return
                if tag == "{":
                    self._held, self._raw, self._state = "{" + self._held, "", "object"
                    self._json = _JsonEnd()
                else:
                    self._raw, self._state = tag, "tag"
                continue
            if self._state == "tag":
                self._raw += self._skip_space()
                if not self._held and not final:
                    return
                if self._held.startswith("{"):
                    self._state, self._json = "object", _JsonEnd()
                    continue
                yield from self._unparsed(self._raw)  # the tag, then no call: content
                self._raw, self._state = "", "content"
                continue
            if self._json.fresh:  # a call's object starts with a key: other braces (prose, code) are content at once
                key = self._held[1:].lstrip()[:1]
                if not key and not final:
                    return
                if key != '"':
                    self._held = self._held[1:]
                    yield from self._unparsed(self._raw + "{")
                    self._raw, self._state = "", "content"
                    continue
            end = self._json.end(self._held)
            if end < 0 and not final:
                return
            text = self._held if end < 0 else self._held[:end]
            self._held, self._raw = self._held[len(text):], self._raw + text
            call = self._parse(text) if end >= 0 else None
            yield from self._found([call]) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    @staticmethod
    def _parse(text: str) -> tuple[str, str] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
        if key is None:
            return None
        return value["name"], json.dumps(value[key], ensure_ascii=False)


# -- mistral ---------------------------------------------------------------------------------------------------------


class MistralParser(_Calls):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``."""

    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | start (after the marker) | array | name | args_start | args
        self._raw = ""
        self._name = ""
        self._json = _JsonEnd()

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            state = self._state
            if state == "content":
                if not (yield from self._scan((self.marker,), final=final)):
                    return
                self._raw, self._state = self.marker, "start"
                continue
            if state in ("start", "args_start"):
                self._raw += self._skip_space()
                if not self._held and not final:
                    return
                if state == "start":
                    self._state = "array" if self._held[:1] in ("[", "{") else "name"
                elif self._held.startswith("{"):
                    self._state = "args"
                else:
                    yield from self._unparsed(self._raw)  # [ARGS] without a JSON object
                    self._raw, self._state = "", "content"
                    continue
                if self._state != "name":
                    self._json = _JsonEnd()
                continue
            if state == "name":
                got = self._take((self.args_marker, "{"), final=final)
                if got is None:
                    return
                if got[1] == "{":
                    self._held = "{" + self._held
                    self._raw, self._name, self._state = self._raw + got[0], got[0], "args"
                    self._json = _JsonEnd()
                    continue
                self._raw += got[0] + got[1]
                if got[1]:
                    self._name, self._state = got[0], "args_start"
                    continue
                yield from self._unparsed(self._raw)  # a name and no arguments: cut off
                self._raw, self._state = "", "content"
                continue
            end = self._json.end(self._held)
            if end < 0 and not final:
                return
            text = self._held if end < 0 else self._held[:end]
            self._held, self._raw = self._held[len(text):], self._raw + text
            if end < 0:
                calls = None
            elif state == "array":
                calls = self._parse_array(text)
            else:
                calls = self._parse_args(self._name, text)
            if calls:
                yield from self._found(calls, keep_ws=state == "array" and self._spoke)
            else:
                yield from self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    @staticmethod
    def _parse_array(text: str) -> list[tuple[str, str]] | None:
        """The calls of the older form's JSON (an array of them, or one); None unless every entry is a call."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = []
        for entry in [value] if isinstance(value, dict) else value:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                return None
            args = entry.get("arguments")
            calls.append((entry["name"], "{}" if args is None else args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)))
        return calls or None

    def _parse_args(self, name: str, text: str) -> list[tuple[str, str]] | None:
        name = name.strip()
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not name or not isinstance(value, dict):
            return None
        return [(name, typed(text, name, self.tools))]


# -- deepseek_v3 -----------------------------------------------------------------------------------------------------


class DeepSeekV3Parser(_Calls):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>``."""

    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    fence, fence_end = "\n```json\n", "\n```"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | block (between calls) | call
        self._raw = ""  # the block's text since its start or its last call: content if no call follows

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                if not (yield from self._scan((self.calls_begin,), final=final)):
                    return
                self._raw, self._state = self.calls_begin, "block"
                continue
            if self._state == "block":
                got = self._take((self.call_begin, self.calls_end), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == self.call_begin:
                    self._state = "call"
                    continue
                yield from self._unparsed("" if self._called else self._raw)  # a block without calls
                self._raw, self._state = "", "content"
                continue
            got = self._take((self.call_end,), final=final)
            if got is None:
                return
            self._raw += got[0] + got[1]
            call = self._parse(got[0]) if got[1] else None
            yield from self._found([call], keep_ws=True) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "block"

    def _parse(self, body: str) -> tuple[str, str] | None:
        kind, sep, rest = body.partition(self.sep)
        name, fence, args = rest.partition(self.fence)
        if kind != "function" or not sep or not fence or not name or "\n" in name or not args.endswith(self.fence_end):
            return None
        args = args[:-len(self.fence_end)]
        try:
            value = json.loads(args)
        except ValueError:
            return None
        return (name, args) if isinstance(value, dict) else None


# -- openai (Harmony) ------------------------------------------------------------------------------------------------


class HarmonyCalls:
    """``openai``: gpt-oss's Harmony messages (control_plane/harmony.py), as a tool-call parser: content and calls,
    analysis messages passed on as content as written. answer.AnswerParser does not run this one: it parses Harmony
    answers with harmony.HarmonyParser, reasoning included when the reasoning parser is Harmony's too. The markers
    are special tokens: the answer must be decoded keeping them."""

    keeps_special_tokens = True

    def __init__(self, tools: Tools = None):
        from kvshuttle.control_plane.harmony import HarmonyParser  # harmony.py imports this module

        self._parser = HarmonyParser(tools, reasoning=False)

    @property
    def calls(self) -> int:
        return self._parser.calls

    def feed(self, text: str) -> Iterator[Item]:
        yield from self._items(self._parser.feed(text))

    def finish(self) -> Iterator[Item]:
        yield from self._items(self._parser.finish())

    @staticmethod
    def _items(events) -> Iterator[Item]:
        for event in events:
            yield event if isinstance(event, ParsedCall) else event[1]


TOOL_CALL_PARSERS: dict[str, ToolCallParserFactory] = {
    "hermes": HermesParser,
    "qwen3_json": HermesParser,  # vLLM's alias
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3CoderParser,
    "glm45": Glm45Parser,
    "glm47": Glm45Parser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser,
    "openai": HarmonyCalls,
}
