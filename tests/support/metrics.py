"""Scraping a /metrics endpoint in tests: every sample by (name, labels), and deltas between two scrapes."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(url)
    resp.raise_for_status()
    assert resp.headers["content-type"].startswith("text/plain"), resp.headers
    return parse(resp.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}
