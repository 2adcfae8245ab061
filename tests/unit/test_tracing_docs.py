"""The span-attribute catalogue (services/common/span_attributes.py) lists exactly the kvshuttle.* attributes the
services set: the documentation's span-attribute reference is generated from it (docs/hooks/reference.py)."""

from __future__ import annotations

import re
from pathlib import Path

from kvshuttle.services.common.span_attributes import SPAN_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
TRACED = [*(str(p.relative_to(ROOT)) for p in sorted((ROOT / "services/gateway/turns").glob("*.py"))),
          "services/scheduler/planning.py", "services/registry/servicer.py"]
NOT_ATTRIBUTES = {"kvshuttle.turn", "kvshuttle.gateway", "kvshuttle.scheduler"}  # span and tracer names


def used_attributes() -> set[str]:
    used = {name for path in TRACED for name in re.findall(r'"(kvshuttle\.[a-z_]+)"', (ROOT / path).read_text())}
    return used - NOT_ATTRIBUTES


def test_every_attribute_the_services_set_is_in_the_catalogue():
    used = used_attributes()
    assert len(used) > 20
    missing = sorted(used - set(SPAN_ATTRIBUTES))
    assert not missing, f"span attributes missing from SPAN_ATTRIBUTES (services/common/span_attributes.py): {missing}"


def test_every_catalogued_attribute_is_set_by_a_service():
    unused = sorted(set(SPAN_ATTRIBUTES) - used_attributes())
    assert not unused, f"SPAN_ATTRIBUTES lists attributes no traced service sets: {unused}"


def test_the_catalogue_describes_each_attribute():
    for name, description in SPAN_ATTRIBUTES.items():
        assert re.fullmatch(r"kvshuttle\.[a-z_]+", name), name
        assert description.strip() and "|" not in description, name
