"""Dockerfiles and ``.dockerignore``, read as Docker reads them: no container engine, no network.

A small Dockerfile parser (line continuations, comments, JSON and shell forms, build stages, global ARG defaults in
FROM) and a ``.dockerignore`` matcher with Docker's rules (last matching pattern wins, a pattern also matches
everything under a matching directory). Used by tests/deploy/test_dockerfiles.py (the Dockerfiles checked as files)
and tests/support/dockerfile_build.py (their build steps run in a directory).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# ---- a tiny Dockerfile parser -----------------------------------------------------------------------------------

@dataclass
class Instruction:
    line: int  # 1-based line of the instruction's first line
    keyword: str  # upper case
    args: str  # the rest, continuations joined


@dataclass
class Stage:
    base: str  # as written
    image: str  # base with the global ARG defaults substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def instructions(text: str) -> list[Instruction]:
    """Logical instructions: comment lines dropped (also inside a continuation), `\\`-continued lines joined."""
    escape = "\\"
    lines = text.splitlines()
    for raw in lines:  # parser directives: only before the first instruction or comment that is not one
        m = re.match(r"#\s*(\w+)\s*=\s*(\S+)\s*$", raw)
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):  # (an empty line inside a continuation: skipped, as Docker)
            continue
        if not buf:
            start = number
        if stripped.endswith(escape):
            buf.append(stripped[: -len(escape)].strip())
            continue
        buf.append(stripped)
        logical = " ".join(part for part in buf if part)
        buf = []
        keyword, _, args = logical.partition(" ")
        if "<<" in args and keyword.upper() in ("RUN", "COPY", "ADD"):
            raise ValueError(f"line {start}: heredocs are not supported by this parser")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    if buf:
        raise ValueError(f"line {start}: the file ends inside a line continuation")
    return out


def substitute(value: str, variables: dict[str, str]) -> str:
    """`$VAR`, `${VAR}`, `${VAR:-default}` with the given values (unknown: empty, as Docker does)."""
    def repl(m: re.Match) -> str:
        if m.group(1) is None:
            return variables.get(m.group(3), "")
        if m.group(2) is not None:
            return variables.get(m.group(1)) or m.group(2)
        return variables.get(m.group(1), "")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, value)


def parse(path: Path) -> list[Stage]:
    return parse_text(path.read_text(), path.name)


def parse_text(text: str, name: str = "Dockerfile") -> list[Stage]:
    """The build stages of a Dockerfile; global ARG defaults (before the first FROM) are substituted in FROM."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            base = words[0]
            stage_name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, substitute(base, global_args), stage_name))
        elif not stages:
            assert ins.keyword == "ARG", f"{name}:{ins.line}: only ARG may come before the first FROM"
            for item in shlex.split(ins.args):
                key, _, default = item.partition("=")
                global_args[key] = default
        else:
            stages[-1].instructions.append(ins)
    assert stages, f"{name}: no FROM"
    return stages


def exec_form(args: str) -> list[str] | None:
    """The JSON (exec) form's list, or None for the shell form."""
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


@dataclass
class Copy:
    line: int
    sources: list[str]
    dest: str
    from_stage: str | None


def copies(stage: Stage) -> list[Copy]:
    out = []
    for ins in stage.all("COPY") + stage.all("ADD"):
        rest, flags = ins.args, {}
        while m := re.match(r"--([\w-]+)(?:=(\S*))?\s+", rest):
            flags[m.group(1)] = m.group(2) or ""
            rest = rest[m.end():]
        items = exec_form(rest)
        if items is None:
            items = shlex.split(rest)
        assert len(items) >= 2, f"line {ins.line}: {ins.keyword} needs a source and a destination"
        out.append(Copy(ins.line, items[:-1], items[-1], flags.get("from")))
    return out


def env_names(stage: Stage) -> set[str]:
    names = set()
    for ins in stage.all("ENV"):
        for item in shlex.split(ins.args):
            if "=" in item:
                names.add(item.split("=", 1)[0])
    return names


# ---- .dockerignore ----------------------------------------------------------------------------------------------

def clean_pattern(pattern: str) -> str:
    pattern = re.sub(r"/+", "/", pattern.strip()).strip("/")
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    return "/".join(parts)


def pattern_regex(pattern: str) -> re.Pattern:
    """Docker's pattern syntax (Go's filepath.Match plus `**`) as a regex over slash-separated paths."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


@dataclass
class DockerIgnore:
    patterns: list[tuple[re.Pattern, bool]]  # (regex, is an exception "!")

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        patterns = []
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            patterns.append((pattern_regex(clean_pattern(line[1:] if negate else line)), negate))
        return cls(patterns)

    def excluded(self, rel_path: str) -> bool:
        """True when the path is left out of the build context (it or one of its parent directories matches)."""
        parts = clean_pattern(rel_path).split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for regex, negate in self.patterns:
            if any(regex.match(c) for c in candidates):
                excluded = not negate
        return excluded
