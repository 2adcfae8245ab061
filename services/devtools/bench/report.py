"""Aggregate measured turns into the benchmark report: TTFT by history length and by turn, pull vs recompute vs ideal.

The ratios compare p50 TTFTs of the same turns across modes:

* ``recompute_over_pull``: how much faster pulling the history is than recomputing it (higher is better);
* ``recompute_over_ideal``: the same for the ideal (one worker with prefix caching, nothing moved);
* ``fraction_of_ideal_speedup``: ``recompute_over_pull / recompute_over_ideal`` = ``ideal p50 / pull p50``
  (1.0: pulling is as fast as never having moved the KV);
* ``fraction_of_saving``: ``(recompute - pull) / (recompute - ideal)``: the share of the time recompute loses to
  the ideal that pulling wins back;
* ``pull_over_smg``: kvshuttle ÷ SMG, the pull mode's p50 over the ``smg`` mode's (SMG in front of the same workers,
  ``services/devtools/bench/smg.py``); below 1.0 kvshuttle is faster;
* ``recompute_over_smg``: the same for the recompute mode (both recompute what P lacks: the gateways' own costs);
* ``local_over_pull``, ``local_over_recompute``: the local mode (later turns continued on D) over the pull and the
  recompute; below 1.0 continuing on D is faster. The local mode's own section (``continuing_on_d``, from
  ``local_report.py``) compares the three on exactly the turns it continued on D, also by new tokens per turn.

A ratio is None when a mode is missing or the division is undefined. ``itl`` (the inter-token delays of D's streams
while turns prefill) and ``network`` (prompt tokens over the network per lane) come from ``local_report.py`` too.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from kvshuttle.services.devtools.bench.local_report import (
    DEFAULT_NEW_BUCKETS,
    continuing_on_d,
    format_itl,
    format_local,
    format_network,
    itl_by_prefill,
    network_by_lane,
)
from kvshuttle.services.devtools.bench.samples import IDEAL, LOCAL, MODES, PULL, RECOMPUTE, SMG, TurnSample, TurnStream
from kvshuttle.services.devtools.bench.stats import percentile
from kvshuttle.services.devtools.bench.stats import text_count as _num
from kvshuttle.services.devtools.bench.stats import text_ms as _ms
from kvshuttle.services.devtools.bench.stats import text_pct as _pct
from kvshuttle.services.devtools.bench.stats import text_ratio as _x

DEFAULT_HEADLINE_MIN_HISTORY = 3000
FIRST_TURN = "first turn"
_MAX_LISTED_DISAGREEMENTS = 20

Key = tuple[str, int]  # (conversation, turn)


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _modes_present(samples: Iterable[TurnSample]) -> list[str]:
    present = {s.mode for s in samples}
    return [m for m in MODES if m in present] + sorted(present - set(MODES))


def _canonical_history(samples: list[TurnSample], modes: list[str]) -> dict[Key, int]:
    """The history length each (conversation, turn) is bucketed by: that of the first mode (in ``modes`` order)
    that measured it, so a turn lands in the same bucket in every mode even when answers (and so histories)
    differ slightly between modes."""
    rank = {m: i for i, m in enumerate(modes)}
    best: dict[Key, tuple[int, int]] = {}
    for s in samples:
        key = (s.conversation, s.turn)
        r = rank[s.mode]
        if key not in best or r < best[key][0]:
            best[key] = (r, s.history_tokens)
    return {key: hist for key, (_, hist) in best.items()}


def mode_stats(samples: list[TurnSample]) -> dict:
    """Statistics of one mode's samples in one group."""
    ttft = [s.ttft_ms for s in samples]
    latency = [s.latency_ms for s in samples]
    return {
        "count": len(samples),
        "ttft_p50_ms": _p(ttft, 50),
        "ttft_p90_ms": _p(ttft, 90),
        "ttft_p99_ms": _p(ttft, 99),
        "ttft_mean_ms": _mean(ttft),
        "latency_p50_ms": _p(latency, 50),
        "prompt_tokens_mean": _mean([s.prompt_tokens for s in samples]),
        "history_tokens_mean": _mean([s.history_tokens for s in samples]),
        "pulled_tokens_mean": _mean([s.pulled_tokens for s in samples]),
        "computed_tokens_mean": _mean([s.computed_tokens for s in samples]),
        "output_tokens_mean": _mean([s.output_tokens for s in samples]),
        "decisions": dict(sorted(Counter(s.decision for s in samples).items())),
    }


