"""Session registry rules, without I/O: validation, building a Session from a finished turn, expiry, claims.

Times are float seconds since the epoch (the registry's wall clock). ``InvalidArgument`` means the caller sent
something wrong; ``FailedPrecondition`` means the request is fine but the system is not in a state to honour it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvshuttle.control_plane.kv_eviction import MIN_LEFT_S
from kvshuttle.control_plane.kv_eviction import REASONS as FREE_REASONS
from kvshuttle.control_plane.kv_params import HandleError, blocks_for, parse_handle
from kvshuttle.control_plane.prefix import block_hash_chain, prefix_digest
from kvshuttle.v1 import common_pb2, registry_pb2

MAX_ID_LEN = 256
_ID_RE = re.compile(r"[A-Za-z0-9._:@=+-]+")
# The session record's lease outlives the handle by this much, so a reader sees "expired" (negative expires_in_s)
# rather than the record vanishing while a turn plans with it. Claims check expires_at, never the lease.
LEASE_GRACE_S = 2
MAX_LEASE_TTL_S = 24 * 3600
# etcd refuses requests over --max-request-bytes (1.5 MiB by default); stay well below with the key and framing.
MAX_RECORD_BYTES = 1_400_000
TOKEN_ID_MAX = 2**31 - 1

# Claim refusal reasons (ClaimSessionResponse.reason starts with one of these).
MISSING = "missing"
CLAIMED = "already claimed"
CHANGED = "changed"
NO_HANDLE = "no handle"
EXPIRED = "expired"
# A plan's reason starts with this when the turn recomputes because the session store (the registry or etcd) could
# not be reached; the gateway counts such turns.
STORE_UNAVAILABLE = "session store unavailable"


class InvalidArgument(ValueError):
    """The request is malformed (maps to INVALID_ARGUMENT)."""


class FailedPrecondition(ValueError):
    """The request is well formed but cannot be honoured now (maps to FAILED_PRECONDITION)."""


DEFAULT_TENANT = "default"


def validate_id(kind: str, value: str) -> str:
    """Ids become etcd key segments: 1..256 chars of ``A-Z a-z 0-9 . _ : @ = + -`` (no ``/``, no spaces)."""
    if not value:
        raise InvalidArgument(f"{kind} is required")
    if len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{kind} is {len(value)} characters long; at most {MAX_ID_LEN} allowed")
    if not _ID_RE.fullmatch(value):
        raise InvalidArgument(f"{kind} {value[:64]!r} has characters outside A-Z a-z 0-9 . _ : @ = + -")
    return value


def validate_worker(worker: common_pb2.Worker) -> None:
    """What a worker record must carry to be registered (decode workers also their KV TTL)."""
    validate_id("worker.worker_id", worker.worker_id)
    if worker.role not in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        raise InvalidArgument("worker.role must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE")
    if not worker.grpc_address:
        raise InvalidArgument("worker.grpc_address is required")
    if worker.block_size <= 0:
        raise InvalidArgument(f"worker.block_size must be positive, got {worker.block_size}")
    if worker.role == common_pb2.WORKER_ROLE_DECODE and worker.kv_blocks_ttl_s <= 0:
        raise InvalidArgument(f"a decode worker needs kv_blocks_ttl_s > 0, got {worker.kv_blocks_ttl_s}")
    if worker.kv_blocks_ttl_s < 0 or not 0 <= worker.nixl_port <= 65535:
        raise InvalidArgument("worker.kv_blocks_ttl_s must be >= 0 and nixl_port within 0..65535")


def validate_free_reason(reason: str) -> None:
    """A claim that frees the KV names why: one of kv_eviction.REASONS (or "" for a pull's claim)."""
    if reason and reason not in FREE_REASONS:
        raise InvalidArgument(f"free_reason must be empty or one of {', '.join(FREE_REASONS)}, got {reason[:64]!r}")


def worker_lease_ttl(requested: int, default: int) -> int:
    """The lease TTL for a registration: ``requested`` seconds, or ``default`` when 0."""
    if requested < 0 or requested > MAX_LEASE_TTL_S:
        raise InvalidArgument(f"lease_ttl_s must be within 0..{MAX_LEASE_TTL_S}, got {requested}")
    return requested or default


def to_seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def set_seconds(ts, t: float) -> None:
    ts.FromNanoseconds(int(round(t * 1e9)))


def expires_in(session: common_pb2.Session, now: float) -> float:
    """Seconds until the session's handle expires (negative once expired)."""
    return to_seconds(session.expires_at) - now


FREE_MIN_LEFT_S = MIN_LEFT_S  # a handle closer to its expiry is left to expire (P declines reads 5 s before it)


def freeable(session: common_pb2.Session, tokens: int, now: float) -> bool:
    """Whether the record's handle can be freed by reading its first block (or all of it, when it covers less)
    from a prompt of ``tokens`` tokens that repeats them (kv_params.free_read): an unclaimed handle,
    far enough from its expiry."""
    bs = session.block_size
    return (bool(session.kv_transfer_params_json) and not session.claimed and bs > 0 and session.covered_tokens > 0
            and tokens > min(session.covered_tokens, bs) and expires_in(session, now) >= FREE_MIN_LEFT_S)


def lease_ttl_for(expires_at: float, now: float) -> int:
    """etcd lease TTL (whole seconds) that keeps a record until a little after ``expires_at``."""
    return max(1, math.ceil(expires_at - now)) + LEASE_GRACE_S


@dataclass(frozen=True)
class SessionPlan:
    """A Session record to store, and the TTL of the lease to attach it to."""

    session: common_pb2.Session
    lease_ttl_s: int


RESPONSE_TTL_RANGE_S = (1, 30 * 86400)  # how long a stored response may be kept


def validate_stored_response(response, ttl_s: int) -> None:
    """A StoredResponse the registry can keep: ids, a body within the record limit, a TTL in range."""
    validate_id("response_id", response.response_id)
    validate_id("tenant", response.tenant)
    validate_id("session_id", response.session_id)
    if not response.body_json:
        raise InvalidArgument("body_json is required")
    low, high = RESPONSE_TTL_RANGE_S
    if not low <= ttl_s <= high:
        raise InvalidArgument(f"ttl_s must be between {low} and {high} seconds, got {ttl_s}")
    size = response.ByteSize()
    if size > MAX_RECORD_BYTES:
        raise InvalidArgument(f"the stored response would be {size} bytes; the store takes at most {MAX_RECORD_BYTES}")


TEXT_KEY_BYTES = 32  # a content key (Session.text_key): SHA-256
MAX_FIND_KEYS = 64  # FindSession's most keys per request


def validate_find(text_keys) -> None:
    """FindSession's keys: 1 to MAX_FIND_KEYS content keys of TEXT_KEY_BYTES each."""
    if not text_keys:
        raise InvalidArgument("text_keys is required: content keys of the prompt text's prefixes, longest first")
    if len(text_keys) > MAX_FIND_KEYS:
        raise InvalidArgument(f"at most {MAX_FIND_KEYS} text_keys are allowed, got {len(text_keys)}")
    odd = [i for i, k in enumerate(text_keys) if len(k) != TEXT_KEY_BYTES]
    if odd:
        raise InvalidArgument(f"text_keys[{odd[0]}] must be {TEXT_KEY_BYTES} bytes (SHA-256), got "
                              f"{len(text_keys[odd[0]])}")


def build_session(req: registry_pb2.RecordTurnRequest, worker: common_pb2.Worker | None, *, now: float,
                  margin_s: float, previous: common_pb2.Session | None = None) -> SessionPlan:
    """The Session record for a finished turn on ``worker`` (the decode worker, looked up by the caller).

    covered_tokens is the handle's ``remote_num_tokens``; block hashes chain ``token_ids[:covered]`` in the decode
    worker's block size, and prefix_digest hashes them in one piece. The handle expires at
    ``finished_at + kv_blocks_ttl_s - margin_s``; a ``finished_at`` in the future (clock skew) counts as now, so skew
    never lengthens a handle's life.
    """
    validate_id("session_id", req.session_id)
    validate_id("tenant", req.tenant)
    validate_id("decode_worker_id", req.decode_worker_id)
    if not req.token_ids:
        raise InvalidArgument("token_ids is required: the exact ids the decode worker holds")
    if any(t < 0 for t in req.token_ids):
        raise InvalidArgument("token_ids must not be negative")
    if not req.kv_transfer_params_json:
        raise InvalidArgument("kv_transfer_params_json is required")
    if req.text_key and len(req.text_key) != TEXT_KEY_BYTES:
        raise InvalidArgument(f"text_key must be {TEXT_KEY_BYTES} bytes (SHA-256 of the text), got {len(req.text_key)}")
    try:
        handle = parse_handle(req.kv_transfer_params_json)
    except HandleError as exc:
        raise InvalidArgument(f"kv_transfer_params_json: {exc}") from None
    covered = handle.num_tokens
    if covered > len(req.token_ids):
        raise InvalidArgument(f"the handle covers {covered} tokens (remote_num_tokens) but only "
                              f"{len(req.token_ids)} token_ids were given")
    if worker is None:
        raise FailedPrecondition(f"decode worker {req.decode_worker_id!r} is not registered")
    if worker.role != common_pb2.WORKER_ROLE_DECODE:
        raise FailedPrecondition(f"worker {req.decode_worker_id!r} is a {common_pb2.WorkerRole.Name(worker.role)} "
                                 "worker, not a decode worker")
    if worker.block_size <= 0 or worker.kv_blocks_ttl_s <= 0:
        raise FailedPrecondition(f"decode worker {worker.worker_id!r} has no block size or KV TTL registered")
    if worker.engine_id and handle.engine_id != worker.engine_id:
        raise InvalidArgument(f"the handle's remote_engine_id {handle.engine_id!r} is not decode worker "
                              f"{worker.worker_id!r}'s engine {worker.engine_id!r}")
    need = blocks_for(covered, worker.block_size)
    short = [len(g) for g in handle.block_groups if len(g) < need]
    if short:
        raise InvalidArgument(f"the handle holds {short[0]} blocks in a group; {covered} tokens need {need} "
                              f"blocks of {worker.block_size}")

    finished = min(to_seconds(req.finished_at), now) if req.HasField("finished_at") else now
    expires_at = finished + worker.kv_blocks_ttl_s - margin_s
    if expires_at <= now:
        raise FailedPrecondition(f"the handle has already expired: finished {now - finished:.1f}s ago, decode KV "
                                 f"TTL {worker.kv_blocks_ttl_s}s minus {margin_s:g}s margin")

    session = common_pb2.Session(
        session_id=req.session_id, tenant=req.tenant, decode_worker_id=req.decode_worker_id,
        kv_transfer_params_json=req.kv_transfer_params_json, covered_tokens=covered,
        block_size=worker.block_size,
        block_hashes=block_hash_chain(req.token_ids, covered, worker.block_size),
        prefix_digest=prefix_digest(req.token_ids, covered),
        token_ids=req.token_ids, text=req.text, text_key=req.text_key,
        turn=(previous.turn if previous is not None else 0) + 1, claimed=False,
    )
    set_seconds(session.expires_at, expires_at)
    set_seconds(session.updated_at, now)
    if previous is not None and (previous.HasField("created_at") or previous.HasField("updated_at")):
        session.created_at.CopyFrom(previous.created_at if previous.HasField("created_at") else previous.updated_at)
    else:
        set_seconds(session.created_at, now)
    size = session.ByteSize()
    if size > MAX_RECORD_BYTES:
        raise InvalidArgument(f"the session record would be {size} bytes; the store takes at most "
                              f"{MAX_RECORD_BYTES} (shorten the conversation or its text)")
    return SessionPlan(session, lease_ttl_for(expires_at, now))


def claim_refusal(session: common_pb2.Session | None, revision: int, now: float) -> str | None:
    """Why ``session`` cannot be claimed at ``revision`` now, or None when it can."""
    if session is None:
        return MISSING
    if session.claimed:
        return CLAIMED
    if session.revision != revision:
        return f"{CHANGED}: the record is at revision {session.revision}, not {revision}"
    if not session.kv_transfer_params_json:
        return NO_HANDLE
    left = expires_in(session, now)
    if left <= 0:
        return f"{EXPIRED} {-left:.1f}s ago"
    return None

