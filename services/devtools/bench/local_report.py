"""The local mode's part of the benchmark report: a later turn continued on D (the decode worker holding the
session's KV serves it from its own prefix cache) against the pull (P computes the new part with the history pulled
from D, D reads the prompt's KV back) and the recompute, and what continuing on D costs D's other streams.

* :func:`continuing_on_d`: TTFT p50/p99 of pull, local and recompute on the turns the local mode did continue on D
  and the pull mode did pull (each mode did what it is named for), by history length and by **new tokens** (what the turn adds: its prompt minus the previous turn's prompt and
  answer), with local ÷ pull and local ÷ recompute; and :func:`crossover`, the new-token bucket where continuing on D
  stops beating the pull. The local mode's turns that did not continue on D, and the pull mode's that did not pull,
  are counted by decision and reason code (:func:`local_turns`), never dropped silently.
* :func:`itl_by_prefill`: the delays between successive streamed chunks of D's streams (every lane's turns but the
  ideal worker's) that overlap a local turn's prefill (its request to its first token), a pull turn's, a recompute
  turn's, or none: the price of a prefill inside D's batch against one on P, from the same run.
* :func:`network_by_lane`: per lane, the prompt tokens that crossed the network per later turn: D → P (what P
  pulled) and P → D (what D read back from P: D's own vLLM counter, measured around each turn at concurrency 1).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterable
from itertools import pairwise

from kvshuttle.services.devtools.bench.samples import IDEAL, LOCAL, PULL, RECOMPUTE, TurnSample, TurnStream
from kvshuttle.services.devtools.bench.stats import percentile, summary
from kvshuttle.services.devtools.bench.stats import text_count as _num
from kvshuttle.services.devtools.bench.stats import text_ms as _ms
from kvshuttle.services.devtools.bench.stats import text_ratio as _x

DEFAULT_NEW_BUCKETS = (0, 256, 1024, 4096)
COMPARED = (PULL, LOCAL, RECOMPUTE)  # the modes the Continuing-on-D tables compare, in their column order
PREFILL_KINDS = (LOCAL, PULL, RECOMPUTE)  # the turn decisions whose prefills the ITL report tells apart
NONE = "none"  # no measured turn was prefilling

Key = tuple[str, int]  # (conversation, turn)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _tokens(n: int) -> str:
    """1024 -> "1k", 4096 -> "4k", 1000 -> "1000"."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def new_bucket_label(lo: int, hi: int | None) -> str:
    if hi is None:
        return f">={_tokens(lo)}"
    return f"<{_tokens(hi)}" if lo == 0 else f"{_tokens(lo)}-{_tokens(hi)}"


def history_label(lo: int, hi: int | None) -> str:
    """As the history tables label their buckets (report.bucket_label)."""
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def check_edges(edges: Iterable[int]) -> list[int]:
    out = [int(e) for e in edges]
    if not out or any(e < 0 for e in out) or any(a >= b for a, b in pairwise(out)):
        raise ValueError(f"bucket edges must be non-negative and strictly increasing, got {list(edges)}")
    return out if out[0] == 0 else [0, *out]


def canonical(samples: list[TurnSample], modes: list[str], attr: str) -> dict[Key, int]:
    """``attr`` (history_tokens, new_tokens) of each (conversation, turn) as the first mode in ``modes`` order that
    measured it saw it: a turn lands in the same bucket in every mode."""
    rank = {m: i for i, m in enumerate(modes)}
    best: dict[Key, tuple[int, int]] = {}
    for s in samples:
        key, r = (s.conversation, s.turn), rank.get(s.mode, len(rank))
        if key not in best or r < best[key][0]:
            best[key] = (r, getattr(s, attr))
    return {key: value for key, (_, value) in best.items()}


