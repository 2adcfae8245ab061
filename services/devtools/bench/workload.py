"""The conversations the benchmark replays: generated agentic sessions, or a file in the OpenAI-messages format.

Generated conversations look like a coding agent's loop: a long system prompt (tools with JSON schemas, rules,
repository notes), then user turns that each carry tool results (``read_file``, ``grep``, ``run_tests`` output made
from the Python standard library's own sources, identical on every machine with the same Python) and a short
instruction. The assistant answers are produced by the model at run time, so a conversation only stores the user
side and how many tokens to generate per turn.

Token counts here are estimates from characters (``tokens_per_char``); the runner reports the real counts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from dataclasses import dataclass
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

TOOLS = (
    ("read_file", "Read a file of the repository, with line numbers.",
     {"path": "string, path relative to the repository root", "start_line": "integer, optional",
      "end_line": "integer, optional"}),
    ("grep", "Search the repository for a regular expression; prints path:line:text for every match.",
     {"pattern": "string, a Python regular expression", "path": "string, a directory or file (default: .)",
      "max_results": "integer, optional"}),
    ("run_tests", "Run the test suite (or one test file) with pytest and return its output.",
     {"path": "string, optional test file or directory", "keyword": "string, optional -k expression"}),
    ("list_dir", "List the files of a directory with their sizes.", {"path": "string"}),
    ("edit_file", "Replace an exact snippet of a file with new text. Fails if the snippet is not unique.",
     {"path": "string", "old": "string, the exact text to replace", "new": "string, the replacement"}),
    ("run_command", "Run a shell command in the repository root (no network) and return stdout and stderr.",
     {"command": "string", "timeout_s": "integer, optional, default 60"}),
)

RULES = (
    "Call exactly one tool per step, as a single JSON object {\"tool\": name, \"arguments\": {...}}.",
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

INSTRUCTIONS = (
    "What does `{name}` do? Answer in two sentences, then give your next tool call.",
    "Is there a bug in `{name}`? Explain briefly and say which tool you would call next.",
    "Summarize this output in one paragraph and propose the next step.",
    "Which function here should we change to fix the failing test? Give the next tool call as JSON.",
    "List the public functions you saw so far and what `{name}` is for.",
    "Continue: decide the next tool call and explain why in one sentence.",
    "Does `{name}` handle empty input correctly? Answer yes or no with a reason.",
    "Write the edit_file call that would add a docstring to `{name}`.",
)

ORGS = ("acme", "orbital", "northwind", "tessellate", "bluefin", "quarry", "lumen", "kestrel", "harbor", "ferrite")
PROJECTS = ("pyutils", "stdlib-fork", "toolbox", "corelib", "parsekit", "datapipe", "shellkit", "textops",
            "configlib", "netbase")

_DEF_RE = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_][A-Za-z0-9_]*)|^\s*class\s+([A-Za-z_][A-Za-z0-9_]*)")
_GREP_PATTERNS = ("def ", "return ", "self.", "raise ", "import ", "if not ", "isinstance(", "None")


@dataclass
class Conversation:
    id: str
    system: str | None  # system prompt text (None: none)
    user_turns: list[str]  # the user messages, in order (assistant answers come from the model at run time)
    max_tokens: list[int]  # tokens to generate per turn (same length as user_turns)


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


def _read_file_block(rng: random.Random, src: _Source, chars: int) -> tuple[str, str]:
    i, name = rng.choice(src.names)
    start = max(0, i - rng.randint(0, 5))
    body, size, end = [], 0, start
    while end < len(src.lines) and size < chars:
        line = f"{end + 1:>6}\t{src.lines[end]}"
        body.append(line)
        size += len(line) + 1
        end += 1
    header = f'Tool result of read_file(path="{src.path}", start_line={start + 1}, end_line={end}):'
    return header + "\n" + "\n".join(body), name


def _grep_block(rng: random.Random, sources: tuple[_Source, ...], chars: int) -> tuple[str, str]:
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
    header = f'Tool result of grep(pattern="{pattern}", path="."):'
    return header + "\n" + "\n".join(body), name


def _run_tests_block(rng: random.Random, src: _Source, chars: int) -> tuple[str, str]:
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
    header = f'Tool result of run_tests(path="{test_file}"):'
    return header + "\n" + "\n".join(lines), failing[0][1]


def _user_turn(rng: random.Random, sources: tuple[_Source, ...], chars: int) -> str:
    """One tool-result step of about ``chars`` characters: tool output blocks, then a short instruction."""
    template = rng.choice(INSTRUCTIONS)
    blocks, size, name = [], 0, None
    # Reserve room for the instruction (the name it mentions is at most ~40 characters).
    budget = max(40, chars - len(template) - 44)
    while size < budget:
        kind = rng.random()
        if kind < 0.6:
            block, found = _read_file_block(rng, rng.choice(sources), budget - size)
        elif kind < 0.8:
            block, found = _grep_block(rng, sources, budget - size)
        else:
            block, found = _run_tests_block(rng, rng.choice(sources), budget - size)
        blocks.append(block)
        size += len(block) + 2
        name = name or found
    instruction = template.format(name=name)
    if len(instruction) > chars // 2:  # a tiny turn: keep most of it for the tool result
        instruction = "Next step?"
    body = _fit("\n\n".join(blocks), chars - len(instruction) - 2)
    return (body + "\n\n" + instruction if body else instruction)[:chars]


def _system_prompt(rng: random.Random, session: str, repo: str, sources: tuple[_Source, ...], chars: int) -> str:
    parts = [f"Session {session}: you are a coding agent working in repository {repo}.",
             "You fix bugs and answer questions about the code by calling tools. The user relays every tool "
             "result back to you verbatim as their next message.", "", "# Tools", ""]
    for name, doc, params in TOOLS:
        schema = {"name": name, "description": doc,
                  "parameters": {"type": "object", "properties": {k: {"description": v} for k, v in params.items()},
                                 "required": [k for k, v in params.items() if "optional" not in v]}}
        parts.append(json.dumps(schema))
    parts += ["", "# Rules", ""]
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


def agentic_conversations(*, count: int, seed: int, max_history_tokens: int, system_tokens: int,
                          turn_tokens: tuple[int, int], max_tokens: int,
                          tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR,
                          max_turns: int = 64) -> list[Conversation]:
    """``count`` agentic conversations, deterministic for ``seed``.

    Each turn's size (estimated tokens) is drawn uniformly from ``turn_tokens``; turns are added while the estimated
    history (system + user turns + ``max_tokens`` per answer) stays within ``max_history_tokens``, up to
    ``max_turns``. The last turn is shortened to use the remaining room when at least ``turn_tokens[0]`` is left.
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
    if not 0 < tokens_per_char <= 4:
        raise ValueError(f"tokens_per_char must be in (0, 4], got {tokens_per_char}")
    if system_tokens < 0:
        raise ValueError(f"system_tokens must be >= 0, got {system_tokens}")
    if system_tokens + lo + max_tokens > max_history_tokens:
        raise ValueError(f"max_history_tokens={max_history_tokens} leaves no room for one turn: system_tokens "
                         f"{system_tokens} + min turn {lo} + max_tokens {max_tokens}")
    sources = _sources()
    out = []
    for index in range(count):
        rng = random.Random(f"kvshuttle-agentic:{seed}:{index}")
        session = hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:12]
        repo = f"{rng.choice(ORGS)}/{rng.choice(PROJECTS)}"
        system = None
        total = 0
        if system_tokens > 0:
            system = _system_prompt(rng, session, repo, sources, int(system_tokens / tokens_per_char))
            total = estimate_tokens(system, tokens_per_char)
        turns: list[str] = []
        while len(turns) < max_turns:
            size = rng.randint(lo, hi)
            room = max_history_tokens - total - max_tokens
            last = size >= room
            if size > room:
                if room < lo:
                    break
                size = room
            text = _user_turn(rng, sources, int(size / tokens_per_char))
            if system is None and not turns:  # no system prompt: the first user message carries the unique line
                text = _fit(f"Session {session}: you are a coding agent working in repository {repo}.\n\n{text}",
                            int(size / tokens_per_char))
            turns.append(text)
            total += estimate_tokens(text, tokens_per_char) + max_tokens
            if last:
                break
        out.append(Conversation(id=f"agentic-s{seed}-{index:04d}", system=system, user_turns=turns,
                                max_tokens=[max_tokens] * len(turns)))
    return out


