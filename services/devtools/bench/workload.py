"""The conversations the benchmark replays: generated agentic sessions, or a file in the OpenAI-messages format.

Generated conversations are a coding agent's loop in OpenAI's message format. Every request carries the session's
``tools`` (:data:`TOOLS` as function tools with JSON-schema parameters) and a system prompt (rules, repository
notes). The first turn is the user's task, with the failing test output they pasted; every later turn sends the
result of the tool the previous answer called as a ``role: "tool"`` message (``read_file``, ``grep`` or
``run_tests`` output made from the Python standard library's own sources, identical on every machine with the same
Python), sometimes followed by a short user instruction. Every turn but the last ends with the assistant calling the
tool whose result the next turn carries (:attr:`Turn.call`, forced with ``tool_choice``: the test models do not call
tools on their own); the last one is answered freely. The answers themselves are generated at run time, so a
conversation stores only the client's side, which tool each answer calls, and how many tokens to generate per turn.

Token counts here are estimates from characters (``tokens_per_char``); the runner reports the real counts.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

# Byte-level BPE tokenizers (Qwen, Llama 3) average ~0.25-0.3 tokens per character on Python source and English.
DEFAULT_TOKENS_PER_CHAR = 0.3

# Pure-Python standard-library modules the tool results are cut from (those missing on this Python are skipped).
SOURCE_MODULES = (
    "json.decoder", "json.encoder", "textwrap", "string", "heapq", "fnmatch", "shlex", "difflib", "argparse",
    "dataclasses", "functools", "collections", "enum", "pathlib", "statistics", "fractions", "calendar",
    "configparser", "csv", "glob", "ipaddress", "gettext", "pprint", "tokenize", "ast", "inspect", "shutil",
    "tempfile", "copy", "contextlib", "random", "queue", "graphlib", "base64", "operator", "typing", "weakref",
    "zipfile", "tarfile", "http.client", "urllib.parse", "email.message", "logging", "subprocess", "threading",
    "selectors", "html.parser", "datetime", "_pydecimal", "traceback", "uuid", "warnings", "timeit", "cmd",
    "optparse", "plistlib",
)

# The tools every generated conversation offers: (name, description, ((parameter, JSON type, description), ...)).
# No parameter is required: a forced call with empty arguments (`{}`) is then valid, the only call a random test
# model writes that renders back exactly (see lanes.forced_call_bias).
TOOLS = (
    ("read_file", "Read a file of the repository, with line numbers.",
     (("path", "string", "Path relative to the repository root"),
      ("start_line", "integer", "First line to show (default: 1)"),
      ("end_line", "integer", "Last line to show (default: the end of the file)"))),
    ("grep", "Search the repository for a regular expression; prints path:line:text for every match.",
     (("pattern", "string", "A Python regular expression"),
      ("path", "string", "A directory or file to search (default: .)"),
      ("max_results", "integer", "At most this many matches (default: all)"))),
    ("run_tests", "Run the test suite (or one test file) with pytest and return its output.",
     (("path", "string", "A test file or directory (default: the whole suite)"),
      ("keyword", "string", "A pytest -k expression"))),
    ("list_dir", "List the files of a directory with their sizes.",
     (("path", "string", "A directory (default: .)"),)),
    ("edit_file", "Replace an exact snippet of a file with new text. Fails if the snippet is not unique.",
     (("path", "string", "The file to edit"), ("old", "string", "The exact text to replace"),
      ("new", "string", "The replacement"))),
    ("run_command", "Run a shell command in the repository root (no network) and return stdout and stderr.",
     (("command", "string", "The command line"), ("timeout_s", "integer", "Seconds to wait (default: 60)"))),
)
# The tools whose results the generated conversations carry (the others are offered, never called), and how often
# each is the next call.
CALLED_TOOLS = (("read_file", 0.6), ("grep", 0.2), ("run_tests", 0.2))

RULES = (
    "Call exactly one tool per step.",
    "Read the code before you change it; never guess the contents of a file.",
    "Keep edits minimal and in the style of the surrounding code.",
    "Run the tests after every edit and read the failures carefully before the next step.",
    "When a test fails, find the root cause; do not weaken or delete the test.",
    "Cite functions and classes by name, with the file they live in.",
    "Do not invent tool results; if a tool fails, say so and try another approach.",
    "Prefer standard-library solutions; do not add dependencies.",
    "When you are done, answer with a short summary of what changed and why.",
    "Keep every answer short: the user reads them in a terminal.",
)

# The user's task (turn 1), followed by the test output they pasted.
TASKS = (
    "The tests of `{name}` fail since the last change. Find the cause and fix it. The output:",
    "A user reports wrong results from `{name}`. Find out why and fix it. What I ran:",
    "Add a docstring to every public function that lacks one, starting with `{name}`. The current test run:",
    "Explain what `{name}` does, then check that it handles empty input. Tests so far:",
)

# A short user instruction after a tool result (on some turns).
INSTRUCTIONS = (
    "What does `{name}` do? Answer in two sentences, then continue.",
    "Is there a bug in `{name}`? Say so briefly before the next step.",
    "Summarize this output in one sentence, then continue.",
    "Which function here should change to fix the failing test?",
    "Keep going; mention `{name}` if it matters.",
    "Does `{name}` handle empty input correctly? Check before you edit anything.",
    "Read the tests of `{name}` before you change it.",
)
INSTRUCTION_RATE = 0.3  # share of tool-result turns with a user instruction after the result

# A forced call gets at least this many tokens to generate (it ends by itself where its grammar ends): the hermes call
# `<tool_call>\n{"name": ..., "arguments": {}}\n</tool_call>` takes up to ~50 tokens of the test models' tokenizer.
CALL_MIN_TOKENS = 96

ORGS = ("acme", "orbital", "northwind", "tessellate", "bluefin", "quarry", "lumen", "kestrel", "harbor", "ferrite")
PROJECTS = ("pyutils", "stdlib-fork", "toolbox", "corelib", "parsekit", "datapipe", "shellkit", "textops",
            "configlib", "netbase")

_DEF_RE = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_][A-Za-z0-9_]*)|^\s*class\s+([A-Za-z_][A-Za-z0-9_]*)")
_GREP_PATTERNS = ("def ", "return ", "self.", "raise ", "import ", "if not ", "isinstance(", "None")


@dataclass
class Turn:
    """One step of the agent loop: the messages the client sends, then the answer the model generates."""

    tool_results: list[str]  # "tool" messages answering the previous answer's tool call, in order
    user: str | None  # a user message after them (None: none)
    call: str | None  # the function the answer is made to call (tool_choice); None: the model answers freely
    max_tokens: int  # tokens to generate (a forced call: at least CALL_MIN_TOKENS, see answer_tokens)

    @property
    def answer_tokens(self) -> int:
        """The request's max_tokens: a forced call gets room for the whole call (it stops where its grammar ends)."""
        return max(self.max_tokens, CALL_MIN_TOKENS) if self.call else self.max_tokens

    def text(self) -> str:
        """Everything the turn sends, as one text (for size estimates)."""
        return "".join(self.tool_results) + (self.user or "")