def local_turns(samples: list[TurnSample]) -> dict:
    """What the local mode's turns were: the later turns continued on D, and the others by decision and reason code
    (each counted, none dropped); the first turns' decisions (nothing held on D yet: a recompute); and the turns
    continued on D whose D-side prefix-cache hit exceeded their own history (another lane's or session's blocks on D:
    the lane would then not measure its own turn)."""
    lane = [s for s in samples if s.mode == LOCAL]
    later = [s for s in lane if s.turn > 1]
    local = [s for s in later if s.decision == LOCAL]
    others = Counter((s.decision, s.reason_code or "-") for s in later if s.decision != LOCAL)
    hits = [s for s in local if s.decode_cached_tokens >= 0]
    return {
        "later_turns": len(later), "local": len(local),
        "not_local": [{"decision": d, "reason_code": code, "turns": n} for (d, code), n in sorted(others.items())],
        "first_turns": dict(sorted(Counter(s.decision for s in lane if s.turn == 1).items())),
        "beyond_own_history": sum(1 for s in hits if s.decode_cached_tokens > s.history_tokens),
        # D's own prefix-cache hit on those turns as a share of the history they carried (1.0: all of it, bar
        # nothing; the last partial KV block of the history is computed again)
        "cached_of_history": _div(sum(s.decode_cached_tokens for s in hits), sum(s.history_tokens for s in hits)),
    }


def _compare(members: list[TurnSample], history: dict[Key, int], new: dict[Key, int], **fields) -> dict:
    keys = {(s.conversation, s.turn) for s in members}
    by_mode: dict[str, list[float]] = defaultdict(list)
    for s in members:
        by_mode[s.mode].append(s.ttft_ms)
    modes = {m: {"count": len(v), "ttft_p50_ms": percentile(v, 50), "ttft_p99_ms": percentile(v, 99),
                 "ttft_mean_ms": _mean(v)} for m, v in by_mode.items() if v}
    p50 = {m: st["ttft_p50_ms"] for m, st in modes.items()}
    return {**fields, "turns": len(keys), "history_tokens_mean": _mean([history[k] for k in keys]),
            "new_tokens_mean": _mean([new[k] for k in keys]), "modes": modes,
            "ratios": {"local_over_pull": _div(p50.get(LOCAL), p50.get(PULL)),
                       "local_over_recompute": _div(p50.get(LOCAL), p50.get(RECOMPUTE))}}


def _bucketed(members: list[TurnSample], value: dict[Key, int], edges: list[int], label, history, new) -> list[dict]:
    out = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        inside = [s for s in members if value[(s.conversation, s.turn)] >= lo
                  and (hi is None or value[(s.conversation, s.turn)] < hi)]
        if inside:
            out.append(_compare(inside, history, new, label=label(lo, hi), lo=lo, hi=hi))
    return out


def crossover(groups: list[dict]) -> dict:
    """Where continuing on D stops beating the pull, from groups in ascending new-token order: the first group whose
    local TTFT p50 is not below the pull's (ties count as not beating it) after one where it was.

    ``status``: ``crosses`` (``bucket`` is that group; ``new_tokens`` interpolates where the p50 difference changes
    sign between the two groups' mean new tokens), ``local_never_faster`` (it already loses in the first group:
    ``bucket`` is that one), ``local_always_faster`` (``bucket`` None) or ``no_data``. ``monotonic``: False when
    local beats the pull again in a later group (``wins_after``; ``wins`` and ``losses`` list them all)."""
    rows = [(g["label"], g["new_tokens_mean"], g["modes"][LOCAL]["ttft_p50_ms"], g["modes"][PULL]["ttft_p50_ms"])
            for g in groups if LOCAL in g["modes"] and PULL in g["modes"]]
    wins = [label for label, _, local, pull in rows if local < pull]
    losses = [label for label, _, local, pull in rows if local >= pull]
    out: dict = {"status": "no_data", "bucket": None, "new_tokens": None, "wins": wins, "losses": losses,
                 "monotonic": True, "wins_after": []}
    if not rows:
        return out
    first_loss = next((i for i, (_, _, local, pull) in enumerate(rows) if local >= pull), None)
    if first_loss is None:
        out["status"] = "local_always_faster"
        return out
    out["wins_after"] = [label for label, _, local, pull in rows[first_loss:] if local < pull]
    out["monotonic"] = not out["wins_after"]
    out["bucket"] = rows[first_loss][0]
    if first_loss == 0:
        out["status"] = "local_never_faster"
        return out
    out["status"] = "crosses"
    (_, x0, l0, p0), (_, x1, l1, p1) = rows[first_loss - 1], rows[first_loss]
    d0, d1 = l0 - p0, l1 - p1  # d0 < 0 <= d1
    out["new_tokens"] = x0 + (x1 - x0) * (-d0) / (d1 - d0)
    return out


