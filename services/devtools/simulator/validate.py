"""The simulator checked against the real stack: `kvshuttle simulate --validate-samples RUN/samples.jsonl`.

The input is what `kvshuttle bench` measured on the real local stack (its ``samples.jsonl``: per turn the prompt,
the history, the tokens pulled and computed, the answer's length, TTFT and latency). Its conversations are split in
two: the *calibration* half fits a hardware profile (the simulator's ground truth) by non-negative least squares, one
linear model of a turn's measured TTFT::

    TTFT ≈ F + a·c + b·c·(p + c/2) + r·(n + pulled) + t·[pulled > 0]

(``c`` tokens computed after ``p`` already in KV, ``n`` prompt tokens sent on to D, ``pulled`` loaded from D: the
profile's compute curve, its link, and a transfer's fixed cost; ``F`` the fixed costs of a turn); the decode step is
the answers' median time per token. The *validation* half's conversations are then simulated on one prefill and one
decode worker with that profile, one conversation at a time as the bench ran them (pull mode: the kvshuttle strategy;
recompute mode: the recompute strategy), and the simulated TTFT is set next to the measured one, per history bucket.
The verdict (within ``TOLERANCE``) takes each mode's p50 over all its turns and its median error per turn.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvshuttle.control_plane.cost_model import PrefillPrior, nonnegative_least_squares
from kvshuttle.services.devtools.simulator import strategies
from kvshuttle.services.devtools.simulator.cluster import DecodeWorker, PrefillWorker
from kvshuttle.services.devtools.simulator.engine import SimSettings, Simulation
from kvshuttle.services.devtools.simulator.hardware import Profile, profile
from kvshuttle.services.devtools.simulator.workload import OWN_SEGMENTS, SimSession, SimTurn

MODES = {"pull": "kvshuttle", "recompute": "recompute"}  # bench mode -> the simulated strategy
BUCKETS = ((0, 0, "first turn"), (1, 2000, "<2k"), (2000, 4000, "2k-4k"), (4000, 1 << 62, "4k+"))
TOLERANCE = 0.2


class ValidationError(ValueError):
    pass


def load_samples(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({k: row[k] for k in ("mode", "conversation", "turn", "prompt_tokens", "history_tokens",
                                                 "ttft_ms", "latency_ms", "output_tokens", "pulled_tokens",
                                                 "computed_tokens")})
            except (ValueError, KeyError, TypeError) as exc:
                raise ValidationError(f"{path}:{number}: not a bench sample ({exc})") from None
    rows = [r for r in rows if r["mode"] in MODES]
    if not rows:
        raise ValidationError(f"{path}: no samples of mode {' or '.join(MODES)}")
    return rows


def _features(row: dict[str, Any]) -> list[float]:
    n, c, pulled = row["prompt_tokens"], row["computed_tokens"], row["pulled_tokens"]
    p = n - c
    return [1.0, c / 1000, c * (p + c / 2) / 1e6, (n + pulled) / 1000, 1.0 if pulled else 0.0]


def calibrate(rows: list[dict[str, Any]], base: Profile) -> tuple[Profile, dict[str, float]]:
    """A profile fitted to ``rows`` (relative error: a 50 ms turn counts as much as a 5 s one)."""
    a = [[0.0] * 5 for _ in range(5)]
    b = [0.0] * 5
    for row in rows:
        x, y = _features(row), row["ttft_ms"]
        w = 1 / max(y, 1.0) ** 2
        for i in range(5):
            b[i] += w * x[i] * y
            for j in range(5):
                a[i][j] += w * x[i] * x[j]
    for i in range(5):  # a whisper of ridge: a feature that never varied stays at 0, not at an arbitrary value
        a[i][i] += 1e-9 + 1e-6 * a[i][i]
    fixed, per_k, per_kk, per_k_moved, per_transfer = nonnegative_least_squares(a, b)
    steps = [(r["latency_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in rows if r["output_tokens"] > 1]
    tpot = statistics.median(steps) if steps else base.tpot_ms
    fitted = dataclasses.replace(  # a turn's fixed costs, the hand-off to D's included, are F: the decode step aside
        base, fixed_ms=max(0.0, fixed - tpot), ms_per_ktoken=per_k, ms_per_ktoken_kcontext=per_kk,
        transfer_fixed_ms=per_transfer, handoff_fixed_ms=0.0, tpot_ms=tpot, noise=0.0,
        link_gbit_s=base.kv_bytes_per_token * 8 * 1000 * 1000 / (max(per_k_moved, 1e-6) * 1e9),
        source=f"fitted to {len(rows)} measured turns")
    return fitted, {"F_ms": fixed, "ms_per_ktoken": per_k, "ms_per_ktoken_kcontext": per_kk,
                    "ms_per_ktoken_moved": per_k_moved, "ms_per_transfer": per_transfer, "tpot_ms": tpot}


def sessions_of(rows: list[dict[str, Any]], gap_s: float = 1.0) -> list[SimSession]:
    """The conversations of ``rows`` (one mode) as sessions, one after another (the bench's concurrency 1)."""
    by_conv: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_conv[row["conversation"]].append(row)
    out, segment, start = [], OWN_SEGMENTS, 0.0
    for conv in sorted(by_conv):
        turns = sorted(by_conv[conv], key=lambda r: r["turn"])
        first = turns[0]["prompt_tokens"]
        sim_turns, history = [], 0
        for t, row in enumerate(turns):
            new = row["prompt_tokens"] if t == 0 else row["prompt_tokens"] - history
            if t and new < 1:
                raise ValidationError(f"{conv} turn {row['turn']}: its prompt does not extend the last turn's")
            sim_turns.append(SimTurn(0 if t == 0 else new, max(1, row["output_tokens"]), gap_s))
            history = row["prompt_tokens"] + row["output_tokens"]
        out.append(SimSession(conv, "t0", start, [(segment, first)], sim_turns))
        segment += 1
        start += 3600.0  # far apart: one conversation at a time
    return out


def _bucket(history: int) -> str:
    return next(name for low, high, name in BUCKETS if (history == 0 if high == 0 else low <= history < high))


def simulate_mode(rows: list[dict[str, Any]], mode: str, prof: Profile, prefill_cache_tokens: int,
                  seed: int = 0) -> list[tuple[int, float]]:
    """(history tokens, simulated TTFT ms) per turn of ``rows`` (one mode), in order of the sessions."""
    sessions = sessions_of(rows)
    index: dict[int, set[str]] = {}
    unit = prof.block_size
    p = PrefillWorker("p0", prefill_cache_tokens // unit, prof.block_size, index)
    d = DecodeWorker("d0", prof.decode_kv_tokens, prof.block_size)
    strategy = strategies.make(MODES[mode], [p], [d], random.Random(seed), candidates=1, unit=unit,
                               prior=PrefillPrior(), index=index)
    result = Simulation(sessions, strategy, prof, [p], [d], SimSettings(unit_tokens=unit, seed=seed)).run()
    order = sorted(range(len(result.turns)), key=lambda i: result.turns.arrival[i])
    return [(result.turns.history[i], result.turns.ttft_ms[i]) for i in order]


def validate(path: str | Path, *, base: str = "cpu-tiny", prefill_cache_tokens: int = 0,
             warm_up: int = 1) -> dict[str, Any]:
    """Fit on the even-numbered conversations, simulate the odd-numbered ones, compare per mode and bucket.

    The first ``warm_up`` conversations of the run are left out: they pay for the engines' warm-up (the first NIXL
    handshake on a link, the first compiled shapes and grammars), seconds the simulator does not model."""
    rows = load_samples(path)
    skipped = sorted({r["conversation"] for r in rows})[:warm_up]
    rows = [r for r in rows if r["conversation"] not in skipped]
    conversations = sorted({r["conversation"] for r in rows})
    if len(conversations) < 2:
        raise ValidationError(f"{path}: need at least 2 conversations (one to fit, one to check), got "
                              f"{len(conversations)}")
    check = set(conversations[1::2])
    fit_rows = [r for r in rows if r["conversation"] not in check]
    prof, coefficients = calibrate(fit_rows, profile(base))
    table: dict[str, dict[str, Any]] = {}
    per_turn: dict[str, float] = {}
    for mode in MODES:
        measured_rows = sorted((r for r in rows if r["mode"] == mode and r["conversation"] in check),
                               key=lambda r: (r["conversation"], r["turn"]))
        if not measured_rows:
            continue
        simulated = simulate_mode(measured_rows, mode, prof, prefill_cache_tokens)
        measured = defaultdict(list)
        sim = defaultdict(list)
        for row, (_, ttft) in zip(measured_rows, simulated, strict=True):
            name = _bucket(row["history_tokens"])
            measured[name].append(row["ttft_ms"])
            sim[name].append(ttft)
            measured["all"].append(row["ttft_ms"])
            sim["all"].append(ttft)
            measured["error"].append(abs(ttft / row["ttft_ms"] - 1))
        per_turn[mode] = round(statistics.median(measured["error"]), 3)
        table[mode] = {name: {"turns": len(measured[name]), "measured_p50_ms": round(statistics.median(measured[name]), 1),
                              "simulated_p50_ms": round(statistics.median(sim[name]), 1),
                              "ratio": round(statistics.median(sim[name]) / statistics.median(measured[name]), 3)}
                       for name in [b[2] for b in BUCKETS] + ["all"] if measured[name]}
    # The verdict: each mode's p50 over all its turns, and each mode's median error per turn (the buckets are shown,
    # but a bucket of a few turns of 100 ms on a shared 2-core machine is too noisy to judge by).
    worst = max([abs(cells["all"]["ratio"] - 1) for cells in table.values()] + list(per_turn.values()), default=0.0)
    return {"samples": str(path), "warm_up_conversations": skipped, "fit_conversations": len(conversations) - len(check),
            "checked_conversations": len(check), "fit_turns": len(fit_rows), "coefficients": coefficients,
            "median_error_per_turn": per_turn,
            "profile": dataclasses.asdict(prof), "table": table, "worst_error": round(worst, 3),
            "within_tolerance": worst <= TOLERANCE, "tolerance": TOLERANCE}


def format_validation(rep: dict[str, Any]) -> str:
    c = rep["coefficients"]
    lines = [f"kvshuttle simulate --validate-samples {rep['samples']}: profile fitted to {rep['fit_turns']} turns of "
             f"{rep['fit_conversations']} conversations, checked on {rep['checked_conversations']} others "
             f"(left out as warm-up: {', '.join(rep['warm_up_conversations']) or 'none'})",
             f"fit: {c['F_ms']:.1f} ms + {c['ms_per_ktoken']:.1f} ms/1k computed + {c['ms_per_ktoken_kcontext']:.2f} "
             f"ms/1k computed/1k context + {c['ms_per_ktoken_moved']:.2f} ms/1k moved + {c['ms_per_transfer']:.1f} ms "
             f"per pull; decode {c['tpot_ms']:.1f} ms/token", "",
             f"{'mode':<10} {'history':<11} {'turns':>5} {'measured p50':>13} {'simulated p50':>14} {'sim/real':>9}"]
    for mode, cells in rep["table"].items():
        for name, cell in cells.items():
            lines.append(f"{mode:<10} {name:<11} {cell['turns']:>5} {cell['measured_p50_ms']:>13,.1f} "
                         f"{cell['simulated_p50_ms']:>14,.1f} {cell['ratio']:>9.2f}")
    verdict = "within" if rep["within_tolerance"] else "NOT within"
    errors = ", ".join(f"{mode} {error:.0%}" for mode, error in rep["median_error_per_turn"].items())
    lines += ["", f"median error per turn: {errors}",
              f"worst of the all-turn p50s and the per-turn errors: {rep['worst_error']:.0%}: {verdict} "
              f"±{rep['tolerance']:.0%}"]
    return "\n".join(lines)