@dataclass
class Conversation:
    id: str
    system: str | None  # system prompt text (None: none)
    turns: list[Turn]
    tools: list[dict[str, Any]] | None = None  # the OpenAI function tools every request carries (None: a plain chat)

    @property
    def max_tokens(self) -> list[int]:
        return [t.max_tokens for t in self.turns]

    def plain(self) -> Conversation:
        """The same conversation as a plain chat without tools: one user message per turn, the tool results written
        into it as text and the tool definitions into the system prompt (the soak and the policy sweep replay this
        shape: their stacks run no tool-call parser)."""
        system = self.system
        if self.tools:
            listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
            system = f"{system}\n\n# Tools\n\n{listing}" if system else f"# Tools\n\n{listing}"
        turns = []
        for k, turn in enumerate(self.turns):
            called = self.turns[k - 1].call if k else None
            parts = [f"Tool result of {called or 'a tool'}:\n{r}" for r in turn.tool_results]
            if turn.user is not None:
                parts.append(turn.user)
            turns.append(Turn([], "\n\n".join(parts), None, turn.max_tokens))
        return Conversation(self.id, system, turns, None)


def tool_definitions(repo: str, session: str) -> list[dict[str, Any]]:
    """:data:`TOOLS` as OpenAI function tools, spelled as the gateway hands them to the chat template (name,
    description, parameters). The first one names the session's checkout, so that conversations differ from their
    first tokens even without a system prompt."""
    out = []
    for k, (name, doc, params) in enumerate(TOOLS):
        if k == 0:
            doc = f"{doc.removesuffix('.')} (the {repo} checkout in /work/{session})."
        schema = {"type": "object", "properties": {p: {"type": kind, "description": d} for p, kind, d in params}}
        out.append({"type": "function", "function": {"name": name, "description": doc, "parameters": schema}})
    return out


