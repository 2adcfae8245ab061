"""The demo conversation: an agent reading files turn by turn, through the gateway's OpenAI API, streamed.

Each turn is also replayed with pulls disabled (a twin session) so the table shows TTFT for pull and recompute side
by side, and whether the greedy answers are identical.
"""

from __future__ import annotations

import inspect
import uuid
from dataclasses import dataclass

import httpx
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.gateway.chat_stream import stream_chat
from kvshuttle.v1 import common_pb2

SYSTEM = ("You are a coding agent. You read source files with tools and explain what they do, "
          "citing function names. Keep answers short.")
# Tool results the agent "reads": stdlib sources, identical on every machine with the same Python.
FILES = ["textwrap", "json.decoder", "string", "bisect", "heapq", "fnmatch", "colorsys", "shlex"]


def tool_result(module: str, chars: int = 2400) -> str:
    mod = __import__(module, fromlist=["_"])
    return inspect.getsource(mod)[:chars]


@dataclass
class TurnResult:
    decision: str
    reason: str
    prompt_tokens: int
    pulled: int
    computed: int
    ttft_ms: float
    text: str


async def stream_turn(client: httpx.AsyncClient, session: str, messages: list[dict], max_tokens: int,
                      disable_pull: bool) -> TurnResult:
    got = await stream_chat(client, session, {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                              "disable_pull": disable_pull})
    return TurnResult(got.kv["decision"], got.kv["reason"], got.usage.get("prompt_tokens", 0),
                      got.kv["pulled_tokens"], got.kv["computed_tokens"], got.ttft_ms, got.text)


async def flush_prefill_caches(workers: list[common_pb2.Worker]) -> None:
    for w in workers:
        if w.role == common_pb2.WORKER_ROLE_PREFILL:
            client = EngineClient(w.grpc_address, timeout_s=30)
            try:
                await client.flush_cache()
            finally:
                await client.close()


async def run_demo(stack, cfg) -> int:
    session = f"demo-{uuid.uuid4().hex[:8]}"
    twin = f"{session}-recompute"
    history: list[dict] = [{"role": "system", "content": SYSTEM}]
    twin_history = list(history)
    rows = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
        for turn in range(cfg.turns):
            module = FILES[turn % len(FILES)]
            user = {"role": "user", "content": f"Tool result of `cat {module}.py`:\n{tool_result(module)}\n"
                                               f"What does it do?"}
            history.append(user)
            if cfg.flush_prefill_cache:
                await flush_prefill_caches(stack.workers)
            pull = await stream_turn(client, session, history, cfg.max_tokens, disable_pull=False)
            history.append({"role": "assistant", "content": pull.text})
            base = None
            if cfg.compare_recompute:
                twin_history.append(user)
                if cfg.flush_prefill_cache:
                    await flush_prefill_caches(stack.workers)
                base = await stream_turn(client, twin, twin_history, cfg.max_tokens, disable_pull=True)
                twin_history.append({"role": "assistant", "content": base.text})
            rows.append((turn + 1, pull, base))

    print()
    print(f"kvshuttle demo: {cfg.turns}-turn conversation {session!r} through the gateway at {stack.base_url}")
    print(f"model {stack.model_dir.name} ({cfg.dtype}), P's prefix cache flushed before each turn: "
          f"{cfg.flush_prefill_cache}, scheduler policy: {cfg.policy}")
    header = f"{'turn':>4}  {'prompt':>6}  {'decision':<9}  {'pulled':>6}  {'computed':>8}  {'TTFT ms':>8}"
    if cfg.compare_recompute:
        header += f"  {'recompute TTFT ms':>17}  {'speed-up':>8}  {'same answer':>11}"
    print(header)
    print("-" * len(header))
    for n, pull, base in rows:
        line = (f"{n:>4}  {pull.prompt_tokens:>6}  {pull.decision:<9}  {pull.pulled:>6}  {pull.computed:>8}  "
                f"{pull.ttft_ms:>8.1f}")
        if base is not None:
            line += f"  {base.ttft_ms:>17.1f}  {base.ttft_ms / pull.ttft_ms:>7.2f}x  {str(base.text == pull.text):>11}"
        print(line)
    print()
    for n, pull, _ in rows:
        print(f"turn {n}: {pull.reason}")
    ok = all(pull.decision == "pull" for _, pull, _ in rows[1:])
    same = all(base is None or base.text == pull.text for _, pull, base in rows)
    print()
    await print_metrics(stack)
    print()
    print("every turn after the first pulled its history: " + ("yes" if ok else "NO"))
    if cfg.compare_recompute:
        print("answers identical with and without pulls: " + ("yes" if same else "NO"))
    return 0 if ok and same else 1


async def print_metrics(stack) -> None:
    """What the gateway's Prometheus endpoint says about the run (the warm-up and the recompute twin included)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = stack.metrics["gateway"]
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(url)).text
    except httpx.HTTPError as exc:
        print(f"metrics: {url} did not answer ({exc!r})")
        return
    turns: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvshuttle_turns_total":
                turns[sample.labels["decision"]] = turns.get(sample.labels["decision"], 0) + sample.value
            elif sample.name == "kvshuttle_turn_tokens_total":
                tokens[sample.labels["kind"]] = sample.value
    prompt = tokens.get("prompt", 0) or 1
    print(f"metrics ({url}): turns {', '.join(f'{k} {v:.0f}' for k, v in sorted(turns.items()))}; prompt tokens "
          f"{tokens.get('prompt', 0):.0f} = pulled {tokens.get('pulled', 0):.0f} "
          f"({tokens.get('pulled', 0) / prompt:.0%}) + cached {tokens.get('cached', 0):.0f} + computed "
          f"{tokens.get('computed', 0):.0f}")
    print("other endpoints: " + ", ".join(f"{name} {u}" for name, u in stack.metrics.items() if name != "gateway"))
