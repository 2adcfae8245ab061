"""`kvshuttle bench-clients`: how much of each later turn's history is pulled, per client style, on a reasoning model.

A client echoes the history back whole (its answers' reasoning included, as our docs show the openai SDK used),
or with only the fields of the OpenAI format (reasoning dropped: what agent frameworks, LangChain, the Agents SDK and
aiperf send), to a gateway that renders with the model's own template (which renders echoed reasoning) or with
Qwen3's (which drops the reasoning of every assistant message before the last user query); with a session id
(``X-Session-ID``) or without one (found by content). For each style the agent test model (trained to reason and
call tools: kvshuttle.workers.agent_script's client conversation) runs the conversation on the local stack, through a
tap (turn_tap.py) that empties P's prefix cache before each turn and reads P's own counters after it.

Reported per style: the later turns, how many were found (continued their session), and the share of the history
the decode worker held (its covered tokens) that P pulled, from P's counters: all of it for an exact echo; the whole
blocks up to where the re-rendered history first differs otherwise (the rest is recomputed). Each run is its own
tenant (an API key each), so no run finds another's sessions.

The agent model's histories are short (a few hundred tokens, and CPU KV blocks hold 128), so the shares are coarse:
a GPU's 16-token blocks give finer ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import httpx
from kvshuttle.services.common.config import from_namespace, load, setting
from kvshuttle.services.devtools.bench.turn_tap import TappedTurn, TurnTap, check_pulls
from kvshuttle.services.devtools.stack import Stack, StackConfig
from kvshuttle.workers import agent_script as script

log = logging.getLogger("kvshuttle.bench")
REASONING_PARSER = "qwen3"


@dataclasses.dataclass
class ClientStylesConfig:
    """How much of each later turn's history is pulled, per client style, on the reasoning agent test model."""

    ENV_PREFIX = "KVSHUTTLE_BENCH_CLIENTS_"
    model_dir: str = setting("var/models/agent", "The agent test model (built with make-model if missing)")
    out_dir: str = setting("var/bench-clients", "Results go to <out-dir>/<timestamp>/")


@dataclasses.dataclass(frozen=True)
class Style:
    name: str
    template: str  # agent_script.TEMPLATE_VARIANTS
    whole: bool  # echo the answers whole (reasoning included), else only role, content and tool_calls


STYLES = (
    Style("echo whole", "echo", True),
    Style("reasoning dropped", "echo", False),
    Style("Qwen3 template", "qwen3", True),
    Style("Qwen3 template, reasoning dropped", "qwen3", False),
)


