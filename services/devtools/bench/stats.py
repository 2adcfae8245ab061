"""Percentiles and summaries of measurements (no numpy), and writing a report."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating linearly between closest ranks (numpy's default).

    Raises ValueError on empty input or ``q`` outside [0, 100].
    """
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100 or math.isnan(q):
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    if frac == 0:
        return data[lo]
    return data[lo] + (data[hi] - data[lo]) * frac


def summary(values: Iterable[float]) -> dict:
    """``count, mean, p50, p90, p99, min, max`` of ``values``; all but count are None when there are none."""
    data = sorted(float(v) for v in values)
    if not data:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    return {"count": len(data), "mean": sum(data) / len(data), "p50": percentile(data, 50),
            "p90": percentile(data, 90), "p99": percentile(data, 99), "min": data[0], "max": data[-1]}


def write_json(path: str | Path, data: dict) -> Path:
    """Write a command's JSON report to ``path`` (its folder made first); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return out


# A figure as the report's tables print it ("-" when there is none).

def text_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def text_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def text_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def text_count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
