"""API keys for the gateway: each key maps to a tenant (and optionally admin rights); the file holds only hashes.

Keys file (JSON; the gateway's ``--api-keys-file``, ``KVSHUTTLE_GATEWAY_API_KEYS_FILE``)::

    {"keys": [
      {"sha256": "<hex sha256 of the key>", "tenant": "acme", "name": "acme-prod"},
      {"sha256": "<hex>", "tenant": "ops", "admin": true, "name": "ops"}
    ]}

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
from kvshuttle.services.common.config import ConfigError

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "kvs-"  # generated keys start with this (greppable in secret scanners)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant its key belongs to, and whether it may use admin-only routes."""

    tenant: str
    admin: bool = False
    name: str = ""


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

    def __init__(self, entries: Iterable[tuple[bytes, Principal]] = ()):
        self._entries = list(entries)

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
        entries: list[tuple[bytes, Principal]] = []
        seen: set[str] = set()
        for i, item in enumerate(items):
            where = f"--api-keys-file {path!r}, entry {i}"
            if not isinstance(item, dict):
                raise ConfigError(f"{where}: must be an object")
            unknown = set(item) - {"sha256", "tenant", "admin", "name"}
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
            entries.append((bytes.fromhex(digest), Principal(tenant, admin, str(item.get("name", "")))))
        if not entries:
            raise ConfigError(f"--api-keys-file: {path!r} lists no keys (leave the setting empty for an open gateway)")
        return cls(entries)

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

    def from_header(self, header: str | None) -> Principal:
        """The holder of an ``Authorization`` header's bearer key."""
        if self._entries and header and bearer_key(header) is None:
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        return self.principal(bearer_key(header))


def entry(key: str, tenant: str, *, admin: bool = False, name: str = "") -> dict:
    """The keys-file entry for ``key``."""
    session_rules.validate_id("tenant", tenant)
    out: dict = {"sha256": hash_key(key), "tenant": tenant}
    if admin:
        out["admin"] = True
    if name:
        out["name"] = name
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """`kvshuttle hash-key`: print the keys-file entry for a key read on stdin, or for a new key."""
    parser = argparse.ArgumentParser(prog="kvshuttle hash-key", description=main.__doc__)
    parser.add_argument("--tenant", required=True, help="Tenant the key belongs to")
    parser.add_argument("--admin", action="store_true", help="The key may use admin-only routes")
    parser.add_argument("--name", default="", help="A label for the entry (shown nowhere else)")
    parser.add_argument("--generate", action="store_true",
                        help="Make a new random key and print it (to stderr) with the entry; else read it on stdin")
    args = parser.parse_args(argv)
    try:
        session_rules.validate_id("tenant", args.tenant)
    except session_rules.InvalidArgument as exc:
        parser.error(str(exc))
    if args.generate:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        print(f"new API key (shown once, store it now): {key}", file=sys.stderr)
    else:
        key = sys.stdin.readline().strip()
        if not key:
            parser.error("no key on stdin")
    print(json.dumps(entry(key, args.tenant, admin=args.admin, name=args.name)))
