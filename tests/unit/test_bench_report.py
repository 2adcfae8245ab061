"""Benchmark statistics and the report: percentiles, buckets, ratios, answer agreement, output files."""

from __future__ import annotations

import contextlib
import json

import pytest
from kvshuttle.services.devtools.bench.report import build_report, format_table, write_outputs
from kvshuttle.services.devtools.bench.samples import IDEAL, PULL, RECOMPUTE, TurnSample
from kvshuttle.services.devtools.bench.stats import percentile, summary

# matplotlib lists the machine's fonts (fc-list, a process) the first time it runs on a machine, to build its font
# cache: done here, at collection, before the unit tests' no-process rule applies (a fresh CI machine has no cache).
with contextlib.suppress(ImportError):  # without matplotlib (no bench extra), write_outputs writes no plot
    import matplotlib.font_manager  # noqa: F401

# ---------------------------------------------------------------------------------------------------------------
# stats


def test_percentile_interpolates_linearly():
    values = [4, 1, 3, 2]  # unsorted on purpose
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 4
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 25) == 1.75  # rank 0.75
    assert percentile([10, 20, 30, 40, 50], 50) == 30
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)  # rank 3.96
    assert percentile([7.5], 90) == 7.5


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 100.5), ([1.0], float("nan"))])
def test_percentile_rejects_bad_input(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_summary():
    assert summary([3, 1, 2, 10]) == {"count": 4, "mean": 4.0, "p50": 2.5, "p90": pytest.approx(7.9),
                                      "p99": pytest.approx(9.79), "min": 1.0, "max": 10.0}
    assert summary([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None,
                           "max": None}


# ---------------------------------------------------------------------------------------------------------------
# build_report on a synthetic run with known numbers
#
# Two conversations, three turns, three modes. History: turn 1 = 0, turn 2 = 1000 (a) / 1200 (b),
# turn 3 = 3500 (a) / 4000 (b). TTFT (ms), (a, b):
#            turn 1     turn 2      turn 3
#   pull     50, 50     100, 120    100, 140
#   recomp.  50, 50     300, 340    800, 1000
#   ideal    40, 40      80, 100     80, 100
TTFT = {
    PULL: {1: (50, 50), 2: (100, 120), 3: (100, 140)},
    RECOMPUTE: {1: (50, 50), 2: (300, 340), 3: (800, 1000)},
    IDEAL: {1: (40, 40), 2: (80, 100), 3: (80, 100)},
}
HISTORY = {1: (0, 0), 2: (1000, 1200), 3: (3500, 4000)}
BUCKETS = [0, 2000, 3000]


def _samples(modes=(PULL, RECOMPUTE, IDEAL)) -> list[TurnSample]:
    out = []
    for mode in modes:
        for turn in (1, 2, 3):
            for i, conv in enumerate(("a", "b")):
                hist = HISTORY[turn][i]
                if mode == RECOMPUTE and (conv, turn) == ("b", 2):
                    hist = 1990  # a slightly different answer earlier: still bucketed with pull's 1200
                new = 300
                pulled = hist if mode == PULL and turn > 1 and (conv, turn) != ("b", 3) else 0
                decision = {PULL: PULL if pulled else RECOMPUTE, RECOMPUTE: RECOMPUTE, IDEAL: IDEAL}[mode]
                digest = "other" if (mode, conv, turn) == (IDEAL, "b", 3) else f"{conv}{turn}"
                out.append(TurnSample(
                    mode=mode, conversation=conv, turn=turn, prompt_tokens=hist + new, history_tokens=hist,
                    new_tokens=new, ttft_ms=float(TTFT[mode][turn][i]), latency_ms=float(TTFT[mode][turn][i] + 1000),
                    output_tokens=32, decision=decision, pulled_tokens=pulled, computed_tokens=hist + new - pulled,
                    output_digest=digest))
    return out


def _by_label(groups):
    return {g["label"]: g for g in groups}


def test_headline_ratios_are_exact():
    report = build_report(_samples(), buckets=BUCKETS, meta={"title": "t"})
    h = report["headline"]
    assert h["label"] == "history >= 3000 tokens"
    assert h["min_history_tokens"] == 3000
    assert h["turns"] == 2
    assert {m: s["ttft_p50_ms"] for m, s in h["modes"].items()} == {PULL: 120.0, RECOMPUTE: 900.0, IDEAL: 90.0}
    assert h["ratios"] == {
        "recompute_over_pull": 7.5,
        "recompute_over_ideal": 10.0,
        "fraction_of_ideal_speedup": 0.75,
        "fraction_of_saving": (900 - 120) / (900 - 90),
        "pull_over_smg": None,  # no smg mode in this run
        "recompute_over_smg": None,
        "local_over_pull": None,  # no local mode either
        "local_over_recompute": None,
    }
    assert h["modes"][PULL]["ttft_p90_ms"] == pytest.approx(136.0)  # 100 + 0.9 * 40
    assert h["modes"][PULL]["latency_p50_ms"] == 1120.0
    assert h["modes"][PULL]["pulled_tokens_mean"] == 1750.0  # (3500 + 0) / 2
    assert h["modes"][PULL]["decisions"] == {PULL: 1, RECOMPUTE: 1}


def test_buckets_and_turns():
    report = build_report(_samples(), buckets=BUCKETS, meta={})
    groups = _by_label(report["by_history"])
    assert list(groups) == ["first turn", "0-2000", "3000+"]  # 2000-3000 is empty: left out
    first = groups["first turn"]
    assert first["turns"] == 2 and first["modes"][PULL]["count"] == 2
    assert first["ratios"]["recompute_over_pull"] == 1.0
    assert first["ratios"]["fraction_of_saving"] == 0.0  # (50 - 50) / (50 - 40)
    mid = groups["0-2000"]
    # recompute's (b, 2) says history 1990, but the turn is bucketed by pull's 1200, in every mode.
    assert mid["modes"][RECOMPUTE]["count"] == 2
    assert mid["history_tokens_mean"] == 1100.0
    assert mid["ratios"]["recompute_over_pull"] == 320 / 110
    assert mid["ratios"]["recompute_over_ideal"] == 320 / 90
    assert mid["ratios"]["fraction_of_ideal_speedup"] == 90 / 110
    assert mid["ratios"]["fraction_of_saving"] == (320 - 110) / (320 - 90)
    assert (groups["3000+"]["lo"], groups["3000+"]["hi"]) == (3000, None)
    assert groups["3000+"]["ratios"] == report["headline"]["ratios"]

    turns = report["by_turn"]
    assert [g["turn"] for g in turns] == [1, 2, 3]
    assert turns[1]["ratios"] == mid["ratios"]
    assert report["later_turns"]["turns"] == 4
    assert report["later_turns"]["modes"][RECOMPUTE]["ttft_p50_ms"] == 570.0  # 300, 340, 800, 1000
    assert report["overall"]["turns"] == 6
    assert report["pull_decisions"] == {"turns": 4, "pulled": 3, "fraction": 0.75}


def test_bucket_edges_without_zero_and_threshold_from_meta():
    report = build_report(_samples(), buckets=[1100, 3600], meta={"headline_min_history": 3600})
    assert [g["label"] for g in report["by_history"]] == ["first turn", "0-1100", "1100-3600", "3600+"]
    assert report["headline"]["turns"] == 1
    assert report["headline"]["ratios"]["recompute_over_pull"] == 1000 / 140
    override = build_report(_samples(), buckets=[0], meta={"headline_min_history": 3600}, headline_min_history=1)
    assert override["headline"]["turns"] == 4


def test_bad_bucket_edges():
    with pytest.raises(ValueError, match="strictly increasing"):
        build_report(_samples(), buckets=[0, 1000, 1000], meta={})
    with pytest.raises(ValueError, match="at least one edge"):
        build_report(_samples(), buckets=[], meta={})


def test_answers_agree():
    agree = build_report(_samples(), buckets=BUCKETS, meta={})["answers_agree"]
    assert (agree["compared"], agree["agree"]) == (6, 5)
    assert agree["fraction"] == 5 / 6
    assert agree["disagreements"] == [{"conversation": "b", "turn": 3}]
    assert agree["pairs"]["pull=recompute"] == {"compared": 6, "agree": 6, "fraction": 1.0}
    assert agree["pairs"]["pull=ideal"] == {"compared": 6, "agree": 5, "fraction": 5 / 6}


def test_empty_digests_are_not_compared():
    samples = _samples((PULL, RECOMPUTE))
    samples[0].output_digest = ""
    agree = build_report(samples, buckets=BUCKETS, meta={})["answers_agree"]
    assert (agree["compared"], agree["agree"]) == (5, 5)


def test_missing_modes_give_none_ratios_and_dashes():
    report = build_report(_samples((PULL, RECOMPUTE)), buckets=BUCKETS, meta={})
    assert report["modes"] == [PULL, RECOMPUTE]
    r = report["headline"]["ratios"]
    assert r == {"recompute_over_pull": 7.5, "recompute_over_ideal": None, "fraction_of_ideal_speedup": None,
                 "fraction_of_saving": None, "pull_over_smg": None, "recompute_over_smg": None,
                 "local_over_pull": None, "local_over_recompute": None}
    assert IDEAL not in report["headline"]["modes"]
    text = format_table(report)
    row = next(line for line in text.splitlines() if line.startswith("3000+"))
    assert row.split() == ["3000+", "2", "3750", "120.0", "136.0", "900.0", "980.0", "-", "-", "7.50x", "-", "-",
                           "-"]

    only_pull = build_report(_samples((PULL,)), buckets=BUCKETS, meta={})
    assert set(only_pull["headline"]["ratios"].values()) == {None}
    assert only_pull["answers_agree"]["compared"] == 0
    assert "no turn measured in two modes" in format_table(only_pull)

    empty = build_report([], buckets=BUCKETS, meta={})
    assert empty["by_history"] == [] and empty["headline"]["turns"] == 0
    assert "(no samples)" in format_table(empty)


def test_zero_ttft_does_not_divide_by_zero():
    samples = _samples()
    for s in samples:
        if s.mode == PULL:
            s.ttft_ms = 0.0
    r = build_report(samples, buckets=BUCKETS, meta={})["headline"]["ratios"]
    assert r["recompute_over_pull"] is None and r["fraction_of_ideal_speedup"] is None
    assert r["fraction_of_saving"] == 900 / 810


def test_format_table():
    text = format_table(build_report(_samples(), buckets=BUCKETS, meta={"title": "kvshuttle bench on tiny"}))
    lines = text.splitlines()
    assert lines[0] == "kvshuttle bench on tiny"
    assert lines[1] == ("headline (history >= 3000 tokens, 2 turns): TTFT p50 pull 120.0 ms, recompute 900.0 ms, "
                        "ideal 90.0 ms")
    assert "recompute/pull 7.50x" in lines[2] and "recompute/ideal 10.00x" in lines[2]
    assert "75.0% of the ideal speed-up" in lines[2] and "96.3% of recompute's extra time" in lines[2]
    assert "pull mode, turns 2+: 3/4 pulled their history (75.0%)" in text
    assert "answers agree across modes: 5/6 (83.3%)" in text
    row = next(line for line in lines if line.startswith("3000+"))
    assert row.split() == ["3000+", "2", "3750", "120.0", "136.0", "900.0", "980.0", "90.0", "98.0", "7.50x",
                           "10.00x", "75.0%", "96.3%"]
    turn_row = next(line for line in lines if line.startswith("turn 2 "))
    assert turn_row.split()[:6] == ["turn", "2", "2", "1100", "110.0", "118.0"]  # label, turns, history, pull
    # Every row of a table is as wide as its header.
    header = next(line for line in lines if line.startswith("history") and "p50" in line)
    start = lines.index(header)
    for line in lines[start + 2:start + 5]:
        assert len(line) == len(header)


# ---------------------------------------------------------------------------------------------------------------
# write_outputs


def test_write_outputs(tmp_path):
    samples = _samples()
    report = build_report(samples, buckets=BUCKETS, meta={"title": "unit", "model": "tiny", "plot_log_y": True})
    paths = write_outputs(report, samples, tmp_path / "out")
    assert set(paths) == {"results", "samples", "table", "plot"}
    assert [p.name for p in paths.values()] == ["results.json", "samples.jsonl", "report.txt", "ttft.png"]
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["plot"].stat().st_size > 10_000
    results = json.loads(paths["results"].read_text())
    assert results["meta"] == {"title": "unit", "model": "tiny", "plot_log_y": True}
    assert results["headline"]["ratios"]["recompute_over_pull"] == 7.5
    assert results == json.loads(json.dumps(report))
    lines = paths["samples"].read_text().splitlines()
    assert [TurnSample.from_dict(json.loads(line)) for line in lines] == samples
    assert paths["table"].read_text() == format_table(report)


def test_write_outputs_with_missing_modes(tmp_path):
    samples = _samples((PULL,))
    paths = write_outputs(build_report(samples, buckets=BUCKETS, meta={}), samples, tmp_path, log_y=False)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = write_outputs(build_report([], buckets=BUCKETS, meta={}), [], tmp_path / "empty")
    assert empty["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert empty["samples"].read_text() == ""
