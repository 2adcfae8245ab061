"""Under ``CI=true`` the end-to-end tests fail, loudly, when vLLM is missing; elsewhere they are skipped.

The e2e suite runs in a child pytest where ``vllm`` looks uninstalled (``sys.modules['vllm'] = None`` from a
``sitecustomize``: ``importlib.util.find_spec`` then answers None, as for a missing package). Nothing starts:
the missing prerequisite is found before any worker is launched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def run_e2e_without_vllm(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(hide), "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/test_turns.py",
                           "-k", "not fuzz"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_ci_fails_without_vllm(tmp_path):
    done = run_e2e_without_vllm(tmp_path, "true")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "vllm is not installed: CI runs every test" in done.stdout
    assert " passed" not in done.stdout.splitlines()[-1], done.stdout.splitlines()[-1]


def test_elsewhere_the_e2e_tests_are_skipped_without_vllm(tmp_path):
    done = run_e2e_without_vllm(tmp_path, "")
    last = done.stdout.splitlines()[-1]
    assert done.returncode == 0 and "skipped" in last and "passed" not in last and "failed" not in last, last