def continuing_on_d(samples: list[TurnSample], modes: list[str], history_edges: list[int],
                    new_edges: Iterable[int] = DEFAULT_NEW_BUCKETS) -> dict:
    """The local mode against pull and recompute on the same turns: those the local mode continued on D and the pull
    mode (when measured) pulled; the others are counted in ``turns`` (by decision and reason code)."""
    new_edges = check_edges(new_edges)
    history, new = canonical(samples, modes, "history_tokens"), canonical(samples, modes, "new_tokens")
    keys = {(s.conversation, s.turn) for s in samples if s.mode == LOCAL and s.turn > 1 and s.decision == LOCAL}
    unpulled = [s for s in samples if s.mode == PULL and s.decision != PULL and (s.conversation, s.turn) in keys]
    keys -= {(s.conversation, s.turn) for s in unpulled}
    turns = local_turns(samples)
    turns["compared"] = len(keys)
    turns["pull_not_pulled"] = [{"decision": d, "reason_code": code, "turns": n} for (d, code), n in
                                sorted(Counter((s.decision, s.reason_code or "-") for s in unpulled).items())]
    members = [s for s in samples if s.mode in COMPARED and (s.conversation, s.turn) in keys]
    by_new = _bucketed(members, new, new_edges, new_bucket_label, history, new)
    return {
        "turns": turns,
        "overall": _compare(members, history, new, label="all"),
        "by_history": _bucketed(members, history, check_edges(history_edges), history_label, history, new),
        "by_new_tokens": by_new, "new_bucket_edges": new_edges, "crossover": crossover(by_new),
    }


# ---------------------------------------------------------------------------------------------------------------
# Inter-token delays of D's streams