def ratios(p50: dict[str, float | None]) -> dict:
    """The comparison ratios from the p50 TTFT of each mode (missing modes: None)."""
    pull, rec, ideal, smg, local = p50.get(PULL), p50.get(RECOMPUTE), p50.get(IDEAL), p50.get(SMG), p50.get(LOCAL)
    saving = None
    if pull is not None and rec is not None and ideal is not None:
        saving = _div(rec - pull, rec - ideal)
    return {
        "recompute_over_pull": _div(rec, pull),
        "recompute_over_ideal": _div(rec, ideal),
        "fraction_of_ideal_speedup": _div(ideal, pull),
        "fraction_of_saving": saving,
        "pull_over_smg": _div(pull, smg),
        "recompute_over_smg": _div(rec, smg),
        "local_over_pull": _div(local, pull),
        "local_over_recompute": _div(local, rec),
    }


def _group(samples: list[TurnSample], history: dict[Key, int], modes: list[str], **fields) -> dict:
    keys = {(s.conversation, s.turn) for s in samples}
    hist = [history[k] for k in keys]
    by_mode: dict[str, list[TurnSample]] = defaultdict(list)
    for s in samples:
        by_mode[s.mode].append(s)
    stats = {m: mode_stats(by_mode[m]) for m in modes if by_mode.get(m)}
    group = dict(fields)
    group.update({
        "turns": len(keys),
        "history_tokens_mean": _mean(hist),
        "history_tokens_min": min(hist) if hist else None,
        "history_tokens_max": max(hist) if hist else None,
        "modes": stats,
        "ratios": ratios({m: st["ttft_p50_ms"] for m, st in stats.items()}),
    })
    return group


def bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def _check_edges(buckets: list[int]) -> list[int]:
    edges = [int(b) for b in buckets]
    if not edges:
        raise ValueError("buckets must list at least one edge")
    if any(b < 0 for b in edges) or any(b >= c for b, c in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"bucket edges must be non-negative and strictly increasing, got {buckets}")
    return edges if edges[0] == 0 else [0, *edges]


