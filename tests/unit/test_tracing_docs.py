"""Every kvshuttle.* span attribute the services set is documented in the README's Tracing section."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACED = ["services/gateway/turns.py", "services/scheduler/servicer.py", "services/registry/servicer.py"]
NOT_ATTRIBUTES = {"kvshuttle.turn", "kvshuttle.gateway", "kvshuttle.scheduler"}  # span and tracer names


def test_every_kvshuttle_attribute_is_documented():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Tracing"):]
    section = section[:section.index("\n## ", 1)]
    used = {name for path in TRACED for name in re.findall(r'"(kvshuttle\.[a-z_]+)"', (ROOT / path).read_text())}
    assert len(used - NOT_ATTRIBUTES) > 20
    missing = sorted(name for name in used - NOT_ATTRIBUTES if f"`{name}`" not in section)
    assert not missing, f"span attributes missing from the README's Tracing section: {missing}"