def _merged(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, overlapping intervals joined: (starts, ends) of disjoint intervals."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(intervals):
        if starts and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _overlaps(merged: tuple[list[float], list[float]] | None, a: float, b: float) -> bool:
    """Whether (a, b) overlaps one of the disjoint intervals (start < b and end > a): only the last one starting
    before b can."""
    if not merged:
        return False
    starts, ends = merged
    i = bisect_left(starts, b) - 1
    return i >= 0 and ends[i] > a


def itl_by_prefill(streams: list[TurnStream], *, exclude_modes: Iterable[str] = (IDEAL,)) -> dict:
    """The delays (ms) between successive token chunks of D's streams, by what was prefilling meanwhile.

    A prefill is a turn's request to its first token (``sent`` to ``tokens[0]``), by the turn's decision: ``local``
    (D computes it inside its batch), ``pull`` (P computes the new part with the pulled history, then D reads the
    prompt's KV), ``recompute`` (P computes all of it, D reads it). A delay counts for each kind whose prefill on
    the same decode worker overlaps it (a stream's own prefill ends where its delays start), and as ``none`` when no
    measured prefill overlaps it. Streams of ``exclude_modes`` (the ideal worker: not D) are left out."""
    excluded = set(exclude_modes)
    streams = [s for s in streams if s.mode not in excluded and s.tokens]
    workers = {s.decode_worker for s in streams if s.decode_worker}
    per_worker = len(workers) > 1  # one D (or unknown): every stream is on it

    def where(s: TurnStream) -> str:
        return s.decode_worker if per_worker else ""

    spans: dict[str, dict[str, list[tuple[float, float]]]] = {k: defaultdict(list) for k in PREFILL_KINDS}
    for s in streams:
        if s.decision in spans:
            spans[s.decision][where(s)].append((s.sent, s.tokens[0]))
    merged = {k: {w: _merged(v) for w, v in by_worker.items()} for k, by_worker in spans.items()}
    gaps: dict[str, list[float]] = {k: [] for k in (*PREFILL_KINDS, NONE)}
    for s in streams:
        if per_worker and not s.decode_worker:
            continue
        w = where(s)
        for a, b in pairwise(s.tokens):
            hit = False
            for kind in PREFILL_KINDS:
                if _overlaps(merged[kind].get(w), a, b):
                    gaps[kind].append((b - a) * 1000)
                    hit = True
            if not hit:
                gaps[NONE].append((b - a) * 1000)
    out: dict = {"streams": len(streams), "gaps": sum(len(s.tokens) - 1 for s in streams), "by_prefill": {}}
    for kind in (*PREFILL_KINDS, NONE):
        row = summary(gaps[kind])
        if kind != NONE:
            row["prefills"] = sum(len(v) for v in spans[kind].values())
            row["prefill_s"] = sum(e - s for v in spans[kind].values() for s, e in v)
        out["by_prefill"][kind] = row
    return out


# ---------------------------------------------------------------------------------------------------------------
# Prompt tokens over the network


def network_by_lane(samples: list[TurnSample], modes: list[str]) -> list[dict]:
    """Per lane (the ideal worker's excepted: one worker, nothing moves), over its later turns: the prompt tokens P
    pulled from D (D -> P, the turns' ``pulled_tokens``) and those D read back from P (P -> D; 0 on a turn continued
    on D) with D's own prefix-cache hit; the P -> D means are None unless every turn's count is known."""
    rows = []
    for mode in modes:
        if mode == IDEAL:
            continue
        later = [s for s in samples if s.mode == mode and s.turn > 1]
        if not later:
            continue
        read = [s.decode_read_tokens for s in later if s.decode_read_tokens >= 0]
        hit = [s.decode_cached_tokens for s in later if s.decode_cached_tokens >= 0]
        pulled = [s.pulled_tokens for s in later]
        whole = len(read) == len(later)
        rows.append({
            "mode": mode, "turns": len(later), "prompt_tokens_mean": _mean([s.prompt_tokens for s in later]),
            "pulled_tokens_mean": _mean(pulled), "pulled_tokens_sum": sum(pulled),
            "read_tokens_measured": len(read), "read_tokens_mean": _mean(read) if whole else None,
            "read_tokens_sum": sum(read) if whole else None,
            "decode_cached_tokens_mean": _mean(hit) if len(hit) == len(later) else None,
            "crossed_tokens_mean": _mean([p + r for p, r in zip(pulled, [s.decode_read_tokens for s in later],
                                                                strict=True)]) if whole else None,
        })
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Text


def _rows(title: str, head: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    header = "  ".join(f"{n:<{w}}" if i == 0 else f"{n:>{w}}" for i, (n, w) in enumerate(head))
    lines = [title, header, "-" * len(header)]
    for row in rows:
        lines.append("  ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(row, head,
                                                                                                         strict=True))))
    if not rows:
        lines.append("(no samples)")
    return lines


def _compare_rows(title: str, first: str, groups: list[dict]) -> list[str]:
    head = [(first, 10), ("turns", 5), ("history", 7), ("new", 5)]
    for m in COMPARED:
        head += [(f"{m} p50", max(9, len(m) + 4)), ("p99", 8)]
    head += [("local/pull", 10), ("local/rec", 9)]
    rows = []
    for g in groups:
        row = [g["label"], str(g["turns"]), _num(g["history_tokens_mean"]), _num(g["new_tokens_mean"])]
        for m in COMPARED:
            st = g["modes"].get(m, {})
            row += [_ms(st.get("ttft_p50_ms")), _ms(st.get("ttft_p99_ms"))]
        row += [_x(g["ratios"]["local_over_pull"]), _x(g["ratios"]["local_over_recompute"])]
        rows.append(row)
    return _rows(title, head, rows)


def crossover_line(c: dict) -> str:
    how = "local TTFT p50 against the pull's, by new tokens per turn"
    if c["status"] == "crosses":
        more = "" if c["monotonic"] else f" (not monotonic: local wins again in {', '.join(c['wins_after'])})"
        return (f"crossover ({how}): continuing on D beats the pull below {c['bucket']} new tokens and stops beating "
                f"it in {c['bucket']} (~{c['new_tokens']:.0f} new tokens, interpolated){more}")
    if c["status"] == "local_never_faster":
        more = f" (not monotonic: local wins in {', '.join(c['wins_after'])})" if c["wins_after"] else ""
        return f"crossover ({how}): none, the pull is as fast or faster from the smallest bucket ({c['bucket']}){more}"
    if c["status"] == "local_always_faster":
        return f"crossover ({how}): none measured, continuing on D beats the pull in every bucket"
    return f"crossover ({how}): no turn measured in both modes"


