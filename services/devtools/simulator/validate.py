"""The simulator checked against the real stack: `kvshuttle simulate --validate-samples RUN/samples.jsonl[,MORE...]`.

The input is what `kvshuttle bench` measured on the real local stack (its ``samples.jsonl``: per turn the prompt,
the history, the tokens pulled, computed and found in P's cache, the answer's length, TTFT and latency, the workers
that served it and when it was sent). The *first* run's conversations are split in two: the *calibration* half fits
a hardware profile (the simulator's ground truth) by non-negative least squares, one linear model of a turn's
measured TTFT::

    TTFT ≈ F + a·c + b·c·(p + c/2) + r·(n + pulled) + t·[pulled > 0]

(``c`` tokens computed after ``p`` already in KV, ``n`` prompt tokens sent on to D, ``pulled`` loaded from D: the
profile's compute curve, its link, and a transfer's fixed cost; ``F`` the fixed costs of a turn); the decode step is
the answers' median time per token.

Every run is then replayed whole, per mode, on as many prefill and decode workers as served it, as the bench drove
it: a closed loop of as many conversations at a time as were in flight (the bench's ``--concurrency``, read off the
send times), each turn sent as long after the previous answer as it was (pull mode: the kvshuttle_pull strategy, its
planner and prefix index; recompute mode: the recompute strategy; local mode: kvshuttle continuing on D whenever it
can, a prefill on D priced with its own curve, fitted (:func:`fit_local`) to the calibration half's turns that
continued on D). The checked turns are the first run's other half
and every turn of the later runs (the first ``warm_up`` conversations of each concurrent slot aside: the engines'
warm-up).
Simulated against measured, per history bucket: TTFT p50 and p90; and per run: the turns each prefill worker served
(busiest first) and the prompt tokens found in P's cache, pulled and computed. The verdict: every bucket of at least
``MIN_JUDGED_TURNS`` turns within ``TOLERANCE`` at p50 and p90.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from kvshuttle.control_plane.cost_model import PrefillPrior, nonnegative_least_squares
from kvshuttle.services.devtools.simulator import strategies
from kvshuttle.services.devtools.simulator.cluster import DecodeWorker, PrefillWorker
from kvshuttle.services.devtools.simulator.engine import SimSettings, Simulation
from kvshuttle.services.devtools.simulator.hardware import Profile, profile
from kvshuttle.services.devtools.simulator.workload import OWN_SEGMENTS, SimSession, SimTurn

# bench mode -> the simulated strategy (the bench's pull lane runs the threshold policy: pull or recompute, never D;
# its local lane a policy that continues on D whenever it can)
MODES = {"pull": "kvshuttle_pull", "recompute": "recompute", "local": "kvshuttle_on_d"}
FIT_MODES = ("pull", "recompute")  # the profile is fitted to P's prefills; local turns fit only D's fixed cost
BUCKETS = ((0, 0, "first turn"), (1, 2000, "<2k"), (2000, 4000, "2k-4k"), (4000, 1 << 62, "4k+"))
TOLERANCE = 0.25
MIN_JUDGED_TURNS = 5  # a bucket of fewer turns is shown, not judged (a few 100 ms turns on a shared machine)
GAP_S = 1.0  # between turns, for samples without send times (older bench runs)
REQUIRED = ("mode", "conversation", "turn", "prompt_tokens", "history_tokens", "ttft_ms", "latency_ms",
            "output_tokens", "pulled_tokens", "computed_tokens")
OPTIONAL = {"prefill_worker": "", "decode_worker": "", "cached_tokens": 0, "sent_at": 0.0, "decision": ""}


class ValidationError(ValueError):
    pass


def load_samples(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise ValidationError(f"{path}: {exc.strerror or exc}") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({k: row[k] for k in REQUIRED} | {k: row.get(k, v) for k, v in OPTIONAL.items()})
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


def fit_local(rows: list[dict[str, Any]], tpot_ms: float, chunk_tokens: int) -> tuple[float, float, float] | None:
    """A prefill on D's own curve, ``F_D + a·c + b·c·(p + c/2)``, fitted to the turns continued on D as P's curve
    is fitted to P's (relative error, non-negative), less D's decode steps the engine adds; None with fewer turns
    than terms. Its own fit, as a pull has its own term: the same model on the same hardware, but no P, no hand-off,
    and D's batch around it."""
    if len(rows) < 3:
        return None
    a = [[0.0] * 3 for _ in range(3)]
    b = [0.0] * 3
    for row in rows:
        c = row["computed_tokens"]
        p = row["prompt_tokens"] - c
        x = [1.0, c / 1000, c * (p + c / 2) / 1e6]
        y = row["ttft_ms"] - max(1, math.ceil(c / chunk_tokens)) * tpot_ms
        w = 1 / max(row["ttft_ms"], 1.0) ** 2
        for i in range(3):
            b[i] += w * x[i] * y
            for j in range(3):
                a[i][j] += w * x[i] * x[j]
    for i in range(3):
        a[i][i] += 1e-9 + 1e-6 * a[i][i]
    fixed, per_k, per_kk = nonnegative_least_squares(a, b)
    return fixed, per_k, per_kk


