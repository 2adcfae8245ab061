"""Per-tenant prefix-cache salts (pure): which of vLLM's prefix caches a request may hit.

vLLM folds a request's ``cache_salt`` into the hash of its prompt's first KV block, so every later block hash
depends on it too: two requests with different salts never share a cached block, and ``cached_tokens`` says
nothing about what a request with another salt sent. The gateway gives every engine call of a turn (on P and on D)
the salt of the turn's tenant, derived here from the tenant, or from its cache group when the keys file puts it in
one (tenants of one group share a salt, so their common prefixes are cached once).

The salt is derived, not secret: it only separates. No client can choose one (the gateway refuses a request's
``cache_salt`` field and derives the salt from the authenticated tenant), the salt never leaves the servers, and a
caller that could send its own salt to a worker is already past every control the salt adds to (it can run any
prompt there; network policy keeps it out). It is a digest, so worker-side records (vLLM's KV events) carry no
tenant name. P and D, and every gateway replica, derive the same salt for a tenant with no shared setting, so P's
blocks pulled into D and D's blocks pulled into P hash alike on both sides.

The salt travels to vLLM's gRPC server as call metadata (``METADATA_KEY``: vLLM's ``GenerateRequest`` has no salt
field for token input); kvshuttle's vLLM plugin (workers/vllm_call_options.py) puts it in the prompt and answers with
``APPLIED_KEY`` in the call's initial metadata, so a worker without the plugin is refused, never silently unsalted.
"""

from __future__ import annotations

import hashlib
import re

METADATA_KEY = "kvshuttle-cache-salt"  # the salt, on a Generate call to a worker
APPLIED_KEY = "kvshuttle-cache-salt-applied"  # the worker's answer: "1" when it put the salt in the prompt
PREFIX = "kvs1-"
# The scheduler's free reads (one block of a held handle, read only so that D frees it): a salt no turn ever has,
# so the block P caches on the way is never hit by any tenant.
FREE_READ = "kvshuttle-free-read"
_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_DOMAIN = b"kvshuttle prefix-cache salt v1\0"


def for_tenant(tenant: str, cache_group: str = "") -> str:
    """The salt of ``tenant``'s engine calls: its cache group's when it has one, else its own. A tenant and a group
    of the same name get different salts."""
    scope = f"group\0{cache_group}" if cache_group else f"tenant\0{tenant}"
    return PREFIX + hashlib.sha256(_DOMAIN + scope.encode()).hexdigest()[:32]


def valid(salt: str) -> bool:
    """A salt a worker takes: 1-128 characters of letters, digits and ``._:-`` (vLLM validates none on this path)."""
    return bool(_VALID.match(salt))