def format_local(section: dict, meta: dict) -> list[str]:
    t = section["turns"]
    lines = [f"Continuing on D (local mode: scheduler policy {meta.get('local_policy') or '?'}"
             + (f", {meta['local_policy_spec']}" if meta.get("local_policy_spec") else "") + ")"]
    not_local = ", ".join(f"{r['decision']} ({r['reason_code']}) {r['turns']}" for r in t["not_local"])
    lines.append(f"local mode, turns 2+: {t['local']}/{t['later_turns']} continued on D"
                 + (f"; not continued: {not_local}" if not_local else "")
                 + f"; turn 1: {', '.join(f'{d} {n}' for d, n in t['first_turns'].items()) or '-'}")
    unpulled = ", ".join(f"{r['decision']} ({r['reason_code']}) {r['turns']}" for r in t.get("pull_not_pulled", []))
    lines.append(f"compared on the {t.get('compared', 0)} turns the local mode continued on D and the pull mode pulled"
                 + (f" (the pull mode did not pull: {unpulled})" if unpulled else ""))
    share = t["cached_of_history"]
    lines.append(f"D's own prefix cache served {'-' if share is None else f'{100 * share:.1f}%'} of those turns' "
                 f"history; turns whose hit exceeded their own history (another lane's blocks): "
                 f"{t['beyond_own_history']}")
    lines.append("")
    lines += _compare_rows("TTFT (ms) by history length, on those turns", "history",
                           section["by_history"])
    lines.append("")
    lines += _compare_rows("TTFT (ms) by new tokens per turn (prompt - previous prompt and answer), same turns", "new",
                           section["by_new_tokens"])
    lines.append(crossover_line(section["crossover"]))
    return lines


ITL_LABELS = {LOCAL: "a local turn prefills on D", PULL: "a pull turn prefills (P; D reads)",
              RECOMPUTE: "a recompute turn prefills (P; D reads)", NONE: "no measured turn prefills"}


def format_itl(itl: dict, concurrency: int | None = None) -> list[str]:
    head = [("while", 38), ("prefills", 8), ("gaps", 6), ("p50", 7), ("p90", 7), ("p99", 7), ("mean", 7)]
    rows = []
    for kind, row in itl["by_prefill"].items():
        rows.append([ITL_LABELS.get(kind, kind), str(row.get("prefills", "-")), str(row["count"]), _ms(row["p50"]),
                     _ms(row["p90"]), _ms(row["p99"]), _ms(row["mean"])])
    title = (f"D's inter-token delay (ms, between streamed chunks; {itl['streams']} streams of every lane but ideal) "
             f"by what was prefilling meanwhile")
    lines = _rows(title, head, rows)
    if concurrency == 1:
        lines.append("(concurrency 1: no other turn runs while a stream does; --concurrency 2 or more prices "
                     "prefills against D's streams)")
    return lines


def format_network(rows: list[dict], measured: bool, concurrency: int | None = None) -> list[str]:
    head = [("lane", 10), ("turns", 5), ("prompt", 6), ("D->P pulled", 11), ("P->D read", 9), ("D cache hit", 11),
            ("crossed", 7)]
    out = [[r["mode"], str(r["turns"]), _num(r["prompt_tokens_mean"]), _num(r["pulled_tokens_mean"]),
            _num(r["read_tokens_mean"]), _num(r["decode_cached_tokens_mean"]), _num(r["crossed_tokens_mean"])]
           for r in rows]
    lines = _rows("Prompt tokens over the network per turn (turns 2+, means; P->D: what D read back from P)", head,
                  out)
    if not measured:
        why = f"concurrency {concurrency}" if concurrency and concurrency > 1 else "a stack the bench did not start"
        lines.append(f"(P->D and D's cache hit per turn: not measured ({why}; read from D's vLLM counters around each "
                     f"turn only at concurrency 1 on the bench's own stack); a turn continued on D reads nothing "
                     f"from P)")
    return lines
