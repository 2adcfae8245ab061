"""API keys for the gateway tests: three tenants (``ops`` is an admin) and the keys file that declares them."""

from __future__ import annotations

import json

from kvshuttle.services.gateway.edge import auth

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


def open_guard(app):
    """``app`` behind the gateway's HTTP guard with no keys (the open gateway): every caller is the default tenant.
    Routes refuse a request that did not pass the guard (401), so tests of the HTTP APIs go through it."""
    from kvshuttle.services.gateway.edge.http_guard import HttpGuard

    return HttpGuard(app, auth.KeyRing(), 8 << 20)