def tools_tokens(tools: list[dict[str, Any]] | None, tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> int:
    """Estimated tokens of the tool definitions as a template renders them (one JSON object each)."""
    return estimate_tokens("\n".join(json.dumps(t, ensure_ascii=False) for t in tools or []), tokens_per_char)


@dataclass(frozen=True)
class _Source:
    module: str
    path: str  # as shown to the model, e.g. "json/decoder.py"
    lines: tuple[str, ...]
    names: tuple[tuple[int, str], ...]  # (0-based line index, function/class name)


@lru_cache(maxsize=1)
def _sources() -> tuple[_Source, ...]:
    out = []
    for module in SOURCE_MODULES:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        try:
            text = Path(spec.origin).read_text(encoding="utf-8")
        except OSError:
            continue
        path = module.replace(".", "/") + ("/__init__.py" if Path(spec.origin).name == "__init__.py" else ".py")
        lines = tuple(text.splitlines())
        names = []
        for i, line in enumerate(lines):
            m = _DEF_RE.match(line)
            if m:
                names.append((i, m.group(1) or m.group(2)))
        if lines and names:
            out.append(_Source(module, path, lines, tuple(names)))
    if not out:
        raise RuntimeError("no standard-library sources found to build the agentic workload from")
    return tuple(out)


def estimate_tokens(text: str, tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> int:
    """Estimated token count of ``text`` (at least 1 for non-empty text)."""
    if not text:
        return 0
    return max(1, round(len(text) * tokens_per_char))


def _fit(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters, at a line end when that loses little."""
    if chars <= 0:
        return ""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n", 0, chars + 1)
    if cut < chars * 0.95:
        cut = chars
    return text[:cut].rstrip()


def _read_file_result(rng: random.Random, src: _Source, chars: int) -> tuple[str, str]:
    """read_file's output: a header naming the file, then about ``chars`` characters of numbered lines from a
    function or class on (from earlier on when the file ends first); and that function's name."""
    i, name = rng.choice(src.names)
    header = f"[File: {src.path} ({len(src.lines)} lines total)]"
    start = max(0, i - rng.randint(0, 5))
    numbered = [f"{n + 1:>6}\t{line}" for n, line in enumerate(src.lines)]
    size, end = len(header) + 1, start
    while end < len(numbered) and size < chars:
        size += len(numbered[end]) + 1
        end += 1
    while start > 0 and size < chars:
        start -= 1
        size += len(numbered[start]) + 1
    return header + "\n" + "\n".join(numbered[start:end]), name


def _grep_result(rng: random.Random, sources: tuple[_Source, ...], chars: int) -> tuple[str, str]:
    """grep's output (``path:line:text`` hits of one pattern, about ``chars`` characters) and a public name from the
    first file searched."""
    pattern = rng.choice(_GREP_PATTERNS)
    order = list(sources)
    rng.shuffle(order)
    body, size, name = [], 0, order[0].names[0][1]
    for src in order:
        for n, line in enumerate(src.lines):
            if pattern in line:
                hit = f"{src.path}:{n + 1}:{line.strip()}"
                body.append(hit)
                size += len(hit) + 1
                if size >= chars:
                    break
        if size >= chars:
            break
    for _, candidate in order[0].names:
        if not candidate.startswith("_"):
            name = candidate
            break
    return "\n".join(body), name


def _run_tests_result(rng: random.Random, src: _Source, chars: int) -> tuple[str, str]:
    """pytest's output for a test file of ``src`` (about ``chars`` characters: tracebacks through real source) and
    the first failing function's name."""
    stem = src.path.rsplit("/", 1)[-1].removesuffix(".py")
    if stem == "__init__":
        stem = src.path.split("/")[0]
    test_file = f"tests/test_{stem}.py"
    names = [n for _, n in src.names]
    failing = rng.sample(src.names, k=min(len(src.names), 3))
    failing_names = {n for _, n in failing}
    lines = ["============================= test session starts ==============================",
             f"collected {len(names)} items", ""]
    for k, n in enumerate(names):
        status = "FAILED" if n in failing_names else "PASSED"
        lines.append(f"{test_file}::test_{n.lower()} {status}  [{round(100 * (k + 1) / len(names)):>3}%]")
    lines += ["", "=================================== FAILURES ==================================="]
    size = sum(len(x) + 1 for x in lines)
    k = 0
    while size < chars:  # tracebacks through the failing functions' source until the output is long enough
        i, n = failing[k % len(failing)] if k < len(failing) else rng.choice(src.names)
        k += 1
        block = [f"_____________________________ test_{n.lower()} _____________________________", "",
                 f"    def test_{n.lower()}():", f">       result = {src.module}.{n}(*CASES[{k}])", ""]
        stop = min(len(src.lines), i + rng.randint(8, 30))
        for j in range(i, stop):
            block.append(f"{'>' if j == stop - 1 else ' '}   {src.lines[j]}")
        block += [f"E   AssertionError: unexpected result from {n} for case {k}", "",
                  f"{src.path}:{stop}: AssertionError"]
        lines += block
        size += sum(len(x) + 1 for x in block)
    return "\n".join(lines), failing[0][1]


def _tool_result(rng: random.Random, sources: tuple[_Source, ...], tool: str, chars: int) -> tuple[str, str]:
    if tool == "read_file":
        return _read_file_result(rng, rng.choice(sources), chars)
    if tool == "grep":
        return _grep_result(rng, sources, chars)
    return _run_tests_result(rng, rng.choice(sources), chars)


def _next_tool(rng: random.Random) -> str:
    x, acc = rng.random(), 0.0
    for name, share in CALLED_TOOLS:
        acc += share
        if x < acc:
            return name
    return CALLED_TOOLS[-1][0]


def _task_turn(rng: random.Random, sources: tuple[_Source, ...], chars: int, intro: str) -> str:
    """The first user message, about ``chars`` characters: ``intro``, the task, then the test output it quotes."""
    template = rng.choice(TASKS)
    # Reserve room for the task (the name it mentions is at most ~40 characters).
    budget = max(40, chars - len(intro) - len(template) - 44)
    output, name = _run_tests_result(rng, rng.choice(sources), budget)
    return _fit(f"{intro}{template.format(name=name)}\n\n{output}", chars)


def _tool_turn(rng: random.Random, sources: tuple[_Source, ...], tool: str, chars: int) -> tuple[str, str | None]:
    """A later turn of about ``chars`` characters: ``tool``'s result, and sometimes a user instruction after it."""
    template = rng.choice(INSTRUCTIONS) if rng.random() < INSTRUCTION_RATE else None
    reserve = len(template) + 44 if template and len(template) + 44 <= chars // 2 else 0
    result, name = _tool_result(rng, sources, tool, chars - reserve)
    user = template.format(name=name) if reserve else None
    return _fit(result, chars - (len(user) if user else 0)), user


def _system_prompt(rng: random.Random, session: str, repo: str, sources: tuple[_Source, ...], chars: int) -> str:
    parts = [f"Session {session}: you are a coding agent working in repository {repo}.",
             "You fix bugs and answer questions about the code by calling the tools you are given; each tool's "
             "result comes back to you as the next message.", "", "# Rules", ""]
    rules = list(RULES)
    rng.shuffle(rules)
    parts += [f"{i + 1}. {rule}" for i, rule in enumerate(rules)]
    parts += ["", "# Repository notes", ""]
    order = list(sources)
    rng.shuffle(order)
    text = "\n".join(parts)
    k = 0
    while len(text) < chars:  # file notes (path, size, top-level names, module docstring) until long enough
        src = order[k % len(order)]
        k += 1
        public = [n for _, n in src.names if not n.startswith("_")][:12]
        doc = _module_doc(src)
        note = f"- {src.path} ({len(src.lines)} lines): defines {', '.join(public) or 'private helpers only'}."
        if doc:
            note += f" {doc}"
        text += "\n" + note
    return _fit(text, chars)


def _module_doc(src: _Source) -> str:
    """The first paragraph of the module docstring, on one line ('' if none)."""
    lines = list(src.lines)
    while lines and (not lines[0].strip() or lines[0].startswith("#")):
        lines.pop(0)
    if not lines or not lines[0].lstrip().startswith(('"""', "'''", 'r"""')):
        return ""
    first = lines[0].strip().lstrip("r")[3:]
    para = [first] if first else []
    for line in lines[1:]:
        if not line.strip() or '"""' in line or "'''" in line:
            if '"""' in line or "'''" in line:
                para.append(line.strip().split('"""')[0].split("'''")[0])
            break
        para.append(line.strip())
    return " ".join(p for p in para if p)[:400]


@lru_cache(maxsize=8)
def _max_tools_tokens(tokens_per_char: float) -> int:
    """The largest estimated size of any session's tool definitions (they name its repository)."""
    longest = max((f"{o}/{p}" for o in ORGS for p in PROJECTS), key=len)
    return tools_tokens(tool_definitions(longest, "0" * 12), tokens_per_char)


SPREADS = ("uniform", "log")  # how generated turn sizes spread over --turn-tokens-min..max


def agentic_conversations(*, count: int, seed: int, max_history_tokens: int, system_tokens: int,
                          turn_tokens: tuple[int, int], max_tokens: int,
                          tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR,
                          max_turns: int = 64, spread: str = "uniform") -> list[Conversation]:
    """``count`` agentic conversations, deterministic for ``seed``.

    ``system_tokens`` (estimated) is the system prompt with the tool definitions: the system text fills what the
    tools leave (0: no system prompt, the first user message then starts with the session's unique line). Each
    turn's size (the tool result and user text it sends, estimated tokens) is drawn from ``turn_tokens``: uniformly
    (``spread="uniform"``), or log-uniformly (``"log"``: as many turns between 100 and 1,000 tokens as between 1,000
    and 10,000, so that one run has both small and large new parts);
    turns are added while the estimated history (system + tools + turns + ``max_tokens`` per answer) stays within
    ``max_history_tokens``, up to ``max_turns``. The last turn is shortened to use the remaining room when at least
    ``turn_tokens[0]`` is left. Every turn but the last calls the tool whose result the next turn carries.
    Conversation ``i`` is the same whatever ``count`` is.
    """
    lo, hi = turn_tokens
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 0 < lo <= hi:
        raise ValueError(f"turn_tokens must be (min, max) with 0 < min <= max, got {turn_tokens}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {', '.join(SPREADS)}, got {spread!r}")
    if not 0 < tokens_per_char <= 4:
        raise ValueError(f"tokens_per_char must be in (0, 4], got {tokens_per_char}")
    if system_tokens < 0:
        raise ValueError(f"system_tokens must be >= 0, got {system_tokens}")
    fixed = max(system_tokens, _max_tools_tokens(tokens_per_char))
    if fixed + lo + max_tokens > max_history_tokens:
        raise ValueError(f"max_history_tokens={max_history_tokens} leaves no room for one turn: system prompt and "
                         f"tools {fixed} + min turn {lo} + max_tokens {max_tokens}")
    sources = _sources()
    out = []
    for index in range(count):
        rng = random.Random(f"kvshuttle-agentic:{seed}:{index}")
        session = hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:12]
        repo = f"{rng.choice(ORGS)}/{rng.choice(PROJECTS)}"
        tools = tool_definitions(repo, session)
        total = tools_tokens(tools, tokens_per_char)
        system = None
        if system_tokens > 0:
            room = int(system_tokens / tokens_per_char) - len("\n".join(json.dumps(t) for t in tools))
            system = _system_prompt(rng, session, repo, sources, room) or None
            total += estimate_tokens(system or "", tokens_per_char)
        intro = "" if system else f"Session {session}: you are a coding agent working in repository {repo}.\n\n"
        turns: list[Turn] = []
        results_of: list[str | None] = []  # per turn: the tool whose result it carries (None: the first turn)
        while len(turns) < max_turns:
            size = rng.randint(lo, hi) if spread == "uniform" else round(math.exp(rng.uniform(math.log(lo),
                                                                                              math.log(hi))))
            room = max_history_tokens - total - max_tokens
            last = size >= room
            if size > room:
                if room < lo:
                    break
                size = room
            chars = int(size / tokens_per_char)
            if not turns:
                turn, tool = Turn([], _task_turn(rng, sources, chars, intro), None, max_tokens), None
            else:
                tool = _next_tool(rng)
                result, user = _tool_turn(rng, sources, tool, chars)
                turn = Turn([result], user, None, max_tokens)
            turns.append(turn)
            results_of.append(tool)
            total += estimate_tokens(turn.text(), tokens_per_char) + max_tokens
            if last:
                break
        for k in range(len(turns) - 1):  # each answer calls the tool whose result the next turn carries
            turns[k].call = results_of[k + 1]
        out.append(Conversation(id=f"agentic-s{seed}-{index:04d}", system=system, turns=turns, tools=tools))
    return out


def estimated_history_tokens(conversation: Conversation, tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> int:
    """Estimated tokens of the whole conversation: system + tools + every turn's input + every answer at its
    max_tokens."""
    total = estimate_tokens(conversation.system or "", tokens_per_char) + tools_tokens(conversation.tools,
                                                                                       tokens_per_char)
    return total + sum(estimate_tokens(t.text(), tokens_per_char) + t.max_tokens for t in conversation.turns)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI-messages files (the format of vLLM's benchmarks/multi_turn, with OpenAI's tool calls and tool messages)


def _content_text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant message with only tool calls
        return ""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: content part {k} must be {{\"type\": \"text\", \"text\": str}}, "
                                 f"got {_short(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {_short(content)}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # the gateway's (turns/tools.py FUNCTION_NAME)


def _parse_tools(value: Any, name: str) -> list[dict[str, Any]]:
    """A conversation's ``"tools"`` (OpenAI function tools), spelled as the gateway hands them to the template."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name}: \"tools\" must be a non-empty list of function tools, got {_short(value)}")
    out, seen = [], set()
    for k, tool in enumerate(value):
        where = f"{name}, tool {k}"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}, got {_short(tool)}")
        fname = fn.get("name")
        if not isinstance(fname, str) or not _FUNCTION_NAME.match(fname):
            raise ValueError(f"{where}: function name must match {_FUNCTION_NAME.pattern}, got {_short(fname)}")
        if fname in seen:
            raise ValueError(f"{where}: two tools are named {fname!r}")
        seen.add(fname)
        description, params = fn.get("description"), fn.get("parameters")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}: description must be a string, got {_short(description)}")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ValueError(f"{where}: parameters must be a JSON Schema object of type \"object\", got "
                             f"{_short(params)}")
        spelled: dict[str, Any] = {"name": fname, "description": description, "parameters": params}
        if "strict" in fn:
            spelled["strict"] = fn["strict"]
        out.append({"type": "function", "function": spelled})
    return out


def _parse_calls(value: Any, where: str) -> list[tuple[str, str, int]]:
    """An assistant message's ``tool_calls``: [(id, function name, characters of name and arguments)]."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: tool_calls must be a non-empty list, got {_short(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}, tool call {j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"{at}: expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}, got {_short(call)}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{at}: id must be a non-empty string, got {_short(call_id)}")
        fname = fn.get("name")
        if not isinstance(fname, str) or not fname:
            raise ValueError(f"{at}: function name must be a non-empty string, got {_short(fname)}")
        arguments = fn.get("arguments", "{}")
        size = len(fname) + len(arguments if isinstance(arguments, str) else json.dumps(arguments))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"{at}: arguments are not valid JSON: {_short(fn.get('arguments'))}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}: arguments must be a JSON object, got {_short(fn.get('arguments'))}")
        calls.append((call_id, fname, size))
    return calls


@dataclass
class _Pending:
    """The turn being read: its inputs so far."""

    tool_results: list[str] = field(default_factory=list)
    user: str | None = None


def _parse_conversation(entry: Any, position: int, *, max_tokens: int, tokens_per_char: float,
                        max_turns: int | None) -> Conversation:
    if not isinstance(entry, dict):
        raise ValueError(f"conversation #{position}: expected an object with \"messages\", got {_short(entry)}")
    cid = entry.get("id", entry.get("conversation_id"))
    if cid is None:
        cid = f"conversation-{position}"
    elif not isinstance(cid, (str, int)) or isinstance(cid, bool):
        raise ValueError(f"conversation #{position}: id must be a string or an integer, got {_short(cid)}")
    cid = str(cid)
    name = f"conversation {cid!r} (#{position})"
    messages = entry.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{name}: \"messages\" must be a non-empty list, got {_short(messages)}")
    budgets_given = entry.get("max_tokens")
    if budgets_given is not None and (not isinstance(budgets_given, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in budgets_given)):
        raise ValueError(f"{name}: \"max_tokens\" must be a list of positive integers, got {_short(budgets_given)}")
    tools = _parse_tools(entry["tools"], name) if entry.get("tools") is not None else None
    system: str | None = None
    turns: list[Turn] = []
    answers: list[int | None] = []  # per turn: answer length in characters (None: no answer given)
    pending: _Pending | None = None
    open_calls: list[tuple[str, str, int]] = []  # the last assistant message's calls, until tool messages answer them
    called_at = -1  # the message that made them
    answered: set[str] = set()
    for k, msg in enumerate(messages):
        where = f"{name}, message {k}"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected an object with \"role\" and \"content\", got {_short(msg)}")
        role = msg.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"{where}: role must be \"system\", \"user\", \"assistant\" or \"tool\", got "
                             f"{_short(role)}")
        if role == "assistant" and msg.get("tool_calls") is not None:
            calls = _parse_calls(msg["tool_calls"], where)
            text = _content_text(msg.get("content"), where, role)
        else:
            if "content" not in msg:
                raise ValueError(f"{where}: missing \"content\"")
            text = _content_text(msg["content"], where, role)
            calls = []
        if open_calls and role != "tool":
            unanswered = [i for i, _, _ in open_calls if i not in answered]
            if not answered:
                raise ValueError(f"{where}: message {called_at} called tools ({', '.join(map(repr, unanswered))}); "
                                 f"the messages after it must be the tool messages that answer them")
            open_calls = []
        if role == "system":
            if k != 0:
                raise ValueError(f"{where}: a system message is only allowed as the first message")
            system = text
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}: a tool message needs the \"tool_call_id\" of the call it answers, got "
                                 f"{_short(call_id)}")
            if not open_calls:
                raise ValueError(f"{where}: a tool message must follow the assistant message whose tool call it "
                                 f"answers")
            if call_id not in {i for i, _, _ in open_calls}:
                raise ValueError(f"{where}: tool_call_id {call_id!r} answers no tool call of message {called_at} "
                                 f"(its calls: {', '.join(repr(i) for i, _, _ in open_calls)})")
            answered.add(call_id)
            pending = pending or _Pending()
            pending.tool_results.append(text)
        elif role == "user":
            if pending is not None and pending.user is not None:
                if budgets_given is None:
                    pending.user += "\n\n" + text
                    continue
                turns.append(Turn(pending.tool_results, pending.user, None, max_tokens))
                answers.append(None)
                pending = None
            pending = pending or _Pending()
            pending.user = text
        else:
            if pending is None:
                if not turns:
                    raise ValueError(f"{where}: assistant message before any user message")
                if calls or turns[-1].call is not None:
                    raise ValueError(f"{where}: an assistant message with tool calls must follow a user or tool "
                                     f"message, not another assistant message")
                answers[-1] = (answers[-1] or 0) + len(text)  # one answer in several messages
            else:
                call = calls[0][1] if calls else None
                if call is not None and tools is not None and call not in {t["function"]["name"] for t in tools}:
                    raise ValueError(f"{where}: calls {call!r}, which is not among the conversation's tools")
                turns.append(Turn(pending.tool_results, pending.user, call, max_tokens))
                answers.append(len(text) + sum(size for _, _, size in calls))
                pending = None
            open_calls, called_at, answered = calls, k, set()
    if pending is not None:
        turns.append(Turn(pending.tool_results, pending.user, None, max_tokens))
        answers.append(None)
    if not any(t.user is not None for t in turns):
        raise ValueError(f"{name}: no user message")
    if budgets_given is not None:
        if len(budgets_given) != len(turns):
            raise ValueError(f"{name}: \"max_tokens\" lists {len(budgets_given)} budgets for {len(turns)} turns")
        budgets = [min(max_tokens, b) for b in budgets_given]
    else:
        budgets = [max_tokens if chars is None else min(max_tokens, max(1, round(chars * tokens_per_char)))
                   for chars in answers]
    for turn, budget in zip(turns, budgets, strict=True):
        turn.max_tokens = budget
    called = sorted({t.call for t in turns if t.call})
    if called and tools is None:  # a file without tool definitions: each called function, with any arguments
        tools = [{"type": "function", "function": {"name": c, "description": None, "parameters": {"type": "object"}}}
                 for c in called]
    if max_turns is not None:
        turns = turns[:max_turns]
    return Conversation(id=cid, system=system, turns=turns, tools=tools)