def _conversations(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """One mode's rows by conversation (turns in order), the conversations in the order the bench started them."""
    by_conv: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_conv[row["conversation"]].append(row)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r["turn"])
    timed = all(r["sent_at"] > 0 for r in rows)
    order = sorted(by_conv, key=lambda c: (by_conv[c][0]["sent_at"], c) if timed else c)
    return {c: by_conv[c] for c in order}


def in_flight(rows: list[dict[str, Any]]) -> int:
    """The most conversations of ``rows`` (one mode) in flight at once, from their send times (1 without them)."""
    if not all(r["sent_at"] > 0 for r in rows):
        return 1
    edges = []
    for turns in _conversations(rows).values():
        edges.append((turns[0]["sent_at"], 1))
        edges.append((max(t["sent_at"] + t["latency_ms"] / 1000 for t in turns), -1))
    most = now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        now += step
        most = max(most, now)
    return max(1, most)


def sessions_of(rows: list[dict[str, Any]]) -> list[SimSession]:
    """The conversations of ``rows`` (one mode) as sessions, in the order the bench started them, each turn sent as
    long after the previous answer ended as measured (``GAP_S`` without send times)."""
    out, segment = [], OWN_SEGMENTS
    timed = all(r["sent_at"] > 0 for r in rows)
    t0 = min(r["sent_at"] for r in rows) if timed else 0.0
    for k, (conv, turns) in enumerate(_conversations(rows).items()):
        first = turns[0]["prompt_tokens"]
        sim_turns, history = [], 0
        for t, row in enumerate(turns):
            new = row["prompt_tokens"] if t == 0 else row["prompt_tokens"] - history
            if t and new < 1:
                raise ValidationError(f"{conv} turn {row['turn']}: its prompt does not extend the last turn's")
            gap = GAP_S
            if timed and t:
                prev = turns[t - 1]
                gap = max(0.0, row["sent_at"] - prev["sent_at"] - prev["latency_ms"] / 1000)
            sim_turns.append(SimTurn(0 if t == 0 else new, max(1, row["output_tokens"]), 0.0 if t == 0 else gap))
            history = row["prompt_tokens"] + row["output_tokens"]
        start = turns[0]["sent_at"] - t0 if timed else float(k)
        out.append(SimSession(conv, "t0", start, [(segment, first)], sim_turns))
        segment += 1
    return out


def _bucket(history: int) -> str:
    return next(name for low, high, name in BUCKETS if (history == 0 if high == 0 else low <= history < high))


