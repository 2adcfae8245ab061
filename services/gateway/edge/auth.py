"""API keys for the gateway: each key maps to a tenant (and optionally admin rights); the file holds only hashes.

Keys file (JSON; the gateway's ``--api-keys-file``, ``KVSHUTTLE_GATEWAY_API_KEYS_FILE``)::

    {"keys": [
      {"sha256": "<hex sha256 of the key>", "tenant": "acme", "name": "acme-prod"},
      {"sha256": "<hex>", "tenant": "ops", "admin": true, "name": "ops"}
    ]}

Optional ``"limits"``: per tenant (``"*"``: every tenant without its own entry), any of ``requests_per_second``,
``tokens_per_minute`` (prompt plus generated) and ``concurrent_turns``; 0 or absent: no limit
(control_plane/rate_limit.py says how each is counted)::

    "limits": {"*": {"requests_per_second": 20}, "acme": {"tokens_per_minute": 120000, "concurrent_turns": 4}}

Optional ``"cache_group"`` on an entry: tenants with the same group share one prefix-cache salt, so a prompt prefix
they have in common (a system prompt) is cached once for all of them, and each can tell from ``cached_tokens`` what
the others sent. Without it every tenant's prefix cache is its own (control_plane/cache_salt.py). All of a tenant's
entries must name the same group.

Optional ``"models"`` on an entry: the served models (names, as clients ask for them) its key may use; others are
answered as unknown (404 ``model_not_found``) and left out of ``GET /v1/models``. Without it the key may use every
model the gateway serves.

``kvshuttle hash-key`` makes an entry: it reads a key on stdin (or ``--generate`` makes a new one) and prints the entry.
A request's tenant comes from its key alone; ``admin`` keys may also use the admin-only routes (worker listing).
With no keys file the gateway is open: every caller is the default tenant, with admin rights.

Keys are compared as SHA-256 digests, against every entry, with ``hmac.compare_digest`` (time independent of where
they differ). Neither keys nor their hashes are logged.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import re
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.rate_limit import TenantLimits
from kvshuttle.services.common.config import ConfigError

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "kvs-"  # generated keys start with this (greppable in secret scanners)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant its key belongs to, and whether it may use admin-only routes."""

    tenant: str
    admin: bool = False
    name: str = ""
    cache_group: str = ""  # tenants of one group share a prefix-cache salt ("": the tenant's own)
    models: frozenset[str] | None = None  # the models the key may use (None: every one served)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


OPEN = Principal(session_rules.DEFAULT_TENANT, admin=True, name="open")


class AuthError(Exception):
    """No key, or an unknown one (HTTP 401 / gRPC UNAUTHENTICATED)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value, or None."""
    if not header:
        return None
    scheme, _, key = header.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class KeyRing:
    """The configured keys; ``principal(key)`` answers who holds a key."""

    def __init__(self, entries: Iterable[tuple[bytes, Principal]] = (), limits: dict[str, TenantLimits] | None = None):
        self._entries = list(entries)
        self.limits = dict(limits or {})  # per tenant; "*": the rest

    def limits_of(self, tenant: str) -> TenantLimits:
        """The tenant's limits (its own entry, else ``"*"``'s, else none)."""
        return self.limits.get(tenant) or self.limits.get("*") or NO_LIMITS

    def replace(self, other: KeyRing) -> None:
        """Take ``other``'s keys and limits (a reloaded keys file): every holder of this ring sees them at once."""
        self._entries, self.limits = list(other._entries), dict(other.limits)

    @property
    def enabled(self) -> bool:
        """False: no keys configured, the gateway is open."""
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, path: str) -> KeyRing:
        """Read a keys file; ConfigError saying what is wrong and where (never echoing a hash)."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"--api-keys-file: cannot read {path!r}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"--api-keys-file: {path!r} is not valid JSON: {exc}") from None
        items = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ConfigError(f"--api-keys-file: {path!r} must hold an object with a \"keys\" list")
        unknown_top = set(data) - {"keys", "limits"}
        if unknown_top:
            raise ConfigError(f"--api-keys-file: {path!r}: unknown fields {sorted(unknown_top)} (known: keys, limits)")
        entries: list[tuple[bytes, Principal]] = []
        seen: set[str] = set()
        groups: dict[str, str] = {}  # tenant -> its cache group
        for i, item in enumerate(items):
            where = f"--api-keys-file {path!r}, entry {i}"
            if not isinstance(item, dict):
                raise ConfigError(f"{where}: must be an object")
            unknown = set(item) - {"sha256", "tenant", "admin", "name", "cache_group", "models"}
            if unknown:
                raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
            digest = str(item.get("sha256", "")).lower()
            if not _HEX64.match(digest):
                raise ConfigError(f"{where}: \"sha256\" must be 64 hex digits (the key's SHA-256; "
                                  "`kvshuttle hash-key` makes it)")
            if digest in seen:
                raise ConfigError(f"{where}: the same key is listed twice")
            seen.add(digest)
            tenant = item.get("tenant")
            try:
                session_rules.validate_id("tenant", tenant if isinstance(tenant, str) else "")
            except session_rules.InvalidArgument as exc:
                raise ConfigError(f"{where}: {exc}") from None
            admin = item.get("admin", False)
            if not isinstance(admin, bool):
                raise ConfigError(f"{where}: \"admin\" must be true or false")
            group = _cache_group(item.get("cache_group", ""), tenant, groups, where)
            models = item.get("models")
            if models is not None and (not isinstance(models, list) or not models
                                       or not all(isinstance(m, str) and m for m in models)):
                raise ConfigError(f"{where}: \"models\" must be a non-empty list of model names (leave it out for "
                                  "every model)")
            entries.append((bytes.fromhex(digest), Principal(tenant, admin, str(item.get("name", "")), group,
                                                            frozenset(models) if models is not None else None)))
        if not entries:
            raise ConfigError(f"--api-keys-file: {path!r} lists no keys (leave the setting empty for an open gateway)")
        return cls(entries, _limits(data.get("limits", {}), {p.tenant for _, p in entries}, path))

    def principal(self, key: str | None) -> Principal:
        """The key's holder; AuthError for no key or an unknown one. The open gateway answers ``OPEN``."""
        if not self._entries:
            return OPEN
        if not key:
            raise AuthError("an API key is required: send it as 'Authorization: Bearer <key>' (or, from an "
                            "Anthropic client, as 'x-api-key')")
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, principal in self._entries:  # every entry, whatever matched: no early exit
            if hmac.compare_digest(stored, digest):
                found = principal
        if found is None:
            raise AuthError("invalid API key")
        return found

    def models_named(self) -> set[str]:
        """Every model some entry's ``models`` names."""
        return {m for _, p in self._entries if p.models is not None for m in p.models}

    def cache_group(self, tenant: str) -> str:
        """The tenant's cache group ("": none, or no such tenant here)."""
        return next((p.cache_group for _, p in self._entries if p.tenant == tenant), "")

    def from_header(self, header: str | None) -> Principal:
        """The holder of an ``Authorization`` header's bearer key."""
        if self._entries and header and bearer_key(header) is None:
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        return self.principal(bearer_key(header))


