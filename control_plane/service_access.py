"""Who may call which internal gRPC method: service identities and the per-method rules of the registry's and the
scheduler's APIs (services/common/caller_check.py applies them on the servers, from the caller's certificate).

A service's identity is its certificate's Common Name under mutual TLS: a role (``registry``, ``scheduler``,
``gateway``, ``worker``, ``admin``), optionally with a name after a colon (``worker:decode-0``: a certificate for one
worker). The rules:

* only workers register, keep alive and deregister workers, and a named worker certificate only as itself;
* gateways and schedulers read, record, claim, find and end sessions (``RecordTurn``, ``FindSession`` and the stored
  responses are the gateway's alone; ``PlanTurn`` and ``ReportOutcome`` too);
* schedulers and gateways watch and list the workers;
* ``admin`` may call anything (operators' tools: grpcurl, ``kvshuttle bench-services``).

Methods of other services (the gateway's public API, health, reflection) are not governed here: the gateway's API
takes API keys, health and reflection stay open. A governed method missing from the rules is refused to all but
admin, so a new method is closed until it is given its callers.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("registry", "scheduler", "gateway", "worker", "admin")
GOVERNED_SERVICES = ("kvshuttle.v1.SessionRegistry", "kvshuttle.v1.TransferScheduler")

_REGISTRY, _SCHEDULER = (f"/{s}/" for s in GOVERNED_SERVICES)
_SESSIONS = frozenset({"gateway", "scheduler"})
RULES: dict[str, frozenset[str]] = {
    _REGISTRY + "RegisterWorker": frozenset({"worker"}),
    _REGISTRY + "KeepAlive": frozenset({"worker"}),
    _REGISTRY + "DeregisterWorker": frozenset({"worker"}),
    _REGISTRY + "ListWorkers": _SESSIONS,
    _REGISTRY + "WatchWorkers": _SESSIONS,
    _REGISTRY + "GetSession": _SESSIONS,
    _REGISTRY + "ClaimSession": _SESSIONS,
    _REGISTRY + "DeleteSession": _SESSIONS,
    _REGISTRY + "RecordTurn": frozenset({"gateway"}),
    _REGISTRY + "FindSession": frozenset({"gateway"}),
    _REGISTRY + "PutResponse": frozenset({"gateway"}),
    _REGISTRY + "GetResponse": frozenset({"gateway"}),
    _REGISTRY + "GetResponseChain": frozenset({"gateway"}),
    _REGISTRY + "DeleteResponse": frozenset({"gateway"}),
    _SCHEDULER + "PlanTurn": frozenset({"gateway"}),
    _SCHEDULER + "ReportOutcome": frozenset({"gateway"}),
    _SCHEDULER + "GetStats": _SESSIONS,
}
# Methods whose request names a worker (the field's path): a named worker certificate may only name itself.
WORKER_FIELDS: dict[str, tuple[str, ...]] = {
    _REGISTRY + "RegisterWorker": ("worker", "worker_id"),
    _REGISTRY + "KeepAlive": ("worker_id",),
    _REGISTRY + "DeregisterWorker": ("worker_id",),
}


@dataclass(frozen=True)
class Caller:
    """A service identity: its role and, for a certificate issued to one instance, its name."""

    role: str
    name: str = ""

    def __str__(self) -> str:
        return f"{self.role}:{self.name}" if self.name else self.role


def caller_of(common_name: str) -> Caller | None:
    """The identity a certificate's Common Name states (``role`` or ``role:name``); None when it names no role."""
    role, colon, name = common_name.strip().partition(":")
    if role not in ROLES or (colon and not name):
        return None
    return Caller(role, name)


def governed(method: str) -> bool:
    """Whether ``method`` (``/package.Service/Method``) is one of the internal APIs these rules cover."""
    return method.startswith((_REGISTRY, _SCHEDULER))


def refusal(method: str, caller: Caller | None, worker_named: str | None = None) -> str:
    """Why ``caller`` may not call ``method`` ("" when it may). ``worker_named``: the worker the request names, for the
    methods in WORKER_FIELDS."""
    if not governed(method):
        return ""
    if caller is None:
        return (f"{method} needs a kvshuttle service identity: a client certificate whose Common Name is one of "
                f"{', '.join(ROLES)} (optionally role:name)")
    if caller.role == "admin":
        return ""
    allowed = RULES.get(method, frozenset())
    if caller.role not in allowed:
        who = ", ".join(sorted(allowed)) + " or admin" if allowed else "admin only"
        return f"{method} is not open to the {caller.role} identity ({caller}): {who}"
    if method in WORKER_FIELDS and caller.name and worker_named is not None and worker_named != caller.name:
        return f"the worker certificate {caller} may only act as worker {caller.name!r}, not {worker_named!r}"
    return ""
