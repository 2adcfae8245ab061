"""API keys for the gateway tests: three tenants (``ops`` is an admin) and the keys file that declares them."""

from __future__ import annotations

import json

from kvshuttle.services.gateway import auth

KEYS = {"acme": "kvs-acme-7c1d0b5e", "globex": "kvs-globex-93aa41f2", "ops": "kvs-ops-admin-51e0"}


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def keys_file(directory) -> str:
    """Write ``keys.json`` with the three tenants' keys into ``directory``; return its path."""
    path = directory / "keys.json"
    path.write_text(json.dumps({"keys": [auth.entry(KEYS["acme"], "acme", name="acme"),
                                         auth.entry(KEYS["globex"], "globex"),
                                         auth.entry(KEYS["ops"], "ops", admin=True)]}))
    return str(path)