def estimated_history_tokens(conversation: Conversation, tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> int:
    """Estimated tokens of the whole conversation: system + every user turn + every answer at its max_tokens."""
    total = estimate_tokens(conversation.system or "", tokens_per_char)
    return total + sum(estimate_tokens(t, tokens_per_char) for t in conversation.user_turns) + sum(
        conversation.max_tokens)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI-messages files (the format of vLLM's benchmarks/multi_turn)


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
    system: str | None = None
    users: list[str] = []
    answers: list[int | None] = []  # per user turn: answer length in characters (None: no answer given)
    prev = None
    for k, msg in enumerate(messages):
        where = f"{name}, message {k}"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected an object with \"role\" and \"content\", got {_short(msg)}")
        role = msg.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: role must be \"system\", \"user\" or \"assistant\", got {_short(role)}")
        if "content" not in msg:
            raise ValueError(f"{where}: missing \"content\"")
        text = _content_text(msg["content"], where, role)
        if role == "system":
            if k != 0:
                raise ValueError(f"{where}: a system message is only allowed as the first message")
            system = text
        elif role == "user":
            if prev == "user" and budgets_given is None:
                users[-1] += "\n\n" + text
            else:
                users.append(text)
                answers.append(None)
        else:
            if not users:
                raise ValueError(f"{where}: assistant message before any user message")
            answers[-1] = (answers[-1] or 0) + len(text)
        prev = role
    if not users:
        raise ValueError(f"{name}: no user message")
    if budgets_given is not None:
        if len(budgets_given) != len(users):
            raise ValueError(f"{name}: \"max_tokens\" lists {len(budgets_given)} budgets for {len(users)} user "
                             f"messages")
        budgets = [min(max_tokens, b) for b in budgets_given]
    else:
        budgets = [max_tokens if chars is None else min(max_tokens, max(1, round(chars * tokens_per_char)))
                   for chars in answers]
    if max_turns is not None:
        users, budgets = users[:max_turns], budgets[:max_turns]
    return Conversation(id=cid, system=system, user_turns=users, max_tokens=budgets)


