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

The whitespace that ends the content before a call is dropped (vLLM's engine parsers strip the content of an
answer with calls), the whole content when it is only whitespace; ``deepseek_v3`` keeps it, and so does mistral's
array form unless the content is only whitespace, as vLLM's parsers for them do. Whitespace that starts the content is
kept (vLLM strips it too, in whole answers only: its streams keep it).

The families, one module each with its parser and its forced-call syntax (what ``tool_choice`` ``required`` or a
named function makes the model write; constraints.py asks the family for it):

- hermes.py: ``hermes``, ``qwen3_json``;
- qwen3_coder.py: ``qwen3_coder``, ``qwen3_xml``;
- glm45.py: ``glm45``, ``glm47`` (one parser, a forced-call syntax each: their templates differ);
- llama3_json.py: ``llama3_json``, ``llama4_json``;
- mistral.py: ``mistral``;
- deepseek_v3.py: ``deepseek_v3``;
- harmony.py: ``openai`` (gpt-oss's Harmony format, reasoning and calls in one syntax; answer.AnswerParser parses
  both with its HarmonyParser). Its calls cannot be forced (harmony.NOT_FORCED says why).

The shared parts: base.py (the types, the parser protocol), scan.py (finding tags in a growing text), calls.py (the
parsing machine most families share), schema.py (the request's tools, arguments typed by schema), forced.py (the
forced-call syntaxes the families are built from). Imports run one way: the families import those, this module
imports the families.
"""

from __future__ import annotations

from kvshuttle.control_plane.tool_calls import deepseek_v3, glm45, harmony, hermes, llama3_json, mistral, qwen3_coder
from kvshuttle.control_plane.tool_calls.base import (
    Family,
    ForcedCalls,
    Item,
    ParsedCall,
    ToolCallParser,
    ToolCallParserFactory,
    Tools,
)
from kvshuttle.control_plane.tool_calls.deepseek_v3 import DeepSeekV3Parser
from kvshuttle.control_plane.tool_calls.forced import CallSyntax, EitherSyntax
from kvshuttle.control_plane.tool_calls.glm45 import Glm45Parser
from kvshuttle.control_plane.tool_calls.harmony import HarmonyCalls
from kvshuttle.control_plane.tool_calls.hermes import HermesParser
from kvshuttle.control_plane.tool_calls.llama3_json import Llama3JsonParser
from kvshuttle.control_plane.tool_calls.mistral import MistralParser
from kvshuttle.control_plane.tool_calls.qwen3_coder import Qwen3CoderParser
from kvshuttle.control_plane.tool_calls.schema import schema_types, tool_names, tool_properties, typed

__all__ = [
    "FAMILIES", "FORCED_CALLS", "TOOL_CALL_PARSERS", "CallSyntax", "DeepSeekV3Parser", "EitherSyntax", "Family",
    "ForcedCalls", "Glm45Parser", "HarmonyCalls", "HermesParser", "Item", "Llama3JsonParser", "MistralParser",
    "ParsedCall", "Qwen3CoderParser", "ToolCallParser", "ToolCallParserFactory", "Tools", "not_forced", "schema_types",
    "tool_names", "tool_properties", "typed",
]

FAMILIES: dict[str, Family] = {name: family for family in (
    hermes.FAMILY, qwen3_coder.FAMILY, glm45.FAMILY, glm45.GLM47, llama3_json.FAMILY, mistral.FAMILY, deepseek_v3.FAMILY,
    harmony.FAMILY) for name in family.names}

TOOL_CALL_PARSERS: dict[str, ToolCallParserFactory] = {name: family.parser for name, family in FAMILIES.items()}

# The parsers whose calls can be forced (tool_choice required or a named function), by name.
FORCED_CALLS: dict[str, ForcedCalls] = {name: family.forced for name, family in FAMILIES.items()
                                        if family.forced is not None}


def not_forced(parser: str) -> str:
    """Why calls cannot be forced with the tool-call parser named ``parser`` (a sentence naming it); "" when they
    can."""
    family = FAMILIES.get(parser)
    if family is None:
        return f"--tool-call-parser {parser or '(none)'} is not one of the tool-call parsers ({', '.join(FAMILIES)})"
    if family.forced is not None:
        return ""
    return f"the {parser} tool-call parser's calls cannot be forced: {family.not_forced}"