def load_conversations(path: str | Path, *, max_tokens: int, max_turns: int | None = None, limit: int | None = None,
                       tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> list[Conversation]:
    """Conversations from a JSON file ``[{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}, ...]``.

    A ``.jsonl`` file (one conversation object per line) is accepted too. A turn is what the client sends before an
    answer: user messages, or the tool messages answering the previous answer's calls (each ``tool_call_id`` must
    name a call of the assistant message right before them) and any user message after them. An assistant message
    ends a turn: its ``tool_calls`` (OpenAI's, ids included) say which function that turn's answer is made to call
    (with several calls, the first one's: the replay forces one call, and the tool messages that answered them all
    answer it), and its estimated length (content, and the calls' names and arguments) sets the turn's generation
    budget (at least 1, at most ``max_tokens``); turns without one get ``max_tokens``. An optional ``"tools"`` list
    gives the tool definitions (default: each called function, any arguments). Consecutive user messages are merged
    into one turn, except in a conversation that carries a ``"max_tokens"`` list (kvshuttle's extension, written by
    :func:`save_conversations`): there every user message starts a turn and the list gives the turns' budgets (each
    capped at ``max_tokens``). Raises ValueError naming the bad conversation/message.
    """
    path = Path(path)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from None
    if path.suffix == ".jsonl":
        entries = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
    else:
        try:
            entries = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(entries, list):
            raise ValueError(f"{path}: expected a JSON list of conversations, got {type(entries).__name__}")
    if limit is not None:
        entries = entries[:max(0, limit)]
    out, seen = [], set()
    for position, entry in enumerate(entries):
        try:
            conv = _parse_conversation(entry, position, max_tokens=max_tokens, tokens_per_char=tokens_per_char,
                                       max_turns=max_turns)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if conv.id in seen:
            raise ValueError(f"{path}: conversation #{position}: duplicate id {conv.id!r}")
        seen.add(conv.id)
        out.append(conv)
    return out


def conversation_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The client's side of ``conv`` in the OpenAI-messages format: system, then per turn its tool messages and user
    message, and for a turn that calls a tool an assistant message with that call (id ``call_<turn>``; the
    arguments and any content are the model's at run time, so none are stored)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    for k, turn in enumerate(conv.turns):
        if turn.tool_results and (k == 0 or conv.turns[k - 1].call is None):
            raise ValueError(f"conversation {conv.id!r}: turn {k + 1} carries tool results, but the answer before "
                             f"it calls no tool")
        messages += [{"role": "tool", "tool_call_id": f"call_{k - 1}", "content": text} for text in turn.tool_results]
        if turn.user is not None:
            messages.append({"role": "user", "content": turn.user})
        if turn.call is not None:
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": turn.call, "arguments": "{}"}}]})
    return messages


def save_conversations(conversations: list[Conversation], path: str | Path) -> Path:
    """Write ``conversations`` in the OpenAI-messages format (:func:`conversation_messages`), with each
    conversation's ``"tools"`` and, to keep turn boundaries and budgets, a ``"max_tokens"`` list (ignored by tools
    that do not know it)."""
    path = Path(path)
    data = []
    for conv in conversations:
        entry: dict[str, Any] = {"id": conv.id}
        if conv.tools is not None:
            entry["tools"] = copy.deepcopy(conv.tools)
        entry["messages"] = conversation_messages(conv)
        entry["max_tokens"] = list(conv.max_tokens)
        data.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path