def simulate_mode(rows: list[dict[str, Any]], mode: str, prof: Profile, prefill_cache_tokens: int,
                  seed: int = 0, host_cores: float = 0.0) -> dict[tuple[str, int], dict[str, Any]]:
    """Every turn of ``rows`` (one mode of one run) simulated: (conversation, turn) -> the simulated TTFT (ms), the
    prefill worker (its index), and the prompt tokens cached, pulled and computed."""
    sessions = sessions_of(rows)
    index: dict[int, set[str]] = {}
    unit = prof.block_size
    n_prefill = max(1, len({r["prefill_worker"] for r in rows if r["prefill_worker"]}))
    n_decode = max(1, len({r["decode_worker"] for r in rows if r["decode_worker"]}))
    ps = [PrefillWorker(f"p{i}", prefill_cache_tokens // unit, prof.block_size, index) for i in range(n_prefill)]
    ds = [DecodeWorker(f"d{i}", prof.decode_kv_tokens, prof.block_size) for i in range(n_decode)]
    strategy = strategies.make(MODES[mode], ps, ds, random.Random(seed), candidates=max(n_prefill, n_decode),
                               unit=unit, prior=PrefillPrior(), index=index)
    settings = SimSettings(unit_tokens=unit, seed=seed, sessions_in_flight=in_flight(rows), host_cores=host_cores)
    cols = Simulation(sessions, strategy, prof, ps, ds, settings).run().turns
    measured = _conversations(rows)
    out = {}
    for i in range(len(cols)):
        conv = sessions[cols.session[i]].session_id
        row = measured[conv][cols.turn[i]]
        # a turn prefilled on D: its cached tokens are D's prefix-cache hit (the bench's sample says D's, too)
        cached = cols.d_cached[i] if cols.local[i] else cols.cached[i]
        out[(conv, row["turn"])] = {"ttft_ms": cols.ttft_ms[i], "prefill": cols.prefill[i], "cached": cached,
                                    "pulled": cols.pulled[i], "computed": cols.computed[i]}
    if len(out) != len(rows):
        raise ValidationError(f"the simulation answered {len(out)} of {len(rows)} turns of mode {mode}")
    return out


def _p(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ratio(sim: float, real: float) -> float | None:
    return round(sim / real, 3) if real else None


def _compare(checked: list[dict[str, Any]], simulated: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Measured against simulated for the ``checked`` rows (one mode of one run)."""
    measured_by, sim_by = defaultdict(list), defaultdict(list)
    errors = []
    real_p, sim_p = Counter(), Counter()
    tokens = {"measured": Counter(), "simulated": Counter()}
    for row in checked:
        sim = simulated[(row["conversation"], row["turn"])]
        for name in (_bucket(row["history_tokens"]), "all"):
            measured_by[name].append(row["ttft_ms"])
            sim_by[name].append(sim["ttft_ms"])
        errors.append(abs(sim["ttft_ms"] / row["ttft_ms"] - 1))
        real_p[row["prefill_worker"] or "p"] += 1
        sim_p[sim["prefill"]] += 1
        tokens["measured"].update(cached=row["cached_tokens"], pulled=row["pulled_tokens"],
                                  computed=row["computed_tokens"], prompt=row["prompt_tokens"])
        tokens["simulated"].update(cached=sim["cached"], pulled=sim["pulled"], computed=sim["computed"],
                                   prompt=row["prompt_tokens"])
    buckets = {}
    for name in [b[2] for b in BUCKETS] + ["all"]:
        if not measured_by[name]:
            continue
        real, sim = measured_by[name], sim_by[name]
        cell = {"turns": len(real)}
        for q, tag in ((0.5, "p50"), (0.9, "p90")):
            cell[f"measured_{tag}_ms"] = round(_p(real, q), 1)
            cell[f"simulated_{tag}_ms"] = round(_p(sim, q), 1)
            cell[f"{tag}_ratio"] = _ratio(_p(sim, q), _p(real, q))
        cell["judged"] = len(real) >= MIN_JUDGED_TURNS
        buckets[name] = cell
    total = len(checked)
    shares = {side: {k: round(c[k] / c["prompt"], 3) if c["prompt"] else 0.0 for k in ("cached", "pulled", "computed")}
              for side, c in tokens.items()}
    return {"buckets": buckets, "median_error_per_turn": round(statistics.median(errors), 3),
            "turns_per_prefill": {"measured": sorted(real_p.values(), reverse=True),
                                  "simulated": sorted(sim_p.values(), reverse=True)},
            "busiest_prefill_share": {"measured": round(max(real_p.values()) / total, 3),
                                      "simulated": round(max(sim_p.values()) / total, 3)},
            "prompt_token_shares": shares}


def validate(paths: str | Path | list[str | Path], *, base: str = "cpu-tiny", prefill_cache_tokens: int = 0,
             warm_up: int = 1, host_cores: float = 0.0) -> dict[str, Any]:
    """Fit on the first run's even-numbered conversations; replay every run; compare the first run's other half and
    the later runs' conversations, per mode and bucket.

    The first ``warm_up`` conversations of each run's concurrent slots are left out of the fit and the checks (they
    are replayed: they load the workers as they did): they pay for the engines' warm-up (the first NIXL handshake on a link, the first
    compiled shapes and grammars), seconds the simulator does not model. ``host_cores`` > 0: the run's workers shared
    one host of that many cores (``SimSettings.host_cores``), as the bench's local stack does."""
    if isinstance(paths, str | Path):
        paths = [p for p in str(paths).split(",") if p]
    if not paths:
        raise ValidationError("no samples file given")
    runs = [(str(p), load_samples(p)) for p in paths]

    def kept(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """The run's warm-up conversations (the first ``warm_up`` of each of its concurrent slots: those started
        together pay the cold start together) and the others, in the order the bench started them."""
        order = list(_conversations(rows))
        cold = warm_up * max(in_flight([r for r in rows if r["mode"] == mode]) for mode in {r["mode"] for r in rows})
        return order[:cold], order[cold:]

    first_path, first_rows = runs[0]
    skipped, conversations = kept(first_rows)
    if len(conversations) < 2:
        raise ValidationError(f"{first_path}: need at least 2 conversations after the warm-up (one to fit, one to "
                              f"check), got {len(conversations)}")
    fit_convs = set(conversations[0::2])
    fit_rows = [r for r in first_rows if r["conversation"] in fit_convs and r["mode"] in FIT_MODES]
    if not fit_rows:
        raise ValidationError(f"{first_path}: no {' or '.join(FIT_MODES)} samples to fit the profile to")
    prof, coefficients = calibrate(fit_rows, profile(base))
    local_rows = [r for r in first_rows if r["conversation"] in fit_convs and r.get("decision") == "local"]
    local = fit_local(local_rows, prof.tpot_ms, SimSettings().max_num_batched_tokens)
    if local is not None:
        prof = dataclasses.replace(prof, local_fixed_ms=local[0], local_ms_per_ktoken=local[1],
                                   local_ms_per_ktoken_kcontext=local[2])
        coefficients |= {"local_F_ms": local[0], "local_ms_per_ktoken": local[1],
                         "local_ms_per_ktoken_kcontext": local[2], "local_turns": len(local_rows)}
    checks = []
    for i, (path, rows) in enumerate(runs):
        warm, rest = kept(rows)
        check = set(rest) - (fit_convs if i == 0 else set())
        per_mode = {}
        for mode in MODES:
            mode_rows = [r for r in rows if r["mode"] == mode]
            checked = [r for r in mode_rows if r["conversation"] in check]
            if not checked:
                continue
            simulated = simulate_mode(mode_rows, mode, prof, prefill_cache_tokens, host_cores=host_cores)
            per_mode[mode] = _compare(checked, simulated) | {
                "in_flight": in_flight(mode_rows),
                "prefill_workers": max(1, len({r["prefill_worker"] for r in mode_rows if r["prefill_worker"]}))}
        checks.append({"samples": path, "warm_up_conversations": warm, "checked_conversations": len(check),
                       "modes": per_mode})
    ratios = [cell[f"{tag}_ratio"] for run in checks for m in run["modes"].values() for cell in m["buckets"].values()
              if cell["judged"] for tag in ("p50", "p90") if cell[f"{tag}_ratio"] is not None]
    worst = max((abs(r - 1) for r in ratios), default=0.0)
    return {"samples": [p for p, _ in runs], "warm_up_conversations": skipped, "fit_conversations": len(fit_convs),
            "fit_turns": len(fit_rows), "coefficients": coefficients, "profile": dataclasses.asdict(prof),
            "runs": checks, "worst_error": round(worst, 3), "within_tolerance": worst <= TOLERANCE,
            "tolerance": TOLERANCE, "min_judged_turns": MIN_JUDGED_TURNS, "host_cores": host_cores}


def format_validation(rep: dict[str, Any]) -> str:
    c = rep["coefficients"]
    lines = [f"kvshuttle simulate --validate-samples {','.join(rep['samples'])}: profile fitted to {rep['fit_turns']} "
             f"turns of {rep['fit_conversations']} conversations of the first run (left out as warm-up: "
             f"{', '.join(rep['warm_up_conversations']) or 'none'})",
             f"fit: {c['F_ms']:.1f} ms + {c['ms_per_ktoken']:.1f} ms/1k computed + {c['ms_per_ktoken_kcontext']:.2f} "
             f"ms/1k computed/1k context + {c['ms_per_ktoken_moved']:.2f} ms/1k moved + {c['ms_per_transfer']:.1f} ms "
             f"per pull; decode {c['tpot_ms']:.1f} ms/token"
             + (f"; a prefill on D ({c['local_turns']} turns): {c['local_F_ms']:.1f} ms + "
                f"{c['local_ms_per_ktoken']:.1f} ms/1k computed + {c['local_ms_per_ktoken_kcontext']:.2f} ms/1k "
                f"computed/1k context" if "local_F_ms" in c else "")
             + (f"; the workers share {rep['host_cores']:g} cores" if rep.get("host_cores") else "")]
    for run in rep["runs"]:
        lines += ["", f"{run['samples']}: {run['checked_conversations']} conversations checked"]
        lines.append(f"{'mode':<10} {'history':<11} {'turns':>5} {'p50 real':>9} {'p50 sim':>9} {'sim/real':>8} "
                     f"{'p90 real':>9} {'p90 sim':>9} {'sim/real':>8}")
        for mode, m in run["modes"].items():
            for name, cell in m["buckets"].items():
                mark = "" if cell["judged"] else "  (too few turns to judge)"
                lines.append(f"{mode:<10} {name:<11} {cell['turns']:>5} {cell['measured_p50_ms']:>9,.1f} "
                             f"{cell['simulated_p50_ms']:>9,.1f} {cell['p50_ratio'] or 0:>8.2f} "
                             f"{cell['measured_p90_ms']:>9,.1f} {cell['simulated_p90_ms']:>9,.1f} "
                             f"{cell['p90_ratio'] or 0:>8.2f}{mark}")
        for mode, m in run["modes"].items():
            share, real, sim = m["prompt_token_shares"], m["turns_per_prefill"]["measured"], \
                m["turns_per_prefill"]["simulated"]
            lines.append(f"{mode}: {m['in_flight']} conversation(s) in flight, {m['prefill_workers']} prefill "
                         f"worker(s); turns per prefill worker, busiest first: measured {real}, simulated {sim}; "
                         f"prompt tokens cached / pulled / computed: measured "
                         f"{share['measured']['cached']:.0%} / {share['measured']['pulled']:.0%} / "
                         f"{share['measured']['computed']:.0%}, simulated {share['simulated']['cached']:.0%} / "
                         f"{share['simulated']['pulled']:.0%} / {share['simulated']['computed']:.0%}; median error "
                         f"per turn {m['median_error_per_turn']:.0%}")
    verdict = "within" if rep["within_tolerance"] else "NOT within"
    lines += ["", f"worst p50/p90 error over the buckets of at least {rep['min_judged_turns']} turns: "
                  f"{rep['worst_error']:.0%}: {verdict} ±{rep['tolerance']:.0%}"]
    return "\n".join(lines)