async def converse(base_url: str, api_key: str, *, whole: bool, session_id: str = "") -> list[str]:
    """The client conversation as an OpenAI-format chat loop (the official SDK's requests, sent with httpx):
    ``whole``: each answer echoed as it came (its reasoning_content included), else only role, content and
    tool_calls. Returns the answers."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": script.CLIENT_TOOL_DESCRIPTION,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    headers = {"Authorization": f"Bearer {api_key}", **({"X-Session-ID": session_id} if session_id else {})}
    messages: list[dict] = [{"role": "system", "content": script.CLIENT_SYSTEM}]
    answers = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as http:
        for question in script.CLIENT_QUESTIONS:
            messages.append({"role": "user", "content": question})
            while True:
                resp = await http.post("/v1/chat/completions", json={
                    "model": "agent", "messages": messages, "tools": tools, "temperature": 0,
                    "max_tokens": script.CLIENT_MAX_TOKENS})
                resp.raise_for_status()
                message = {k: v for k, v in resp.json()["choices"][0]["message"].items() if v is not None}
                messages.append(message if whole else {k: v for k, v in message.items()
                                                       if k in ("role", "content", "tool_calls")})
                if not message.get("tool_calls"):
                    answers.append(message.get("content") or "")
                    break
                for call in message["tool_calls"]:
                    city = json.loads(call["function"]["arguments"])["city"]
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": script.client_weather(city)})
    return answers


@dataclasses.dataclass
class Row:
    style: str
    session_id: bool
    later_turns: int
    found: int
    pulled: int  # tokens P pulled over the later turns (its counters)
    held: int  # tokens the decode worker held for them (the previous records' covered tokens)
    whole: int  # later turns that pulled all the decode worker held
    problems: list[str]

    @property
    def share(self) -> float:
        return self.pulled / self.held if self.held else 0.0


def summarize(style: str, named: bool, turns: list[TappedTurn], block_size: int) -> Row:
    held: dict[str, list[int]] = {}
    problems = check_pulls(turns, block_size, dict(held))
    row = Row(style, named, 0, 0, 0, 0, 0, problems)
    for i, t in enumerate(turns):
        if i:
            row.later_turns += 1
            row.found += t.session_id in held
            covered = len(held.get(t.session_id, [])) - 1
            if t.session_id in held:
                row.pulled += int(t.by_source.get("external_kv_transfer", 0))
                row.held += covered
                row.whole += t.pulled == covered
        held[t.session_id] = t.history
    return row


def key_file(path: Path, runs: int) -> list[str]:
    """An API keys file with one key (and tenant) per run; returns the keys."""
    keys = [f"bench-clients-{i}" for i in range(runs)]
    path.write_text(json.dumps({"keys": [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": f"run{i}"}
                                         for i, k in enumerate(keys)]}))
    return keys


async def measure(stack: Stack, urls: dict[str, str], keys: list[str]) -> list[Row]:
    """Every style, without and with a session id, each run as its own tenant (``keys[i]``: run i's API key) on
    the gateway of its template (``urls``)."""
    rows, block_size = [], stack.workers[0].block_size
    for i, (style, named) in enumerate((s, n) for s in STYLES for n in (False, True)):
        async with TurnTap(stack, urls[style.template], tenant=f"run{i}") as tap:
            answers = await converse(tap.base_url, keys[i], whole=style.whole,
                                     session_id=f"bench-clients-{i}" if named else "")
        if [a.strip() for a in answers] != [script.CLIENT_STEPS[j].content for j in (1, 3, 4)]:
            log.warning("%s: the model answered off script (%s): its later turns may diverge", style.name, answers)
        rows.append(summarize(style.name, named, tap.turns, block_size))
    return rows


def format_rows(rows: list[Row], block_size: int) -> str:
    lines = [f"{'client style':<36} {'session id':<10} {'later turns':>11} {'found':>6} {'pulled / held':>15} "
             f"{'share':>6} {'all pulled':>10}", "-" * 100]
    for r in rows:
        lines.append(f"{r.style:<36} {'yes' if r.session_id else 'no':<10} {r.later_turns:>11} {r.found:>6} "
                     f"{f'{r.pulled} / {r.held}':>15} {r.share:>6.0%} {r.whole:>10}")
    lines.append(f"(share: tokens P pulled over the later turns, by its own counters, / tokens the decode worker "
                 f"held for them; KV blocks of {block_size} tokens)")
    return "\n".join(lines)


async def run(model_dir: str, work: Path) -> tuple[list[Row], int]:
    cfg = from_namespace(StackConfig, environ={
        "KVSHUTTLE_STACK_WORK_DIR": str(work / "stack"), "KVSHUTTLE_MODEL_DIR": model_dir,
        "KVSHUTTLE_STACK_MODEL_VARIANT": "agent", "KVSHUTTLE_STACK_HTTP_PORT": "0", "KVSHUTTLE_STACK_GRPC_PORT": "0",
        "KVSHUTTLE_STACK_MAX_MODEL_LEN": "2048", "KVSHUTTLE_STACK_TOOL_CALL_PARSER": "hermes",
        "KVSHUTTLE_STACK_REASONING_PARSER": REASONING_PARSER})
    # the threshold policy: a pull whenever one is safe (this measures what is pullable, not the cost model); idle
    # sessions keep their KV (freeing it reads a block on P, which its counters would count)
    stack = Stack(cfg, scheduler_env={"KVSHUTTLE_SCHEDULER_POLICY": "threshold",
                                      "KVSHUTTLE_SCHEDULER_KV_IDLE_LIMIT_S": "0"})
    children = []
    try:
        await stack.start()
        keys = key_file(work / "keys.json", len(STYLES) * 2)
        urls = {}
        for template in dict.fromkeys(s.template for s in STYLES):
            path = work / f"{template}.jinja"
            path.write_text(script.chat_template(template))
            child, urls[template] = await stack.spawn_gateway(
                f"gateway-{template}", "--tool-call-parser", "hermes", "--reasoning-parser", REASONING_PARSER,
                "--chat-template", str(path), "--api-keys-file", str(work / "keys.json"))
            children.append(child)
        return await measure(stack, urls, keys), stack.workers[0].block_size
    finally:
        for child in children:
            await child.stop()
        await stack.stop()


def main(argv: list[str] | None = None) -> int:
    cfg = load(ClientStylesConfig, argv, prog="kvshuttle bench-clients", description=ClientStylesConfig.__doc__)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = Path(cfg.out_dir).resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows, block_size = asyncio.run(run(str(Path(cfg.model_dir).resolve()), out))
    table = format_rows(rows, block_size)
    print(table)
    (out / "client_styles.txt").write_text(table + "\n")
    (out / "client_styles.json").write_text(json.dumps([dataclasses.asdict(r) | {"share": r.share} for r in rows],
                                                       indent=2) + "\n")
    bad = [p for r in rows for p in r.problems]
    for problem in bad:
        print(f"not as promised: {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