NO_LIMITS = TenantLimits()


def _limits(value: object, tenants: set[str], path: str) -> dict[str, TenantLimits]:
    """The keys file's ``"limits"``: per tenant (each one a tenant some key belongs to) or ``"*"``."""
    if not isinstance(value, dict):
        raise ConfigError(f"--api-keys-file {path!r}: \"limits\" must be an object of tenant -> limits")
    out = {}
    for tenant, limits in value.items():
        where = f"--api-keys-file {path!r}, limits of {tenant!r}"
        if tenant != "*" and tenant not in tenants:
            raise ConfigError(f"{where}: no key belongs to that tenant (\"*\" sets every tenant's)")
        try:
            out[tenant] = TenantLimits.parse(limits, where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return out


def _cache_group(value: object, tenant: str, groups: dict[str, str], where: str) -> str:
    """An entry's ``cache_group``, the same for each of a tenant's entries (``groups`` notes them)."""
    group = value if isinstance(value, str) else None
    try:
        if group:
            session_rules.validate_id("cache_group", group)
    except session_rules.InvalidArgument as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if group is None:
        raise ConfigError(f"{where}: \"cache_group\" must be a string")
    if groups.setdefault(tenant, group) != group:
        raise ConfigError(f"{where}: tenant {tenant!r} is in cache group {groups[tenant]!r} in an earlier entry; "
                          "all of a tenant's entries must name the same cache_group")
    return group


def entry(key: str, tenant: str, *, admin: bool = False, name: str = "", cache_group: str = "",
          models: Sequence[str] = ()) -> dict:
    """The keys-file entry for ``key``."""
    session_rules.validate_id("tenant", tenant)
    out: dict = {"sha256": hash_key(key), "tenant": tenant}
    if admin:
        out["admin"] = True
    if name:
        out["name"] = name
    if cache_group:
        session_rules.validate_id("cache_group", cache_group)
        out["cache_group"] = cache_group
    if models:
        out["models"] = list(models)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`kvshuttle hash-key`: print the keys-file entry for a key read on stdin, or for a new key."""
    parser = argparse.ArgumentParser(prog="kvshuttle hash-key", description=main.__doc__)
    parser.add_argument("--tenant", required=True, help="Tenant the key belongs to")
    parser.add_argument("--admin", action="store_true", help="The key may use admin-only routes")
    parser.add_argument("--name", default="", help="A label for the entry (shown nowhere else)")
    parser.add_argument("--cache-group", default="",
                        help="Share a prefix cache with the other tenants of this group (default: the tenant's own)")
    parser.add_argument("--models", default="",
                        help="The served models the key may use, comma-separated (default: every one)")
    parser.add_argument("--generate", action="store_true",
                        help="Make a new random key and print it (to stderr) with the entry; else read it on stdin")
    args = parser.parse_args(argv)
    try:
        session_rules.validate_id("tenant", args.tenant)
        if args.cache_group:
            session_rules.validate_id("cache_group", args.cache_group)
    except session_rules.InvalidArgument as exc:
        parser.error(str(exc))
    if args.generate:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        print(f"new API key (shown once, store it now): {key}", file=sys.stderr)
    else:
        key = sys.stdin.readline().strip()
        if not key:
            parser.error("no key on stdin")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(json.dumps(entry(key, args.tenant, admin=args.admin, name=args.name, cache_group=args.cache_group,
                           models=models)))
