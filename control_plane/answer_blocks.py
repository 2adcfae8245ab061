"""One answer's blocks, whatever API spells them: the rules every API follows, held once (pure).

The turn's parse stage turns the model's text into events (answer.py: reasoning and content pieces, tool calls).
:class:`AnswerBlocks` turns those events into an ordered list of blocks (reasoning, text, call) and, as they
stream, into three kinds of step: a block opened, text appended to the open block, a block closed. Each API's
speller (chat's deltas and message, Anthropic's content blocks, Responses' output items) only spells these steps, so
what an answer says is decided here, the same for every API, streamed or whole:

- **Which calls are kept**: all, or with ``parallel_tool_calls`` false the first call the answer makes (the
  others are dropped and change nothing else).
- **Reasoning**: kept unless ``include_reasoning`` is false (chat's vLLM field).
- **Blank text**: whitespace outside an open text block (e.g. the blank line between the reasoning and a call) is
  held. Text that follows makes it the start of a text block; a call or reasoning that follows drops it; at the
  answer's end it becomes the answer's text only when the answer kept no call (an answer of only whitespace is
  text, in every API).
- **The finish reason**: ``tool_calls`` when a call was kept, else the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.reasoning import REASONING
from kvshuttle.control_plane.tool_calls import ParsedCall

REASONING_BLOCK, TEXT_BLOCK, CALL_BLOCK = "reasoning", "text", "call"
OPENED, APPENDED, CLOSED = 0, 1, 2


@dataclass(slots=True)
class Block:
    """One block of the answer. ``position``: its place among the answer's kept blocks; ``call_index``: a call's
    place among the kept calls (chat's ``tool_calls[].index``); ``call_id``: made by the speller's id maker."""

    kind: str
    position: int
    name: str = ""
    arguments: str = ""  # a call's arguments: a JSON object's text
    call_index: int = -1
    call_id: str = ""
    # The reasoning or text so far, as the pieces appended (``text`` joins them once per change): appending to one
    # growing string would copy it on every token of a long answer.
    pieces: list[str] = field(default_factory=list)
    _joined: str = ""
    _joined_pieces: int = 0

    @property
    def text(self) -> str:
        if self._joined_pieces != len(self.pieces):
            self._joined, self._joined_pieces = "".join(self.pieces), len(self.pieces)
        return self._joined


Step = tuple[int, Block, str]  # (OPENED | APPENDED | CLOSED, the block, the text appended)


class AnswerBlocks:
    def __init__(self, *, parallel_tool_calls: bool = True, include_reasoning: bool = True,
                 new_call_id: Callable[[], str] = lambda: ""):
        self.parallel_tool_calls, self.include_reasoning = parallel_tool_calls, include_reasoning
        self.new_call_id = new_call_id
        self.blocks: list[Block] = []
        self.calls = 0
        self._open: Block | None = None
        self._blank = ""  # whitespace held outside a text block
        self.finished = False

    # -- streaming ------------------------------------------------------------------------------------------------

    def feed(self, events: Iterable[Event]) -> list[Step]:
        """The steps for the events of the next piece of answer text."""
        out: list[Step] = []
        for event in events:
            if isinstance(event, ParsedCall):
                self._call(event, out)
            elif event.kind == REASONING:
                if self.include_reasoning and event.text:
                    self._blank = ""
                    self._append(REASONING_BLOCK, event.text, out)
            elif event.text:
                self._text(event.text, out)
        return out

    def extend_text(self, text: str) -> bool:
        """Content ``text`` added to the open text block, the one step ``feed`` would take for it (APPENDED); False,
        with nothing done, when the answer has no open text block (``feed`` decides then). The streaming fast path:
        most of an answer's tokens are this step."""
        open_ = self._open
        if open_ is None or open_.kind != TEXT_BLOCK or not text:
            return False
        open_.pieces.append(text)
        return True

    def finish(self, events: Iterable[Event] = ()) -> list[Step]:
        """The steps for what the parser held back (``events``), once the answer has ended; closes the open
        block."""
        out = self.feed(events)
        if self._blank and not self.calls:
            self._append(TEXT_BLOCK, self._blank, out)
        self._blank = ""
        self._close(out)
        self.finished = True
        return out

    def finish_reason(self, engine_reason: str) -> str:
        """The answer's finish reason: ``tool_calls`` when it kept a call (as vLLM reports it)."""
        return "tool_calls" if self.calls else engine_reason

    # -- the whole answer ------------------------------------------------------------------------------------------

    def whole(self, events: Iterable[Event]) -> list[Block]:
        """Every block of a whole answer (``events``: all its events)."""
        self.finish(events)
        return self.blocks

    def joined(self, kind: str) -> str | None:
        """The text of every block of ``kind`` (reasoning or text) joined; None when there is none."""
        parts = [b.text for b in self.blocks if b.kind == kind]
        return "".join(parts) if parts else None

    @property
    def kept_calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == CALL_BLOCK]

    # -- the rules -------------------------------------------------------------------------------------------------

    def _text(self, text: str, out: list[Step]) -> None:
        open_ = self._open
        if open_ is not None and open_.kind == TEXT_BLOCK:
            open_.pieces.append(text)
            out.append((APPENDED, open_, text))
            return
        held = self._blank + text
        if not held.strip():
            self._blank = held
            return
        self._blank = ""
        self._append(TEXT_BLOCK, held, out)

    def _call(self, call: ParsedCall, out: list[Step]) -> None:
        if self.calls and not self.parallel_tool_calls:
            return
        self._blank = ""
        self._close(out)
        block = Block(CALL_BLOCK, len(self.blocks), name=call.name, arguments=call.arguments, call_index=self.calls,
                      call_id=self.new_call_id())
        self.calls += 1
        self.blocks.append(block)
        out.append((OPENED, block, ""))
        out.append((CLOSED, block, ""))

    def _append(self, kind: str, text: str, out: list[Step]) -> None:
        open_ = self._open
        if open_ is None or open_.kind != kind:
            self._close(out)
            open_ = self._open = Block(kind, len(self.blocks))
            self.blocks.append(open_)
            out.append((OPENED, open_, ""))
        open_.pieces.append(text)
        out.append((APPENDED, open_, text))

    def _close(self, out: list[Step]) -> None:
        if self._open is not None:
            out.append((CLOSED, self._open, ""))
            self._open = None