def load_conversations(path: str | Path, *, max_tokens: int, max_turns: int | None = None, limit: int | None = None,
                       tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR) -> list[Conversation]:
    """Conversations from a JSON file ``[{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}, ...]``.

    A ``.jsonl`` file (one conversation object per line) is accepted too. An assistant message after a user turn
    sets that turn's generation budget to its estimated length (at least 1, at most ``max_tokens``); turns without
    one get ``max_tokens``. Consecutive user messages are merged into one turn, except in a conversation that
    carries a ``"max_tokens"`` list (kvshuttle's extension, written by :func:`save_conversations`): there every
    user message is a turn and the list gives the turns' budgets (each capped at ``max_tokens``). Raises ValueError
    naming the bad conversation/message.
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


def save_conversations(conversations: list[Conversation], path: str | Path) -> Path:
    """Write ``conversations`` in the OpenAI-messages format: system + user messages (answers come from the model at
    run time, so none are stored) and, to keep turn boundaries and budgets, a ``"max_tokens"`` list per
    conversation (ignored by tools that do not know it)."""
    path = Path(path)
    data = []
    for conv in conversations:
        if len(conv.max_tokens) != len(conv.user_turns):
            raise ValueError(f"conversation {conv.id!r}: {len(conv.max_tokens)} max_tokens for "
                             f"{len(conv.user_turns)} user turns")
        messages = [{"role": "system", "content": conv.system}] if conv.system is not None else []
        messages += [{"role": "user", "content": text} for text in conv.user_turns]
        data.append({"id": conv.id, "messages": messages, "max_tokens": list(conv.max_tokens)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path