def answers_agree(samples: list[TurnSample], modes: list[str] | None = None) -> dict:
    """Whether each (conversation, turn) measured in two or more modes produced the same output digest in all.

    Turns whose digest is empty in some mode are not compared. ``pairs`` breaks it down per pair of modes.
    """
    modes = modes or _modes_present(samples)
    digests: dict[Key, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for s in samples:
        digests[(s.conversation, s.turn)][s.mode].add(s.output_digest)
    compared = agree = 0
    disagreements = []
    pairs = {f"{a}={b}": {"compared": 0, "agree": 0} for i, a in enumerate(modes) for b in modes[i + 1:]}
    for key in sorted(digests):
        per_mode = digests[key]
        if len(per_mode) < 2 or any("" in d for d in per_mode.values()):
            continue
        compared += 1
        if len(set().union(*per_mode.values())) == 1:
            agree += 1
        elif len(disagreements) < _MAX_LISTED_DISAGREEMENTS:
            disagreements.append({"conversation": key[0], "turn": key[1]})
        for i, a in enumerate(modes):
            for b in modes[i + 1:]:
                if a in per_mode and b in per_mode:
                    pair = pairs[f"{a}={b}"]
                    pair["compared"] += 1
                    pair["agree"] += int(len(per_mode[a] | per_mode[b]) == 1)
    for pair in pairs.values():
        pair["fraction"] = _div(pair["agree"], pair["compared"])
    return {"compared": compared, "agree": agree, "fraction": _div(agree, compared), "pairs": pairs,
            "disagreements": disagreements}


def build_report(samples: list[TurnSample], *, buckets: list[int], meta: dict,
                 headline_min_history: int | None = None, new_buckets: list[int] | None = None,
                 streams: list[TurnStream] | None = None) -> dict:
    """The report: headline (history >= threshold), overall, by history bucket, by turn index, answer agreement,
    prompt tokens over the network per lane; with the local mode, its comparison with pull and recompute
    (``new_buckets``: edges of new tokens per turn); with ``streams``, the inter-token delays of D's streams by what
    was prefilling meanwhile.

    ``headline_min_history`` defaults to ``meta["headline_min_history"]``, else 3000 tokens. Turn 1 is its own
    bucket ("first turn"); the others go by history tokens into ``[edge_i, edge_i+1)``, the last one open-ended.
    """
    edges = _check_edges(buckets)
    threshold = headline_min_history
    if threshold is None:
        threshold = int(meta.get("headline_min_history", DEFAULT_HEADLINE_MIN_HISTORY))
    modes = _modes_present(samples)
    history = _canonical_history(samples, modes)

    first = [s for s in samples if s.turn == 1]
    later = [s for s in samples if s.turn != 1]
    by_history = []
    if first:
        by_history.append(_group(first, history, modes, label=FIRST_TURN, lo=0, hi=0))
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        members = [s for s in later if history[(s.conversation, s.turn)] >= lo
                   and (hi is None or history[(s.conversation, s.turn)] < hi)]
        if members:
            by_history.append(_group(members, history, modes, label=bucket_label(lo, hi), lo=lo, hi=hi))

    by_turn = []
    for turn in sorted({s.turn for s in samples}):
        by_turn.append(_group([s for s in samples if s.turn == turn], history, modes, label=f"turn {turn}",
                              turn=turn))

    headline = _group([s for s in later if history[(s.conversation, s.turn)] >= threshold], history, modes,
                      label=f"history >= {threshold} tokens", min_history_tokens=threshold)
    pulls = [s for s in later if s.mode == PULL]
    pulled = sum(1 for s in pulls if s.decision == PULL)
    extra: dict = {"network": network_by_lane(samples, modes)}
    if LOCAL in modes:
        extra["continuing_on_d"] = continuing_on_d(samples, modes, edges, new_buckets or DEFAULT_NEW_BUCKETS)
    if streams is not None:
        extra["itl"] = itl_by_prefill(streams)
    return {
        **extra,
        "meta": dict(meta),
        "modes": modes,
        "bucket_edges": edges,
        "headline": headline,
        "overall": _group(samples, history, modes, label="all turns"),
        "later_turns": _group(later, history, modes, label="turns 2+"),
        "by_history": by_history,
        "by_turn": by_turn,
        "answers_agree": answers_agree(samples, modes),
        "pull_decisions": {"turns": len(pulls), "pulled": pulled, "fraction": _div(pulled, len(pulls))},
    }


# ---------------------------------------------------------------------------------------------------------------
# Text output



def _shown_modes(report: dict) -> list[str]:
    return list(MODES) + [m for m in report.get("modes", []) if m not in MODES]


def _mode_field(mode: str, field: str, fmt: Callable[[float | None], str]) -> Callable[[dict], str]:
    return lambda g: fmt(g["modes"].get(mode, {}).get(field))


def _table(title: str, groups: list[dict], columns: list[tuple[str, int, Callable[[dict], str]]]) -> str:
    header = "  ".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w, _) in enumerate(columns))
    lines = [title, header, "-" * len(header)]
    for g in groups:
        lines.append("  ".join(f"{fn(g):<{w}}" if i == 0 else f"{fn(g):>{w}}"
                               for i, (_, w, fn) in enumerate(columns)))
    if not groups:
        lines.append("(no samples)")
    return "\n".join(lines)


def _ttft_columns(report: dict, first: str) -> list[tuple[str, int, Callable[[dict], str]]]:
    cols: list[tuple[str, int, Callable[[dict], str]]] = [
        (first, 12, lambda g: g["label"]),
        ("turns", 5, lambda g: str(g["turns"])),
        ("history", 7, lambda g: _num(g["history_tokens_mean"])),
    ]
    for m in _shown_modes(report):
        cols.append((f"{m[:9]} p50", max(9, len(m[:9]) + 4), _mode_field(m, "ttft_p50_ms", _ms)))
        cols.append(("p90", 8, _mode_field(m, "ttft_p90_ms", _ms)))
    cols += [
        ("rec/pull", 8, lambda g: _x(g["ratios"]["recompute_over_pull"])),
        ("rec/ideal", 9, lambda g: _x(g["ratios"]["recompute_over_ideal"])),
        ("of ideal", 8, lambda g: _pct(g["ratios"]["fraction_of_ideal_speedup"])),
        ("of saving", 9, lambda g: _pct(g["ratios"]["fraction_of_saving"])),
    ]
    if SMG in report.get("modes", []):
        cols.append(("pull/smg", 8, lambda g: _x(g["ratios"].get("pull_over_smg"))))
    return cols


