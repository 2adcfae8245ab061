"""`kvshuttle smoke-test` (the Helm chart's `helm test`) against the real stack: a passing run pulls, and a failing
one says why with exit status 1."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

pytestmark = pytest.mark.e2e


async def smoke_test(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvshuttle.services.commands", "smoke-test", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode()


async def test_smoke_test_passes_and_pulls_on_a_working_stack(stack):
    rc, out = await smoke_test("--url", stack.base_url, "--turns", "3", "--require-pull")
    print(out)
    assert rc == 0, out
    assert re.findall(r"^turn \d: (\w+)", out, re.M) == ["recompute", "pull", "pull"]
    assert "smoke test passed: 3 turns, 2 of 2 later turns pulled their history" in out


async def test_smoke_test_fails_with_the_gateways_reason(stack):
    rc, out = await smoke_test("--url", stack.base_url, "--model", "no-such-model")
    assert rc == 1, out
    assert out.startswith("smoke test FAILED: turn 1: 404") and "no-such-model" in out
