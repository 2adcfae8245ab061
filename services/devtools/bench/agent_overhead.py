"""`kvshuttle bench-agent`: what tools and reasoning add to each turn in the gateway, measured (no vLLM).

For every step of the agent conversation (kvshuttle.workers.agent_script, grown to ``--repeat`` times its length so
the history is long), the gateway's own code is timed: rendering the chat template with the tools, tokenizing the
prompt's new text (the recorded ids are reused, as the gateway does), the content keys that find a session without an id, and parsing the answer (reasoning + tool calls) as it
streams in token-sized pieces. Prints p50 / p90 per stage and per turn, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvshuttle.control_plane.answer import AnswerParser
from kvshuttle.control_plane.continuation import prefix_keys
from kvshuttle.control_plane.reasoning import REASONING_PARSERS
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.workers import agent_script as script

STAGES = ("render_ms", "tokenize_ms", "find_keys_ms", "parse_ms")


def conversation(repeat: int) -> list[tuple[list[dict], str]]:
    """(messages sent, answer generated) per step: the agent script played ``repeat`` times in one conversation."""
    steps, history = [], [{"role": "system", "content": script.SYSTEM}]
    for _ in range(repeat):
        for step in range(len(script.TURNS)):
            history += script.inputs(step)
            steps.append((list(history), script.assistant_text(step)))
            history.append(script.assistant_message(step))
    return steps


def measure(model_dir: str, repeat: int = 4, rounds: int = 20, piece_chars: int = 4) -> dict[str, dict[str, float]]:
    tok = GatewayTokenizer(model_dir)
    markers = tok.end_markers
    samples: dict[str, list[float]] = {name: [] for name in (*STAGES, "turn_ms")}
    for _ in range(rounds):
        recorded = ""
        for messages, answer in conversation(repeat):
            t0 = time.perf_counter()
            text = tok.render_chat(messages, True, tools=script.TOOLS)
            t1 = time.perf_counter()
            # As the gateway does: the recorded ids are kept, only the text after the recorded text is tokenized.
            tok.encode(text[len(recorded):] if recorded and text.startswith(recorded) else text)
            t2 = time.perf_counter()
            prefix_keys(text, markers)
            t3 = time.perf_counter()
            parser = AnswerParser(REASONING_PARSERS["qwen3"], TOOL_CALL_PARSERS["hermes"], prompt_text=text,
                                  request_tools=script.TOOLS)
            for i in range(0, len(answer), piece_chars):
                list(parser.feed(answer[i:i + piece_chars]))
            list(parser.finish())
            t4 = time.perf_counter()
            for name, ms in zip(STAGES, ((t1 - t0), (t2 - t1), (t3 - t2), (t4 - t3)), strict=True):
                samples[name].append(ms * 1000)
            samples["turn_ms"].append((t4 - t0) * 1000)
            recorded = text + answer
    return {name: {"p50": round(statistics.median(v), 4),
                   "p90": round(statistics.quantiles(v, n=10)[-1], 4), "n": len(v)} for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshuttle bench-agent", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="var/models/agent", help="a model directory with a tool-calling "
                        "template (default: the agent test model; `kvshuttle make-model var/models/agent --variant "
                        "agent` builds it)")
    parser.add_argument("--repeat", type=int, default=4, help="play the 6-step script this many times in one "
                        "conversation (longer histories)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if not Path(args.model_dir, "tokenizer.json").is_file():
        print(f"no model in {args.model_dir}: build it with `kvshuttle make-model {args.model_dir} --variant agent`",
              file=sys.stderr)
        return 2
    result = measure(args.model_dir, args.repeat, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"per turn, {len(script.TURNS) * args.repeat} turns x {args.rounds} rounds (ms):")
    for name, figures in result.items():
        print(f"  {name:<14} p50 {figures['p50']:8.3f}   p90 {figures['p90']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
