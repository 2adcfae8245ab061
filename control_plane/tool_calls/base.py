"""The types every tool-call family shares: a found call, the parser protocol, a family's forced-call syntax."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol


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

    def feed(self, text: str) -> Iterable[Item]:
        """The content pieces and finished calls that the next piece of the answer decides (iterated once, per
        streamed token: a parser may answer plain text with a list, no generator)."""
        ...

    def finish(self) -> Iterator[Item]:
        """What was held back, once the answer has ended."""
        ...


ToolCallParserFactory = Callable[[Tools], ToolCallParser]  # a parser for one answer, given the request's tools


class ForcedCalls(Protocol):
    """How a family's calls are forced (``tool_choice`` ``required`` or a named function): the structural-tag format
    (xgrammar's, which vLLM's engine takes) that makes the model write them in the family's own syntax, the arguments
    held to each tool's parameter schema. What it accepts, the family's parser parses back into the same calls."""

    def format(self, tools: list[dict[str, Any]], named: str | None, *, one_call: bool = False) -> dict[str, Any]:
        """``named`` None: one or more calls of any of ``tools`` (exactly one with ``one_call``: the request's
        ``parallel_tool_calls`` false); else exactly one call of that function."""
        ...


@dataclass(frozen=True)
class Family:
    """A tool-call parser family: its names (vLLM's, aliases after), its parser, and either its forced-call syntax or
    why its calls cannot be forced (the reason a request forcing them is refused with)."""

    names: tuple[str, ...]
    parser: ToolCallParserFactory
    forced: ForcedCalls | None = None
    not_forced: str = ""
