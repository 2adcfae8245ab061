"""A simulation's figures (TTFT, goodput at an SLO, KV held, prefix-cache hits, network bytes, decode inter-token
latency) and their table."""

from __future__ import annotations

from typing import Any

from kvshuttle.services.devtools.bench.stats import percentile
from kvshuttle.services.devtools.simulator.engine import Result

# History buckets (tokens of history before the turn's new tokens): first turns are their own row.
BUCKETS = ((0, 0, "first turn"), (1, 4096, "<4k"), (4096, 16384, "4k-16k"), (16384, 65536, "16k-64k"),
           (65536, 1 << 62, "64k+"))


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 1) if values else None


def weighted_percentile(counts: dict[float, float], q: float) -> float | None:
    """The ``q``-th percentile of values given as value -> how many (nearest rank; negative counts read as 0)."""
    items = sorted((v, c) for v, c in counts.items() if c > 0)
    total = sum(c for _, c in items)
    if not items or total <= 0:
        return None
    target, seen = q / 100 * total, 0.0
    for value, count in items:
        seen += count
        if seen >= target - 1e-9:
            return value
    return items[-1][0]


def _itl(res: Result) -> dict[str, Any]:
    """Decode inter-token latency over every decode step of every stream (each step's length, as many times as it
    served streams), over all decode workers, and the worst decode worker's p99."""
    merged: dict[float, float] = {}
    worst = None
    for steps in res.itl.values():
        for value, count in steps.items():
            merged[value] = merged.get(value, 0.0) + count
        p99 = weighted_percentile(steps, 99)
        if p99 is not None and (worst is None or p99 > worst):
            worst = p99
    total = sum(c for c in merged.values() if c > 0)
    mean = sum(v * c for v, c in merged.items() if c > 0) / total if total else None
    worst_gaps = list(res.stream_worst_ms)
    return {"itl_p50_ms": weighted_percentile(merged, 50), "itl_p99_ms": weighted_percentile(merged, 99),
            "itl_p999_ms": weighted_percentile(merged, 99.9), "itl_mean_ms": round(mean, 2) if mean else None,
            "itl_p99_worst_decode_ms": worst, "decode_steps": round(total),
            "stream_worst_gap_p50_ms": _pct(worst_gaps, 50), "stream_worst_gap_p99_ms": _pct(worst_gaps, 99)}


def summarize(res: Result, slo_ms: float) -> dict[str, Any]:
    cols = res.turns
    n = len(cols)
    ttft = list(cols.ttft_ms)
    duration = max(res.ended - res.started, 1e-9)
    within = sum(1 for t in ttft if t <= slo_ms)
    prompt = sum(cols.prompt)
    pulls = sum(1 for p in cols.pulled if p > 0)
    buckets = {}
    for low, high, name in BUCKETS:
        rows = [t for t, h in zip(ttft, cols.history, strict=True) if (h == 0 if high == 0 else low <= h < high)]
        buckets[name] = {"turns": len(rows), "p50_ms": _pct(rows, 50), "p99_ms": _pct(rows, 99)}
    return {
        "strategy": res.strategy, "turns": n, "sessions": res.sessions, "peak_live_sessions": res.peak_live_sessions,
        "simulated_s": round(duration, 1),
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "goodput_per_s": round(within / duration, 2), "within_slo": round(within / n, 4) if n else None,
        "slo_ms": slo_ms,
        "prefill_busy": round(res.prefill_busy_s / (duration * max(1, res.prefill_workers)), 4),
        "pull_share": round(pulls / n, 4) if n else None,
        "prefill_cache_hit": round(sum(cols.cached) / prompt, 4) if prompt else None,
        "pulled_share": round(sum(cols.pulled) / prompt, 4) if prompt else None,
        "computed_share": round(sum(cols.computed) / prompt, 4) if prompt else None,
        "d_kv_held_mean": round(res.held_fraction_sum / res.ticks, 4) if res.ticks else None,
        "d_kv_held_peak": round(res.held_fraction_max, 4),
        "d_kv_used_mean": round(res.used_fraction_sum / res.ticks, 4) if res.ticks else None,
        "d_stalls": res.d_stalls,
        "d_wait_p99_ms": _pct(list(cols.d_wait_ms), 99),
        "p_wait_p50_ms": _pct(list(cols.p_wait_ms), 50),
        "network_gb_p_to_d": round(res.bytes_p_to_d / 1e9, 2), "network_gb_d_to_p": round(res.bytes_d_to_p / 1e9, 2),
        "evictions": dict(res.evictions), "expired_handles": res.expired,
        "local_share": round(sum(cols.local) / n, 4) if n else None,
        "decode_cache_hit": (round(sum(c for c, loc in zip(cols.d_cached, cols.local, strict=True) if loc) / prompt, 4)
                             if prompt else None),
        "cpu_restored_share": round(sum(cols.restored) / prompt, 4) if prompt else None,
        "peer_pulled_share": round(sum(cols.peer) / prompt, 4) if prompt else None,
        "kv_mb_d_to_p_per_turn": round(res.bytes_d_to_p / n / 1e6, 1) if n else None,
        "kv_mb_p_to_d_per_turn": round(res.bytes_p_to_d / n / 1e6, 1) if n else None,
        "kv_mb_restored_per_turn": round(res.bytes_restored / n / 1e6, 1) if n else None,
        "kv_mb_p_to_p_per_turn": round(res.bytes_p_to_p / n / 1e6, 1) if n else None,
        "network_gb_p_to_p": round(res.bytes_p_to_p / 1e9, 2), "restored_gb": round(res.bytes_restored / 1e9, 2),
        "decode_busy_prefilling": round(res.decode_prefill_s / (duration * max(1, res.decode_workers)), 4),
        **_itl(res),
        "decisions": dict(sorted(cols.codes.items(), key=lambda kv: -kv[1])),
        "by_history": buckets,
    }


