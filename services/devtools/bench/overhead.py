"""The control plane's own cost per turn, from the same run's pull turns and direct P→D turns.

Two views, both reported:

* **added TTFT**: the gateway's pull turn minus the direct client's turn of the same conversation and turn index
  (same prompt, same workers, measured a moment apart). Includes machine noise; its p50 is the honest headline.
* **hops**: the gateway's own timers for each pull turn, split into client HTTP, the registry read, prompt
  building, planning (scheduler + registry claim), P (prefill, incl. the NIXL pull) and the first token's way out
  (P's token streamed at once; D's NIXL read + first step when D samples it).
  ``control_plane_ms`` = registry read + plan: the time spent in kvshuttle's services on the way to the first token.
"""

from __future__ import annotations

from kvshuttle.services.devtools.bench.samples import PULL, TurnSample
from kvshuttle.services.devtools.bench.stats import summary

DIRECT = "direct"

# name, what it is
HOPS: tuple[tuple[str, str], ...] = (
    ("client_http_ms", "HTTP: client to gateway and the first SSE chunk back, outside the gateway's ASGI app"),
    ("request_ms", "gateway: the request's body, input check, validation, key and limits, to the turn's start"),
    ("session_ms", "registry: read the session (GetSession)"),
    ("prompt_other_ms", "gateway: chat template, tokenizing, exact-id splice"),
    ("plan_ms", "scheduler: PlanTurn (prefix check + registry claim)"),
    ("prefill_ms", "P: prefill over gRPC, incl. the NIXL pull"),
    ("decode_first_ms", "first token out after P (when D samples it: D's NIXL read + first step)"),
)

Key = tuple[str, int]


def hops(client_ttft_ms: float, timings: dict[str, float]) -> dict[str, float]:
    """Split one gateway turn's client-side TTFT with the gateway's timers (see ``TurnTimings``)."""
    prompt, session = timings.get("prompt_ms", 0.0), timings.get("session_ms", 0.0)
    plan, prefill, ttft = timings.get("plan_ms", 0.0), timings.get("prefill_ms", 0.0), timings.get("ttft_ms", 0.0)
    request = timings.get("request_ms", 0.0)  # absent before 2026-12-06: then counted in client_http_ms
    return {
        "client_http_ms": client_ttft_ms - ttft - request,
        "request_ms": request,
        "session_ms": session,
        "prompt_other_ms": prompt - session,
        "plan_ms": plan,
        "prefill_ms": prefill,
        "decode_first_ms": ttft - prompt - plan - prefill,
    }


def control_plane_overhead(samples: list[TurnSample], timings: dict[Key, dict[str, float]]) -> dict:
    pull = {(s.conversation, s.turn): s for s in samples if s.mode == PULL}
    direct = {(s.conversation, s.turn): s for s in samples if s.mode == DIRECT}
    paired = sorted(k for k in pull.keys() & direct.keys() if pull[k].decision == direct[k].decision)
    added = [pull[k].ttft_ms - direct[k].ttft_ms for k in paired]
    split = [hops(pull[k].ttft_ms, timings[k]) for k in sorted(pull) if k in timings]
    hop_stats = {name: summary([h[name] for h in split]) for name, _ in HOPS}
    control = [h["session_ms"] + h["plan_ms"] for h in split]
    total = sum(pull[k].ttft_ms for k in pull if k in timings)
    shares = {name: (sum(h[name] for h in split) / total if total else None) for name, _ in HOPS}
    return {
        "paired_turns": len(paired),
        "added_ttft_ms": summary(added),
        "control_plane_ms": summary(control),
        "control_plane_with_http_ms": summary([c + h["client_http_ms"] for c, h in zip(control, split, strict=True)]),
        "hops": hop_stats,
        "hop_share_of_ttft": shares,
        "hop_descriptions": dict(HOPS),
    }


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_overhead(o: dict) -> str:
    lines = ["Control-plane overhead (gateway pull turns vs a direct P->D client, same run, same workers)"]
    a = o["added_ttft_ms"]
    lines.append(f"  added TTFT per turn (gateway - direct, {o['paired_turns']} paired turns): "
                 f"p50 {_f(a.get('p50'))} ms, p99 {_f(a.get('p99'))} ms, mean {_f(a.get('mean'))} ms")
    c, ch = o["control_plane_ms"], o["control_plane_with_http_ms"]
    lines.append(f"  kvshuttle services on the path (registry read + plan): p50 {_f(c.get('p50'))} ms, "
                 f"p99 {_f(c.get('p99'))} ms; with the client HTTP hop: p50 {_f(ch.get('p50'))} ms, "
                 f"p99 {_f(ch.get('p99'))} ms")
    lines.append(f"  {'hop':<18} {'p50 ms':>8} {'p99 ms':>8} {'share of TTFT':>14}  what")
    for name, text in HOPS:
        s = o["hops"][name]
        share = o["hop_share_of_ttft"][name]
        lines.append(f"  {name:<18} {_f(s.get('p50')):>8} {_f(s.get('p99')):>8} "
                     f"{'-' if share is None else f'{share * 100:.1f}%':>14}  {text}")
    return "\n".join(lines)
