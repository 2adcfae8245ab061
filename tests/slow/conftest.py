"""Every test in tests/slow/ is marked ``slow``: they start subprocesses (vLLM's and openai_harmony's reference parsers,
xgrammar, child interpreters, ``buf``, a pytest run) or build and train the test models. ``make test`` runs them;
``make test-fast`` and ``pytest -m "not slow"`` leave them out."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items: mark only this folder's.
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.slow)