def _detail_columns(report: dict) -> list[tuple[str, int, Callable[[dict], str]]]:
    cols: list[tuple[str, int, Callable[[dict], str]]] = [("history", 12, lambda g: g["label"])]
    for m in _shown_modes(report):
        cols.append((f"{m[:9]} lat p50", max(13, len(m[:9]) + 8), _mode_field(m, "latency_p50_ms", _ms)))
    cols.append(("pull pulled", 11, _mode_field(PULL, "pulled_tokens_mean", _num)))
    for m in _shown_modes(report):
        cols.append((f"{m[:9]} computed", max(13, len(m[:9]) + 9), _mode_field(m, "computed_tokens_mean", _num)))
    return cols


def format_table(report: dict) -> str:
    """Fixed-width text: headline lines, TTFT by history bucket and by turn, latency and token means by bucket."""
    meta = report.get("meta", {})
    h = report["headline"]
    r = h["ratios"]
    lines = []
    title = meta.get("title")
    if title:
        lines.append(str(title))
    p50 = {m: h["modes"].get(m, {}).get("ttft_p50_ms") for m in _shown_modes(report)}
    lines.append(f"headline ({h['label']}, {h['turns']} turns): TTFT p50 "
                 + ", ".join(f"{m} {_ms(v)}" + (" ms" if v is not None else "") for m, v in p50.items()))
    lines.append(f"  recompute/pull {_x(r['recompute_over_pull'])}   recompute/ideal {_x(r['recompute_over_ideal'])}"
                 f"   pull reaches {_pct(r['fraction_of_ideal_speedup'])} of the ideal speed-up,"
                 f" wins back {_pct(r['fraction_of_saving'])} of recompute's extra time")
    o = report["later_turns"]["ratios"]
    lines.append(f"turns 2+ ({report['later_turns']['turns']} turns): recompute/pull {_x(o['recompute_over_pull'])}"
                 f"   recompute/ideal {_x(o['recompute_over_ideal'])}"
                 f"   of ideal speed-up {_pct(o['fraction_of_ideal_speedup'])}"
                 f"   of saving {_pct(o['fraction_of_saving'])}")
    if SMG in report.get("modes", []):
        lines.append(f"kvshuttle / SMG (pull p50 / smg p50, below 1: kvshuttle faster): headline "
                     f"{_x(r.get('pull_over_smg'))}, turns 2+ {_x(o.get('pull_over_smg'))}"
                     f"   (recompute / smg: {_x(r.get('recompute_over_smg'))}, {_x(o.get('recompute_over_smg'))})")
        smg_meta = meta.get("smg") or {}
        if smg_meta.get("forced_calls"):
            lines.append(f"smg: {smg_meta.get('rewritten_calls', 0)}/{smg_meta['forced_calls']} forced calls came "
                         f"back with arguments other than {{}} (SMG drops logit_bias) and were echoed as {{}}")
    d = report["pull_decisions"]
    if d["turns"]:
        lines.append(f"pull mode, turns 2+: {d['pulled']}/{d['turns']} pulled their history ({_pct(d['fraction'])})")
    a = report["answers_agree"]
    if meta.get("lane_prompts") == "tagged":
        lines.append("answers agree across modes: not compared (P's cache warm: each mode's system prompt is tagged "
                     "with its name, so no mode reuses another's prefix on P)")
    elif a["compared"]:
        pairs = ", ".join(f"{name} {p['agree']}/{p['compared']}" for name, p in a["pairs"].items() if p["compared"])
        lines.append(f"answers agree across modes: {a['agree']}/{a['compared']} ({_pct(a['fraction'])})"
                     + (f"  [{pairs}]" if pairs else ""))
    else:
        lines.append("answers agree across modes: - (no turn measured in two modes)")
    lines.append("")
    lines.append(_table("TTFT (ms) by history length (tokens)", report["by_history"],
                        _ttft_columns(report, "history")))
    lines.append("")
    lines.append(_table("TTFT (ms) by turn", report["by_turn"], _ttft_columns(report, "turn")))
    lines.append("")
    lines.append(_table("latency p50 (ms) and mean prompt tokens pulled / computed, by history length",
                        report["by_history"], _detail_columns(report)))
    if "continuing_on_d" in report:
        lines.append("")
        lines += format_local(report["continuing_on_d"], meta)
    if report.get("itl") and report["itl"]["gaps"]:
        lines.append("")
        lines += format_itl(report["itl"], meta.get("concurrency"))
    if report.get("network"):
        lines.append("")
        lines += format_network(report["network"], bool(meta.get("decode_read_measured")), meta.get("concurrency"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Files


def _plot(report: dict, samples: list[TurnSample], path: Path, log_y: bool) -> None:
    # Matplotlib only here (and no pyplot: no global backend state), so the rest of the bench works without it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    meta = report.get("meta", {})
    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_ratio = fig.subplots(1, 2, width_ratios=(3, 2))
    colors = {PULL: "tab:blue", RECOMPUTE: "tab:red", IDEAL: "tab:green", "direct": "tab:purple", SMG: "tab:orange",
              LOCAL: "tab:brown"}
    for mode in report["modes"]:
        color = colors.get(mode)
        pts = [(s.history_tokens, s.ttft_ms) for s in samples if s.mode == mode]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, alpha=0.25, color=color)
        line = [(g["history_tokens_mean"], g["modes"][mode]["ttft_p50_ms"]) for g in report["by_history"]
                if mode in g["modes"]]
        if line:
            ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", color=color, label=f"{mode} (p50)")
    ax.set_xlabel("history length (tokens already in the conversation)")
    ax.set_ylabel("time to first token (ms)")
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if report["modes"]:
        ax.legend()
    ax.set_title("TTFT p50 per history bucket (dots: turns)")

    later = [g for g in report["by_history"] if g["label"] != FIRST_TURN]
    for field, label, color in (("recompute_over_pull", "recompute / pull", "tab:blue"),
                                ("recompute_over_ideal", "recompute / ideal", "tab:green"),
                                ("recompute_over_smg", "recompute / smg", "tab:orange")):
        pts = [(g["history_tokens_mean"], g["ratios"][field]) for g in later if g["ratios"][field] is not None]
        if pts:
            ax_ratio.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=label)
    ax_ratio.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax_ratio.set_xlabel("history length (tokens)")
    ax_ratio.set_ylabel("TTFT p50 ratio (higher: faster than recompute)")
    ax_ratio.grid(True, alpha=0.3)
    if ax_ratio.get_legend_handles_labels()[0]:
        ax_ratio.legend()
    ax_ratio.set_title("speed-up over recompute")

    title = meta.get("title") or "kvshuttle multi-turn benchmark"
    details = ", ".join(f"{k} {meta[k]}" for k in ("model", "device", "dtype") if meta.get(k))
    fig.suptitle(f"{title}: TTFT vs history length" + (f" ({details})" if details else ""))
    fig.savefig(path, dpi=120)


def write_outputs(report: dict, samples: list[TurnSample], out_dir: Path, *,
                  log_y: bool | None = None, streams: list[TurnStream] | None = None) -> dict[str, Path]:
    """Write results.json (the report, meta included), samples.jsonl, report.txt (format_table), ttft.png and, with
    ``streams``, streams.jsonl (when each turn's tokens arrived: the inter-token report's input).

    ``log_y`` (default ``meta["plot_log_y"]``, else False) puts the TTFT axis on a log scale. Returns the paths by
    name: ``results``, ``samples``, ``table``, ``plot`` (and ``streams``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"results": out_dir / "results.json", "samples": out_dir / "samples.jsonl",
             "table": out_dir / "report.txt", "plot": out_dir / "ttft.png"}
    paths["results"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    with paths["samples"].open("w") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict()) + "\n")
    if streams is not None:
        paths["streams"] = out_dir / "streams.jsonl"
        with paths["streams"].open("w") as f:
            for stream in streams:
                f.write(json.dumps(stream.to_dict()) + "\n")
    paths["table"].write_text(format_table(report))
    if log_y is None:
        log_y = bool(report.get("meta", {}).get("plot_log_y", False))
    _plot(report, samples, paths["plot"], log_y)
    return paths
