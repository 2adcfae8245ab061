"""The simulator's sessions: an agentic arrival process, and the Mooncake trace format (read and written).

A session's tokens are *segments*: ``(segment id, length)`` runs whose every token is the segment id. Two prompts
are equal token for token exactly when their segments are, so the real prefix digests (:mod:`control_plane.prefix`)
work on them unchanged; a segment shared by many sessions (a system prompt, tool definitions, a trace's hash block)
is a prefix their prompts share, which a prefill worker's prefix cache can hit.

A session runs on the base model (``model`` "") or under one of the model's LoRA adapters (``lora-<k>``): vLLM
computes and hashes an adapter's KV under the adapter, so a system prompt shared by sessions of two adapters (or of
an adapter and the base model) is two prefixes, no cache hit and no pull between them. The workload gives each
adapter's shared prompts segment ids of their own for that.

A session's first prompt is ``first`` (its segments); each later turn's prompt is the history (every earlier prompt
and answer) plus ``new_tokens`` fresh tokens (the user's message, or a tool's result). A turn arrives ``gap_s`` after
the previous answer ended (closed loop: an agent waits for the answer before it acts), the first at ``start_s``.

**Mooncake format** (JSON lines, as NVIDIA aiperf and the FAST'25 Mooncake traces use it): ``timestamp`` (ms),
``input_length``, ``output_length``, ``hash_ids`` (one id per ``trace_block`` tokens, 512 by default), and
optionally ``session_id``, ``delay`` (ms after the previous turn's answer) and ``model`` (an adapter's name: its
hash ids name KV of that adapter's own). Lines with a ``session_id`` are that
session's turns in order; lines without one join the session whose last prompt's hash ids they extend (the way the
gateway finds a session for a client that sends no id), else start a new session.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Segment ids at or above this are the simulator's own (answers, fresh messages); trace hash ids stay below it.
OWN_SEGMENTS = 1 << 28


class TraceError(ValueError):
    """A trace line that cannot be used (the message names the line and the field)."""


@dataclass(slots=True)
class SimTurn:
    new_tokens: int  # tokens added after the history (0 on the first turn: its prompt is the session's ``first``)
    output_tokens: int
    gap_s: float = 0.0  # after the previous answer ended (first turn: after the session it waits for, in a closed loop)


@dataclass(slots=True)
class SimSession:
    session_id: str
    tenant: str
    start_s: float
    first: list[tuple[int, int]]  # the first prompt's segments
    turns: list[SimTurn]
    model: str = ""  # the LoRA adapter it runs under ("": the base model)

    @property
    def first_tokens(self) -> int:
        return sum(n for _, n in self.first)


@dataclass(frozen=True)
class AgenticMix:
    """Sessions of coding/tool agents and of chat users, arriving as a Poisson process."""

    sessions: int = 1000
    arrival_s: float = 60.0  # sessions start uniformly at random (Poisson) within this window
    agent_share: float = 0.7  # the rest are chat sessions
    shared_prompts: int = 20  # distinct system prompts + tool definitions, chosen Zipf(1.1)
    shared_tokens: tuple[int, int] = (2000, 8000)
    first_user_tokens: tuple[int, int] = (200, 4000)
    agent_turns: tuple[int, int] = (4, 30)
    agent_gap_s: float = 3.0  # mean (exponential): the agent runs a tool, then sends its result
    agent_result_tokens: tuple[int, int] = (100, 3000)  # log-uniform
    agent_output_tokens: tuple[int, int] = (20, 400)
    chat_turns: tuple[int, int] = (2, 8)
    chat_gap_s: float = 45.0  # mean: a person reads and types
    chat_message_tokens: tuple[int, int] = (20, 600)
    chat_output_tokens: tuple[int, int] = (100, 800)
    max_history_tokens: int = 131_072  # the model's context: a session ends before it would pass it
    tenants: int = 8
    adapters: int = 0  # LoRA adapters of the model, chosen Zipf(1.1) by the sessions that run under one
    adapter_share: float = 0.0  # sessions run under an adapter (the rest: the base model)
    seed: int = 0


def _log_uniform(rng: random.Random, span: tuple[int, int]) -> int:
    low, high = span
    return max(1, int(round(math.exp(rng.uniform(math.log(max(1, low)), math.log(max(1, high)))))))


def agentic_sessions(mix: AgenticMix) -> list[SimSession]:
    rng = random.Random(mix.seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(mix.shared_prompts)]
    shared = [(k + 1, rng.randint(*mix.shared_tokens)) for k in range(mix.shared_prompts)]
    own = itertools.count(OWN_SEGMENTS)
    starts = sorted(rng.uniform(0, mix.arrival_s) for _ in range(mix.sessions))
    out = []
    adapter_weights = [1 / (k + 1) ** 1.1 for k in range(mix.adapters)]
    for i, start in enumerate(starts):
        agent = rng.random() < mix.agent_share
        adapter = (rng.choices(range(mix.adapters), adapter_weights)[0] + 1
                   if mix.adapters and rng.random() < mix.adapter_share else 0)
        first = [rng.choices(shared, weights)[0]] if shared else []
        if adapter and first:  # the same system prompt, another KV: a segment of the adapter's own
            first = [(first[0][0] + adapter * mix.shared_prompts, first[0][1])]
        first.append((next(own), rng.randint(*mix.first_user_tokens)))
        history = sum(n for _, n in first)
        turns: list[SimTurn] = []
        count = rng.randint(*(mix.agent_turns if agent else mix.chat_turns))
        for t in range(count):
            new = 0 if t == 0 else _log_uniform(rng, mix.agent_result_tokens if agent else mix.chat_message_tokens)
            output = _log_uniform(rng, mix.agent_output_tokens if agent else mix.chat_output_tokens)
            if history + new + output > mix.max_history_tokens:
                break
            gap = 0.0 if t == 0 else rng.expovariate(1 / (mix.agent_gap_s if agent else mix.chat_gap_s))
            turns.append(SimTurn(new, output, gap))
            history += new + output
        if turns:
            out.append(SimSession(f"s{i}", f"t{i % mix.tenants}", start, first, turns,
                                  f"lora-{adapter}" if adapter else ""))
    return out


# -- Mooncake trace format ----------------------------------------------------------------------------------------


def _field(line: dict, key: str, where: str, kind: type = int, default=None):
    value = line.get(key, default)
    if value is None:
        raise TraceError(f"{where}: missing {key!r}")
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {key!r} is not a{'n' if kind is int else ''} {kind.__name__}: {value!r}") from None
    if isinstance(out, int | float) and out < 0:
        raise TraceError(f"{where}: {key!r} must be >= 0, got {value!r}")
    return out


def _hash_segments(hash_ids: list[int], tokens: int, block: int) -> list[tuple[int, int]]:
    """A first prompt from its hash ids: one segment per id (the last one the remainder)."""
    segments, left = [], tokens
    for h in hash_ids:
        if left <= 0:
            break
        segments.append((h, min(block, left)))
        left -= block
    return segments


def read_mooncake(lines: Iterable[str], trace_block: int = 512, source: str = "trace") -> list[SimSession]:
    """Sessions from Mooncake-format lines (see the module docstring); raises TraceError naming a bad line."""
    own = itertools.count(OWN_SEGMENTS)
    sessions: dict[str, SimSession] = {}
    history: dict[str, int] = {}  # session -> tokens of its history so far (prompts + answers)
    last_at: dict[str, float] = {}  # session -> its last turn's timestamp (s)
    by_prefix: dict[int, str] = {}  # chained hash of a session's last prompt's hash ids -> the session
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{source}:{number}"
        try:
            line = json.loads(text)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON ({exc})") from None
        if not isinstance(line, dict):
            raise TraceError(f"{where}: not a JSON object")
        inputs = _field(line, "input_length", where)
        output = max(1, _field(line, "output_length", where))
        hash_ids = line.get("hash_ids") or []
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and 0 <= h < OWN_SEGMENTS for h in hash_ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of ints in 0..{OWN_SEGMENTS - 1}")
        if inputs < 1:
            raise TraceError(f"{where}: 'input_length' must be >= 1")
        model = str(line.get("model") or "")
        # chained per model: a line of one adapter never joins a session of another (or of the base model)
        chain = list(itertools.accumulate(hash_ids, lambda acc, h: hash((acc, h)), initial=hash(model)))[1:]
        sid = str(line["session_id"]) if line.get("session_id") is not None else None
        if sid is None:  # the latest session whose whole last prompt this one extends
            sid = next((by_prefix[c] for c in reversed(chain[:-1]) if c in by_prefix), None)
        at = _field(line, "timestamp", where, float, 0.0) / 1000
        if sid is None or sid not in sessions:
            sid = sid or f"m{number}"
            ids = [_model_segment(model, h) for h in hash_ids] if model else hash_ids
            first = _hash_segments(ids, inputs, trace_block) or [(next(own), inputs)]
            if sum(n for _, n in first) < inputs:
                first.append((next(own), inputs - sum(n for _, n in first)))
            sessions[sid] = SimSession(sid, str(line.get("tenant", "t0")), at, first, [SimTurn(0, output)], model)
            history[sid] = inputs + output
        else:
            gap = (_field(line, "delay", where, float) / 1000 if line.get("delay") is not None
                   else max(0.0, at - last_at[sid]))
            new = max(1, inputs - history[sid])  # a trace whose next input does not hold the whole history: the rest
            sessions[sid].turns.append(SimTurn(new, output, gap))
            history[sid] += new + output
        last_at[sid] = at
        if chain:
            by_prefix[chain[-1]] = sid
    return sorted(sessions.values(), key=lambda s: s.start_s)


def _model_segment(model: str, hash_id: int) -> int:
    """The segment of a trace hash id under adapter ``model``: the same block of text is another KV there."""
    return int.from_bytes(hashlib.blake2b(f"{model}\0{hash_id}".encode(), digest_size=8).digest()) % OWN_SEGMENTS


def load_mooncake(path: str | Path, trace_block: int = 512) -> list[SimSession]:
    with open(path, encoding="utf-8") as f:
        return read_mooncake(f, trace_block, source=str(path))


@dataclass
class _BlockIds:
    """Hash ids of ``block``-token blocks, by their content (chained: equal ids mean equal prefixes)."""

    block: int
    ids: dict[tuple, int] = field(default_factory=dict)

    def of(self, segments: list[tuple[int, int]]) -> list[int]:
        out, prev, pieces, filled = [], -1, [], 0
        for seg, n in segments:
            while n > 0:
                take = min(n, self.block - filled)
                pieces.append((seg, take))
                filled += take
                n -= take
                if filled == self.block:
                    out.append(self._id(prev, pieces))
                    prev, pieces, filled = out[-1], [], 0
        if pieces:
            out.append(self._id(prev, pieces))
        return out

    def _id(self, prev: int, pieces: list[tuple[int, int]]) -> int:
        key = (prev, tuple(pieces))
        return self.ids.setdefault(key, len(self.ids))


def mooncake_lines(sessions: Iterable[SimSession], trace_block: int = 512) -> Iterator[str]:
    """The sessions as Mooncake lines with ``session_id`` and ``delay`` (one line per turn; answers as their own
    segments, so each prompt's hash ids extend the previous prompt's up to its last block)."""
    blocks = _BlockIds(trace_block)
    own = itertools.count(OWN_SEGMENTS)
    for s in sessions:
        segments = list(s.first)
        for t, turn in enumerate(s.turns):
            if turn.new_tokens:
                segments.append((next(own), turn.new_tokens))
            line = {"session_id": s.session_id, "tenant": s.tenant, "timestamp": round(s.start_s * 1000, 3),
                    "input_length": sum(n for _, n in segments), "output_length": turn.output_tokens,
                    "hash_ids": blocks.of(segments)}
            if t:
                line["delay"] = round(turn.gap_s * 1000, 3)
            if s.model:
                line["model"] = s.model
            yield json.dumps(line, separators=(",", ":"))
            segments.append((next(own), turn.output_tokens))
