"""tests/unit/ is the quick loop: no unit test starts a process. Any attempt (subprocess, asyncio's subprocesses,
multiprocessing, os.fork/system/posix_spawn), from the test or the code it runs, fails the test, naming tests/slow/,
where such tests go. test_test_layout.py checks the same statically (imports of subprocess, sys.executable, ...)."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess

import pytest

MESSAGE = "a unit test started a process ({}): tests that start processes belong in tests/slow/ (tests/README.md)"


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(MESSAGE.format(what))

    return refused


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    fork_exec = _refuse("fork_exec: subprocess, asyncio's subprocesses, multiprocessing")
    monkeypatch.setattr(_posixsubprocess, "fork_exec", fork_exec)
    monkeypatch.setattr(subprocess, "_fork_exec", fork_exec)  # subprocess imported it by name
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
