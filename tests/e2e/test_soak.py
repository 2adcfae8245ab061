"""A short soak on the shared stack: concurrent multi-turn sessions through the gateway, every turn must succeed.

The long soak is a benchmark (`kvshuttle soak`, numbers in docs/performance.md); this checks the command's machinery and
the invariant it reports (zero failed turns) at a small size.
"""

from __future__ import annotations

import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.bench.soak import Soak, SoakConfig, format_report

pytestmark = pytest.mark.e2e


async def test_a_short_soak_has_no_failed_turns(stack, tmp_path):
    cfg = from_namespace(SoakConfig, environ={
        "KVSHUTTLE_MODEL_DIR": str(stack.model_dir), "KVSHUTTLE_SOAK_GATEWAY_URL": stack.base_url,
        "KVSHUTTLE_SOAK_SESSIONS": "4", "KVSHUTTLE_SOAK_DURATION_S": "20", "KVSHUTTLE_SOAK_WARMUP_S": "0",
        "KVSHUTTLE_SOAK_SAMPLE_INTERVAL_S": "2", "KVSHUTTLE_SOAK_MAX_HISTORY_TOKENS": "1500",
        "KVSHUTTLE_SOAK_OUT_DIR": str(tmp_path)})
    services = {c.name: c.pid for c in stack.children if c.name in ("registry", "scheduler", "gateway")}
    soak = Soak(cfg, stack.base_url, services)
    report = await soak.run()
    print("\n" + format_report(report))
    assert report["turns"] > 0 and report["failed"] == 0, report["failed_examples"]
    assert report["decisions"].get("pull", 0) > 0  # later turns of the conversations pulled their history
    assert {r.stream for r in soak.results} == {True, False}
    assert set(report["memory"]) == set(services)
    assert all(m["end_mib"] > 0 for m in report["memory"].values())