def _fmt(value: Any, scale: float = 1.0, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and scale != 1.0:
        return f"{value * scale:.1f}{unit}"
    if isinstance(value, float):
        return f"{value:,.1f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    return f"{value:,}{unit}"


def table(rows: list[dict[str, Any]]) -> str:
    """One column per strategy: the headline figures, then TTFT p50 and p99 by history bucket."""
    if not rows:
        return "(no results)"
    slo = rows[0]["slo_ms"]
    lines = [("", [r["strategy"] for r in rows])]
    spec = [
        ("turns", "turns", 1.0, ""), ("TTFT p50 (ms)", "ttft_p50_ms", 1.0, ""),
        ("TTFT p99 (ms)", "ttft_p99_ms", 1.0, ""), (f"goodput (turns/s, TTFT <= {slo:g} ms)", "goodput_per_s", 1.0, ""),
        ("within SLO", "within_slo", 100.0, "%"), ("prefill workers busy", "prefill_busy", 100.0, "%"), ("turns that pulled", "pull_share", 100.0, "%"),
        ("prompt tokens: P cache hit", "prefill_cache_hit", 100.0, "%"),
        ("prompt tokens: pulled", "pulled_share", 100.0, "%"), ("prompt tokens: computed", "computed_share", 100.0, "%"),
        ("D KV held, mean", "d_kv_held_mean", 100.0, "%"), ("D KV held, peak", "d_kv_held_peak", 100.0, "%"),
        ("D KV used, mean", "d_kv_used_mean", 100.0, "%"), ("turns that waited for D's KV", "d_stalls", 1.0, ""),
        ("D wait p99 (ms)", "d_wait_p99_ms", 1.0, ""), ("P queue wait p50 (ms)", "p_wait_p50_ms", 1.0, ""),
        ("network P->D (GB)", "network_gb_p_to_d", 1.0, ""), ("network D->P (GB)", "network_gb_d_to_p", 1.0, ""),
        ("turns prefilled on D", "local_share", 100.0, "%"),
        ("prompt tokens: D prefix cache (prefilled on D)", "decode_cache_hit", 100.0, "%"),
        ("prompt tokens: restored from P's CPU tier", "cpu_restored_share", 100.0, "%"),
        ("prompt tokens: pulled from a peer's CPU tier", "peer_pulled_share", 100.0, "%"),
        ("KV D->P per turn (MB)", "kv_mb_d_to_p_per_turn", 1.0, ""),
        ("KV P->D per turn (MB)", "kv_mb_p_to_d_per_turn", 1.0, ""),
        ("KV CPU tier->GPU per turn (MB)", "kv_mb_restored_per_turn", 1.0, ""),
        ("KV P->P (peer CPU tier) per turn (MB)", "kv_mb_p_to_p_per_turn", 1.0, ""),
        ("decode workers busy prefilling", "decode_busy_prefilling", 100.0, "%"),
        ("decode ITL p50 (ms)", "itl_p50_ms", 1.0, ""), ("decode ITL p99 (ms)", "itl_p99_ms", 1.0, ""),
        ("decode ITL p99.9 (ms)", "itl_p999_ms", 1.0, ""), ("decode ITL mean (ms)", "itl_mean_ms", 1.0, ""),
        ("decode ITL p99, worst D (ms)", "itl_p99_worst_decode_ms", 1.0, ""),
        ("longest gap per answer, p50 (ms)", "stream_worst_gap_p50_ms", 1.0, ""),
        ("longest gap per answer, p99 (ms)", "stream_worst_gap_p99_ms", 1.0, ""),
    ]
    for label, key, scale, unit in spec:
        lines.append((label, [_fmt(r.get(key), scale, unit) for r in rows]))
    for q in ("p50", "p99"):
        for _, _, name in BUCKETS:
            lines.append((f"TTFT {q}, history {name} (ms)", [_fmt(r["by_history"][name][f"{q}_ms"]) for r in rows]))
    width = max(len(label) for label, _ in lines)
    col = max(12, *(len(v) for _, vals in lines for v in vals))
    return "\n".join(f"{label:<{width}}  " + "  ".join(f"{v:>{col}}" for v in vals) for label, vals in lines)
